"""`plot`: a figure of `Records` (matplotlib, the `report` extra)."""

import numpy as np

# What the `report` extra installs: true however keras-hetero was installed
# (from a checkout or a wheel; it is not on a package registry yet).
_EXTRA = 'pip install "matplotlib>=3.8"'


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
    figure_class, canvas_class = matplotlib_classes()
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


def matplotlib_classes():
    """`(Figure, FigureCanvasAgg)` of matplotlib.

    Raises:
        ImportError: Naming the `report` extra, if matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "kh.report draws its figure with matplotlib, which is not "
            f"installed. Install it (the report extra) with: {_EXTRA}"
        ) from error
    return Figure, FigureCanvasAgg
