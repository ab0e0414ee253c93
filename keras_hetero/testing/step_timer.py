"""`StepTimer`: wall and CPU time between train batches, for benchmarks and
demos."""

import time

import numpy as np

from keras_hetero._compat import keras


class StepTimer(keras.callbacks.Callback):
    """Records the time between consecutive train batches of a `fit`.

    The first batch of each `fit` (tracing, warm-up) has no predecessor and
    is not counted. For benchmarks and demos, never for assertions in tests.

    Wall time is what a user waits; process CPU time (all of this process's
    threads: the replicas' steps, the input pipeline, Python) is the work
    done, including TF's thread pools spinning while they wait.

    Attributes:
        seconds: Wall seconds, one float per timed step of the last `fit`.
        cpu_seconds: This process's CPU seconds over the same intervals.

    Example:

    >>> timer = StepTimer()
    >>> # model.fit(data, callbacks=[timer]); timer.median()
    """

    def on_train_begin(self, logs=None):
        self._last = None
        self.seconds = []
        self.cpu_seconds = []

    def on_train_batch_end(self, batch, logs=None):
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.seconds.append(now[0] - self._last[0])
            self.cpu_seconds.append(now[1] - self._last[1])
        self._last = now

    def median(self):
        """Median seconds per step of the last `fit`."""
        return float(np.median(self.seconds))
