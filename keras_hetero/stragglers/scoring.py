"""Pure scoring logic of `StragglerDetector`: who is slow, and since when.

Numpy over explicit, immutable state (`ScoreState`), testable without
TensorFlow. Fed the same all-reduced telemetry, every worker scores alike.
Two implementations of the same rules: `add_reading` + `evaluate`, the
reference (a new state per step; tests and benchmarks/straggler.py use it),
and `Scorer`, the incremental one `StragglerDetector` runs (tests check that
both give the same events).

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

A replica becomes a straggler only when its low score also costs time
beyond the noise. Its excess is (its current cost - the cost it is compared
with) * its rows (of its latest reading with rows). Its current cost is
the lower of its median and its latest reading (slow over the window but
not now is not slow now); the compared cost is the best replica's median
(relative score) or its own median times its individual score. The excess
must exceed the noise floor, the largest of `min_excess_seconds`,
`NOISE_MADS` median absolute deviations of the window's step times (all
replicas pooled: the usual jitter) and `NOISE_MEANS` times
`ScoreState.noise` (how often and by how much steps get delayed here, over
the last ~1 / `NOISE_DECAY` steps). The floor guards the alarm only: a
straggler recovers when its scores are back above the thresholds, so a
real one does not flap when noise rises.

Why: on a loaded 2-core machine (two equal logical CPUs, measured by
benchmarks/straggler.py) a 6 ms step takes 10-11 ms whenever the scheduler
gives its core away for a time slice, for one replica and not the other,
several steps in a row; and the whole machine's pace drifts 2x within a
run, so a replica's luckiest window (its baseline) is far from its usual
pace. Without the floor and the common-mode division, two equal replicas
were flagged 42-128 times per 1200 steps.
"""

import dataclasses
import math

import numpy as np

from keras_hetero.balancing import core as rebalance

# Per evaluation: a baseline 10% too low is forgotten in about 100 steps,
# while a real slowdown is flagged within `window / 2 + patience` steps.
BASELINE_RELAX = 0.001

# Default least excess (seconds per step) a straggler must cost. The window
# medians of two equal replicas on a quiet 2-core machine differ by up to
# 1.5 ms (3 ms steps); sub-millisecond steps differ by a systematic 0.05 ms.
MIN_EXCESS_SECONDS = 0.003

# The excess must also exceed this many median absolute deviations of the
# window's step times (about 7 standard deviations of Gaussian noise;
# scheduling noise has far heavier tails)...
NOISE_MADS = 10.0

# ... and this many times `ScoreState.noise`, the mean deviation of a step
# from its replica's median. The median deviation misses delays that hit
# fewer than half of the steps; the mean counts them, weighted by how often
# they come. Each deviation is capped at the replica's median step time, so
# a lone stall (the first step, an epoch's first batch) or the onset of a
# real slowdown moves the mean little.
NOISE_MEANS = 6.0

# Weight of the newest step in `ScoreState.noise` (memory ~50 steps).
NOISE_DECAY = 0.02


@dataclasses.dataclass(frozen=True)
class StragglerEvent:
    """A replica became a straggler (`kind="straggler"`) or recovered.

    Attributes:
        step: Train steps completed when the event fired.
        replica: Global replica index.
        worker: Index of the worker (task) running the replica.
        device: The replica's device.
        relative_score: Best replica's cost per row / this replica's.
        individual_score: This replica's baseline cost / its current cost,
            divided by the highest such ratio of the replicas (when there
            are others).
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
        below: Consecutive low evaluations (see `evaluate`), per replica.
        above: Consecutive evaluations that were not, per replica.
        flagged: Whether each replica is currently a straggler.
        rows: Rows of each replica in its latest reading with rows (0
            before any): a worker of a ParameterServerStrategy job that
            finished no step since the last batch end reads 0 rows.
        noise: Exponential average (weight `NOISE_DECAY`) of the steps'
            mean deviation from their replica's median, in seconds.
    """

    readings: np.ndarray
    seen: int
    baseline: np.ndarray
    below: np.ndarray
    above: np.ndarray
    flagged: np.ndarray
    rows: np.ndarray
    noise: float = 0.0

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
            # States saved before `rows` and `noise` existed: the next
            # reading sets `rows`, and `noise` starts afresh.
            rows=np.asarray(
                data.get("rows", np.zeros(len(data["flagged"]))), np.float64
            ),
            noise=float(data.get("noise", 0.0)),
        )


def add_reading(state, rows, compute_seconds):
    """A new state with one step's costs per row added."""
    window = rebalance.SpeedWindow(state.readings).add(rows, compute_seconds)
    rows = np.asarray(rows, np.float64)
    return dataclasses.replace(
        state,
        readings=window.readings,
        seen=state.seen + 1,
        rows=np.where(rows > 0, rows, state.rows),
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


def noise_floor(state, cost, min_excess_seconds):
    """`(floor, noise)`: the excess a low score needs, and the new noise.

    `noise` is `state.noise` updated with the latest reading's deviations.
    """
    rows = state.rows
    scored = rows > 0
    deviation = np.abs(state.readings - cost) * rows
    pooled = deviation[:, scored]
    pooled = np.sort(pooled[~np.isnan(pooled)])
    mad = _sorted_median(pooled) if pooled.size else 0.0
    newest = state.readings[-1]
    latest = np.minimum(np.abs(newest - cost), cost) * rows
    latest = latest[scored & ~np.isnan(latest)]
    noise = state.noise
    if latest.size:
        mean = math.fsum(latest.tolist()) / latest.size
        noise = noise + NOISE_DECAY * (mean - noise)
    floor = max(min_excess_seconds, NOISE_MADS * mad, NOISE_MEANS * noise)
    return floor, noise


def _sorted_median(ordered):
    """Median of a sorted, non-empty 1-D array, as `_median` computes it."""
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
    relative score below `relative_threshold` (`threshold` if None). It is
    flagged after `patience` consecutive low evaluations, each with an
    excess time above the noise floor (see the module docstring;
    `min_excess_seconds` is its least value), and recovers after `patience`
    consecutive evaluations that are not low, whatever the noise: the floor
    guards the alarm, not the all-clear, so a straggler on a noisy machine
    does not flap. Nothing is scored until the window is full once.

    Returns:
        `(new_state, changes)`, `changes` a list of
        `(replica, kind, relative_score, individual_score)`.
    """
    window = state.readings.shape[0]
    if state.seen < window:
        return state, []
    cost = current_costs(state)
    relative, individual = scores(state, cost)
    floor, noise = noise_floor(state, cost, min_excess_seconds)
    best = np.fmin.reduce(cost)
    # The baseline is the lowest median seen, relaxed upward a little each
    # evaluation: over a long run the noise's luckiest window would
    # otherwise become the yardstick and flag ordinary jitter.
    # (fmin skips NaN: a replica's first median becomes its baseline.)
    baseline = np.fmin(state.baseline * (1.0 + BASELINE_RELAX), cost)
    if relative_threshold is None:
        relative_threshold = threshold
    newest = state.readings[-1]
    current = np.where(newest < cost, newest, cost)
    # NaN (no reading) compares False: not low.
    with np.errstate(invalid="ignore"):
        relative_excess = (current - best) * state.rows
        individual_excess = (current - cost * individual) * state.rows
    slow = relative < relative_threshold
    lost = individual < threshold
    costly = (slow & (relative_excess > floor)) | (
        lost & (individual_excess > floor)
    )
    flagged = state.flagged
    low = np.where(flagged, slow | lost, costly)
    below = np.where(low, state.below + 1, 0)
    above = np.where(low, 0, state.above + 1)
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
        state,
        baseline=baseline,
        below=below,
        above=above,
        flagged=flagged,
        noise=noise,
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
        self.noise = 0.0

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
        scorer.noise = float(state.noise)
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
            noise=self.noise,
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
        rows = [float(r) for r in rows]
        reading = [
            float(s) / r if r > 0 else nan
            for r, s in zip(rows, compute_seconds)
        ]
        self.rows = [r if r > 0 else old for r, old in zip(rows, self.rows)]
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
        floor = self._noise_floor(columns, cost, min_excess_seconds)
        changes = []
        for replica, value in enumerate(cost):
            relative = _ratio(best, value)
            individual = ratios[replica]
            rows_now = self.rows[replica]
            newest = reading[replica]
            current = newest if newest < value else value
            relaxed = self.baseline[replica] * (1.0 + BASELINE_RELAX)
            # fmin: NaN loses to a number.
            if value == value and not relaxed <= value:
                self.baseline[replica] = value
            else:
                self.baseline[replica] = relaxed
            slow = relative < relative_threshold
            lost = individual < threshold
            if self.flagged[replica]:
                low = slow or lost
            else:
                low = (slow and (current - best) * rows_now > floor) or (
                    lost and (current - value * individual) * rows_now > floor
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

    def _noise_floor(self, columns, cost, min_excess_seconds):
        """`noise_floor` on lists; updates `self.noise`."""
        pooled = [
            abs(v - c) * r
            for column, c, r in zip(columns, cost, self.rows)
            if r > 0
            for v in column
            if v == v
        ]
        mad = _median(pooled) if pooled else 0.0
        latest = []
        for v, c, r in zip(self.readings[-1], cost, self.rows):
            deviation = abs(v - c)
            deviation = deviation if deviation < c else c
            if r > 0 and v == v:
                latest.append(deviation * r)
        if latest:
            mean = math.fsum(latest) / len(latest)
            self.noise = self.noise + NOISE_DECAY * (mean - self.noise)
        return max(
            min_excess_seconds, NOISE_MADS * mad, NOISE_MEANS * self.noise
        )


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
