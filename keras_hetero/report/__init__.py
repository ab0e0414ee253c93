"""Run reports: what every replica did during `fit`, as a PNG and a web page.

`kh.callbacks.RunReport` collects `Records` during `fit` and calls `write`
at the end; `plot` and `write` also work on records you build or keep.
Drawing needs matplotlib, the optional extra `keras-hetero[report]`; the
rest of keras-hetero does not import it.

The package holds what keras-hetero reports during `fit`: `sources` (what
the other callbacks did, step by step), `writer` (scalars to the default
TensorBoard writer), `tensorboard` (`HeteroTensorBoard`) and `run_report`
(`RunReport`).
"""

import base64
import dataclasses
import html
import io
import os

import numpy as np

_EXTRA = 'pip install "keras-hetero[report]"'


@dataclasses.dataclass(frozen=True)
class Records:
    """Per-step, per-replica measurements of one `fit`, and its events.

    Row `k` of the arrays is the `k`-th recorded train step.

    Attributes:
        steps: Global train step of each record, shape `[n]`.
        rows: Rows each replica trained on, shape `[n, replicas]`.
        compute_seconds: Each replica's compute seconds per step, shape
            `[n, replicas]` (from `model.step_stats`).
        step_seconds: Wall seconds of each step as the training loop saw
            it, shape `[n]`; NaN where not measured (a `fit`'s first step).
        devices: The device of each replica.
        events: `kh.callbacks.StragglerEvent`s, oldest first.
        checkpoints: `(step, blocking seconds, write seconds)` per save.
        share_changes: `(step, shares)` per `ShardRebalancer` decision.
        wait_seconds: Low-communication training (`kh.LowCommunication`):
            each replica's seconds per step waiting at the synchronisation
            before the record's, shape `[n, replicas]`; else None.
    """

    steps: np.ndarray
    rows: np.ndarray
    compute_seconds: np.ndarray
    step_seconds: np.ndarray
    devices: list
    events: list = dataclasses.field(default_factory=list)
    checkpoints: list = dataclasses.field(default_factory=list)
    share_changes: list = dataclasses.field(default_factory=list)
    wait_seconds: np.ndarray = None

    @property
    def num_replicas(self):
        """How many replicas the records cover."""
        return len(self.devices)

    @property
    def shares(self):
        """Each replica's fraction of each step's rows, `[n, replicas]`."""
        total = self.rows.sum(axis=1, keepdims=True)
        return self.rows / np.maximum(total, 1)


@dataclasses.dataclass(frozen=True)
class ReportFiles:
    """Where `write` put the report.

    Attributes:
        png: The figure (PNG).
        html: A self-contained page: the figure, a per-replica summary, and
            tables of straggler events, checkpoints and share changes.
    """

    png: str
    html: str


def plot(records):
    """Draws the records: per-replica step time and shares over steps.

    Top panel: each replica's compute seconds per step (one line per
    replica, in replica order, then the wall step time dashed; the frame
    may cut the rare slow steps of epoch starts), straggler
    events as markers on the flagged replica's line, checkpoints as dotted
    vertical lines. Bottom panel: each replica's share of the step's rows
    (one line per replica). Uses matplotlib's Agg canvas (no display, no
    global pyplot state).

    Args:
        records: A `kh.report.Records`.

    Returns:
        A `matplotlib.figure.Figure`. Its axes' lines hold the plotted data
        (`line.get_xdata()`, `line.get_ydata()`), labelled "replica <i>".

    Raises:
        ImportError: If matplotlib is not installed (the `report` extra).

    Example:

    >>> figure = kh.report.plot(report.records)  # doctest: +SKIP
    >>> figure.axes[0].get_lines()[0].get_label()  # doctest: +SKIP
    'replica 0'
    """
    figure_class, canvas_class = _matplotlib()
    figure = figure_class(figsize=(9, 6), dpi=100)
    canvas_class(figure)
    times, shares = figure.subplots(2, 1, sharex=True)
    steps = records.steps
    colors = [f"C{replica % 10}" for replica in range(records.num_replicas)]
    for axes, series in (
        (times, records.compute_seconds),
        (shares, records.shares),
    ):
        for replica in range(records.num_replicas):
            axes.plot(
                steps,
                series[:, replica],
                color=colors[replica],
                linewidth=1.2,
                label=f"replica {replica}",
            )
    if records.wait_seconds is not None:
        for replica in range(records.num_replicas):
            times.plot(
                steps,
                records.wait_seconds[:, replica],
                color=colors[replica],
                linestyle=":",
                linewidth=1.0,
                label=f"replica {replica} wait",
            )
    if np.any(np.isfinite(records.step_seconds)):
        times.plot(
            steps,
            records.step_seconds,
            color="black",
            linestyle="--",
            linewidth=0.8,
            label="step (wall)",
        )
    flagged = [e for e in records.events if e.kind == "straggler"]
    for event in flagged:
        times.plot(
            [event.step],
            [_value_at(records, event.step, event.replica)],
            marker="v",
            markersize=9,
            color=colors[event.replica],
            markeredgecolor="black",
            linestyle="none",
            label="_straggler",
        )
    for step, _, _ in records.checkpoints:
        for axes in (times, shares):
            axes.axvline(step, color="grey", linestyle=":", linewidth=0.8)
    times.set_ylim(0, _time_limit(records))
    times.set_ylabel("seconds per step")
    times.set_title(
        f"{records.num_replicas} replicas; v = straggler event, "
        "dotted = checkpoint"
    )
    shares.set_ylabel("share of the global batch")
    shares.set_xlabel("train step")
    shares.set_ylim(0, 1)
    for axes in (times, shares):
        axes.grid(alpha=0.3)
        axes.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    return figure


def write(records, directory):
    """Writes `report.png` and a self-contained `report.html` into
    `directory`.

    The HTML page embeds the PNG (base64) and has tables of the replicas,
    straggler events, checkpoints and share changes; it loads nothing from
    anywhere else.

    Args:
        records: A `kh.report.Records`, or anything with a `.records`
            attribute holding one (e.g. a `kh.callbacks.RunReport`).
        directory: Where the files go; created if missing.

    Returns:
        `kh.report.ReportFiles` with the paths of both files.

    Raises:
        ImportError: If matplotlib is not installed (the `report` extra).
        ValueError: If there is nothing recorded.

    Example:

    >>> files = kh.report.write(report.records, "/tmp/run1")  # doctest: +SKIP
    >>> files.html  # doctest: +SKIP
    '/tmp/run1/report.html'
    """
    records = getattr(records, "records", records)
    if not isinstance(records, Records) or not len(records.steps):
        raise ValueError(
            "Invalid value for argument `records`. Received: "
            f"records={records!r}. Expected kh.report.Records with at "
            "least one recorded step."
        )
    figure = plot(records)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    image = buffer.getvalue()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    files = ReportFiles(
        png=os.path.join(directory, "report.png"),
        html=os.path.join(directory, "report.html"),
    )
    with open(files.png, "wb") as f:
        f.write(image)
    with open(files.html, "w", encoding="utf-8") as f:
        f.write(_page(records, image))
    return files


def _page(records, image):
    """The HTML page for `records` with the PNG bytes `image` embedded."""
    encoded = base64.b64encode(image).decode("ascii")
    sections = [
        "<h2>Replicas</h2>",
        _table(
            (
                "replica",
                "device",
                "mean rows",
                "mean compute s/step",
                "mean s/row",
                "last share",
            ),
            _replica_rows(records),
        ),
        "<h2>Straggler events</h2>",
        _table(
            ("step", "replica", "device", "kind", "relative", "individual"),
            [
                (
                    e.step,
                    e.replica,
                    e.device,
                    e.kind,
                    f"{e.relative_score:.2f}",
                    f"{e.individual_score:.2f}",
                )
                for e in records.events
            ],
        ),
        "<h2>Checkpoints</h2>",
        _table(
            ("step", "training blocked (s)", "write (s)"),
            [
                (step, _seconds(blocking), _seconds(write_seconds))
                for step, blocking, write_seconds in records.checkpoints
            ],
        ),
        "<h2>Share changes</h2>",
        _table(
            ("step", "new shares"),
            [
                (step, " ".join(f"{s:.3f}" for s in shares))
                for step, shares in records.share_changes
            ],
        ),
    ]
    first, last = int(records.steps[0]), int(records.steps[-1])
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            "<title>keras-hetero run report</title>",
            "<style>body{font-family:sans-serif;margin:2em}"
            "table{border-collapse:collapse;margin-bottom:1em}"
            "td,th{border:1px solid #bbb;padding:2px 8px;text-align:right}"
            "</style></head><body>",
            "<h1>keras-hetero run report</h1>",
            f"<p>Steps {first} to {last}, {records.num_replicas} replicas, "
            f"{len(records.events)} straggler event(s), "
            f"{len(records.checkpoints)} checkpoint(s).</p>",
            f'<img alt="per-replica step time and shares" '
            f'src="data:image/png;base64,{encoded}">',
            *sections,
            "</body></html>",
            "",
        ]
    )


def _replica_rows(records):
    rows = records.rows.astype(np.float64)
    seconds = records.compute_seconds
    with np.errstate(divide="ignore", invalid="ignore"):
        per_row = np.nansum(seconds, axis=0) / rows.sum(axis=0)
    return [
        (
            replica,
            device,
            f"{rows[:, replica].mean():.1f}",
            f"{np.nanmean(seconds[:, replica]):.4f}",
            f"{per_row[replica]:.2e}",
            f"{records.shares[-1, replica]:.3f}",
        )
        for replica, device in enumerate(records.devices)
    ]


def _table(header, rows):
    if not rows:
        return "<p>None.</p>"
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row)
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _seconds(value):
    return "in flight" if value is None else f"{value:.3f}"


def _time_limit(records):
    # Epoch starts and retracing make a few wall times much longer than the
    # rest; they may leave the frame instead of flattening every line.
    highest = np.nanmax(records.compute_seconds, initial=0.0)
    if np.any(np.isfinite(records.step_seconds)):
        highest = max(highest, np.nanpercentile(records.step_seconds, 90))
    return 1.25 * highest if highest > 0 else 1.0


def _value_at(records, step, replica):
    index = int(np.searchsorted(records.steps, step))
    index = min(index, len(records.steps) - 1)
    return float(records.compute_seconds[index, replica])


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "kh.report draws its figure with matplotlib, which is not "
            f"installed. Install the report extra: {_EXTRA}"
        ) from error
    return Figure, FigureCanvasAgg
