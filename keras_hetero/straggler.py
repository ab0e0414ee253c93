"""Pure scoring logic of `StragglerDetector`: who is slow, and since when.

Numpy over explicit, immutable state (`ScoreState`), testable without
TensorFlow. Fed the same all-reduced telemetry, every worker scores alike.

Per replica and step the cost is `compute_seconds / rows` (seconds per row),
so a replica that was given more rows is not blamed for it. Over a window of
recent costs:

- relative score = best replica's median cost / this replica's median cost;
- individual score = this replica's baseline (the lowest median it has
  shown, relaxed upward by `BASELINE_RELAX` per evaluation) / its current
  median; with other replicas scored, divided by the highest such ratio
  among them (the least slowed replica's), so a slowdown that every replica
  shares (the machine got busier) is not any replica's.

Both are in (0, 1]; 1 is "as fast as it gets".

A low score counts only when it costs time beyond the noise: the replica's
excess, (its median cost - the cost it is compared with) * its rows in the
latest step, must exceed `min_excess_seconds` and `NOISE_MADS` median
absolute deviations of the window's step times (all replicas pooled).
Small steps on a busy machine need this: there a 3 ms step takes 8 ms
whenever the scheduler gives its core away for a time slice, for one
replica and not the other, for several steps in a row.
"""

import dataclasses
import math

import numpy as np

from keras_hetero import rebalance

# Per evaluation: a baseline 10% too low is forgotten in about 100 steps,
# while a real slowdown is flagged within `window / 2 + patience` steps.
BASELINE_RELAX = 0.001

# Seconds of compute a replica must lose per step, against the replica it is
# compared with or its own baseline, before a low score counts. Steps of a
# few ms on a busy 2-core machine lost 1-5 ms to scheduling alone (measured
# on two equal logical CPUs; benchmarks/straggler.py); real stragglers of
# interest lose far more.
MIN_EXCESS_SECONDS = 0.003

# The excess must also exceed this many median absolute deviations of the
# window's step times: the noise floor of the machine as measured now
# (about 7 standard deviations of Gaussian noise; scheduling noise has far
# heavier tails).
NOISE_MADS = 10.0


@dataclasses.dataclass(frozen=True)
class StragglerEvent:
    """A replica became a straggler (`kind="straggler"`) or recovered.

    Attributes:
        step: Train steps completed when the event fired.
        replica: Global replica index.
        worker: Index of the worker (task) running the replica.
        device: The replica's device.
        relative_score: Best replica's cost per row / this replica's.
        individual_score: This replica's baseline cost / its current cost.
        kind: `"straggler"` or `"recovered"`.
    """

    step: int
    replica: int
    worker: int
    device: str
    relative_score: float
    individual_score: float
    kind: str


@dataclasses.dataclass(frozen=True)
class ScoreState:
    """Everything the scoring remembers, as plain arrays.

    Attributes:
        readings: `[window, replicas]` recent costs per row, NaN = none.
        seen: How many readings have been added.
        baseline: Lowest median cost per replica so far (NaN = none yet).
        below: Consecutive evaluations below the threshold, per replica.
        above: Consecutive evaluations at or above it, per replica.
        flagged: Whether each replica is currently a straggler.
        rows: Rows of each replica in the latest reading (0 before any).
    """

    readings: np.ndarray
    seen: int
    baseline: np.ndarray
    below: np.ndarray
    above: np.ndarray
    flagged: np.ndarray
    rows: np.ndarray

    @classmethod
    def empty(cls, num_replicas, window):
        return cls(
            readings=np.full((window, num_replicas), np.nan),
            seen=0,
            baseline=np.full(num_replicas, np.nan),
            below=np.zeros(num_replicas, np.int64),
            above=np.zeros(num_replicas, np.int64),
            flagged=np.zeros(num_replicas, bool),
            rows=np.zeros(num_replicas, np.float64),
        )

    def to_dict(self):
        return {
            name: (value.tolist() if isinstance(value, np.ndarray) else value)
            for name, value in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data):
        return cls(
            readings=np.asarray(data["readings"], np.float64),
            seen=int(data["seen"]),
            baseline=np.asarray(data["baseline"], np.float64),
            below=np.asarray(data["below"], np.int64),
            above=np.asarray(data["above"], np.int64),
            flagged=np.asarray(data["flagged"], bool),
            # States saved before `rows` existed: the next reading sets it.
            rows=np.asarray(
                data.get("rows", np.zeros(len(data["flagged"]))), np.float64
            ),
        )


def add_reading(state, rows, compute_seconds):
    """A new state with one step's costs per row added."""
    window = rebalance.SpeedWindow(state.readings).add(rows, compute_seconds)
    return dataclasses.replace(
        state,
        readings=window.readings,
        seen=state.seen + 1,
        rows=np.asarray(rows, np.float64),
    )


def current_costs(state):
    """Median cost per row per replica over the window (NaN: no reading)."""
    return rebalance.SpeedWindow(state.readings).seconds_per_row()


def scores(state, cost=None):
    """`(relative, individual)` score arrays; NaN where a replica has none."""
    cost = current_costs(state) if cost is None else cost
    # NaN costs (no reading) stay NaN; fmin skips them when finding the best.
    best = np.fmin.reduce(cost)
    with np.errstate(divide="ignore", invalid="ignore"):
        relative, individual = best / cost, state.baseline / cost
        # Against the least slowed replica: a slowdown all share is none's.
        finite = individual[np.isfinite(individual)]
        if finite.size > 1:
            individual = individual / finite.max()
    return relative, individual


def noise_seconds(state, cost=None):
    """Median absolute deviation of the window's step times, pooled.

    Each reading's distance from its replica's median cost, times the
    replica's rows in the latest reading; replicas without rows are left
    out. 0.0 when there is nothing to measure.
    """
    cost = current_costs(state) if cost is None else cost
    rows = state.rows
    deviation = np.abs(state.readings - cost) * rows
    known = deviation[:, rows > 0]
    return _sorted_median(np.sort(known[~np.isnan(known)]))


def _sorted_median(ordered):
    """Median of a sorted 1-D array (0.0 if empty), as `_median` computes."""
    if not ordered.size:
        return 0.0
    middle, odd = divmod(len(ordered), 2)
    if odd:
        return float(ordered[middle])
    return float(0.5 * (ordered[middle - 1] + ordered[middle]))


def evaluate(
    state,
    *,
    threshold,
    patience,
    relative_threshold=None,
    min_excess_seconds=MIN_EXCESS_SECONDS,
):
    """Scores the window and updates flags.

    A replica is low when its individual score is below `threshold` or its
    relative score below `relative_threshold` (`threshold` if None), in
    either case with an excess time (see the module docstring) above
    `min_excess_seconds` and `NOISE_MADS` times `noise_seconds`. It is
    flagged after `patience` consecutive low evaluations and recovers after
    `patience` consecutive evaluations that are not. Nothing is scored
    until the window is full once.

    Returns:
        `(new_state, changes)`, `changes` a list of
        `(replica, kind, relative_score, individual_score)`.
    """
    window = state.readings.shape[0]
    if state.seen < window:
        return state, []
    cost = current_costs(state)
    relative, individual = scores(state, cost)
    floor = max(min_excess_seconds, NOISE_MADS * noise_seconds(state, cost))
    best = np.fmin.reduce(cost)
    # The baseline is the lowest median seen, relaxed upward a little each
    # evaluation: over a long run the noise's luckiest window would
    # otherwise become the yardstick and flag ordinary jitter.
    # (fmin skips NaN: a replica's first median becomes its baseline.)
    baseline = np.fmin(state.baseline * (1.0 + BASELINE_RELAX), cost)
    # NaN (no reading) compares False: not low.
    if relative_threshold is None:
        relative_threshold = threshold
    with np.errstate(invalid="ignore"):
        relative_excess = (cost - best) * state.rows
        individual_excess = cost * (1.0 - individual) * state.rows
    low = ((relative < relative_threshold) & (relative_excess > floor)) | (
        (individual < threshold) & (individual_excess > floor)
    )
    below = np.where(low, state.below + 1, 0)
    above = np.where(low, 0, state.above + 1)
    flagged = state.flagged
    starts = ~flagged & (below >= patience)
    ends = flagged & (above >= patience)
    changes = []
    if starts.any() or ends.any():
        flagged = (flagged | starts) & ~ends
        for replica in np.flatnonzero(starts | ends):
            changes.append(
                (
                    int(replica),
                    "straggler" if starts[replica] else "recovered",
                    float(relative[replica]),
                    float(individual[replica]),
                )
            )
    new_state = dataclasses.replace(
        state, baseline=baseline, below=below, above=above, flagged=flagged
    )
    return new_state, changes


class Scorer:
    """`add_reading` + `evaluate` in one call, on plain Python floats.

    The same arithmetic as the numpy functions above (a test checks that
    both give the same states and changes), without numpy's per-call cost
    on arrays of a handful of replicas: `StragglerDetector` runs it every
    step. Mutable; convert with `state()` / `from_state()`.

    Args:
        num_replicas: Replicas scored.
        window: Readings the median covers.

    Example:

    >>> scorer = Scorer(2, 3)
    >>> scorer.step([16, 16], [0.016, 0.016], threshold=0.7, patience=1)
    []
    """

    def __init__(self, num_replicas, window):
        nan = float("nan")
        self.window = window
        self.readings = [[nan] * num_replicas for _ in range(window)]
        self.seen = 0
        self.baseline = [nan] * num_replicas
        self.below = [0] * num_replicas
        self.above = [0] * num_replicas
        self.flagged = [False] * num_replicas
        self.rows = [0.0] * num_replicas

    @classmethod
    def from_state(cls, state):
        """A scorer holding `ScoreState` `state`."""
        window, replicas = state.readings.shape
        scorer = cls(replicas, window)
        scorer.readings = [[float(v) for v in row] for row in state.readings]
        scorer.seen = int(state.seen)
        scorer.baseline = [float(v) for v in state.baseline]
        scorer.below = [int(v) for v in state.below]
        scorer.above = [int(v) for v in state.above]
        scorer.flagged = [bool(v) for v in state.flagged]
        scorer.rows = [float(v) for v in state.rows]
        return scorer

    def state(self):
        """This scorer's `ScoreState`."""
        return ScoreState(
            readings=np.array(self.readings, np.float64),
            seen=self.seen,
            baseline=np.array(self.baseline, np.float64),
            below=np.array(self.below, np.int64),
            above=np.array(self.above, np.int64),
            flagged=np.array(self.flagged, bool),
            rows=np.array(self.rows, np.float64),
        )

    def step(
        self,
        rows,
        compute_seconds,
        *,
        threshold,
        patience,
        relative_threshold=None,
        min_excess_seconds=MIN_EXCESS_SECONDS,
    ):
        """Adds one reading and evaluates; returns `evaluate`'s changes."""
        if relative_threshold is None:
            relative_threshold = threshold
        nan = float("nan")
        self.rows = [float(r) for r in rows]
        reading = [
            float(s) / r if r > 0 else nan
            for r, s in zip(self.rows, compute_seconds)
        ]
        self.readings.pop(0)
        self.readings.append(reading)
        self.seen += 1
        if self.seen < self.window:
            return []
        columns = list(zip(*self.readings))
        cost = [_median(column) for column in columns]
        known = [c for c in cost if c == c]
        best = min(known) if known else nan
        ratios = [_ratio(b, c) for b, c in zip(self.baseline, cost)]
        finite = [r for r in ratios if math.isfinite(r)]
        if len(finite) > 1:  # against the least slowed replica
            peak = max(finite)
            ratios = [_ratio(r, peak) for r in ratios]
        deviations = [
            abs(v - c) * r
            for column, c, r in zip(columns, cost, self.rows)
            if r > 0
            for v in column
            if v == v
        ]
        noise = _median(deviations) if deviations else 0.0
        floor = max(min_excess_seconds, NOISE_MADS * noise)
        changes = []
        for replica, value in enumerate(cost):
            relative = _ratio(best, value)
            individual = ratios[replica]
            rows_now = self.rows[replica]
            relaxed = self.baseline[replica] * (1.0 + BASELINE_RELAX)
            # fmin: NaN loses to a number.
            if value == value and not relaxed <= value:
                self.baseline[replica] = value
            else:
                self.baseline[replica] = relaxed
            low = (
                relative < relative_threshold
                and (value - best) * rows_now > floor
            ) or (
                individual < threshold
                and value * (1.0 - individual) * rows_now > floor
            )
            if low:
                self.below[replica] += 1
                self.above[replica] = 0
            else:
                self.below[replica] = 0
                self.above[replica] += 1
            flagged = self.flagged[replica]
            if not flagged and self.below[replica] >= patience:
                kind = "straggler"
            elif flagged and self.above[replica] >= patience:
                kind = "recovered"
            else:
                continue
            self.flagged[replica] = not flagged
            changes.append((replica, kind, relative, individual))
        return changes


def _median(values):
    known = sorted(v for v in values if v == v)
    if not known:
        return float("nan")
    middle, odd = divmod(len(known), 2)
    if odd:
        return known[middle]
    return 0.5 * (known[middle - 1] + known[middle])


def _ratio(numerator, denominator):
    """numpy's float64 division: x/0 is inf (or NaN for 0/0), NaN stays."""
    if denominator == 0:
        if numerator != numerator or numerator == 0:
            return float("nan")
        return math.copysign(float("inf"), numerator)
    return numerator / denominator
