"""Writing checkpoints: `Writer` writes one save at a time, on the training
thread or on a background one, and keeps what each save cost."""

import logging
import os
import shutil
import threading
import time

from keras_hetero.checkpointing import storage

logger = logging.getLogger("keras_hetero")


class Writer:
    """Writes `ElasticCheckpoint`'s saves to `directory`, keeping `keep`.

    At most one save is in flight (`busy`); an error of a background write
    is raised on the training thread (`raise_error`). `cost` (seconds a save
    blocks training) and `write_seconds` are moving averages, for the
    "auto" interval.

    Args:
        directory: Where the checkpoints go (`kh.checkpointing` layout).
        keep: Checkpoints kept.
        local_directory: A second copy of each save on this machine's own
            disk (written first), or None. A failed local write (a full
            disk) is logged, naming the directory, and ends the local
            copies of this `Writer`; the shared ones go on.
    """

    def __init__(self, directory, keep, local_directory=None):
        self.directory, self.keep = directory, keep
        self.local_directory = local_directory
        self.local_failed = None  # why the local copies stopped
        self._thread = None
        self._error = None
        self._lock = threading.Lock()
        self._saves = {}  # step -> [blocking seconds, write seconds]
        self.reset_timings()

    def reset_timings(self):
        """Forgets the measured costs (a new `fit` measures afresh)."""
        self.cost = None
        self.write_seconds = None

    @property
    def busy(self):
        """Whether a background write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, step, arrays, state, wait, started, shared=True):
        """Writes `arrays` and `state` as step `step`'s checkpoint.

        Args:
            step: The global step.
            arrays: The tensors, as numpy arrays (copied already).
            state: The JSON state.
            wait: Write on this thread (else on a background one).
            started: `time.perf_counter()` when the save began (the copy
                counts in its cost).
            shared: Write to `directory` too (the chief), not only the
                local copy. Defaults to `True`.
        """
        with self._lock:
            self._saves[step] = [None, None]

        def write():
            write_started = time.perf_counter()
            self._write_local(step, arrays, state)
            try:
                if shared:
                    storage.write(self.directory, step, arrays, state)
                    storage.prune(self.directory, self.keep)
            except BaseException as error:  # surfaced on the main thread
                with self._lock:
                    self._error = error
                    del self._saves[step]
                return
            seconds = time.perf_counter() - write_started
            with self._lock:
                self.write_seconds = _ema(self.write_seconds, seconds)
                self._saves[step][1] = seconds

        if wait:
            write()
            self.raise_error()
        else:
            self._thread = threading.Thread(
                target=write, name="keras_hetero-checkpoint", daemon=True
            )
            self._thread.start()
        blocking = time.perf_counter() - started
        with self._lock:
            self.cost = _ema(self.cost, blocking)
            if step in self._saves:
                self._saves[step][0] = blocking

    def _write_local(self, step, arrays, state):
        if self.local_directory is None or self.local_failed is not None:
            return
        try:
            storage.write(self.local_directory, step, arrays, state)
            storage.prune(self.local_directory, self.keep)
        except OSError as error:
            storage.remove_partial(self.local_directory)
            try:
                free = f"{shutil.disk_usage(self.local_directory).free:,}"
            except OSError:
                free = "unknown"
            size = sum(a.nbytes for a in arrays)
            self.local_failed = str(error)
            logger.error(
                "ElasticCheckpoint: cannot write the local copy of step %d "
                "to local_directory=%r (%s; a copy needs about %s bytes, "
                "%s are free there). No more local copies in this fit: "
                "the checkpoints in %s go on, and a restart restores from "
                "them.",
                step,
                os.fspath(self.local_directory),
                error.strerror or error,
                f"{size:,}",
                free,
                self.directory,
            )

    @property
    def saves(self):
        """`(step, seconds blocked, seconds written or None)` per save."""
        with self._lock:
            return [(s, b, w) for s, (b, w) in sorted(self._saves.items())]

    def join(self):
        """Waits for the save in flight, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def raise_error(self):
        """Raises a background write's error, once.

        Raises:
            RuntimeError: Naming the directory and the error.
        """
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                f"ElasticCheckpoint could not write to {self.directory}: "
                f"{error}"
            ) from error


def _ema(old, new, weight=0.3):
    return new if old is None else (1 - weight) * old + weight * new
