"""`write`: the report's PNG and its self-contained HTML page."""

import base64
import dataclasses
import html
import io
import os

import numpy as np

from keras_hetero.report import figure as figure_lib
from keras_hetero.report.records import Records


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
    figure = figure_lib.plot(records)
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
