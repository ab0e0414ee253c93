"""Pure decision logic for per-replica shares: validation, rounding, schedule.

No TensorFlow here: everything is numpy over explicit state so it can be tested
and reasoned about alone.
"""

import threading

import numpy as np


def validate_shares(shares, num_replicas):
    """Checks `shares` and returns them as float64 fractions summing to 1.

    Args:
        shares: One non-negative number per replica. They are normalised, so
            `[3, 1]` means `[0.75, 0.25]`.
        num_replicas: How many replicas the shares must cover.

    Returns:
        A float64 `np.ndarray` of length `num_replicas` summing to 1.

    Raises:
        ValueError: If `shares` has the wrong length, a negative, NaN or
            infinite entry, or sums to 0.

    Example:

    >>> validate_shares([3, 1], 2)
    array([0.75, 0.25])
    """
    try:
        values = np.asarray(shares, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"Invalid value for argument `shares`. Received: shares={shares!r}."
            f" Expected {num_replicas} non-negative numbers, one per replica."
        ) from None
    if values.ndim != 1 or values.shape[0] != num_replicas:
        raise ValueError(
            "Invalid value for argument `shares`. "
            f"Received: shares={shares!r} "
            f"(length {values.size}). Expected one share per replica: "
            f"{num_replicas} non-negative numbers."
        )
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(
            "Invalid value for argument `shares`. "
            f"Received: shares={shares!r}. "
            "Expected finite, non-negative numbers."
        )
    total = values.sum()
    if total <= 0:
        raise ValueError(
            "Invalid value for argument `shares`. "
            f"Received: shares={shares!r}. "
            "Expected at least one positive share (they sum to 0)."
        )
    return values / total


def rows_from_shares(shares, total_rows):
    """Splits `total_rows` into whole rows per replica by largest remainder.

    Each replica first gets `floor(share * total_rows)`; the rows left over go,
    one each, to the replicas with the largest fractional remainders (ties to
    the lower replica index). The result sums exactly to `total_rows`.

    Args:
        shares: Fractions summing to 1 (see `validate_shares`).
        total_rows: The number of rows to split.

    Returns:
        An int64 `np.ndarray`, one row count per replica.

    Example:

    >>> rows_from_shares(np.array([0.5, 0.25, 0.25]), 7)
    array([3, 2, 2])
    """
    exact = np.asarray(shares, dtype=np.float64) * int(total_rows)
    rows = np.floor(exact).astype(np.int64)
    missing = int(total_rows) - int(rows.sum())
    if missing > 0:
        order = np.argsort(-(exact - rows), kind="stable")
        rows[order[:missing]] += 1
    return rows


class ShareSchedule:
    """Which shares split which global batch.

    Global batches are numbered per *pass* of the input pipeline: a pass is
    one iteration over the data (an epoch when Keras re-iterates the dataset
    each epoch; the whole `fit` when the dataset is repeated), and batch
    `index` counts from 0 within it. Every worker of a job runs the same
    passes in the same order, so `(pass, index)` names the same global batch
    everywhere, however far each pipeline's prefetching runs ahead. A share
    change names the `(pass, index)` from which it applies.

    Args:
        shares: The initial shares (validated).

    Example:

    >>> schedule = ShareSchedule(np.array([0.5, 0.5]))
    >>> schedule.next_bounds(0, 4)
    array([0, 2, 4])
    """

    def __init__(self, shares):
        self._lock = threading.Lock()
        self._changes = [((-1, 0), np.asarray(shares, dtype=np.float64))]
        self._pass = -1
        self._next_index = 0
        self._skip_examples = 0
        self._mirror = None

    @property
    def mirror(self):
        """The in-graph copy the pipeline splits by (`attach`), or None."""
        return self._mirror

    def attach(self, mirror):
        """Lets the input pipeline split by `mirror`, a copy of this
        schedule it reads without Python (`kh.data.bounds.PipelineSplit`).

        From then on the pipeline's position is the mirror's, and every
        change is published to it; `next_bounds` is no longer called.
        """
        with self._lock:
            self._mirror = mirror
            mirror.publish(self._changes)

    def _cursor(self):
        """`(pass, next index)`; pass -1 before the first batch."""
        if self._mirror is not None:
            return self._mirror.cursor()
        return self._pass, self._next_index

    @property
    def position(self):
        """`(pass, index)` of the next global batch the pipeline will split."""
        with self._lock:
            number, index = self._cursor()
            return (max(number, 0), index)

    @property
    def passes_started(self):
        """How many passes over the data the pipeline has started."""
        with self._lock:
            return self._cursor()[0] + 1

    def shares_at(self, key):
        """The shares that split global batch `key = (pass, index)`."""
        with self._lock:
            return self._shares_at(tuple(key))

    def _shares_at(self, key):
        current = self._changes[0][1]
        for start, shares in self._changes:
            if start > key:
                break
            current = shares
        return current

    def latest(self):
        """The most recently scheduled shares."""
        with self._lock:
            return self._changes[-1][1]

    def set_shares(self, shares, at=None):
        """Schedules `shares` for global batches from `at = (pass, index)` on.

        Args:
            shares: Validated fractions.
            at: The first global batch that uses them. Defaults to the next
                batch the pipeline has not split yet. A batch already split
                keeps its split (never retroactive): an earlier `at` is moved
                to the next unsplit batch.

        Returns:
            The `(pass, index)` from which the shares apply.
        """
        shares = np.asarray(shares, np.float64)
        with self._lock:
            number, index = self._cursor()
            next_unsplit = (max(number, 0), index)
            start = next_unsplit if at is None else max(tuple(at), next_unsplit)
            # A change replaces any later-scheduled one.
            changes = self._replaced(start, shares)
            if self._mirror is not None:
                took = self._mirror.publish(changes, start)
                if took != start:
                    # The pipeline split `start` (and maybe more) before the
                    # change reached it: record where it did take effect.
                    start, changes = took, self._replaced(took, shares)
                    self._mirror.publish(changes)
            self._changes = changes
            return start

    def _replaced(self, start, shares):
        return [c for c in self._changes if c[0] < start] + [(start, shares)]

    def skip_examples(self, count):
        """Makes the next pass start after its first `count` examples."""
        with self._lock:
            self._skip_examples = int(count)

    def take_example_skip(self):
        """Examples the pass that starts now skips (once; then 0)."""
        with self._lock:
            count, self._skip_examples = self._skip_examples, 0
            return np.int64(count)

    def next_bounds(self, index, total_rows):
        """Row boundaries of global batch `index` of the current pass.

        Index 0 starts a new pass. Replica `i` takes rows
        `[bounds[i], bounds[i + 1])`; there is one more bound than replicas.
        """
        with self._lock:
            if int(index) == 0:
                self._pass += 1
            self._next_index = int(index) + 1
            shares = self._shares_at((self._pass, int(index)))
        rows = rows_from_shares(shares, int(total_rows))
        return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)

    def get_state(self):
        """The schedule as plain data (for checkpoints)."""
        with self._lock:
            return {
                "changes": [
                    (list(start), shares.tolist())
                    for start, shares in self._changes
                ]
            }

    def set_state(self, state):
        """Restores `get_state()` output."""
        with self._lock:
            self._changes = [
                (tuple(start), np.asarray(shares, np.float64))
                for start, shares in state["changes"]
            ]
            if self._mirror is not None:
                self._mirror.publish(self._changes)
