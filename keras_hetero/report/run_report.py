"""`RunReport`: records every replica's steps during fit, writes a report."""

import time

import numpy as np

from keras_hetero import _distribute
from keras_hetero._checks import check_int
from keras_hetero.report import figure
from keras_hetero.report import page
from keras_hetero.report import sources as _sources
from keras_hetero.report.records import Records


class RunReport(_sources.Observer):
    """Records per-replica step times and shares, then writes a report.

    After every train batch it keeps `model.step_stats` (rows and compute
    seconds of every replica) and the step's wall time. At the end of `fit`
    it adds the straggler events, checkpoints and share changes of the
    `StragglerDetector`, `ElasticCheckpoint` and `ShardRebalancer` in the
    same `fit` (`HeteroModel.fit` runs it after them) and writes
    `report.png` and a self-contained `report.html` into `directory` (see
    `kh.report.write`). Under multi-worker strategies only the chief
    records and writes.

    Needs a `kh.HeteroModel` (for `step_stats`) and matplotlib, the extra
    `keras-hetero[report]`.

    Args:
        directory: Where the report goes; created if missing.
        every_n_steps: Record one step in this many (for very long runs).
            Defaults to `1`.

    Attributes:
        records: The `kh.report.Records` of the last `fit` (None before).
        files: The `kh.report.ReportFiles` written (None before).

    Raises:
        ImportError: If matplotlib is not installed.
        ValueError: If `every_n_steps` is not an integer >= 1.

    Example:

    >>> report = RunReport("/tmp/run1")  # doctest: +SKIP
    >>> model.fit(data, callbacks=[report])  # doctest: +SKIP
    >>> report.files.html  # doctest: +SKIP
    '/tmp/run1/report.html'
    """

    def __init__(self, directory, every_n_steps=1):
        super().__init__()
        figure.matplotlib_classes()  # fail before training, not after it
        check_int("every_n_steps", every_n_steps)
        self.directory = directory
        self.every_n_steps = every_n_steps
        self.records = None
        self.files = None

    def on_train_begin(self, logs=None):
        self.records = None
        self.files = None
        self._chief = _distribute.is_chief(self.model.distribute_strategy)
        self._steps, self._rows, self._seconds, self._wall = [], [], [], []
        self._waits = []
        self._devices = None
        self._last_end = None
        self._seen = 0
        self._sources.start()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        last, self._last_end = self._last_end, now
        stats = getattr(self.model, "step_stats", None)
        if not self._chief or stats is None or stats.measured_steps == 0:
            return
        self._sources.poll(stats.step)
        self._last_step = stats.step
        self._seen += 1
        if self._seen % self.every_n_steps:
            return
        self._steps.append(stats.step)
        self._rows.append(stats.rows / stats.measured_steps)
        self._seconds.append(stats.compute_seconds / stats.measured_steps)
        if stats.wait_seconds is not None:
            self._waits.append(stats.wait_seconds / stats.measured_steps)
        wall = np.nan if last is None else (now - last) / stats.steps
        self._wall.append(wall)
        self._devices = stats.devices

    def on_train_end(self, logs=None):
        if not self._chief or not self._steps:
            return
        sources = self._sources
        sources.poll(self._last_step)  # ElasticCheckpoint's final save
        self.records = Records(
            steps=np.asarray(self._steps, np.int64),
            rows=np.asarray(self._rows, np.float64),
            compute_seconds=np.asarray(self._seconds, np.float64),
            step_seconds=np.asarray(self._wall, np.float64),
            devices=list(self._devices),
            events=list(sources.events),
            checkpoints=sources.saves(),
            share_changes=list(sources.share_changes),
            wait_seconds=(
                np.asarray(self._waits, np.float64)
                if len(self._waits) == len(self._steps)
                else None
            ),
        )
        self.files = page.write(self.records, self.directory)
