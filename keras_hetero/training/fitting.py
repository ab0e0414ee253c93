"""What `HeteroModel.fit`, `evaluate` and `predict` do around Keras' own:
the strategy checks, arrays and `kh.data.shard` datasets turned into what
Keras takes, keras-hetero's callbacks prepared, low-communication rounds
ended where every replica must hold the same weights. Under
ParameterServerStrategy each goes to `training.parameter_server` instead.

Each function takes the model and Keras' own method (`super().fit` and so
on) and returns what that returns.
"""

import tensorflow as tf

from keras_hetero import _callback_protocol
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero import _phases
from keras_hetero import precision as precision_lib
from keras_hetero.data import arrays
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.training import agreement
from keras_hetero.training import batch_statistics
from keras_hetero.training import epochs
from keras_hetero.training import keras_callbacks
from keras_hetero.training import loss_scale as loss_scale_lib
from keras_hetero.training import low_communication
from keras_hetero.training import parameter_server
from keras_hetero.training import runtime
from keras_hetero.training import state
from keras_hetero.training import step
from keras_hetero.training import stopping
from keras_hetero.training import telemetry


def fit(model, keras_fit, x, y, args, kwargs):
    """`model.fit(x, y, *args, **kwargs)`, Keras' `fit` being `keras_fit`."""
    check_strategy(model, "fit")
    # Keras' own file-writing callbacks write from the chief only.
    undo_keras = keras_callbacks.prepare(model, kwargs.get("callbacks"))
    try:
        if isinstance(kwargs.get("callbacks"), (list, tuple)):
            kwargs["callbacks"] = _callback_protocol.observers_last(
                kwargs["callbacks"]
            )
        if _distribute.is_parameter_server(model.distribute_strategy):
            return parameter_server.fit(
                runtime.parameter_server(model), x, y, args, kwargs
            )
        return _fit(model, keras_fit, x, y, args, kwargs)
    finally:
        undo_keras()


def _fit(model, keras_fit, x, y, args, kwargs):
    converted = arrays.fit_arguments(model, x, y, args, kwargs)
    if converted is not None:
        x, y, args, kwargs = converted.pop("x"), None, (), converted
    arguments = agreement.fit_arguments(kwargs)
    dataset = x
    class_weight = None
    repeat = False
    if isinstance(x, HeteroDataset):
        # Applied by the HeteroDataset: Keras would `.map` the distributed
        # dataset, which has no `map`.
        class_weight = kwargs.pop("class_weight", None)
        # Global batches keep their order; shuffle the examples instead.
        kwargs.setdefault("shuffle", False)
        if _compat.REPEATS_DISTRIBUTED_INPUT:
            kwargs.setdefault("steps_per_epoch", x.num_batches)
            if kwargs["steps_per_epoch"] is None:
                raise ValueError(
                    "The examples passed to `kh.data.shard` have an unknown "
                    "length. Pass `steps_per_epoch=` to `fit` (global "
                    "batches per epoch) under tf-keras."
                )
        # One iterator for the whole `fit` where the epochs stay the same.
        repeat = epochs.repeats_sharded_input(model, x, kwargs)
    # Before anything else communicates: a setting that differs between
    # workers raises here on every worker instead of hanging a collective.
    agreement.check_fit(model, x, arguments)
    _phases.mark(_phases.IN_FIT)
    batch_statistics.check_batch_normalization(
        model, dataset, kwargs.get("callbacks")
    )
    batch_statistics.check_microbatch_statistics(model)
    _compat.fix_synchronized_batch_norm(model)
    x = as_input(model, x, repeat=repeat, class_weight=class_weight)
    validation = kwargs.get("validation_data")
    if isinstance(validation, HeteroDataset):
        if _compat.REPEATS_DISTRIBUTED_INPUT:
            kwargs.setdefault("validation_steps", validation.num_batches)
        kwargs["validation_data"] = as_input(model, validation)
    run = state.run_state(model)
    if run.telemetry is not None:
        run.telemetry.reset()
    undo = _callback_protocol.prepare_fit(
        model, dataset, kwargs.get("callbacks"), kwargs
    )
    local = runtime.local_training(model) if model.built else None
    if local is not None:
        # Evaluation, checkpoints and the end of the epoch see the same
        # weights on every replica: the round ends early there.
        kwargs["callbacks"] = [
            low_communication.SynchroniseAtEpochEnd(local),
            *list(kwargs.get("callbacks") or []),
        ]
    try:
        history = keras_fit(x, y, *args, **kwargs)
    finally:
        undo()
    if local is not None:
        local.maybe_synchronise(force=True)
    return history


def evaluate(model, keras_evaluate, x, y, args, kwargs):
    """`model.evaluate(...)`, Keras' `evaluate` being `keras_evaluate`."""
    check_strategy(model, "evaluate")
    if _distribute.is_parameter_server(model.distribute_strategy):
        return parameter_server.evaluate(
            runtime.parameter_server(model), x, y, args, kwargs
        )
    local = state.run_state(model).local_training
    if local is not None:
        # The replicas' weights differ until the round ends.
        local.maybe_synchronise(force=True)
    converted = arrays.evaluate_arguments(model, x, y, args, kwargs)
    if converted is not None:
        x, y, args, kwargs = converted.pop("x"), None, (), converted
    _default_steps(x, args, kwargs)
    return keras_evaluate(as_input(model, x), y, *args, **kwargs)


def predict(model, keras_predict, x, args, kwargs):
    """`model.predict(...)`, Keras' `predict` being `keras_predict`."""
    check_strategy(model, "predict")
    if _distribute.is_parameter_server(model.distribute_strategy):
        return parameter_server.predict(
            runtime.parameter_server(model), x, args, kwargs
        )
    converted = arrays.predict_arguments(model, x, args, kwargs)
    if converted is not None:
        x, args, kwargs = converted.pop("x"), (), converted
    if isinstance(x, HeteroDataset) and x.reads == "service":
        raise ValueError(
            "`predict` over a tf.data service input "
            "(`kh.data.shard(service=...)`) would return the predictions "
            "in the order the workers received the examples, not theirs. "
            "Predict over `kh.data.shard(examples, ...)` without `service`."
        )
    _default_steps(x, args, kwargs)
    return keras_predict(as_input(model, x), *args, **kwargs)


def _default_steps(x, args, kwargs):
    """tf-keras repeats a distributed input: it needs the step count."""
    if isinstance(x, HeteroDataset) and _compat.REPEATS_DISTRIBUTED_INPUT:
        if x.num_batches is not None and not args:
            kwargs.setdefault("steps", x.num_batches)


def check_strategy(model, method):
    """Refuses, before anything runs, a strategy `model.method()` cannot
    run under.

    Raises:
        ValueError: For XLA with replicas on CPUs, or a call inside the
            scope of another strategy than the model's.
    """
    strategy = model.distribute_strategy
    if (
        method in ("fit", "evaluate")
        and _compat.jit_compiled(model)
        and _distribute.cpu_replicas(strategy)
    ):
        raise ValueError(
            f"`{model.name}.{method}()` with `jit_compile=True` under "
            f"{type(strategy).__name__} with "
            f"{strategy.num_replicas_in_sync} replicas on "
            "CPU devices: TensorFlow cannot compile the cross-replica "
            'all-reduce for CPUs with XLA ("Collectives are not yet '
            'implemented for CPU devices when compiling with XLA", '
            "b/194942685). Compile with `jit_compile=False`, or use one "
            "replica (no strategy, OneDeviceStrategy) or GPUs."
        )
    current = tf.distribute.get_strategy()
    created = _compat.model_strategy(model)
    if tf.distribute.has_strategy() and current is not created:
        raise ValueError(
            f"`{model.name}.{method}()` was called inside the scope of "
            f"{type(current).__name__}, but the model was created "
            + (
                "outside any strategy scope"
                if created is None
                else f"under {type(created).__name__}"
            )
            + ". Create (and compile) the model inside `with "
            "strategy.scope():` of the strategy you train with."
        )


def as_input(model, x, repeat=False, class_weight=None):
    """`x` as Keras takes it: a `kh.data.shard` dataset becomes its
    distributed dataset (checked to be sharded for the model's strategy);
    anything else is unchanged.

    Raises:
        ValueError: For a HeteroDataset sharded for another strategy.
    """
    if not isinstance(x, HeteroDataset):
        return x
    strategy = model.distribute_strategy
    if x.strategy is not strategy and type(x.strategy) is type(strategy):
        raise ValueError(
            "Invalid value for argument `x`: a HeteroDataset sharded for "
            f"another {type(strategy).__name__} instance "
            f"({x.num_replicas} replicas) than the one `{model.name}` runs "
            f"under ({strategy.num_replicas_in_sync} replicas): the split "
            "is bound to the strategy object. Pass "
            "`strategy=model.distribute_strategy` to `kh.data.shard` (or "
            "call it inside the model's `strategy.scope()`)."
        )
    if x.strategy is not strategy:
        raise ValueError(
            "Invalid value for argument `x`: a HeteroDataset sharded for "
            f"{type(x.strategy).__name__} ({x.num_replicas} replicas), "
            f"but `{model.name}` runs under {type(strategy).__name__} "
            f"({strategy.num_replicas_in_sync} replicas). Pass "
            "`strategy=` to `kh.data.shard` (or call it inside the "
            "model's `strategy.scope()`)."
        )
    distributed = x.as_distributed_dataset(
        repeat=repeat, class_weight=class_weight
    )
    # No per-step "does every replica have data" collective: every replica
    # gets an element for every global batch (maybe with no rows), so all
    # run out at the same step. One round trip less per step under
    # MultiWorkerMirroredStrategy; low-communication inner steps then run
    # no collective at all.
    return _compat.without_partial_batch_check(distributed)


def make_train_function(model, keras_make_train_function, force):
    """HeteroModel's `make_train_function`: Keras' own (passed in), with
    the step's telemetry, the accumulator and the low-communication state
    set up first, and timed (`step.timed_train_function`)."""
    if model.train_function is not None and not force:
        return model.train_function
    strategy = model.distribute_strategy
    run = state.run_state(model)
    if run.telemetry is None and not _distribute.is_parameter_server(strategy):
        run.telemetry = telemetry.Telemetry(
            strategy,
            _distribute.global_replica_devices(strategy),
            waits=model.hetero_settings.low_communication is not None,
            carries_stop=stopping.carries_requests(
                strategy, model.hetero_settings
            ),
        )
    if model.built:  # else its first trace builds the model and sums
        runtime.accumulator(model)
    if model.hetero_settings.low_communication is not None:
        low_communication.check_model(model)
        runtime.local_training(model)
    keras_make_train_function(force=force)
    model.train_function = step.timed_train_function(
        model, model.train_function
    )
    return model.train_function


def compile_model(model, keras_compile, args, kwargs):
    """HeteroModel's `compile`: Keras' (`keras_compile`), then the
    optimizer HeteroModel steps with (Keras' loss-scale wrapper taken off,
    no all-reduce of its own) and the loss scale the precision needs,
    which every worker agrees on here."""
    check_strategy(model, "compile")
    settings = model.hetero_settings
    if settings.low_communication is not None:
        low_communication.check_strategy(model.distribute_strategy)
    keras_compile(*args, **kwargs)
    if _compat.is_loss_scale_optimizer(model.optimizer):
        # Keras wraps the optimizer itself under a mixed_float16 policy.
        # Its LossScaleOptimizer decides "finite" from replica 0's
        # gradients before the all-reduce; HeteroModel scales the loss
        # and checks the aggregated gradients (see `loss_scale`).
        model.optimizer = model.optimizer.inner_optimizer
    _compat.skip_optimizer_all_reduce(
        model.optimizer, model.distribute_strategy
    )
    # Workers agree here (one exchange under MultiWorkerMirrored): the
    # loss scale below makes variables on every worker or on none.
    policy = precision_lib.resolve(
        settings.precision,
        model.distribute_strategy,
        settings={
            "compute dtypes": sorted(precision_lib.compute_dtypes(model)),
            "auto_scale_loss": kwargs.get("auto_scale_loss", True),
        },
    )
    needs_scaling = precision_lib.check_model(model, policy)
    run = state.run_state(model)
    run.loss_scale = None
    # Keras 3's `compile(auto_scale_loss=False)`: no loss scaling.
    if needs_scaling and kwargs.get("auto_scale_loss", True):
        with model.distribute_strategy.scope():
            run.loss_scale = loss_scale_lib.DynamicLossScale()
