"""Does each replica's clock see its device's work? Checked online.

`ShardRebalancer` and `StragglerDetector` act on per-replica compute
seconds (`model.step_stats`). Those are device time by construction
(`telemetry.clock`), but a device whose work the clock cannot see (a
runtime that reports kernels done when queued, a clock replaced or broken)
would make them follow noise: shares moved to whichever device dispatches
fastest, stragglers never found. `ClockCheck` watches the readings and
names a replica whose clock is blind, by these signs:

- **floor**: its readings stay below `floor_seconds` per step while it has
  rows (a clock reading a constant gives 0);
- **rows**: when its rows per step change by at least `min_rows_change`
  (a share change), its seconds stay where they were (on a log scale they
  move by less than `min_response` of the rows' move), comparing the
  readings just before the change with those just after;
- **noise**: under constant rows, its cost per row changes from one
  reading to the next by a median factor above `max_jitter` (a change of
  the device's speed is one such change, not many).

Two equally blind devices show none of these (plausible readings, equal,
so nothing moves for the rows sign to test). A fourth sign compares with
the same work timed another way, fed in by the caller every few hundred
steps (`compare`; `training.trust_check` times it, as `kh.doctor`'s trust
check does):

- **host**: its in-step reading is under `TRUST_FRACTION` of the
  host-synchronised seconds of the same rows' forward pass, loss and
  gradients on its device.

All but noise say the clock does not see the device's work: such a replica
is `blind` from then on, and its readings unusable (`usable`, `masked`).
Noise alone is reported but the readings stay usable: a throttled host
(a CFS quota) reads bimodal seconds that are its real time, and the
window medians the decisions use are robust to it.

Each replica is reported once per sign. Pure numpy over explicit state,
like the rest of the decision logic: every worker, fed the same
all-reduced telemetry, decides alike.
"""

import dataclasses

import numpy as np

from keras_hetero._checks import check_int
from keras_hetero._checks import check_number
from keras_hetero.training import state

FLOOR_SECONDS = 1e-5
# The in-step clock must read at least this fraction of the
# host-synchronised time of the same work to be trusted...
TRUST_FRACTION = 0.5
# ...judged only above this host time: below it timer noise and the host's
# round trip decide the ratio, not the device.
MIN_JUDGED_SECONDS = 1e-3


@dataclasses.dataclass(frozen=True)
class ClockFinding:
    """One replica whose clock readings do not mean device time.

    Attributes:
        replica: The global replica index.
        device: That replica's device.
        sign: `"floor"`, `"rows"`, `"noise"` or `"host"` (see the
            module).
        detail: What was measured, in words.
    """

    replica: int
    device: str
    sign: str
    detail: str

    @property
    def blind(self):
        """Whether the sign says the clock does not see the device's work
        ("floor", "rows", "host"); noise alone does not."""
        return self.sign != "noise"

    def message(self, action):
        """A one-line warning that names the device and says `action`."""
        return (
            f"The per-replica clock of replica {self.replica} "
            f"({self.device}) does not seem to measure its device's work: "
            f"{self.detail}. {action}"
        )


class ClockCheck:
    """Watches `(rows, seconds)` readings; finds replicas with blind clocks.

    Args:
        devices: The device of each global replica (names findings).
        window: Readings kept per replica. Defaults to `20`.
        patience: Consecutive readings below the floor before a replica is
            blind. Defaults to `2`.
        floor_seconds: Seconds per step a working clock exceeds. Defaults
            to `1e-5`.
        min_rows_change: Relative change in rows per step that tests the
            response of the seconds (0.5: rows 1.5 times or two thirds of
            what they were). Smaller changes drown in the step-to-step
            noise of a throttled host. Defaults to `0.5`.
        min_response: Least move of the seconds (log scale), as a fraction
            of the rows' move, of a working clock. Defaults to `0.25`.
        max_jitter: Largest median factor between consecutive costs per
            row, under constant rows, not reported as noise. Defaults to
            `8.0`.

    Raises:
        ValueError: For `window` < 4, `patience` < 1, or a negative or
            non-numeric threshold.

    Example:

    >>> check = ClockCheck(["/gpu:0", "/gpu:1"], patience=2)
    >>> check.add([8, 8], [0.02, 0.0])
    []
    >>> [f.sign for f in check.add([8, 8], [0.02, 0.0])]
    ['floor']
    >>> check.usable().tolist()
    [True, False]
    """

    def __init__(
        self,
        devices,
        *,
        window=20,
        patience=2,
        floor_seconds=FLOOR_SECONDS,
        min_rows_change=0.5,
        min_response=0.25,
        max_jitter=8.0,
    ):
        check_int("window", window, 4)
        check_int("patience", patience, 1)
        for name, value in (
            ("floor_seconds", floor_seconds),
            ("min_rows_change", min_rows_change),
            ("min_response", min_response),
            ("max_jitter", max_jitter),
        ):
            check_number(name, value, 0)
        self.devices = list(devices)
        self.window = int(window)
        self.patience = int(patience)
        self.floor_seconds = float(floor_seconds)
        self.min_rows_change = float(min_rows_change)
        self.min_response = float(min_response)
        self.max_jitter = float(max_jitter)
        replicas = len(self.devices)
        self.blind = np.zeros(replicas, bool)
        self._below = np.zeros(replicas, np.int64)
        self._noise_reported = np.zeros(replicas, bool)
        # A ring of the last `window` readings; `_slot` is the oldest's,
        # which the next reading overwrites (see `_recent`).
        self._rows = np.full((self.window, replicas), np.nan)
        self._seconds = np.full((self.window, replicas), np.nan)
        self._slot = 0
        self._readings = 0
        # The rows test: each replica's last measured rows; since its latest
        # change of rows, the readings taken (`_age`, -1: none pending) and
        # the medians of the readings just before it.
        self._enough = max(self.window // 4, 2)
        self._last_rows = np.full(replicas, np.nan)
        self._age = np.full(replicas, -1, np.int64)
        self._before = np.full((2, replicas), np.nan)  # rows, seconds
        # `add(..., at=)`: the key and the findings of the last reading.
        self._last_at = None
        self._last_findings = []

    def add(self, rows, seconds, steps=1, at=None):
        """Adds one reading (one train-function call); returns the new
        findings (replicas found blind or noisy by this reading).

        The work per reading is a few vector operations over the replicas
        (`benchmarks/clock_check.py`); the noise sign is looked at every
        `window // 2` readings.

        Args:
            rows: Rows per replica, summed over `steps`.
            seconds: Compute seconds per replica, summed over `steps` (NaN:
                not measured, e.g. an XLA-compiled step).
            steps: Steps the reading covers. Defaults to `1`.
            at: A key of the reading (the model's step count): a reading
                added again under the same key is not counted twice, and
                returns the findings it gave (several callbacks share one
                check: `shared`). Defaults to `None` (always added).

        Returns:
            A list of `ClockFinding`, empty when nothing new was found.
        """
        if at is not None and at == self._last_at:
            return list(self._last_findings)
        findings = self._add(rows, seconds, steps)
        if at is not None:
            self._last_at, self._last_findings = at, list(findings)
        return findings

    def _add(self, rows, seconds, steps):
        steps = max(int(steps), 1)
        rows = np.asarray(rows, np.float64) / steps
        seconds = np.asarray(seconds, np.float64) / steps
        measured = np.isfinite(seconds) & (rows > 0)
        self._rows[self._slot] = np.where(measured, rows, np.nan)
        self._seconds[self._slot] = np.where(measured, seconds, np.nan)
        self._slot = (self._slot + 1) % self.window
        self._readings += 1
        below = measured & (seconds < self.floor_seconds)
        self._below = np.where(
            below, self._below + 1, np.where(measured, 0, self._below)
        )
        findings = []
        for replica in np.flatnonzero(
            ~self.blind & (self._below >= self.patience)
        ):
            findings.append(
                self._finding(
                    replica,
                    "floor",
                    f"{self._below[replica]} readings in a row below "
                    f"{self.floor_seconds:g} s per step while it had rows",
                )
            )
        for finding in findings:
            self.blind[finding.replica] = True
        for finding in self._rows_test(rows, measured):
            self.blind[finding.replica] = True
            findings.append(finding)
        if self._readings % max(self.window // 2, 1) == 0:
            findings += self._noise()
        return findings

    def recent_seconds(self, replica):
        """The median seconds per step of `replica`'s measured readings in
        the window at its latest rows, as `(rows, seconds)`; `(nan, nan)`
        without any."""
        rows, seconds = self._recent(slice(None), [replica])
        rows, seconds = rows[:, 0], seconds[:, 0]
        measured = np.isfinite(seconds)
        if not measured.any():
            return np.nan, np.nan
        latest = rows[np.flatnonzero(measured)[-1]]
        same = measured & (rows == latest)
        return float(latest), float(np.median(seconds[same]))

    def compare(self, replica, clock_seconds, host_seconds):
        """The trust check: `replica`'s in-step seconds per step against
        the host-synchronised seconds of the same work (forward pass, loss
        and gradients of its rows on its device).

        Args:
            replica: The global replica index.
            clock_seconds: What its in-step clock reads per step.
            host_seconds: The host-synchronised seconds of that work.

        Returns:
            A list with the `"host"` finding if the clock reads under
            `TRUST_FRACTION` of the host's time (the replica is blind from
            then on), else empty. Not judged (empty): a replica already
            blind, a NaN reading, or host time under `MIN_JUDGED_SECONDS`.
        """
        if (
            self.blind[replica]
            or not np.isfinite(clock_seconds)
            or not host_seconds >= MIN_JUDGED_SECONDS
            or clock_seconds >= TRUST_FRACTION * host_seconds
        ):
            return []
        self.blind[replica] = True
        return [
            self._finding(
                replica,
                "host",
                f"it read {clock_seconds * 1e3:.2f} ms per step, "
                f"{clock_seconds / host_seconds:.0%} of the "
                f"{host_seconds * 1e3:.2f} ms the same work took timed from "
                "the host, synchronised",
            )
        ]

    def usable(self):
        """Which replicas' readings may be acted on (a bool array)."""
        return ~self.blind

    def masked(self, seconds):
        """`seconds` with NaN ("not measured") for the unusable replicas:
        decisions then keep what they had for those replicas."""
        return np.where(self.usable(), np.asarray(seconds, np.float64), np.nan)

    def _recent(self, positions, columns=None):
        """`(rows, seconds)` of the readings at `positions` (a slice of
        the window, oldest first) for `columns` (None: every replica)."""
        slots = (self._slot + np.arange(self.window)) % self.window
        slots = slots[positions]
        if columns is None:
            return self._rows[slots], self._seconds[slots]
        index = np.ix_(slots, columns)
        return self._rows[index], self._seconds[index]

    def _finding(self, replica, sign, detail):
        return ClockFinding(int(replica), self.devices[replica], sign, detail)

    def _rows_test(self, rows, measured):
        """Findings of the rows sign: seconds that stay where they were
        while the rows move by `min_rows_change` or more."""
        with np.errstate(divide="ignore", invalid="ignore"):
            move = np.abs(np.log(rows / self._last_rows))
        changed = measured & (move >= np.log1p(self.min_rows_change))
        self._last_rows = np.where(measured, rows, self._last_rows)
        pending = self._age >= 0
        self._age = np.where(pending, self._age + 1, self._age)
        changed &= ~self.blind
        if changed.any():
            # The readings just before the change (this one is the first
            # after it): the last `_enough` measured ones.
            columns = np.flatnonzero(changed)
            before = _last_medians(
                *self._recent(slice(None, -1), columns), self._enough
            )
            self._before[:, columns] = before
            self._age[columns] = np.where(np.isfinite(before[1]), 1, -1)
            pending |= changed
        findings = []
        if not pending.any():  # the common case: no change under test
            return findings
        due = np.flatnonzero((self._age >= self._enough) & ~self.blind)
        for age in np.unique(self._age[due]):
            columns = due[self._age[due] == age]
            after = _last_medians(
                *self._recent(slice(-age, None), columns), self._enough
            )
            known = np.isfinite(after[1])
            # Not enough measured readings since the change: wait, while the
            # window still holds the change.
            waiting = ~known & (age < self.window)
            self._age[columns[~waiting]] = -1
            rows_before, seconds_before = self._before[:, columns]
            rows_after, seconds_after = after
            with np.errstate(divide="ignore", invalid="ignore"):
                # A clock that does not see the work reads the same seconds
                # whatever the rows; a working one moves (with the rows, or
                # against them if the device's speed changed too), on a log
                # scale by at least `min_response` of the rows' move.
                rows_move = np.abs(np.log(rows_after / rows_before))
                seconds_move = np.abs(np.log(seconds_after / seconds_before))
            flat = (
                known
                & (np.minimum(seconds_before, seconds_after) > 0)
                & (seconds_move < self.min_response * rows_move)
            )
            for index in np.flatnonzero(flat):
                findings.append(
                    self._finding(
                        columns[index],
                        "rows",
                        f"its rows per step went from {rows_before[index]:g}"
                        f" to {rows_after[index]:g} and its seconds per step "
                        f"stayed at {seconds_before[index]:.3g} to "
                        f"{seconds_after[index]:.3g}",
                    )
                )
        return findings

    def _noise(self):
        """Findings of the noise sign (each replica once): consecutive
        readings at equal rows, the median factor between them. A change of
        the device's speed is one large step among them, jitter is many."""
        rows, seconds = self._recent(slice(None))
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = seconds / rows
            same = (rows[1:] == rows[:-1]) & (cost[1:] > 0)
            same &= cost[:-1] > 0
            steps = np.abs(np.log(cost[1:] / cost[:-1]))
        counted = same.sum(axis=0)
        # The median of the counted steps: the uncounted sort last. Each
        # replica's steps sorted in one contiguous row (a sort along the
        # window's axis of this array strides over every replica: 3-6x
        # slower).
        steps = np.ascontiguousarray(np.where(same, steps, np.inf).T)
        ordered = np.sort(steps, axis=1)
        middle = np.clip((counted - 1) // 2, 0, ordered.shape[1] - 1)
        median = ordered[np.arange(len(ordered)), middle]
        jitter = np.exp(np.where(counted > 0, median, 0.0))
        noisy = (
            (counted >= self.window // 2)
            & (jitter > self.max_jitter)
            & ~self.blind
            & ~self._noise_reported
        )
        self._noise_reported |= noisy
        return [
            self._finding(
                replica,
                "noise",
                "at constant rows its cost per row changes by a median "
                f"factor of {jitter[replica]:.1f} from one reading to the "
                "next",
            )
            for replica in np.flatnonzero(noisy)
        ]


def _last_medians(rows, seconds, count):
    """Per column, the medians of the rows and seconds of the last `count`
    measured readings (`[2, columns]`; NaN where fewer were measured)."""
    result = np.full((2, rows.shape[1]), np.nan)
    if not rows.size:
        return result
    recent = np.isfinite(seconds[-count:])
    full = recent.all(axis=0) & (len(recent) >= count)
    # The common case: every one of the last `count` readings measured.
    result[0, full] = np.median(rows[-count:, full], axis=0)
    result[1, full] = np.median(seconds[-count:, full], axis=0)
    for column in np.flatnonzero(~full):
        seen = np.flatnonzero(np.isfinite(seconds[:, column]))[-count:]
        if len(seen) == count:
            result[0, column] = np.median(rows[seen, column])
            result[1, column] = np.median(seconds[seen, column])
    return result


def shared(model, devices):
    """The one `ClockCheck` of `model`'s current `fit` for `devices`: the
    rebalancer and the straggler detector feed it the same readings
    (`add(..., at=step)` counts each once) and read the same findings.

    Args:
        model: A HeteroModel (anything else: a check of its own each call,
            for the caller to keep).
        devices: The device of each global replica.

    Returns:
        A `ClockCheck`: the model's, made anew when the replicas differ
        from the last call's or after `forget`.
    """
    run = None if model is None else state.run_state(model)
    if run is None:
        return ClockCheck(devices)
    if run.clock_check is None or run.clock_check.devices != list(devices):
        run.clock_check = ClockCheck(devices)
    return run.clock_check


def forget(model):
    """Drops `model`'s shared check (each `fit` starts a new one)."""
    run = None if model is None else state.run_state(model)
    if run is not None:
        run.clock_check = None
