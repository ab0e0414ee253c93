"""A restart, timed: when each attempt's workers reached each phase of
their start, as the launcher logs it.

Per attempt, in seconds from its origin (the launch, or when this host saw
the previous attempt end: a worker failed, or the rendezvous stopped the
group):

- `peers stopped`: the previous attempt's workers here had all exited;
- `started`: this attempt's processes were started;
- the workers' own phases (`keras_hetero._phases`: `imported`, `in fit`,
  `restored`, `first step`), each when the slowest worker here reached it
  (a phase a worker never marks, such as `restored` without an
  `ElasticCheckpoint`, is left out).

The line is logged once every worker here trained a step, or when the
attempt ends before that, with the phases reached (and how many workers
ran in warm spares, `launcher.warm`, if any did):

    [launcher] attempt 1 up (1 of 1 warm), seconds since worker(s) [1]
    failed: peers stopped 0.52, started 0.53, imported 0.55, in fit
    1.62, restored 2.11, first step 2.87
"""

import os
import re
import shutil
import tempfile
import time

from keras_hetero import _phases

# Every phase a logged line may name, in the order they come.
PHASES = ("peers stopped", "started", *_phases.ORDER)
# How often the phase files are read while an attempt starts.
_READ_EVERY_SECONDS = 0.25


class AttemptTiming:
    """The phases of one attempt's workers on this host.

    Args:
        attempt: The attempt's number (0 first).
        origin: Wall-clock time the phases count from.
        why: What happened at `origin`, for the log ("the launch",
            "worker(s) [1] failed").
        stopped: Wall-clock time the previous attempt's workers had all
            exited here; None for the first attempt.
        indices: The workers' indices in the group (one phase file each).
    """

    def __init__(self, attempt, origin, why, stopped, indices):
        self.attempt, self.origin, self.why = attempt, origin, why
        self.stopped = stopped
        self.started = time.time()
        self.directory = tempfile.mkdtemp(prefix="keras_hetero_phases_")
        self.paths = {
            index: os.path.join(self.directory, f"worker{index}")
            for index in indices
        }
        self.logged = False
        self._next_read = 0.0
        # How many of the workers ran in warm spares (`launcher.warm`).
        self.warm = 0

    def phases(self):
        """`[(phase, seconds since origin)]`, in order, of the phases every
        worker reached."""
        reached = [_phases.read(path) for path in self.paths.values()]
        rows = []
        if self.stopped is not None:
            rows.append(("peers stopped", self.stopped - self.origin))
        rows.append(("started", self.started - self.origin))
        for name in _phases.ORDER:
            times = [worker.get(name) for worker in reached]
            if times and all(t is not None for t in times):
                rows.append((name, max(times) - self.origin))
        return rows

    def check(self, say):
        """Logs (with `say(line)`) the phases once every worker trained a
        step; reads the files at most every `_READ_EVERY_SECONDS`."""
        now = time.monotonic()
        if self.logged or now < self._next_read:
            return
        self._next_read = now + _READ_EVERY_SECONDS
        if all(
            _phases.FIRST_STEP in _phases.read(path)
            for path in self.paths.values()
        ):
            self.log(say)

    def log(self, say, ended=False):
        """Logs the phases reached (once per attempt)."""
        if self.logged:
            return
        self.logged = True
        state = "ended before every worker trained a step" if ended else "up"
        if self.warm:
            state += f" ({self.warm} of {len(self.paths)} warm)"
        text = ", ".join(
            f"{name} {seconds:.2f}" for name, seconds in self.phases()
        )
        say(
            f"[launcher] attempt {self.attempt} {state}, seconds since "
            f"{self.why}: {text}"
        )

    def close(self):
        """Removes the phase files."""
        shutil.rmtree(self.directory, ignore_errors=True)


def warm_workers(line):
    """`(warm, workers)` from a logged line that says it, else None.

    Example:

    >>> warm_workers("[launcher] attempt 2 up (1 of 2 warm), seconds "
    ...              "since worker(s) [0] failed: started 0.1")
    (1, 2)
    """
    match = re.search(r"\((\d+) of (\d+) warm\), seconds since ", line)
    return None if match is None else (int(match[1]), int(match[2]))


def parse(line):
    """`(attempt, {phase: seconds})` from a logged line, or None.

    Example:

    >>> parse("[launcher] attempt 1 up, seconds since worker(s) [0] "
    ...       "failed: peers stopped 0.52, started 0.53, first step 5.87")
    (1, {'peers stopped': 0.52, 'started': 0.53, 'first step': 5.87})
    """
    marker = "[launcher] attempt "
    at = line.find(marker)
    if at < 0 or ", seconds since " not in line:
        return None
    head, _, text = line[at + len(marker) :].partition(": ")
    try:
        attempt = int(head.split()[0])
        phases = {}
        for item in text.split(", "):
            name, _, seconds = item.rpartition(" ")
            phases[name] = float(seconds)
    except ValueError:
        return None
    return attempt, phases
