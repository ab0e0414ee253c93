"""Does each replica's clock see its device's work? Checked online.

`ShardRebalancer` and `StragglerDetector` act on per-replica compute
seconds (`model.step_stats`). Those are device time by construction
(`telemetry.clock`), but a device whose work the clock cannot see (a
runtime that reports kernels done when queued, a clock replaced or broken)
would make them follow noise: shares moved to whichever device dispatches
fastest, stragglers never found. `ClockCheck` watches the readings and
names a replica whose clock is blind, by three signs:

- **floor**: its readings stay below `floor_seconds` per step while it has
  rows (a clock reading a constant gives 0);
- **rows**: when its rows per step change by at least `min_rows_change`
  (a share change), its seconds stay where they were (on a log scale they
  move by less than `min_response` of the rows' move), comparing the
  readings just before the change with those just after;
- **noise**: under constant rows, its cost per row changes from one
  reading to the next by a median factor above `max_jitter` (a change of
  the device's speed is one such change, not many).

The first two say the clock does not see the device's work: such a replica
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

FLOOR_SECONDS = 1e-5


@dataclasses.dataclass(frozen=True)
class ClockFinding:
    """One replica whose clock readings do not mean device time.

    Attributes:
        replica: The global replica index.
        device: That replica's device.
        sign: `"floor"`, `"rows"` or `"noise"` (see the module).
        detail: What was measured, in words.
    """

    replica: int
    device: str
    sign: str
    detail: str

    @property
    def blind(self):
        """Whether the sign says the clock does not see the device's work
        ("floor", "rows"); noise alone does not."""
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
        for name, value, low in (
            ("window", window, 4),
            ("patience", patience, 1),
        ):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(
                    f"Invalid value for argument `{name}`. Received: "
                    f"{name}={value!r}. Expected an integer >= {low}."
                )
        for name, value in (
            ("floor_seconds", floor_seconds),
            ("min_rows_change", min_rows_change),
            ("min_response", min_response),
            ("max_jitter", max_jitter),
        ):
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(
                    f"Invalid value for argument `{name}`. Received: "
                    f"{name}={value!r}. Expected a number >= 0."
                )
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
        self._noise_reported = set()
        self._rows = np.full((self.window, replicas), np.nan)
        self._seconds = np.full((self.window, replicas), np.nan)

    def add(self, rows, seconds, steps=1):
        """Adds one reading (one train-function call); returns the new
        findings (replicas found blind or noisy by this reading).

        Args:
            rows: Rows per replica, summed over `steps`.
            seconds: Compute seconds per replica, summed over `steps` (NaN:
                not measured, e.g. an XLA-compiled step).
            steps: Steps the reading covers. Defaults to `1`.

        Returns:
            A list of `ClockFinding`, empty when nothing new was found.
        """
        steps = max(int(steps), 1)
        rows = np.asarray(rows, np.float64) / steps
        seconds = np.asarray(seconds, np.float64) / steps
        measured = np.isfinite(seconds) & (rows > 0)
        self._rows = np.concatenate(
            [self._rows[1:], np.where(measured, rows, np.nan)[np.newaxis]]
        )
        self._seconds = np.concatenate(
            [self._seconds[1:], np.where(measured, seconds, np.nan)[None]]
        )
        below = measured & (seconds < self.floor_seconds)
        self._below = np.where(
            below, self._below + 1, np.where(measured, 0, self._below)
        )
        findings = []
        for replica in np.flatnonzero(~self.blind):
            finding = self._blind_sign(replica)
            if finding is not None:
                self.blind[replica] = True
                findings.append(finding)
        for replica in np.flatnonzero(~self.blind):
            if replica in self._noise_reported:
                continue
            finding = self._noise(replica)
            if finding is not None:
                self._noise_reported.add(replica)
                findings.append(finding)
        return findings

    def usable(self):
        """Which replicas' readings may be acted on (a bool array)."""
        return ~self.blind

    def masked(self, seconds):
        """`seconds` with NaN ("not measured") for the unusable replicas:
        decisions then keep what they had for those replicas."""
        return np.where(self.usable(), np.asarray(seconds, np.float64), np.nan)

    def _finding(self, replica, sign, detail):
        return ClockFinding(int(replica), self.devices[replica], sign, detail)

    def _blind_sign(self, replica):
        if self._below[replica] >= self.patience:
            return self._finding(
                replica,
                "floor",
                f"{self._below[replica]} readings in a row below "
                f"{self.floor_seconds:g} s per step while it had rows",
            )
        rows = self._rows[:, replica]
        seconds = self._seconds[:, replica]
        seen = np.isfinite(rows)
        rows, seconds = rows[seen], seconds[seen]
        # The latest change of rows by at least `min_rows_change`, and the
        # readings just before and just after it: close in time, so a change
        # of the device's speed rarely falls between them.
        enough = max(self.window // 4, 2)
        ratio = rows[1:] / rows[:-1]
        changes = np.flatnonzero(
            np.abs(np.log(ratio)) >= np.log1p(self.min_rows_change)
        )
        if not changes.size:
            return None
        change = changes[-1] + 1
        before = slice(max(change - enough, 0), change)
        after = slice(change, change + enough)
        if change < enough or len(rows) - change < enough:
            return None
        rows_before, rows_after = (
            np.median(rows[before]),
            np.median(rows[after]),
        )
        seconds_before = np.median(seconds[before])
        seconds_after = np.median(seconds[after])
        if min(seconds_before, seconds_after) <= 0:
            return None  # the floor's to judge
        # A clock that does not see the work reads the same seconds
        # whatever the rows; a working one moves (with the rows, or against
        # them if the device's speed changed too), on a log scale by at
        # least `min_response` of the rows' move.
        rows_move = abs(np.log(rows_after / rows_before))
        seconds_move = abs(np.log(seconds_after / seconds_before))
        if seconds_move >= self.min_response * rows_move:
            return None
        return self._finding(
            replica,
            "rows",
            f"its rows per step went from {rows_before:g} to {rows_after:g} "
            f"and its seconds per step stayed at {seconds_before:.3g} to "
            f"{seconds_after:.3g}",
        )

    def _noise(self, replica):
        rows = self._rows[:, replica]
        seconds = self._seconds[:, replica]
        seen = np.isfinite(rows)
        rows, cost = rows[seen], seconds[seen] / rows[seen]
        # Consecutive readings at equal rows: a change of the device's speed
        # is one large step among them (the detector's business), jitter is
        # many.
        same = (rows[1:] == rows[:-1]) & (cost[1:] > 0) & (cost[:-1] > 0)
        if same.sum() < self.window // 2:
            return None
        steps = np.abs(np.log(cost[1:][same] / cost[:-1][same]))
        jitter = float(np.exp(np.median(steps)))
        if jitter <= self.max_jitter:
            return None
        return self._finding(
            replica,
            "noise",
            "at constant rows its cost per row changes by a median factor "
            f"of {jitter:.1f} from one reading to the next",
        )
