"""`StepTimer`: wall time between train batches, for benchmarks and demos."""

import time

import numpy as np

from keras_hetero._compat import keras


class StepTimer(keras.callbacks.Callback):
    """Records the wall time between consecutive train batches of a `fit`.

    The first batch of each `fit` (tracing, warm-up) has no predecessor and
    is not counted. For benchmarks and demos, never for assertions in tests.

    Attributes:
        seconds: One float per timed step of the last `fit`.

    Example:

    >>> timer = StepTimer()
    >>> # model.fit(data, callbacks=[timer]); timer.median()
    """

    def on_train_begin(self, logs=None):
        self._last = None
        self.seconds = []

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = now

    def median(self):
        """Median seconds per step of the last `fit`."""
        return float(np.median(self.seconds))
