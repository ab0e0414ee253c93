"""Keras' own callbacks under HeteroModel: shared files, BackupAndRestore's
resume point, mid-epoch starts."""

from keras_hetero._compat.epochs import EpochComplete
from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.flavour import keras


def shared_file_paths(callback):
    """The paths a Keras callback writes on every worker, by attribute.

    Keras 3.15's `ModelCheckpoint` (`filepath`), `TensorBoard` (`log_dir`),
    `CSVLogger` (`filename`) and `BackupAndRestore` have no chief/worker
    logic: under MultiWorkerMirroredStrategy every worker writes the same
    paths (h5 files then fail to lock, `BlockingIOError`). `BackupAndRestore`
    derives its files (`_weights_path`, `_training_metadata_path` and their
    `.bkp` copies) from `backup_dir` in `__init__`, so those attributes are
    taken too: every string attribute inside `backup_dir`. tf-keras' own
    `ModelCheckpoint`, `TensorBoard` and `BackupAndRestore` write from the
    chief only (`tf_keras/src/distribute/distributed_file_utils.py`), but
    its `CSVLogger` writes from every worker too (rows once per worker).

    Returns:
        `{attribute name: path}`, empty for callbacks that need nothing.
    """
    callbacks = keras.callbacks
    if isinstance(callback, callbacks.CSVLogger):
        return {"filename": callback.filename}
    if IS_LEGACY:
        return {}
    if isinstance(callback, callbacks.ModelCheckpoint):
        return {"filepath": callback.filepath}
    if isinstance(callback, callbacks.TensorBoard):
        return {"log_dir": callback.log_dir}
    if isinstance(callback, callbacks.BackupAndRestore):
        root = str(callback.backup_dir).rstrip("/\\")
        return {
            name: value
            for name, value in vars(callback).items()
            if isinstance(value, str)
            and value.startswith(root)
            and value[len(root) :][:1] in ("", "/", "\\")
        }
    return {}


def restores_from_files(callback):
    """Whether `callback` reads back at `fit` start what it wrote before.

    Keras 3's `BackupAndRestore` loads `latest.weights.h5` and
    `training_metadata.json` in `on_train_begin`.
    """
    return not IS_LEGACY and isinstance(
        callback, keras.callbacks.BackupAndRestore
    )


def backup_resume_epoch(model, steps_per_epoch, initial_epoch):
    """The epoch a `fit` loop starts at once `on_train_begin` has run.

    Keras' `BackupAndRestore` restores in `on_train_begin` and hands the
    epoch to the `fit` loop: Keras 3.15 through `model._initial_epoch` (its
    loop reads `self._initial_epoch or initial_epoch`), tf-keras through
    `model._training_state` (its loop calls
    `_maybe_load_initial_counters_from_ckpt`). HeteroModel's
    parameter-server loop asks the same way.
    """
    if IS_LEGACY:
        if getattr(model, "_training_state", None) is None:
            return initial_epoch
        epoch, _ = model._maybe_load_initial_counters_from_ckpt(
            steps_per_epoch, initial_epoch
        )
        return epoch
    return model._initial_epoch or initial_epoch


class _ResumePoint:
    """Stands in for tf-keras' `model._training_state`: tells `fit` which
    epoch and step to start at, once (tf-keras asks after `on_train_begin`).
    """

    def __init__(self, epoch, step):
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(
        self, steps_per_epoch, initial_epoch, mode=None
    ):
        epoch, step = self.epoch, self.step
        self.epoch, self.step = initial_epoch, 0
        return max(epoch, initial_epoch), step


def set_initial_step(model, epoch, step, kwargs):
    """Makes the coming `fit` start at `(epoch, step)`.

    tf-keras supports a first step natively (its multi-worker fault
    tolerance hook); Keras 3 only an initial epoch, so its data must end the
    resumed epoch early (see `HeteroDataset.resume_after`).

    Returns:
        A function that undoes the change after `fit`.
    """
    kwargs["initial_epoch"] = max(kwargs.get("initial_epoch", 0), epoch)
    if not IS_LEGACY:
        return lambda: None
    model._training_state = _ResumePoint(epoch, step)

    def undo():
        model._training_state = None

    return undo


def end_epoch_before_step():
    """Keras 3: ends the running epoch from `on_train_batch_begin`.

    A resumed epoch has fewer batches than Keras 3's step count for it
    (Keras 3 has no initial step; see `set_initial_step`), so Keras calls
    the train function once more and that call fails at `get_next`
    (OutOfRange), but only after the ops of the step that do not depend on
    the data have run: the `SeedGenerator.next` state increment of every
    random layer (Dropout, GaussianNoise, ...). Every later step then drew
    other random numbers than the uninterrupted run (measured on Keras
    3.15, MultiWorkerMirroredStrategy). Keras 3's loop (`fit` in
    `backend/tensorflow/trainer.py`) runs the batch callbacks inside
    `epoch_iterator.catch_stop_iteration()`, which takes a StopIteration as
    the end of the data: the epoch ends without that call. tf-keras starts
    the resumed epoch at its step and makes no extra call: nothing to do.
    A repeated input then stands at the next epoch's first batch, and
    HeteroModel's epoch iterator keeps reading it (`_compat.epochs`).
    """
    if not IS_LEGACY:
        raise EpochComplete


# Keras 3 warns when a dataset ends before the epoch's step count; a resumed
# epoch ends early on purpose (its first steps ran before the restart).
RAN_OUT_OF_DATA = "Your input ran out of data"
