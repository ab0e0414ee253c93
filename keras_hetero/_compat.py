"""The one place that knows Keras 3 from tf-keras (Keras 2).

The flavour is chosen once, at import, the way TensorFlow chooses it:
`TF_USE_LEGACY_KERAS=1` selects tf-keras, anything else Keras 3. Every other
module imports `keras` and the flavour-specific helpers from here; nothing else
imports `tf_keras`.

Overrides of Keras internals live here too, each small and each naming the
upstream bug it works around.
"""

import os
import threading

import tensorflow as tf

IS_LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in (
    "1",
    "true",
    "yes",
)

if IS_LEGACY:
    import tf_keras as keras
    from tf_keras.src.engine import data_adapter as _data_adapter
    from tf_keras.src.engine import training as _training
    from tf_keras.src.engine.functional import Functional
    from tf_keras.src.optimizers.optimizer_v1 import TFOptimizer as _TFOptimizer

    unpack_x_y_sample_weight = _data_adapter.unpack_x_y_sample_weight
    functional_init_arguments = _training.is_functional_model_init_params
else:
    import keras
    from keras.src.losses import loss as _loss_module
    from keras.src.models import model as _model_module
    from keras.src.models.functional import Functional
    from keras.src.trainers.data_adapters import (
        data_adapter_utils as _data_adapter_utils,
    )

    unpack_x_y_sample_weight = _data_adapter_utils.unpack_x_y_sample_weight
    functional_init_arguments = _model_module.functional_init_arguments

FLAVOUR = "tf-keras" if IS_LEGACY else "keras3"
KERAS_VERSION = keras.__version__


def release(version):
    """The `(major, minor)` release of a version string like `"3.10.0"`."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


TF_RELEASE = release(tf.__version__)
KERAS_RELEASE = release(KERAS_VERSION)

# Keras 3 internals that changed within the tested range (docs/versions.md),
# keyed by the release that changed them. tests/test_compat_versions.py
# checks each key against the installed Keras. tf-keras 2.19-2.21 and
# TF 2.19-2.21 need none.

# Keras 3.11 (keras/src/trainers/epoch_iterator.py, `_enumerate_iterator`):
# iterating an epoch iterator gives `(begin_step, end_step, iterator)`;
# Keras 3.10 gives `(step, iterator)`.
EPOCH_ITERATOR_YIELDS_STEP_RANGE = not IS_LEGACY and KERAS_RELEASE >= (3, 11)

# Keras 3.12 (keras-team/keras#21548): optional inputs fed None reach the
# step as empty `tf.experimental.Optional`s, which the train function turns
# back into None (`TensorFlowTrainer._autoconvert_optionals`). Keras 3.10
# and 3.11 have neither.
CONVERTS_OPTIONAL_INPUTS = not IS_LEGACY and KERAS_RELEASE >= (3, 12)


# tf-keras never re-iterates a distributed dataset: each epoch continues the
# same iterator, so it wants a repeated dataset and the steps per epoch
# (`steps_per_epoch`, `validation_steps`, `steps`). Keras 3 iterates the
# dataset again each epoch.
REPEATS_DISTRIBUTED_INPUT = IS_LEGACY


def logs_are_global(model):
    """Tells Keras that the step's logs are already global (identical on
    every replica). tf-keras' default (`distribute_reduction_method=
    "auto"`) sums them across replicas off TPU; Keras 3's averages them,
    which leaves identical values as they are."""
    if IS_LEGACY:
        model.distribute_reduction_method = "first"


def register_serializable(name):
    """`register_keras_serializable` under the `keras_hetero` package."""
    return keras.saving.register_keras_serializable(
        package="keras_hetero", name=name
    )


def register_plain_name(name, cls):
    """Makes `cls` known to Keras by its bare class `name` too.

    Legacy `.h5` files store the bare class name (`HeteroModel`), which
    `register_serializable` does not cover (it registers
    `keras_hetero>HeteroModel`); `load_model` then needs no `custom_objects`
    after `import keras_hetero`.
    """
    keras.saving.get_custom_objects()[name] = cls


def init_functional(model, args, kwargs):
    """Initialises `model`, whose class already derives from `Functional`.

    `keras.Model.__init__` would "inject" `Functional` into the bases of every
    class above the instance's, i.e. rewrite `HeteroModel` itself, after which
    subclass-style `HeteroModel`s break. Our functional variant class already
    has `Functional` in its bases, so we run the initialisers directly.
    """
    if not IS_LEGACY:
        _model_module.Trainer.__init__(model)
    Functional.__init__(model, *args, **kwargs)


def functional_config(model, default_get_config):
    """The Functional config (layers and wiring) of a functional HeteroModel.

    tf-keras only writes the layer graph for classes whose `__init__` has
    exactly Functional's arguments; HeteroModel's takes `*args, **kwargs`.
    """
    if IS_LEGACY:
        from tf_keras.src.engine import functional

        return functional.get_network_config(
            model, config={"name": model.name, "trainable": model.trainable}
        )
    return default_get_config()


def symbolic_inputs_outputs(model):
    """`(inputs, outputs)` of a model that has symbolic ones, in the
    structure it was built with (one tensor stays one tensor, so `predict`
    and `export` signatures stay the same), else `(None, None)`."""
    if isinstance(model, keras.Sequential):
        try:  # Both flavours raise for a Sequential that was never built.
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            return None, None
        return (inputs[0], outputs[0]) if inputs else (None, None)
    if not isinstance(model, Functional):
        return None, None
    if IS_LEGACY:
        return model._nested_inputs, model._nested_outputs
    return model._inputs_struct, model._outputs_struct


def compile_arguments(model):
    """The arguments of `model`'s last `compile`, or None if it has none.

    Both flavours keep them in `model._compile_config.config` (what
    `get_compile_config` serialises). The optimizer is the compiled object
    (not, say, the string "adam"), so its state carries over.
    """
    config = getattr(model, "_compile_config", None)
    if config is None:
        return None
    arguments = dict(config.config)
    if getattr(model, "optimizer", None) is not None:
        arguments["optimizer"] = model.optimizer
    return arguments


def model_strategy(model):
    """The strategy `model` was created under, or None."""
    if IS_LEGACY:
        return model._distribution_strategy
    return model._distribute_strategy


def unscaled_mean_loss(model, x, y, y_pred, sample_weight, rows, training):
    """This replica's mean loss over its own rows, regularisers included.

    Both flavours divide the compiled loss and the regularisation losses by
    `num_replicas_in_sync` so that a SUM across replicas gives the mean of
    per-replica means. We undo that here; the caller re-weights by rows.
    tf-keras also updates its `loss` tracker inside `compute_loss`; for Keras 3
    we update `_loss_tracker` the way its own `train_step` does.
    """
    if IS_LEGACY:
        loss = model.compute_loss(x, y, y_pred, sample_weight)
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if num_replicas > 1:
            loss = loss * tf.cast(num_replicas, loss.dtype)
        return loss
    _row_weighted_output_losses(model)
    # One replica keeps stock Keras' numbers (each batch once in the epoch's
    # `<output>_loss`, also a partial last one).
    several = tf.distribute.get_strategy().num_replicas_in_sync > 1
    _replica_rows.value = rows if several else None
    try:
        loss = model._compute_loss(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )
    finally:
        _replica_rows.value = None
    loss = _loss_module.unscale_loss_for_distribution(loss)
    model._loss_tracker.update_state(loss, sample_weight=rows)
    return loss


# The rows of the batch whose loss this thread is computing (MirroredStrategy
# traces each replica in its own thread).
_replica_rows = threading.local()


def _row_weighted_output_losses(model):
    """Keras 3: weights the `<output>_loss` logs by the replica's rows.

    Upstream (Keras 3.15, `CompileLoss.call` in
    keras/src/trainers/compile_utils.py): each output's loss metric is
    updated with `sample_weight=y_pred.shape[0]`, the STATIC batch size,
    which is None inside a traced step whose batch size varies; each
    replica's mean then counts once, whatever its rows, so with uneven rows
    per replica the logs are the unweighted mean of per-replica means (the
    total `loss` log uses the dynamic `tf.shape`). Here each of those
    metrics takes the rows `unscaled_mean_loss` is computing the loss of
    instead. The metrics exist once `CompileLoss` is built, which may
    happen inside the first `_compute_loss`; idempotent.
    """
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None or getattr(compile_loss, "_kh_rows", False):
        return
    compile_loss._kh_rows = True

    def weight_by_rows():
        for metric in compile_loss.metrics:
            metric.update_state = _rows_as_weight(metric.update_state)

    if compile_loss.built:
        weight_by_rows()
        return
    build = compile_loss.build

    def build_then_weight(*args, **kwargs):
        result = build(*args, **kwargs)
        weight_by_rows()
        return result

    compile_loss.build = build_then_weight


def _rows_as_weight(update_state):
    def update(values, sample_weight=None):
        rows = getattr(_replica_rows, "value", None)
        return update_state(
            values, sample_weight=sample_weight if rows is None else rows
        )

    return update


def update_metrics(model, x, y, y_pred, sample_weight):
    """Updates the compiled metrics with this replica's rows."""
    if IS_LEGACY:
        model.compiled_metrics.update_state(y, y_pred, sample_weight)
    else:
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _already_aggregated(grads_and_vars):
    return list(grads_and_vars)


def skip_optimizer_all_reduce(optimizer, strategy):
    """Makes this Keras 3 optimizer instance apply gradients as given.

    Keras 3's TF optimizer always SUM-all-reduces gradients in replica context
    (`TFOptimizer._all_reduce_sum_gradients`, no opt-out flag). HeteroModel's
    gradients are already aggregated (and clipped after aggregation), so the
    optimizer it compiles with must not sum them again. The override is on
    this instance only and is idempotent. (A context manager around each call
    is not enough: MirroredStrategy traces replicas in parallel threads.)
    """
    if IS_LEGACY:
        if (
            isinstance(optimizer, _TFOptimizer)
            and strategy.num_replicas_in_sync > 1
        ):
            # A `tf.compat.v1` optimizer's `apply_gradients` always sums the
            # gradients across replicas (no opt-out): a second sum.
            raise ValueError(
                "Invalid value for argument `optimizer`. Received: "
                f"optimizer={optimizer!r} (a `tf.compat.v1` optimizer) under "
                f"{type(strategy).__name__} with "
                f"{strategy.num_replicas_in_sync} replicas. Such optimizers "
                "sum gradients across replicas themselves, after HeteroModel "
                "has. Use a Keras optimizer (e.g. `keras.optimizers.SGD`)."
            )
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not hasattr(type(inner), "_all_reduce_sum_gradients"):
        raise RuntimeError(
            "keras_hetero cannot skip the optimizer's gradient all-reduce on "
            f"Keras {KERAS_VERSION}: `{type(inner).__name__}` has no "
            "`_all_reduce_sum_gradients`. Install a Keras version within the "
            "range pinned by keras-hetero."
        )
    inner._all_reduce_sum_gradients = _already_aggregated


def apply_aggregated_gradients(optimizer, grads, variables):
    """Applies gradients that are already summed across replicas."""
    grads_and_vars = list(zip(grads, variables))
    if IS_LEGACY:
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if isinstance(optimizer, _TFOptimizer) or replicas == 1:
            # Nothing to skip: one replica, or a `tf.compat.v1` optimizer
            # (which takes no flag; more replicas are refused at compile).
            # Also where tf-keras' legacy optimizers refuse the flag
            # (`experimental_aggregate_gradients=False is not supported for
            # ParameterServerStrategy`: each worker steps alone there).
            optimizer.apply_gradients(grads_and_vars)
        elif isinstance(optimizer, keras.optimizers.legacy.Optimizer):
            optimizer.apply_gradients(
                grads_and_vars, experimental_aggregate_gradients=False
            )
        else:
            optimizer.apply_gradients(
                grads_and_vars, skip_gradients_aggregation=True
            )
        return
    # `skip_optimizer_all_reduce` ran at compile time.
    optimizer.apply_gradients(grads_and_vars)


def is_loss_scale_optimizer(optimizer):
    if IS_LEGACY:
        return isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def all_layers(model):
    """Every layer inside `model`, nested models' layers included."""
    seen, stack = [], list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop()
        if any(layer is s for s in seen):
            continue
        seen.append(layer)
        stack.extend(getattr(layer, "layers", []) or [])
    return seen


def atomic_variable_updates():
    """Keras 3: `assign_add` / `assign_sub` as one TensorFlow op.

    Upstream (Keras 3.15, keras/src/backend/common/variables.py):
    `Variable.assign_add(v)` is `assign(self + v)`, a read then a write. Under
    ParameterServerStrategy several workers update the same variable on a
    parameter server at once, and such updates get lost (measured: 9 of 10
    optimizer `iterations` counted, metric totals short). TensorFlow's own
    `assign_add` is atomic on the variable's device. Installed when a
    HeteroModel first trains under ParameterServerStrategy; stateless
    scopes keep Keras' path. tf-keras variables are TensorFlow's already.
    """
    if IS_LEGACY:
        return
    from keras.src.backend.common import stateless_scope
    from keras.src.backend.tensorflow import core

    cls = core.Variable
    if getattr(cls, "_keras_hetero_atomic", False):
        return

    def updater(name, keras_method):
        def update(self, value):
            if stateless_scope.in_stateless_scope():
                return keras_method(self, value)
            value = self._convert_to_tensor(value, dtype=self._dtype)
            return getattr(self._value, name)(tf.cast(value, self._value.dtype))

        return update

    cls.assign_add = updater("assign_add", cls.assign_add)
    cls.assign_sub = updater("assign_sub", cls.assign_sub)
    cls._keras_hetero_atomic = True


def steps_per_execution(model):
    """The model's `steps_per_execution` as an int."""
    value = getattr(
        model, "_steps_per_execution" if IS_LEGACY else "steps_per_execution", 1
    )
    if hasattr(value, "numpy"):
        value = value.numpy()
    return int(value or 1)


def jit_compiled(model):
    """Whether the model's train step is compiled with XLA."""
    if IS_LEGACY:
        return bool(getattr(model, "_jit_compile", False))
    return bool(getattr(model, "jit_compile", False))


def fix_synchronized_batch_norm(model):
    """tf-keras only: synchronized BatchNormalization on a replica with no
    rows still updates its moving statistics.

    Upstream (tf-keras 2.21, `BatchNormalizationBase._support_zero_size_input`
    and `_assign_moving_average`): under a strategy with partial batches a
    replica whose LOCAL batch is empty skips the moving-average update even
    when the statistics are synchronized (global, valid). The moving
    statistics are ON_READ MEAN, so the read then averages in a stale copy:
    with shares [1, 0] they come out halved. Keras 3 has no such skip.
    """
    if not IS_LEGACY:
        return
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(
            layer, "synchronized", False
        ):
            # An instance attribute: only this model's layers change.
            object.__setattr__(layer, "_support_zero_size_input", _no)


def _no():
    return False


def build_optimizer(model):
    """Creates the optimizer's variables now if no step has yet.

    Returns:
        The optimizer (or None).
    """
    optimizer = model.optimizer
    if optimizer is not None:
        built = getattr(optimizer, "built", None)  # Keras 3
        if built is None:  # tf-keras; its legacy optimizers cannot build
            built = getattr(optimizer, "_built", False) or not hasattr(
                optimizer, "build"
            )
        inside_run = (
            tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context()
        )
        if not built and inside_run:
            # A lazily built model's first XLA trace, inside `strategy.run`:
            # in the strategy's scope already, which a replica context
            # cannot enter again ("Method requires being in cross-replica
            # context", e.g. under OneDeviceStrategy).
            optimizer.build(model.trainable_variables)
        elif not built:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
    return optimizer


def checkpoint_variables(model):
    """Every variable a checkpoint must hold: model state, then optimizer.

    Builds the optimizer's variables first if it has not run a step yet, so
    a restore before the first step has somewhere to put the slots.

    Returns:
        `(names, variables)`, in a stable order for the same model code.
    """
    optimizer = build_optimizer(model)
    variables = list(model.variables)
    if optimizer is not None:
        extra = optimizer.variables
        variables += list(extra() if callable(extra) else extra)
    own = getattr(model, "_hetero_variables", None)
    if own is not None:  # loss scale, gradient accumulator
        variables += own()
    variables += random_generator_states(model)
    unique, seen = [], set()
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    names = [getattr(v, "path", None) or v.name for v in unique]
    return names, unique


def random_generator_states(model):
    """tf-keras: the state variables of the layers' `tf.random.Generator`s.

    Keras 3 random layers (Dropout, GaussianNoise, RandomFlip, ...) keep
    their `SeedGenerator` state in `model.variables`, so a checkpoint has it
    already. tf-keras layers draw through a `backend.RandomGenerator`
    (`layer._random_generator`). By default ("legacy_stateful") it calls TF1
    stateful random ops, whose state lives inside the op kernel: no
    checkpoint can hold it, and a restarted process draws the first step's
    numbers again. After `tf.keras.backend.experimental
    .enable_tf_random_generator()` it holds a `tf.random.Generator` whose
    state is a variable, but one that tf-keras leaves out of
    `model.variables` and creates lazily at the first call; this creates
    it (in the model's strategy scope, as the first call would) and returns
    it.

    Returns:
        A list of state variables (empty under Keras 3).
    """
    if not IS_LEGACY:
        return []
    states = []
    for _, generator in _random_generators(model, "stateful"):
        with model.distribute_strategy.scope():
            generator._maybe_init()
        inner = getattr(generator, "_generator", None)
        if inner is not None:
            states.append(inner.state)
    return states


def unsaved_random_layers(model):
    """tf-keras: names of the layers whose random state no checkpoint holds.

    Those are the layers drawing through TF1 stateful random ops, tf-keras'
    default (`backend.RandomGenerator` with rng type "legacy_stateful"; see
    `random_generator_states`): a restarted process draws the first step's
    numbers again. Keras 3 keeps every random layer's state in a variable.

    Returns:
        A list of layer names (empty under Keras 3).
    """
    if not IS_LEGACY:
        return []
    return [
        layer.name for layer, _ in _random_generators(model, "legacy_stateful")
    ]


def _random_generators(model, rng_type):
    """tf-keras: `(layer, layer._random_generator)` of the layers whose
    `backend.RandomGenerator` has `rng_type`."""
    for layer in all_layers(model):
        generator = getattr(layer, "_random_generator", None)
        if getattr(generator, "_rng_type", None) == rng_type:
            yield layer, generator


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
    """
    if not IS_LEGACY:
        raise StopIteration


# Keras 3 warns when a dataset ends before the epoch's step count; a resumed
# epoch ends early on purpose (its first steps ran before the restart).
RAN_OUT_OF_DATA = "Your input ran out of data"


class Keras3TrainerOverrides:
    """Small replacements for Keras 3 TF-trainer internals.

    Mixed into `HeteroModel` on Keras 3 only. tf-keras needs none of them.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3.10-3.15 reduce the first distributed batch with
        # `strategy.reduce("MEAN", batch, axis=None)` to build the model. That
        # fails for uneven per-replica shapes (AddN shape mismatch) and under
        # MultiWorkerMirroredStrategy ("Attempt to convert a value
        # (PerReplica...)"). Building only needs shapes: take replica 0's part,
        # with the batch dimension unknown (replica 0 may have 0 rows).
        # It also pulls that batch from an extra iterator: an extra pass over
        # the input (and a HeteroDataset pass that trains nothing). The
        # distributed dataset's element spec has the shapes without reading.
        if self._distribute_strategy is None:
            return
        spec = _first_local_spec(iterator)
        if spec is not None:
            data_batch = tf.nest.map_structure(_unbatched_spec, spec)
        elif iterator is not None:
            for entry in iterator:
                it = entry[2] if EPOCH_ITERATOR_YIELDS_STEP_RANGE else entry[1]
                data_batch = next(it)
                break
            data_batch = tf.nest.map_structure(
                _unbatched_spec,
                first_local_values(self.distribute_strategy, data_batch),
            )
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def _make_function(self, step_function):
        # Keras 3.10-3.15 reduce step outputs with `reduce_per_replica(...,
        # "auto")`, which under MultiWorkerMirroredStrategy calls
        # `strategy.reduce("MEAN", v, axis=0)` on scalar logs and fails with
        # "Invalid reduction dimension 0" (tensorflow#72388). HeteroModel's
        # steps return logs that are already global and identical on every
        # replica, so replica 0's copy is the answer; everything else is
        # Keras' own function (tf.function, jit_compile, steps_per_execution).
        # Under a strategy XLA compiles each replica's step (as tf-keras
        # does), not the whole `strategy.run`: Keras 3.15 compiles the
        # latter, which cannot reach variables on any device but the first
        # ("Trying to access resource ... located in device CPU:1"), e.g.
        # under OneDeviceStrategy("/cpu:1"). Without a strategy, Keras' own
        # structure. XLA cannot lift variables created inside HeteroModel's
        # step, so the optimizer's are created first.
        strategy = self.distribute_strategy
        jit = bool(self.jit_compile) and not self.run_eagerly
        per_replica = jit and self._distribute_strategy is not None
        replica_step = step_function
        if jit and self.built:
            build_optimizer(self)
        if per_replica:
            replica_step = tf.function(
                step_function, reduce_retracing=True, jit_compile=True
            )

        # Not autograph-converted, as in Keras: the user's errors (say a
        # metric name that does not exist) keep their own type.
        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            outputs = strategy.run(replica_step, args=(data,))
            return first_local_values(strategy, outputs)

        looped_step = one_step_on_data
        if not self.run_eagerly:
            one_step_on_data = tf.function(
                one_step_on_data,
                reduce_retracing=True,
                jit_compile=jit and not per_replica,
            )
            if self._distribute_strategy is None:
                looped_step = one_step_on_data
        if CONVERTS_OPTIONAL_INPUTS:
            one_step_on_data = self._autoconvert_optionals(one_step_on_data)
            looped_step = self._autoconvert_optionals(looped_step)
        steps_per_execution = int(self.steps_per_execution)

        @tf.autograph.experimental.do_not_convert
        def multi_step_on_iterator(iterator):
            # Keras 3.15's loop (Apache-2.0), unchanged but for the reduction
            # above and `looped_step`: run up to `steps_per_execution` steps
            # while data lasts, never fetching a batch that the next call
            # should get. Under a strategy the step is traced inline here:
            # a nested tf.function around `strategy.run` (Keras' structure)
            # or around the replica function (which MirroredStrategy wraps
            # in one) called in this tf.cond inside tf.while_loop fails at
            # run time with "You must feed a value for placeholder tensor
            # 'while/cond/Placeholder'" (measured on TF 2.21, MirroredStrategy
            # with 2 replicas; stock Keras 3.15 fails this way). The distributed
            # Optional passed through the loop is fine.
            if steps_per_execution == 1:
                return tf.experimental.Optional.from_value(
                    one_step_on_data(iterator.get_next())
                )
            empty_outputs = tf.experimental.Optional.empty(None)

            def cond(step, optional_outputs, next_inputs):
                return tf.logical_and(
                    tf.less(step, steps_per_execution), next_inputs.has_value()
                )

            def body(step, optional_outputs, next_inputs):
                def has_next():
                    outputs = tf.experimental.Optional.from_value(
                        looped_step(next_inputs.get_value())
                    )
                    empty_outputs._element_spec = outputs.element_spec
                    return outputs

                def no_has_next():
                    optional_outputs._element_spec = empty_outputs._element_spec
                    return optional_outputs

                outputs = tf.cond(
                    tf.logical_and(
                        tf.less(step, steps_per_execution),
                        next_inputs.has_value(),
                    ),
                    has_next,
                    no_has_next,
                )
                return (
                    step + 1,
                    outputs,
                    tf.cond(
                        tf.less(step + 1, steps_per_execution),
                        lambda: iterator.get_next_as_optional(),
                        lambda: next_inputs,
                    ),
                )

            _, outputs, _ = tf.while_loop(
                cond,
                body,
                loop_vars=[
                    tf.constant(0),
                    empty_outputs,
                    iterator.get_next_as_optional(),
                ],
            )
            outputs._element_spec = empty_outputs.element_spec
            return outputs

        if not self.run_eagerly:
            multi_step_on_iterator = tf.function(
                multi_step_on_iterator, reduce_retracing=True
            )

        def function(iterator):
            if isinstance(
                iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
            ):
                outputs = multi_step_on_iterator(iterator)
                if not outputs.has_value():
                    raise StopIteration
                return outputs.get_value()
            outputs = None
            for _, data in zip(range(steps_per_execution), iterator):
                outputs = one_step_on_data(data)
            return outputs

        return function


def first_local_values(strategy, structure):
    """Replaces distributed values in `structure` by their first local part."""

    def first(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(first, structure)


def _first_local_spec(iterator):
    """Replica 0's element spec of a Keras epoch iterator's dataset, or None."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None

    def first(value):
        parts = getattr(value, "_value_specs", None)
        return parts[0] if parts else value

    # A PerReplicaSpec (one spec per local replica) is a leaf of tf.nest.
    return tf.nest.map_structure(first, spec)


def _unbatched_spec(value):
    if value is None:
        return None
    return tf.TensorSpec([None, *value.shape[1:]], value.dtype)


class _NoTrainerOverrides:
    """tf-keras needs no trainer overrides."""


TrainerOverrides = _NoTrainerOverrides if IS_LEGACY else Keras3TrainerOverrides


def class_weight_map_fn(class_weight):
    """Keras' own `class_weight` -> sample weights map for dataset batches.

    `fit(dataset, class_weight=...)` maps the dataset with it; a
    distributed dataset has no `map` (both flavours fail with
    "'DistributedDatasetsFromFunction' object has no attribute 'map'"), so
    a HeteroDataset applies it itself. Keras 3 refuses `class_weight` with
    sample weights in the data and gives classes missing from the dict the
    weight 1; tf-keras multiplies them and wants every class a key.
    """
    if IS_LEGACY:
        return _data_adapter._make_class_weight_map_fn(class_weight)
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    return tf_dataset_adapter.make_class_weight_map_fn(class_weight)


def array_class_weights(y, sample_weight, class_weight):
    """Per-example weights for array input, as each flavour's `fit` makes
    them from `class_weight` (Keras 3: `class_weight_to_sample_weights`,
    an error together with `sample_weight`; tf-keras: its dataset map on
    the arrays, multiplied with `sample_weight`)."""
    if IS_LEGACY:
        tensor = tf.convert_to_tensor(y)
        data = (
            (tensor, tensor)
            if sample_weight is None
            else (
                tensor,
                tensor,
                tf.convert_to_tensor(sample_weight),
            )
        )
        _, _, weights = class_weight_map_fn(class_weight)(*data)
        return weights.numpy()
    if sample_weight is not None:
        raise ValueError(
            "You cannot `class_weight` and `sample_weight` at the same time."
        )
    return _data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def global_shuffle(examples, seed):
    """`examples` in a random-access shuffled order: a function of `seed`
    (and the graph-level seed) only.

    tf.data's global shuffle (TF >= 2.15) maps output position `j` to input
    index `perm(j)` without a buffer; it is public only as the private
    `global_shuffle_op._global_shuffle` in TF 2.19-2.21 (TODO(b/325112575)
    upstream: "Move the API to dataset_ops.py"). Its order is the same on
    TF 2.19 and 2.21 (measured). It needs every upstream stage to support
    random access (`supports_random_access`).
    """
    from tensorflow.python.data.experimental.ops import global_shuffle_op

    return global_shuffle_op._global_shuffle(
        examples, seed=seed, reshuffle_each_iteration=False
    )


def supports_random_access(examples):
    """Whether `global_shuffle(examples, ...)` can run.

    There is no public query; the op refuses unsupported upstream stages
    (`filter`, `shuffle`, `unbatch`, `from_generator`, `TFRecordDataset`,
    ...) with a `FailedPreconditionError` when its iterator starts, or at
    the first element (`enumerate`; an upstream stage of unknown length
    under `take`: `InvalidArgumentError`), so we start one and read one
    element (which runs the upstream stages for that element once).
    """
    with tf.init_scope():  # also when called while a pipeline is traced
        try:
            next(iter(global_shuffle(examples, 0)))
        except (
            tf.errors.FailedPreconditionError,
            tf.errors.InvalidArgumentError,
            tf.errors.UnimplementedError,
        ):
            return False
        except (StopIteration, tf.errors.OutOfRangeError):
            pass  # no examples: nothing to read
    return True


class _KnownLength(tf.data.Dataset):
    """`dataset` whose `cardinality()` reports `length` (see
    `with_known_length`)."""

    def __init__(self, dataset, length):
        self._dataset = dataset
        self._length = int(length)
        super().__init__(tf.data.experimental.to_variant(dataset))

    def _inputs(self):
        return [self._dataset]

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def cardinality(self):
        return tf.constant(self._length, tf.int64)


def with_known_length(dataset, length):
    """`dataset`, reporting `length` elements to Keras.

    Keras reads a dataset's length from `cardinality()`; an input pipeline
    built per pass (`flat_map`) reports "unknown", and Keras 3 then takes
    the length of the first epoch it sees. A resumed epoch is short on
    purpose (its first steps ran before a restart), so every later epoch
    would be cut to its length. Multi-replica strategies return a
    distributed dataset whose `_cardinality` we set; one replica (the
    default strategy) returns the dataset itself, hence this wrapper.
    `tf.data.experimental.assert_cardinality` would fail the short epoch.
    """
    return _KnownLength(dataset, length)


def dataset_graph(dataset):
    """The `GraphDef` of a `tf.data.Dataset`'s pipeline, with the bodies of
    its functions (`map`, `filter`, ...) in `graph.library`.

    tf.data has no public way to inspect a pipeline's stages; the private
    `Dataset._as_serialized_graph` (the same call `tf.data.experimental.
    service` and snapshotting use, unchanged in TF 2.19-2.21) serializes it.
    Stages with Python state (`from_generator`, `py_function`) would make it
    warn; the policy `IGNORE` keeps it quiet, since we only read the graph.
    It copies constants captured in the pipeline (`from_tensor_slices` of
    numpy arrays): ~3 s for 400 MB here, and it fails above protobuf's 2 GB.
    """
    from tensorflow.core.framework import graph_pb2

    serialized = dataset._as_serialized_graph(
        external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE
    )
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(serialized.numpy())
    return graph


# Keras 3 metrics compute their results from given values (`StatelessScope`),
# so their replicas' sums can travel in a collective the step already makes.
# tf-keras metrics read their variables directly.
PACKS_METRICS = not IS_LEGACY


def local_metric_values(model):
    """This replica's values of the metric variables that combine replicas.

    Keras 3 only (`PACKS_METRICS`). A SUM of them across replicas, given to
    `metrics_result_from`, gives what a cross-replica read would.

    Returns:
        `(variables, values)`: lists of the same length.
    """
    context = tf.distribute.get_replica_context()
    first = context.replica_id_in_sync_group == 0
    variables, values = [], []
    for variable in model.metrics_variables:
        if variable.aggregation not in ("sum", "mean", "only_first_replica"):
            continue
        # On this replica's device: a read is colocated with its variable,
        # which may name no device ("destinations can not be empty").
        value = tf.identity(variable.value)
        if variable.aggregation == "only_first_replica":
            value = value * tf.cast(first, value.dtype)
        variables.append(variable)
        values.append(value)
    return variables, values


def metrics_result_from(model, variables, sums):
    """`model.get_metrics_result()` with `variables` read as `sums`."""
    context = tf.distribute.get_replica_context()
    values = []
    for variable, value in zip(variables, sums):
        if variable.aggregation == "mean":
            value = value / tf.cast(context.num_replicas_in_sync, value.dtype)
        values.append(value)
    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
        return model.get_metrics_result()


def global_metrics_result(model):
    """`model.get_metrics_result()` over all replicas, in replica context.

    Metric variables are ON_READ: each replica holds its own sums. Read in
    cross-replica context (a `merge_call`), TensorFlow reduces each variable
    on its own, one collective per variable under multi-worker strategies
    (`SyncOnReadVariable._get_cross_replica`). With Keras 3 all local values
    travel in ONE batched all-reduce instead and the results are computed
    from the sums; with tf-keras the `merge_call` stays.
    """
    context = tf.distribute.get_replica_context()
    if not PACKS_METRICS:
        return context.merge_call(lambda _: model.get_metrics_result())
    variables, values = local_metric_values(model)
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
    return metrics_result_from(model, variables, sums)


# --- TensorFlow graph internals ----------------------------------------------

_TIMESTAMPS = {}  # dtype of the dependency -> the traced `_timestamp_after`


def _timestamp_after(dependency):
    with tf.control_dependencies([dependency]):
        return tf.timestamp()


def unordered_timestamp(dependency):
    """`tf.timestamp()` once `dependency` (a tensor) is computed, in-graph.

    Automatic control dependencies (tensorflow/python/framework/
    auto_control_deps.py, `last_write_to_resource[None]`) chain every
    stateful op without resource inputs in program order, so plain
    `tf.timestamp` calls in the replicas' steps would run replica after
    replica (a step's replicas are traced one after another). A stateless
    `PartitionedCall` of a function holding the Timestamp is not chained: a
    native kernel, with no host callback (`numpy_function` costs a Python
    call and the GIL per reading). Grappler inlines the call; the
    Timestamp inside still waits for `dependency` and for the call's
    control inputs.
    """
    function = _TIMESTAMPS.get(dependency.dtype)
    if function is None:
        function = tf.function(_timestamp_after, autograph=False)
        function = function.get_concrete_function(
            tf.TensorSpec(None, dependency.dtype)
        )
        _TIMESTAMPS[dependency.dtype] = function
    function.add_to_graph(tf.compat.v1.get_default_graph())
    (value,) = tf.raw_ops.PartitionedCall(
        args=[dependency],
        Tout=[tf.float64],
        f=function.function_def.signature.name,
    )
    value.set_shape([])
    return value


# --- tf.distribute internals -------------------------------------------------
# TensorFlow has no public way to ask these; each is unchanged in TF
# 2.19-2.21 (tests/test_compat_versions.py runs them on the oldest tested).


def in_multi_worker_mode(strategy):
    """Whether a MultiWorkerMirroredStrategy spans several workers (one
    whose TF_CONFIG names a single worker, or none, runs as one process);
    the strategy's private `extended._in_multi_worker_mode()`."""
    return strategy.extended._in_multi_worker_mode()


def parameter_server_num_workers(strategy):
    """The workers of a ParameterServerStrategy (its private
    `extended._num_workers`; the cluster resolver also counts tasks that
    are not workers)."""
    return strategy.extended._num_workers


def coordinator_workers(coordinator):
    """A `ClusterCoordinator`'s worker objects (private `_cluster.workers`),
    each with `worker_index` and `create_resource`."""
    return coordinator._cluster.workers


def per_worker_values(values):
    """A `PerWorkerValues` of one resource per worker, for
    `ClusterCoordinator.schedule` arguments (the class is not exported)."""
    from tensorflow.python.distribute.coordinator import values as lib

    return lib.PerWorkerValues(tuple(values))


def set_steps_of_distributed_dataset(distributed, steps):
    """Makes Keras read `steps` as a distributed dataset's length.

    TF reports a worker pipeline's element count (one per LOCAL replica per
    global batch) as the distributed dataset's cardinality, stored in its
    private `_cardinality`, which Keras reads as steps per epoch.
    """
    distributed._cardinality = steps


def set_coordination_value(key, value):
    """Puts `key` in the coordination service's key-value store (running in
    every multi-worker job; `tf.distribute` has no public access).
    Raises if there is no coordination service."""
    from tensorflow.python.eager import context

    context.context().set_config_key_value(key, value)


def delete_coordination_value(key):
    """Removes `key` from the coordination service's store."""
    from tensorflow.python.eager import context

    context.context().delete_config_key_value(key)


def has_coordination_value(key, timeout_ms):
    """Whether `key` is in the coordination service's store (waits up to
    `timeout_ms`); False without a coordination service."""
    from tensorflow.python.eager import context

    try:
        context.context().get_config_key_value(key, timeout_in_ms=timeout_ms)
        return True
    except Exception:  # not there in time, or no coordination service
        return False


def inbound_nodes(layer):
    """The nodes of `layer`'s calls on symbolic tensors (private
    `_inbound_nodes` in both flavours; Keras has no public graph walk of a
    model's layers), each with `input_tensors` and `output_tensors`."""
    return getattr(layer, "_inbound_nodes", None) or []


def has_learning_rate_schedule(optimizer):
    """Whether `optimizer`'s learning rate is a `LearningRateSchedule`.
    Both flavours keep the schedule in the private `_learning_rate`; the
    public `learning_rate` is its current value."""
    return isinstance(
        getattr(optimizer, "_learning_rate", None),
        keras.optimizers.schedules.LearningRateSchedule,
    )
