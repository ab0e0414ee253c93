"""Telling a slow link from a slow device (pure Python, no TF).

A synchronous step is compute (each replica's, until its gradients are
ready: `StepStats.compute_seconds`) and then waiting: for the collective
that sums the gradients, and for the input. A slow device makes its own
compute grow (the straggler scores see it, and the others wait for it); a
slow network link makes the waiting grow on every worker while compute
stays as it was. `CommunicationTracker` follows the second: the host time
of each train-function call (`StepStats.call_seconds`) minus the slowest
replica's compute, per step, against its own baseline.

Which link is slow is not visible from one worker's step: in an all-reduce
every worker waits for the slowest transfer alike. `links` probes the
paths between the workers to name the one behind it.
"""

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CommunicationEvent:
    """Steps became slower outside compute (`kind="communication"`) or
    went back to their baseline (`kind="communication_recovered"`).

    Attributes:
        step: Train steps completed when the event fired.
        kind: `"communication"` or `"communication_recovered"`.
        outside_seconds: Median seconds per step outside compute over the
            last `window` readings.
        baseline_seconds: The same median at the start of training.
        compute_seconds: Median compute seconds per step (slowest replica)
            over the last `window` readings.
        workers: The workers (global indices, as in `TF_CONFIG`: the chief
            first) behind the slow link, from the probes between workers;
            `()` when not known (one worker, probes off, or no probe was
            slow).
        slow_links: The slow probes, `(from, to, seconds, reference)`
            tuples: the probe from worker `from` to worker `to` took
            `seconds` (`inf`: no answer), `reference` at the start (None:
            not measured in this fit).
    """

    step: int
    kind: str
    outside_seconds: float
    baseline_seconds: float
    compute_seconds: float
    workers: tuple = ()
    slow_links: tuple = ()


class CommunicationTracker:
    """Follows each step's time outside compute against a baseline.

    The first reading (the fit's first call, which traces) is skipped; the
    median of the next `window` readings is the baseline. A reading whose
    window median exceeds `factor` x baseline + `min_excess_seconds` is
    slow; `patience` slow readings in a row raise a "communication" event,
    `patience` readings below `recover_factor` x baseline +
    `min_excess_seconds` then raise "communication_recovered".

    Args:
        window: Readings each median covers, >= 1.
        patience: Readings in a row before an event, >= 1.
        min_excess_seconds: Seconds per step the time outside compute must
            grow by, >= 0.
        factor: How many times the baseline is slow. Defaults to `2.0`.
        recover_factor: Below how many times the baseline it has
            recovered. Defaults to `1.5`.

    Example:

    >>> tracker = CommunicationTracker(window=2, patience=1,
    ...                                min_excess_seconds=0.001)
    >>> [tracker.step(s, 0.010, 0.002, 1) for s in (10, 1, 2, 3, 4)]
    [None, None, None, None, None]
    >>> tracker.step(5, 0.050, 0.002, 1).kind
    'communication'
    """

    def __init__(
        self,
        window,
        patience,
        min_excess_seconds,
        factor=2.0,
        recover_factor=1.5,
    ):
        self.window = int(window)
        self.patience = int(patience)
        self.min_excess_seconds = float(min_excess_seconds)
        self.factor = float(factor)
        self.recover_factor = float(recover_factor)
        self.baseline = None
        self.slow = False
        self._skipped = False
        self._outside = collections.deque(maxlen=self.window)
        self._compute = collections.deque(maxlen=self.window)
        self._run = 0

    def step(self, step, call_seconds, compute_seconds, steps):
        """Adds one call's reading.

        Args:
            step: Train steps completed after the call.
            call_seconds: Host seconds of the call.
            compute_seconds: The slowest replica's compute seconds in it.
            steps: Steps the call ran (> 0).

        Returns:
            A `CommunicationEvent` when the state changes, else None.
        """
        if not self._skipped:
            self._skipped = True
            return None
        outside = max(0.0, call_seconds - compute_seconds) / steps
        self._outside.append(outside)
        self._compute.append(compute_seconds / steps)
        current = float(np.median(self._outside))
        if self.baseline is None:
            if len(self._outside) == self.window:
                self.baseline = current
                self._outside.clear()
                self._compute.clear()
            return None
        if self.slow:
            limit = self.recover_factor * self.baseline
            crossed = current < limit + self.min_excess_seconds
        else:
            limit = self.factor * self.baseline
            crossed = current > limit + self.min_excess_seconds
        self._run = self._run + 1 if crossed else 0
        if self._run < self.patience:
            return None
        self._run = 0
        self.slow = not self.slow
        return CommunicationEvent(
            step=int(step),
            kind="communication" if self.slow else "communication_recovered",
            outside_seconds=current,
            baseline_seconds=self.baseline,
            compute_seconds=float(np.median(self._compute)),
        )

    def state(self):
        """The baseline and whether steps are slow now (plain data)."""
        return {"baseline": self.baseline, "slow": self.slow}

    def set_state(self, state):
        """Restores `state()` output: a resumed run keeps the baseline of
        the healthy start, not one measured on a link slow already."""
        self.baseline = state["baseline"]
        self.slow = bool(state["slow"])
        self._skipped = False
