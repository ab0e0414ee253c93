"""Pure scoring logic of `StragglerDetector`: who is slow, and since when.

Numpy over explicit, immutable state (`ScoreState`), testable without
TensorFlow. Fed the same all-reduced telemetry, every worker scores alike.
Two implementations of the same rules: `add_reading` + `evaluate`, the
reference (a new state per step; tests and benchmarks/straggler.py use it),
and `Scorer`, the incremental one `StragglerDetector` runs, a fixed number
of vector operations per step however many replicas (tests check that both
give the same events).

Per replica and step the cost is `compute_seconds / rows` (seconds per row),
so a replica that was given more rows is not blamed for it. Over a window of
recent costs:

- relative score = best replica's median cost / this replica's median cost;
- individual score = this replica's baseline (the lowest of its median
  smoothed over evaluations, `paced`, relaxed upward by `BASELINE_RELAX`
  per evaluation; learnt again when its rows rise, `rows_rose`) / its
  current median; with other replicas scored, divided by the highest such
  ratio among them (the least slowed replica's), so a slowdown that every
  replica shares (the machine got busier) is not any replica's.

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

A sustained slowdown counts without the jitter term: when even the
fastest of a replica's newest `window - 1` readings (all present; see
`sustained_readings`) is slower than the cost it is compared with by more
than `min_excess_seconds` and `NOISE_MEANS` times the OTHER replicas'
noise (`others_noise`: the machine's delays, not the replica's own
jitter), random delays cannot explain it (they would have spared one of
those steps), so it is costly whatever the pooled deviations. Why: a
replica slowed by a CPU quota jitters in proportion to its slowdown (0.3
of a core: 53-80 ms steps where 20 ms were), and with two replicas its own
deviations are half of the pooled ones: the jitter term rose to the excess
itself (floor 31-46 ms against 37-48 ms lost) and a quota drop was flagged
17 steps late on a busy machine. The sustained rule flags it within
`window + patience - 2` steps of its first slow one, however it jitters.

Why: on a loaded 2-core machine (two equal logical CPUs, measured by
benchmarks/straggler.py) a 6 ms step takes 10-11 ms whenever the scheduler
gives its core away for a time slice, for one replica and not the other,
several steps in a row; and the whole machine's pace drifts 2x within a
run, so a replica's luckiest window (its baseline) is far from its usual
pace. Without the floor and the common-mode division, two equal replicas
were flagged 42-128 times per 1200 steps.

With `relative_threshold=0` the relative score flags nothing: each replica
is scored against its own expected time at its current rows only (its
baseline cost per row times its rows), as `StragglerDetector` does with a
`ShardRebalancer` in the job, whose job a device slower than the others
is.
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

# Weight of the newest median in `ScoreState.pace`, the smoothed median a
# baseline is taken from (memory ~5 evaluations; see `paced`).
PACE_DECAY = 0.2

# A replica whose rows rise by more than this factor re-learns its
# baseline (see `rows_rose`).
ROWS_RISE = 1.05


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
            are others); NaN while the replica learns its baseline again
            after its rows rose.
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
        replica_noise: The same average per replica, of its own steps'
            deviations (the sustained check's delays term takes the other
            replicas', `others_noise`).
        steady: Readings each replica has given since its rows last rose
            (`rows_rose`); its baseline is learnt again once they fill
            the window.
        pace: Each replica's median cost, smoothed over evaluations
            (`paced`): what its baseline is the lowest of.
    """

    readings: np.ndarray
    seen: int
    baseline: np.ndarray
    below: np.ndarray
    above: np.ndarray
    flagged: np.ndarray
    rows: np.ndarray
    noise: float = 0.0
    replica_noise: np.ndarray = None
    steady: np.ndarray = None
    pace: np.ndarray = None

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
            replica_noise=np.zeros(num_replicas, np.float64),
            steady=np.full(num_replicas, window, np.int64),
            pace=np.full(num_replicas, np.nan),
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
            replica_noise=np.asarray(
                data.get("replica_noise", np.zeros(len(data["flagged"]))),
                np.float64,
            ),
            # Before `steady`: every replica counts as settled.
            steady=np.asarray(
                data.get(
                    "steady",
                    np.full(len(data["flagged"]), len(data["readings"])),
                ),
                np.int64,
            ),
            pace=np.asarray(
                data.get("pace", np.full(len(data["flagged"]), np.nan)),
                np.float64,
            ),
        )


def rows_rose(previous, rows):
    """Which replicas' rows rose by more than `ROWS_RISE` (of those with
    rows before and now).

    Such a replica's cost per row at its earlier rows is no yardstick: a
    device that runs out of a budget within the step (a CPU quota, a GPU's
    power limit) gets slower per row beyond it. Measured on a worker at 0.3
    of a core whose rows the rebalancer raised from 94 to 107 of 512: its
    median cost per row rose by 40% with nothing else changed, and its
    individual score fell to 0.69 (the threshold: 0.7) against the
    baseline of its fewer rows; one such rise flagged it in CI. So its
    baseline is forgotten and learnt again once the window holds only
    readings at its new rows (`ScoreState.steady`); until then it has no
    individual score. Rows that fall keep the baseline: a replica the
    rebalancer relieves because it slowed down is still flagged, and fewer
    rows cost at most the step's fixed overhead more per row.

    Example:

    >>> rows_rose(np.array([0.0, 100.0, 100.0]), np.array([50, 104, 107]))
    array([False, False,  True])
    """
    rows = np.asarray(rows, np.float64)
    return (previous > 0) & (rows > previous * ROWS_RISE)


def _steady_after(steady, rose, scored):
    """`ScoreState.steady` after a reading: 0 where rows rose, one more
    where the replica read rows."""
    return np.where(rose, 0, steady + scored)


def add_reading(state, rows, compute_seconds):
    """A new state with one step's costs per row added."""
    window = rebalance.SpeedWindow(state.readings).add(rows, compute_seconds)
    rows = np.asarray(rows, np.float64)
    rose = rows_rose(state.rows, rows)
    steady = state.steady
    if steady is None:
        steady = np.full(rows.shape, state.readings.shape[0], np.int64)
    return dataclasses.replace(
        state,
        readings=window.readings,
        seen=state.seen + 1,
        rows=np.where(rows > 0, rows, state.rows),
        baseline=np.where(rose, np.nan, state.baseline),
        pace=None if state.pace is None else np.where(rose, np.nan, state.pace),
        steady=_steady_after(steady, rose, rows > 0),
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
    latest = latest_deviations(state.readings[-1], cost, rows)
    latest = latest[scored & ~np.isnan(latest)]
    noise = state.noise
    if latest.size:
        mean = math.fsum(latest.tolist()) / latest.size
        noise = noise + NOISE_DECAY * (mean - noise)
    floor = max(min_excess_seconds, NOISE_MADS * mad, NOISE_MEANS * noise)
    return floor, noise


def latest_deviations(newest, cost, rows):
    """Each replica's newest reading's deviation from its median, capped
    at the median (a lone stall, or a slowdown's onset, moves an average
    of them little), in seconds per step (NaN: no reading)."""
    return np.minimum(np.abs(newest - cost), cost) * rows


def update_replica_noise(replica_noise, deviations, scored):
    """`replica_noise` moved `NOISE_DECAY` of the way to `deviations`
    where a replica has a scored reading."""
    counted = scored & ~np.isnan(deviations)
    moved = replica_noise + NOISE_DECAY * (
        np.where(counted, deviations, 0.0) - replica_noise
    )
    return np.where(counted, moved, replica_noise)


def others_noise(replica_noise):
    """For each replica, the median of the OTHER replicas' noise (its own
    when it is alone): the delays term of its sustained check.

    A replica slowed by a CPU quota (or a throttling GPU) jitters in
    proportion to its slowdown; counted in its own bar, that jitter hid
    a 2x quota drop for 14-16 steps in 2 of 7 real runs (the pooled
    average rose from 2.2 ms to 3.8 ms while the slowed steps, 53-100 ms
    where 33 ms were expected, lost 20 ms at their fastest). The machine's
    delays are what the term is for, and the other replicas measure them.

    Example:

    >>> others_noise(np.array([1.0, 7.0])).tolist()
    [7.0, 1.0]
    >>> others_noise(np.array([1.0, 2.0, 9.0])).tolist()
    [5.5, 5.0, 1.5]
    """
    count = replica_noise.size
    if count < 2:
        return replica_noise.copy()
    # The others' median takes their sorted values at `low` and `high`:
    # the full order's value there, or the next one up when the replica
    # itself sits at or below it (ties give the same value either way).
    others = count - 1
    low, high = (others - 1) // 2, others // 2
    ranks = sorted({low, low + 1, high, high + 1})
    ordered = dict(zip(ranks, np.partition(replica_noise, ranks)[ranks]))

    def at(i):
        return np.where(replica_noise <= ordered[i], ordered[i + 1], ordered[i])

    return 0.5 * (at(low) + at(high))


def sustained_readings(window):
    """How many of the newest readings the sustained check takes.

    One fewer than the window: a slowdown is flagged within `window +
    patience - 2` slow steps (10 with the detector's defaults). Half the
    window (the readings that set the median) was too few: on the busy
    machine model of the tests, delays that hit one replica for a few steps
    in a row then flagged equal replicas.
    """
    return max(window - 1, 1)


def paced(pace, cost, settled):
    """`ScoreState.pace` after an evaluation: `PACE_DECAY` of the way to
    the window's median `cost` (the median itself when there was none;
    unchanged where a replica has no median or is not `settled`).

    A baseline is the lowest pace, not the lowest median, because a window
    can be lucky for a few steps in a row. Measured on a worker at 0.3 of
    a core: its readings come in three steps of its CPU quota's period
    (0.22, 0.31 and 0.40 ms per row), its window's median is 0.31 but for
    a few evaluations when five of nine readings were fast (0.23); that
    median as the baseline put its individual score at 0.69-0.71 (the
    threshold: 0.7) with nothing changed. With the lowest pace as the
    baseline (and `rows_rose`), its lowest individual score in each of
    four 300-step runs was 0.76-0.81. A slowdown still compares its median
    with the baseline: a halved quota was flagged 7 steps after it.

    Example:

    >>> paced(np.array([np.nan, 1.0]), np.array([2.0, 2.0]), True).tolist()
    [2.0, 1.2]
    """
    cost = np.asarray(cost, np.float64)
    if pace is None:
        pace = np.full(cost.shape, np.nan)
    moved = np.where(np.isnan(pace), cost, pace + PACE_DECAY * (cost - pace))
    return np.where(settled & ~np.isnan(cost), moved, pace)


def _settled(steady, window):
    """Which replicas' windows hold only readings at their current rows
    (all of them in states saved before `steady`)."""
    return True if steady is None else steady >= window


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
    relative score below `relative_threshold` (`threshold` if None; 0:
    never). It is
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
    replica_noise = update_replica_noise(
        state.replica_noise,
        latest_deviations(state.readings[-1], cost, state.rows),
        state.rows > 0,
    )
    best = np.fmin.reduce(cost)
    # The baseline is the lowest median seen, relaxed upward a little each
    # evaluation: over a long run the noise's luckiest window would
    # otherwise become the yardstick and flag ordinary jitter.
    # (fmin skips NaN: a replica's first median becomes its baseline.)
    # A replica whose rows rose has none until its window holds only
    # readings at its new rows (`rows_rose`).
    settled = _settled(state.steady, window)
    pace = paced(state.pace, cost, settled)
    baseline = np.where(
        settled,
        np.fmin(state.baseline * (1.0 + BASELINE_RELAX), pace),
        state.baseline,
    )
    if relative_threshold is None:
        relative_threshold = threshold
    newest = state.readings[-1]
    current = np.where(newest < cost, newest, cost)
    # NaN (no reading) compares False: not low.
    # The cost each replica's individual score compares it with.
    compared = cost * individual
    with np.errstate(invalid="ignore"):
        relative_excess = (current - best) * state.rows
        individual_excess = (current - compared) * state.rows
    slow = relative < relative_threshold
    lost = individual < threshold
    # Sustained: even the fastest of the newest `window - 1` readings is
    # that slow (a missing reading, NaN, makes the minimum NaN: not
    # sustained).
    fastest = np.min(state.readings[-sustained_readings(window) :], axis=0)
    sustained_floor = np.maximum(
        min_excess_seconds, NOISE_MEANS * others_noise(replica_noise)
    )
    with np.errstate(invalid="ignore"):
        relative_costly = (relative_excess > floor) | (
            (fastest - best) * state.rows > sustained_floor
        )
        individual_costly = (individual_excess > floor) | (
            (fastest - compared) * state.rows > sustained_floor
        )
    costly = (slow & relative_costly) | (lost & individual_costly)
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
        pace=pace,
        below=below,
        above=above,
        flagged=flagged,
        noise=noise,
        replica_noise=replica_noise,
    )
    return new_state, changes


class Scorer:
    """`add_reading` + `evaluate` in one call, in place.

    The same arithmetic as the functions above (tests check that both give
    the same states and changes), as a fixed number of vector operations
    over the replicas whatever their number, on arrays it keeps and
    updates: no new state per step and no loop over the replicas.
    `StragglerDetector` runs it every step (`benchmarks/scale.py` measures
    it from 8 to 4,096 replicas). Mutable; convert with `state()` /
    `from_state()`.

    Args:
        num_replicas: Replicas scored.
        window: Readings the median covers.

    Example:

    >>> scorer = Scorer(2, 3)
    >>> scorer.step([16, 16], [0.016, 0.016], threshold=0.7, patience=1)
    []
    """

    def __init__(self, num_replicas, window):
        self.window = window
        # `[replicas, window]`, a ring: `_next` is the oldest slot, which
        # the next reading overwrites. Each replica's readings lie in one
        # contiguous row, which the per-replica medians partition.
        self._readings = np.full((num_replicas, window), np.nan)
        self._next = 0
        self.seen = 0
        self.baseline = np.full(num_replicas, np.nan)
        self.below = np.zeros(num_replicas, np.int64)
        self.above = np.zeros(num_replicas, np.int64)
        self.flagged = np.zeros(num_replicas, bool)
        self.rows = np.zeros(num_replicas, np.float64)
        self.noise = 0.0
        self.replica_noise = np.zeros(num_replicas, np.float64)
        self.steady = np.full(num_replicas, window, np.int64)
        self.pace = np.full(num_replicas, np.nan)

    @property
    def num_replicas(self):
        """Replicas scored."""
        return self._readings.shape[0]

    @classmethod
    def from_state(cls, state):
        """A scorer holding `ScoreState` `state`."""
        window, replicas = state.readings.shape
        scorer = cls(replicas, window)
        scorer._readings[...] = state.readings.T
        scorer.seen = int(state.seen)
        scorer.baseline = np.array(state.baseline, np.float64)
        scorer.below = np.array(state.below, np.int64)
        scorer.above = np.array(state.above, np.int64)
        scorer.flagged = np.array(state.flagged, bool)
        scorer.rows = np.array(state.rows, np.float64)
        scorer.noise = float(state.noise)
        if state.replica_noise is not None:
            scorer.replica_noise = np.array(state.replica_noise, np.float64)
        if state.steady is not None:
            scorer.steady = np.array(state.steady, np.int64)
        if state.pace is not None:
            scorer.pace = np.array(state.pace, np.float64)
        return scorer

    def state(self):
        """This scorer's `ScoreState` (a copy)."""
        oldest_first = np.roll(self._readings, -self._next, axis=1)
        return ScoreState(
            readings=np.ascontiguousarray(oldest_first.T),
            seen=self.seen,
            baseline=self.baseline.copy(),
            below=self.below.copy(),
            above=self.above.copy(),
            flagged=self.flagged.copy(),
            rows=self.rows.copy(),
            noise=self.noise,
            replica_noise=self.replica_noise.copy(),
            steady=self.steady.copy(),
            pace=self.pace.copy(),
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
        rows = np.asarray(rows, np.float64)
        scored = rows > 0
        # Dividing by NaN (no rows) gives NaN without a warning.
        newest = np.asarray(compute_seconds, np.float64) / np.where(
            scored, rows, np.nan
        )
        self._readings[:, self._next] = newest
        self._next = (self._next + 1) % self.window
        rose = rows_rose(self.rows, rows)
        if rose.any():
            self.baseline[rose] = np.nan
            self.pace[rose] = np.nan
        self.steady = _steady_after(self.steady, rose, scored)
        self.rows = np.where(scored, rows, self.rows)
        self.seen += 1
        if self.seen < self.window:
            return []
        rows = self.rows
        # NaN (no reading) divides quietly and compares False: not low.
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = rebalance.medians(self._readings.T)
            # NaN costs stay NaN; fmin skips them for the best.
            best = np.fmin.reduce(cost)
            relative = best / cost
            individual = self.baseline / cost
            finite = np.isfinite(individual)
            if np.count_nonzero(finite) > 1:
                # Against the least slowed replica: a slowdown all share
                # is none's.
                individual /= np.max(individual, where=finite, initial=-np.inf)
            floor = self._noise_floor(cost, min_excess_seconds)
            # The baseline: the lowest median seen, relaxed upward a little
            # each evaluation (see `evaluate`); fmin: NaN loses to a number;
            # none while a replica's rows rose within the window.
            settled = self.steady >= self.window
            self.pace = paced(self.pace, cost, settled)
            relaxed = np.fmin(self.baseline * (1.0 + BASELINE_RELAX), self.pace)
            self.baseline = np.where(settled, relaxed, self.baseline)
            current = np.fmin(newest, cost)
            slow = relative < relative_threshold
            lost = individual < threshold
            compared = cost * individual
            costly = (slow & ((current - best) * rows > floor)) | (
                lost & ((current - compared) * rows > floor)
            )
            # Sustained (see `evaluate`): the fastest of the newest
            # `window - 1` readings, taken only for the low replicas the
            # floor spared.
            spared = np.flatnonzero((slow | lost) & ~costly)
            if spared.size:
                newest_slots = (
                    self._next - 1 - np.arange(sustained_readings(self.window))
                ) % self.window
                fastest = np.min(
                    self._readings[np.ix_(spared, newest_slots)], axis=1
                )
                least = np.maximum(
                    min_excess_seconds,
                    NOISE_MEANS * others_noise(self.replica_noise)[spared],
                )
                spared_rows = rows[spared]
                costly[spared] = (
                    slow[spared] & ((fastest - best) * spared_rows > least)
                ) | (
                    lost[spared]
                    & ((fastest - compared[spared]) * spared_rows > least)
                )
        low = np.where(self.flagged, slow | lost, costly)
        self.below = np.where(low, self.below + 1, 0)
        self.above = np.where(low, 0, self.above + 1)
        starts = ~self.flagged & (self.below >= patience)
        ends = self.flagged & (self.above >= patience)
        changed = np.flatnonzero(starts | ends)
        if not changed.size:
            return []
        self.flagged = (self.flagged | starts) & ~ends
        return [
            (
                int(replica),
                "straggler" if starts[replica] else "recovered",
                float(relative[replica]),
                float(individual[replica]),
            )
            for replica in changed
        ]

    def _noise_floor(self, cost, min_excess_seconds):
        """`noise_floor` on the ring; updates `self.noise` and
        `self.replica_noise`."""
        rows = self.rows
        scored = rows > 0
        deviation = np.abs(self._readings - cost[:, np.newaxis])
        deviation *= rows[:, np.newaxis]
        newest_slot = (self._next - 1) % self.window
        pooled = deviation.ravel()
        count = pooled.size
        if not scored.all() or np.isnan(pooled).any():
            counted = ~np.isnan(deviation) & scored[:, np.newaxis]
            count = np.count_nonzero(counted)
            # Not counted: placed last, beyond the order statistics taken.
            pooled = np.where(counted, deviation, np.inf).ravel()
        mad = 0.0
        if count:
            low, high = _order_statistics(
                pooled, [(count - 1) // 2, count // 2]
            )
            mad = float(low if count % 2 else 0.5 * (low + high))
        # min(|newest - cost|, cost) * rows: scaling by rows > 0 keeps the
        # order, so the products' minimum is the same number.
        latest = np.minimum(deviation[:, newest_slot], cost * rows)
        # The same deviations, per replica, for the sustained check.
        self.replica_noise = update_replica_noise(
            self.replica_noise, latest, scored
        )
        latest = latest[scored & ~np.isnan(latest)]
        if latest.size:
            # fsum: exactly the sum the reference takes, in any order.
            mean = math.fsum(latest.tolist()) / latest.size
            self.noise = self.noise + NOISE_DECAY * (mean - self.noise)
        return max(
            min_excess_seconds, NOISE_MADS * mad, NOISE_MEANS * self.noise
        )


# Below this many values `_order_statistics` partitions them all.
_SELECT_DIRECTLY = 4096
# Values sampled to bracket the ranks wanted...
_SAMPLE = 512
# ... and the margin, in sampled values either side (about 3.5 standard
# deviations of a sampled rank: a miss, and a full partition, is rare).
_MARGIN = 40


def _order_statistics(values, ranks):
    """`np.sort(values)[ranks]`, of a 1-D float array without NaN.

    Exactly `np.partition`'s values, at a fraction of its cost for many
    values: two bounds from a sorted sample around the ranks, a count of
    the values below the lower one, and a partition of those between (a
    Floyd-Rivest selection). If the bounds miss a rank (rare), all values
    are partitioned.
    """
    size = values.size
    if size <= _SELECT_DIRECTLY:
        return np.partition(values, ranks)[ranks]
    # The values are each replica's window in turn: a step sharing a factor
    # with the window samples only some of its readings (then a miss is
    # likelier, the result the same). Odd, it shares none with even ones.
    step = size // _SAMPLE | 1
    sample = np.sort(values[::step])
    at = [rank * len(sample) // size for rank in ranks]
    low = sample[max(min(at) - _MARGIN, 0)]
    high = sample[min(max(at) + _MARGIN, len(sample) - 1)]
    below = np.count_nonzero(values < low)
    between = values[(values >= low) & (values <= high)]
    inner = [rank - below for rank in ranks]
    if min(inner) < 0 or max(inner) >= between.size:
        return np.partition(values, ranks)[ranks]
    return np.partition(between, inner)[inner]
