"""Pure decision logic of `ShardRebalancer`: speed estimates and new shares.

Numpy over explicit, immutable state, so it tests without TensorFlow and every
worker of a job, fed the same all-reduced telemetry, takes the same decision.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpeedWindow:
    """The last `size` seconds-per-row readings of each replica.

    Attributes:
        readings: float array `[size, replicas]`, NaN where nothing was seen
            (e.g. a replica with 0 rows). Oldest first.
    """

    readings: np.ndarray

    @classmethod
    def empty(cls, num_replicas, size):
        return cls(np.full((size, num_replicas), np.nan))

    def add(self, rows, compute_seconds):
        """A new window with one step's (or execution's) telemetry added."""
        rows = np.asarray(rows, np.float64)
        # Dividing by NaN (no rows) gives NaN without a warning.
        reading = np.asarray(compute_seconds, np.float64) / np.where(
            rows > 0, rows, np.nan
        )
        return SpeedWindow(
            np.concatenate([self.readings[1:], reading[np.newaxis]])
        )

    def seconds_per_row(self):
        """Median reading per replica (NaN if none): robust to outliers."""
        return medians(self.readings)


def medians(readings):
    """The median of each column of `readings`, skipping NaN (NaN for a
    column with none).

    A few vector operations whatever the number of columns: a partition
    when nothing is NaN, else one sort (NaN sorts last) and each column's
    middle of its known values. Exactly `np.median` of each column's known
    values.

    Args:
        readings: float array `[size, columns]`.

    Returns:
        float array `[columns]`.

    Example:

    >>> medians(np.array([[1.0, np.nan], [3.0, 2.0], [2.0, 4.0]]))
    array([2., 3.])
    """
    size = readings.shape[0]
    unknown = np.isnan(readings)
    if not unknown.any():  # the common case
        middle, odd = divmod(size, 2)
        kth = middle if odd else [middle - 1, middle]
        ordered = np.partition(readings, kth, axis=0)
        if odd:
            return ordered[middle]
        return 0.5 * (ordered[middle - 1] + ordered[middle])
    known = size - np.count_nonzero(unknown, axis=0)
    ordered = np.sort(readings, axis=0)
    columns = np.arange(readings.shape[1])
    # A column with none reads its last row: NaN.
    low = ordered[(known - 1) // 2, columns]
    high = ordered[known // 2, columns]
    return np.where(known % 2 == 1, low, 0.5 * (low + high))


def step_seconds(shares, seconds_per_row, global_batch_size):
    """Predicted synchronous step time: the slowest replica's work."""
    rows = np.asarray(shares) * global_batch_size
    work = np.where(rows > 0, rows * np.nan_to_num(seconds_per_row), 0.0)
    return float(np.max(work))


def balanced_shares(
    seconds_per_row,
    current_shares,
    global_batch_size,
    *,
    min_share=0.0,
    max_rows=None,
):
    """Shares proportional to speed (1 / seconds per row), within bounds.

    Replicas with no estimate (NaN) keep their current share. Every share is
    at least `min_share`, and a replica gets at most `max_rows` rows of a
    global batch (e.g. for its memory); what the bounds take or give is
    spread over the other replicas in proportion to their speed.

    Args:
        seconds_per_row: Estimated seconds per row per replica.
        current_shares: The shares in force.
        global_batch_size: Rows per global batch.
        min_share: Lower bound for every share. Defaults to `0.0`.
        max_rows: Upper bound on any replica's rows, or None (or an array,
            one per replica). Defaults to `None`.

    Returns:
        Shares summing to 1.

    Example:

    >>> balanced_shares(np.array([0.004, 0.002, 0.001]), np.ones(3) / 3, 70)
    array([0.14285714, 0.28571429, 0.57142857])
    """
    current = np.asarray(current_shares, np.float64)
    spr = np.asarray(seconds_per_row, np.float64)
    known = ~np.isnan(spr) & (spr > 0)
    free = 1.0 - current[~known].sum()
    speed = np.zeros_like(spr)
    speed[known] = 1.0 / spr[known]
    target = current.copy()
    if known.any() and speed.sum() > 0:
        target[known] = free * speed[known] / speed[known].sum()
    upper = np.ones_like(target)
    if max_rows is not None:
        upper = np.minimum(
            upper, np.asarray(max_rows, np.float64) / global_batch_size
        )
    lower = np.full_like(target, float(min_share))
    weight = np.where(known, speed, current + 1e-12)
    for _ in range(len(target) + 1):
        clipped = np.clip(target, lower, upper)
        excess = target.sum() - clipped.sum()
        target = clipped
        if abs(excess) < 1e-12:
            break
        # Give (or take) the excess to replicas not pinned at the bound.
        room = (target < upper) if excess > 0 else (target > lower)
        if not room.any():
            break
        target[room] += excess * weight[room] / weight[room].sum()
    return target / target.sum()


def decide(
    window,
    current_shares,
    global_batch_size,
    *,
    min_share=0.0,
    max_rows=None,
    tolerance=0.05,
):
    """New shares, or None when the gain is within `tolerance` (hysteresis).

    Args:
        window: A `SpeedWindow`.
        current_shares: The shares in force.
        global_batch_size: Rows per global batch.
        min_share: See `balanced_shares`. Defaults to `0.0`.
        max_rows: See `balanced_shares`. Defaults to `None`.
        tolerance: Change only if the predicted step time drops by more than
            this fraction (a replica over its `max_rows` moves down
            whatever the gain). Defaults to `0.05`.

    Returns:
        Shares (summing to 1) or None.
    """
    spr = window.seconds_per_row()
    if np.all(np.isnan(spr)):
        return None
    target = balanced_shares(
        spr,
        current_shares,
        global_batch_size,
        min_share=min_share,
        max_rows=max_rows,
    )
    over = max_rows is not None and np.any(
        np.asarray(current_shares, np.float64) * global_batch_size
        > np.asarray(max_rows, np.float64) + 0.5
    )
    now = step_seconds(current_shares, spr, global_batch_size)
    then = step_seconds(target, spr, global_batch_size)
    if not over and now <= then * (1.0 + tolerance):
        return None
    return target
