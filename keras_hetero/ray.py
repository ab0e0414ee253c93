"""Running keras-hetero training under Ray Train (`keras-hetero[ray]`).

Ray Train's `TensorflowTrainer` starts one worker process (a Ray actor) per
worker, writes `TF_CONFIG` for MultiWorkerMirroredStrategy, and restarts the
group from the latest reported checkpoint when a worker fails or the group
is resized. Two pieces make a keras-hetero training function run there
unchanged:

- `TensorflowConfig`: Ray's TensorFlow set-up, keeping the Keras flavour of
  the driver (Ray's own sets `TF_USE_LEGACY_KERAS=1` on every worker);
- `ElasticCheckpoint`: `kh.callbacks.ElasticCheckpoint` that reports Keras
  logs and its checkpoints to Ray (`ray.train.report`) and resumes from
  `ray.train.get_checkpoint()`, so a restarted or resized group continues at
  the exact next step, every example once per epoch.

Requires Ray Train (the `ray` extra: `pip install ".[ray]"` in a checkout);
tested with Ray 2.60 (Train v2).
"""

import dataclasses
import json
import logging
import numbers
import os
import shutil
import tempfile

from keras_hetero._checks import check_int

try:
    import ray.train
    from ray.train.tensorflow import TensorflowConfig as _RayTensorflowConfig
    from ray.train.tensorflow.config import (
        _TensorflowBackend as _RayTensorflowBackend,
    )
except ImportError as error:
    raise ImportError(
        "keras_hetero.ray needs Ray Train, which is not installed (or not "
        f"importable: {error}). Install the tested version (keras-hetero's "
        '"ray" extra) with: pip install "ray[train]==2.60.0"'
    ) from error

from keras_hetero import _compat
from keras_hetero import checkpointing
from keras_hetero.checkpointing import callback as elastic_checkpoint
from keras_hetero.checkpointing import storage

logger = logging.getLogger("keras_hetero")

__all__ = ["ElasticCheckpoint", "TensorflowConfig"]


def _set_keras_flavour(legacy):
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if legacy else "0"


class _Backend(_RayTensorflowBackend):
    def on_start(self, worker_group, backend_config):
        super().on_start(worker_group, backend_config)
        worker_group.execute(_set_keras_flavour, backend_config.legacy_keras)


@dataclasses.dataclass
class TensorflowConfig(_RayTensorflowConfig):
    """Ray Train's TensorFlow set-up that keeps the driver's Keras flavour.

    Pass it as `tensorflow_config` to `ray.train.tensorflow.TensorflowTrainer`.
    Like Ray's own config it gives every worker a `TF_CONFIG` naming all
    workers (world rank = task index), so `MultiWorkerMirroredStrategy()`
    inside the training function joins them. Ray's config also sets
    `TF_USE_LEGACY_KERAS=1` on every worker, which would make the workers
    import keras_hetero with tf-keras even when the driver uses Keras 3;
    this one sets it to the flavour chosen here.

    Args:
        legacy_keras: Whether the workers use tf-keras (`True`) or Keras 3
            (`False`). Defaults to the flavour of the process that creates
            the config (`kh.FLAVOUR`).

    Example:

    >>> trainer = TensorflowTrainer(  # doctest: +SKIP
    ...     train_fn, tensorflow_config=kh.ray.TensorflowConfig(),
    ...     scaling_config=ray.train.ScalingConfig(num_workers=2))
    """

    legacy_keras: bool = dataclasses.field(
        default_factory=lambda: _compat.FLAVOUR == "tf-keras"
    )

    @property
    def backend_cls(self):
        return _Backend


class ElasticCheckpoint(elastic_checkpoint.ElasticCheckpoint):
    """`kh.callbacks.ElasticCheckpoint` that checkpoints through Ray Train.

    Use it instead of `kh.callbacks.ElasticCheckpoint` in a training function
    run by Ray's `TensorflowTrainer`. Every `save_every` train steps, at the
    end of every epoch and at the end of `fit`, every worker calls
    `ray.train.report` with the Keras logs (the epoch's logs at its end)
    plus `epoch` and `step` (the global train step); at those points worker
    0 first writes an ElasticCheckpoint (model, optimizer, data position,
    shares, callback state) and attaches it, so Ray persists it in the
    run's storage (`Result.metrics` are the last checkpoint's). When
    Ray starts the group again (after a worker failure with
    `FailureConfig(max_failures=...)`, an elastic resize, or a new
    `TensorflowTrainer` with the same `RunConfig(name, storage_path)`), every
    worker fetches `ray.train.get_checkpoint()` and resumes from it exactly
    like `kh.callbacks.ElasticCheckpoint`: the next global batch not yet
    trained, with any number of workers.

    Steps trained after the last report are trained again after a restart;
    what Ray keeps (the reported checkpoints and metrics) sees every example
    once per epoch.

    `ray.train.report` is a barrier: all workers must reach it the same
    number of times, so the schedule is a number of steps (the same on every
    worker), never a duration or "auto". Saves are synchronous (Ray uploads
    the files when `report` is called) into a private local directory.

    Args:
        save_every: Train steps between reports with a checkpoint, >= 1.
            Defaults to `100`.
        keep: Local checkpoints kept (Ray keeps its own copies; limit them
            with `ray.train.CheckpointConfig(num_to_keep=...)`). Defaults to
            `1`.
        resize: What a restart with another global batch size does; see
            `kh.callbacks.ElasticCheckpoint`. Defaults to
            `"keep_global_batch"`.
        approximate_resume: Accept input stages a restart cannot
            reproduce (warn once instead of refusing them); see
            `kh.callbacks.ElasticCheckpoint`. Defaults to `False`.

    Raises:
        ValueError: If `save_every` is not a positive number of steps, or
            for a bad `keep` or `resize`; from `fit`, as
            `kh.callbacks.ElasticCheckpoint`, for input a restart cannot
            reproduce.
        RuntimeError: If `fit` runs outside a Ray Train worker.

    Example:

    >>> def train_fn(config):  # doctest: +SKIP
    ...     strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ...     with strategy.scope():
    ...         model = build_model()
    ...     data = kh.data.shard(examples(), 64, strategy=strategy)
    ...     model.fit(data, epochs=3, callbacks=[
    ...         kh.callbacks.ShardRebalancer(data),
    ...         kh.ray.ElasticCheckpoint(save_every=50)])
    """

    def __init__(
        self,
        save_every=100,
        keep=1,
        *,
        resize="keep_global_batch",
        approximate_resume=False,
    ):
        check_int(
            "save_every",
            save_every,
            expected="a positive int (train steps): every worker must call "
            "`ray.train.report` at the same steps",
        )
        super().__init__(
            tempfile.mkdtemp(prefix="keras_hetero-ray-"),
            save_every=save_every,
            keep=keep,
            async_save=False,
            resize=resize,
            exit_on_signal=False,
            approximate_resume=approximate_resume,
        )
        self._since_report = 0

    # --- restore ------------------------------------------------------------

    def prepare_fit(self, context):
        try:
            ray.train.get_context()
        except RuntimeError:
            raise RuntimeError(
                "kh.ray.ElasticCheckpoint must run inside a Ray Train "
                "training function (e.g. one passed to "
                "`ray.train.tensorflow.TensorflowTrainer`); use "
                "`kh.callbacks.ElasticCheckpoint` elsewhere."
            ) from None
        if not checkpointing.list_checkpoints(self.directory):
            self._fetch()
        self._since_report = 0
        return super().prepare_fit(context)

    def _fetch(self):
        """Copies Ray's latest checkpoint, if any, into `directory`."""
        reported = ray.train.get_checkpoint()
        if reported is None:
            return
        os.makedirs(self.directory, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".fetch-", dir=self.directory)
        reported.to_directory(staging)
        with open(os.path.join(staging, storage.STATE)) as f:
            step = json.load(f)["global_step"]
        os.rename(
            staging,
            os.path.join(self.directory, storage.checkpoint_name(step)),
        )
        logger.info(
            "kh.ray.ElasticCheckpoint: fetched Ray checkpoint %s (step %d).",
            reported.path,
            step,
        )

    # --- reporting ----------------------------------------------------------

    def save_due(self):
        return False  # saves happen at report points only

    def on_train_batch_end(self, batch, logs=None):
        before = self.global_step
        super().on_train_batch_end(batch, logs)
        # Steps, not calls: one call runs `steps_per_execution` steps.
        self._since_report += self.global_step - before
        # The last step of an epoch reports in `on_epoch_end`, with the
        # epoch's logs (validation, shares, straggler scores).
        if (
            self._since_report >= self.save_every.steps
            and not self.epoch_complete
        ):
            self._report(logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._report(logs, epoch=epoch)

    def on_train_end(self, logs=None):
        if self._since_report:
            self._report(logs)
        super().on_train_end(logs)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _report(self, logs, epoch=None):
        """Reports metrics on every worker; the chief attaches a checkpoint
        of the current step unless nothing was trained since the last one."""
        checkpoint = None
        name = storage.checkpoint_name(self.global_step)
        path = os.path.join(self.directory, name)
        local = self._low_communication()
        if self._since_report and local is not None:
            # Every worker reports here: the round ends and all of them
            # gather the per-replica state the chief saves.
            self._save_at_round_end(
                local, write=self.is_chief and not os.path.isdir(path)
            )
        if self._since_report and self.is_chief:
            if not os.path.isdir(path):
                self.save_now()
            checkpoint = ray.train.Checkpoint.from_directory(path)
        metrics = _scalars(logs)
        metrics["epoch"] = self.epoch if epoch is None else epoch
        metrics["step"] = self.global_step
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            delete_local_checkpoint_after_upload=False,
        )
        self._since_report = 0


def _scalars(logs):
    """The numeric entries of Keras `logs` as Python floats."""
    metrics = {}
    for key, value in (logs or {}).items():
        if hasattr(value, "numpy"):
            value = value.numpy()
        if getattr(value, "shape", ()) == ():
            value = value.item() if hasattr(value, "item") else value
            if isinstance(value, numbers.Number):
                metrics[key] = float(value)
    return metrics
