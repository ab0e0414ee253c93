"""Pure scoring logic of `StragglerDetector`: who is slow, and since when.

Numpy over explicit, immutable state (`ScoreState`), testable without
TensorFlow. Fed the same all-reduced telemetry, every worker scores alike.

Per replica and step the cost is `compute_seconds / rows` (seconds per row),
so a replica that was given more rows is not blamed for it. Over a window of
recent costs:

- relative score = best replica's median cost / this replica's median cost;
- individual score = this replica's baseline (the lowest median it has
  shown, relaxed upward by `BASELINE_RELAX` per evaluation) / its current
  median.

Both are in (0, 1]; 1 is "as fast as it gets".
"""

import dataclasses
import math

import numpy as np

from keras_hetero import rebalance

# Per evaluation: a baseline 10% too low is forgotten in about 100 steps,
# while a real slowdown is flagged within `window / 2 + patience` steps.
BASELINE_RELAX = 0.001


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
    """

    readings: np.ndarray
    seen: int
    baseline: np.ndarray
    below: np.ndarray
    above: np.ndarray
    flagged: np.ndarray

    @classmethod
    def empty(cls, num_replicas, window):
        return cls(
            readings=np.full((window, num_replicas), np.nan),
            seen=0,
            baseline=np.full(num_replicas, np.nan),
            below=np.zeros(num_replicas, np.int64),
            above=np.zeros(num_replicas, np.int64),
            flagged=np.zeros(num_replicas, bool),
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
        )


def add_reading(state, rows, compute_seconds):
    """A new state with one step's costs per row added."""
    window = rebalance.SpeedWindow(state.readings).add(rows, compute_seconds)
    return ScoreState(
        window.readings,
        state.seen + 1,
        state.baseline,
        state.below,
        state.above,
        state.flagged,
    )


def current_costs(state):
    """Median cost per row per replica over the window (NaN: no reading)."""
    return rebalance.SpeedWindow(state.readings).seconds_per_row()


def scores(state, cost=None):
    """`(relative, individual)` score arrays; NaN where a replica has none."""
    cost = current_costs(state) if cost is None else cost
    # NaN costs (no reading) stay NaN; fmin skips them when finding the best.
    best = np.fmin.reduce(cost)
    if cost.all():  # no zero cost (NaN counts as true): nothing to silence
        return best / cost, state.baseline / cost
    with np.errstate(divide="ignore", invalid="ignore"):
        return best / cost, state.baseline / cost


def evaluate(state, *, threshold, patience, relative_threshold=None):
    """Scores the window and updates flags.

    A replica is flagged after `patience` consecutive evaluations with its
    individual score below `threshold` or its relative score below
    `relative_threshold` (`threshold` if None), and recovers after
    `patience` consecutive evaluations with neither. Nothing is scored until
    the window is full once.

    Returns:
        `(new_state, changes)`, `changes` a list of
        `(replica, kind, relative_score, individual_score)`.
    """
    window = state.readings.shape[0]
    if state.seen < window:
        return state, []
    cost = current_costs(state)
    relative, individual = scores(state, cost)
    # The baseline is the lowest median seen, relaxed upward a little each
    # evaluation: over a long run the noise's luckiest window would
    # otherwise become the yardstick and flag ordinary jitter.
    # (fmin skips NaN: a replica's first median becomes its baseline.)
    baseline = np.fmin(state.baseline * (1.0 + BASELINE_RELAX), cost)
    # NaN (no reading) compares False: not low.
    if relative_threshold is None:
        relative_threshold = threshold
    low = (relative < relative_threshold) | (individual < threshold)
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
    new_state = ScoreState(
        state.readings, state.seen, baseline, below, above, flagged
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
        )

    def step(
        self,
        rows,
        compute_seconds,
        *,
        threshold,
        patience,
        relative_threshold=None,
    ):
        """Adds one reading and evaluates; returns `evaluate`'s changes."""
        if relative_threshold is None:
            relative_threshold = threshold
        nan = float("nan")
        reading = [
            float(s) / float(r) if r > 0 else nan
            for r, s in zip(rows, compute_seconds)
        ]
        self.readings.pop(0)
        self.readings.append(reading)
        self.seen += 1
        if self.seen < self.window:
            return []
        cost = [_median(column) for column in zip(*self.readings)]
        known = [c for c in cost if c == c]
        best = min(known) if known else nan
        changes = []
        for replica, value in enumerate(cost):
            relative = _ratio(best, value)
            individual = _ratio(self.baseline[replica], value)
            relaxed = self.baseline[replica] * (1.0 + BASELINE_RELAX)
            # fmin: NaN loses to a number.
            if value == value and not relaxed <= value:
                self.baseline[replica] = value
            else:
                self.baseline[replica] = relaxed
            low = relative < relative_threshold or individual < threshold
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
