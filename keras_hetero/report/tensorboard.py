"""`HeteroTensorBoard`: per-replica scalars for TensorBoard."""

import os

import numpy as np

from keras_hetero import _distribute
from keras_hetero import _scalar_writer as writer
from keras_hetero._checks import check_int
from keras_hetero.report import sources as _sources


class HeteroTensorBoard(_sources.Observer):
    """Writes every replica's rows, step time, share and scores to TensorBoard.

    Every `update_freq` train steps it writes, from `model.step_stats` of
    that step (step = the model's train step count):

    - `rows/replica_<i>`: rows replica `i` trained on;
    - `compute_seconds/replica_<i>`: its compute seconds per step;
    - `seconds_per_row/replica_<i>`: the two divided;
    - `share/replica_<i>`: its fraction of the step's rows;

    and from the other callbacks of the same `HeteroModel.fit` (which runs
    this one after them): a `StragglerDetector`'s `straggler/relative_<i>`,
    `straggler/individual_<i>` and `straggler/flagged`, and for every
    `ElasticCheckpoint` save, at the step it was taken,
    `checkpoint/blocking_seconds` (training waited) and
    `checkpoint/write_seconds`.

    The event files go to `log_dir/hetero`, beside the `train` and
    `validation` runs of `keras.callbacks.TensorBoard(log_dir)`. Only the
    chief writes under multi-worker strategies (all workers see the same
    numbers). All scalars of a step are written by one traced TensorFlow
    call; the steps in between cost a counter increment (see
    docs/observability.md for measurements). The `tensorboard` package is
    needed to view the files, not to write them.

    Args:
        log_dir: The TensorBoard log directory.
        update_freq: Write every this many train steps (an int >= 1), or
            `"epoch"` (at the end of every epoch). Defaults to `100`.

    Raises:
        ValueError: If `update_freq` is neither an integer >= 1 nor
            `"epoch"`.

    Example:

    >>> board = HeteroTensorBoard("/tmp/logs", update_freq=50)
    >>> # model.fit(data, callbacks=[board]); tensorboard --logdir /tmp/logs
    """

    def __init__(self, log_dir, update_freq=100):
        super().__init__()
        if update_freq != "epoch":
            check_int(
                "update_freq",
                update_freq,
                expected='an integer >= 1 or "epoch"',
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writer = None

    def on_train_begin(self, logs=None):
        self._sources.start()
        self._since_write = 0
        self._checkpoints_written = 0
        self._writer = None
        if _distribute.is_chief(self.model.distribute_strategy):
            self._writer = writer.ScalarWriter(
                os.path.join(self.log_dir, "hetero")
            )

    def on_train_batch_end(self, batch, logs=None):
        if self._writer is None:
            return
        self._poll_checkpoints()
        if self.update_freq == "epoch":
            return
        self._since_write += 1
        if self._since_write >= self.update_freq:
            self._write()

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is not None and self.update_freq == "epoch":
            self._write()

    def on_train_end(self, logs=None):
        if self._writer is None:
            return
        self._poll_checkpoints()  # ElasticCheckpoint's final save
        self._write_checkpoints()
        self._writer.close()
        self._writer = None

    def _write(self):
        self._since_write = 0
        stats = getattr(self.model, "step_stats", None)
        if stats is None or stats.measured_steps == 0:
            return
        self._writer.write(stats.step, replica_scalars(stats))
        self._writer.write(stats.step, self._sources.scalars())
        self._write_checkpoints()

    def _poll_checkpoints(self):
        stats = getattr(self.model, "step_stats", None)
        if self._sources.checkpoints and stats is not None:
            self._sources.poll(stats.step)

    def _write_checkpoints(self):
        # A save's write time is known once its background write is done;
        # saves are written in order, each once.
        saves = self._sources.saves()
        for step, blocking, written in saves[self._checkpoints_written :]:
            if written is None:
                break
            self._writer.write(
                step,
                {
                    "checkpoint/blocking_seconds": blocking,
                    "checkpoint/write_seconds": written,
                },
            )
            self._checkpoints_written += 1


def replica_scalars(stats):
    """The per-replica scalars of one `kh.StepStats`, per step.

    Args:
        stats: A `kh.StepStats` (e.g. `model.step_stats`).

    Returns:
        `{"rows/replica_<i>": ..., "compute_seconds/replica_<i>": ...,
        "seconds_per_row/replica_<i>": ..., "share/replica_<i>": ...}`.
    """
    steps = max(stats.measured_steps, 1)
    rows = np.asarray(stats.rows, np.float64) / steps
    seconds = np.asarray(stats.compute_seconds, np.float64) / steps
    shares = rows / max(rows.sum(), 1.0)
    per_row = stats.seconds_per_row
    scalars = {}
    for replica in range(len(rows)):
        scalars[f"rows/replica_{replica}"] = rows[replica]
        scalars[f"compute_seconds/replica_{replica}"] = seconds[replica]
        scalars[f"seconds_per_row/replica_{replica}"] = per_row[replica]
        scalars[f"share/replica_{replica}"] = shares[replica]
    return scalars
