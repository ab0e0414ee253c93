"""The step's Keras internals: loss, metrics, the optimizer's update, and Keras
3's trainer overrides."""

import threading

import tensorflow as tf
from tensorflow.python.eager import context as _context

from keras_hetero._compat.epochs import adopt_epoch_iterator
from keras_hetero._compat.epochs import assigns_without_reading
from keras_hetero._compat.epochs import install_data_handlers
from keras_hetero._compat.flavour import EPOCH_ITERATOR_YIELDS_STEP_RANGE
from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.flavour import KERAS_VERSION
from keras_hetero._compat.flavour import _loss_module
from keras_hetero._compat.flavour import _TFOptimizer
from keras_hetero._compat.flavour import keras


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
        if training:
            # tf-keras' own `train_step` check (`Model._validate_target_and_
            # loss`): a compiled loss without targets ("Target data is
            # missing"), or no loss at all. Its compiled loss skips outputs
            # without targets, so `add_loss` losses alone train without.
            model._validate_target_and_loss(y, loss)
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


def is_keras_optimizer(value):
    """A Keras optimizer of this flavour (tf-keras: new or legacy)."""
    if IS_LEGACY:
        return isinstance(
            value,
            (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer),
        )
    return isinstance(value, keras.optimizers.Optimizer)


def optimizer_variables(optimizer):
    """The optimizer's variables (a property in Keras 3, a method in
    tf-keras' legacy optimizers)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def distributed_variable(variable):
    """The `tf.Variable` (distributed under a strategy) behind a Keras 3
    variable (`KerasVariable._value`); a tf-keras variable is one."""
    return getattr(variable, "_value", variable)


def is_loss_scale_optimizer(optimizer):
    if IS_LEGACY:
        return isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


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
        # Keras' `fit` and `evaluate` call this with their epoch iterator
        # right after making it: HeteroModel's reads a repeatable input from
        # one iterator, else makes one per epoch (Keras' two where each draws
        # a reshuffling input's seeds), and releases the ones it replaces
        # off the training thread (`training/epochs.py`).
        adopt_epoch_iterator(
            iterator, self.distribute_strategy, self._kh_epochs
        )
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

    def reset_metrics(self):
        # Keras 3.15 reads each metric variable back after resetting it: a
        # cross-replica reduction per variable at every epoch's start (see
        # `_compat.epochs.assigns_without_reading`). (tf-keras'
        # `backend.batch_set_value` reads back too; left as it is.)
        with assigns_without_reading(self._kh_epochs.enabled()):
            super().reset_metrics()

    def _make_function(self, step_function):
        # Keras 3.10-3.15 make their train, test and predict functions here
        # (`keras/src/backend/tensorflow/trainer.py`); HeteroModel's own
        # loop is `training.loop.make_function`, reached through the model.
        return self._hetero_make_function(step_function)


def autoconvert_optionals(model, function):
    """Keras 3.15's wrapper that turns optional inputs' None into empty
    values before `function` (`Trainer._autoconvert_optionals`; only where
    `CONVERTS_OPTIONAL_INPUTS`)."""
    return model._autoconvert_optionals(function)


def set_element_spec(optional, spec):
    """Sets a `tf.experimental.Optional`'s element spec in place.

    Keras 3.15's loop does the same: an empty Optional made before the
    loop takes the spec of the outputs traced inside it, so both branches
    of its `tf.cond` agree (`keras/src/backend/tensorflow/trainer.py`,
    `multi_step_on_iterator`)."""
    optional._element_spec = spec


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


class LegacyTrainerOverrides:
    """Mixed into `HeteroModel` on tf-keras: its `fit` and `evaluate` get
    data handlers that release the iterators they replace off the training
    thread (`training/epochs.py`)."""

    def fit(self, *args, **kwargs):
        install_data_handlers()
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        install_data_handlers()
        return super().evaluate(*args, **kwargs)


TrainerOverrides = (
    LegacyTrainerOverrides if IS_LEGACY else Keras3TrainerOverrides
)


def has_learning_rate_schedule(optimizer):
    """Whether `optimizer`'s learning rate is a `LearningRateSchedule`.
    Both flavours keep the schedule in the private `_learning_rate`; the
    public `learning_rate` is its current value."""
    return isinstance(
        getattr(optimizer, "_learning_rate", None),
        keras.optimizers.schedules.LearningRateSchedule,
    )


# Metrics: the metric variables' replica sums travel in a collective the step
# already makes (the gradients'), and the results are computed from the sums.
# Keras 3 metrics compute their results from given values (`StatelessScope`);
# tf-keras metrics read their variables, which hold the sums while the
# results are computed (`metrics_result_from`). Without this, tf-keras reads
# every result in a `merge_call` that all-reduces each metric variable on its
# own: two more collectives per step for the loss alone, each a round trip
# between workers (benchmarks/multi_worker_step.py).

# tf.VariableAggregation (tf-keras) or its name (Keras 3) -> the name.
_AGGREGATIONS = {
    tf.VariableAggregation.SUM: "sum",
    tf.VariableAggregation.MEAN: "mean",
    tf.VariableAggregation.ONLY_FIRST_REPLICA: "only_first_replica",
    "sum": "sum",
    "mean": "mean",
    "only_first_replica": "only_first_replica",
}


def _metric_variables(model):
    if not IS_LEGACY:
        return model.metrics_variables
    seen, variables = set(), []
    for metric in model.metrics:
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    return variables


def local_metric_values(model):
    """This replica's values of the metric variables that combine replicas.

    A SUM of them across replicas, given to `metrics_result_from`, gives
    what a cross-replica read would.

    Returns:
        `(variables, values)`: lists of the same length.
    """
    context = tf.distribute.get_replica_context()
    first = context.replica_id_in_sync_group == 0
    variables, values = [], []
    for variable in _metric_variables(model):
        aggregation = _AGGREGATIONS.get(variable.aggregation)
        if aggregation is None:
            continue
        # On this replica's device: a read is colocated with its variable,
        # which may name no device ("destinations can not be empty"). In
        # replica context a sync-on-read variable reads this replica's.
        value = tf.identity(variable.value if not IS_LEGACY else variable)
        if aggregation == "only_first_replica":
            value = value * tf.cast(first, value.dtype)
        variables.append(variable)
        values.append(value)
    return variables, values


def metrics_result_from(model, variables, sums):
    """`model.get_metrics_result()` with `variables` read as `sums`."""
    context = tf.distribute.get_replica_context()
    values = []
    for variable, value in zip(variables, sums):
        if _AGGREGATIONS[variable.aggregation] == "mean":
            value = value / tf.cast(context.num_replicas_in_sync, value.dtype)
        values.append(value)
    if not IS_LEGACY:
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return model.get_metrics_result()
    # tf-keras: each replica's own copy holds the sums while the metrics'
    # unwrapped results read it, then its own values again. Automatic control
    # dependencies order the reads and writes of each variable as written.
    own = [tf.identity(variable) for variable in variables]
    for variable, value in zip(variables, values):
        variable.assign(value)
    logs = local_metrics_result(model)
    with tf.control_dependencies(tf.nest.flatten(logs)):
        for variable, value in zip(variables, own):
            variable.assign(value)
    return logs


def local_metrics_result(model):
    """This replica's own metric results, with no collective.

    Keras 3: `get_metrics_result()` in replica context reads each
    replica's own values. tf-keras wraps every `Metric.result`
    (tf_keras/src/utils/metrics_utils.py, `result_wrapper`) in a
    `merge_call` or a sync-on-read context, both of which all-reduce the
    metric variables: one collective per variable per step under
    MultiWorkerMirroredStrategy. The function it wraps reads this
    replica's values.
    """
    if not IS_LEGACY:
        return model.get_metrics_result()
    logs = {}
    for metric in model.metrics:
        wrapped = getattr(
            getattr(metric.result, "__func__", None), "__wrapped__", None
        )
        value = wrapped() if wrapped is not None else metric.result()
        if isinstance(value, dict):
            logs.update(value)
        else:
            logs[metric.name] = value
    return logs


def global_metrics_result(model):
    """`model.get_metrics_result()` over all replicas, in replica context.

    Metric variables are ON_READ: each replica holds its own sums. Read in
    cross-replica context (a `merge_call`), TensorFlow reduces each variable
    on its own, one collective per variable under multi-worker strategies
    (`SyncOnReadVariable._get_cross_replica`). Here all local values travel
    in ONE batched all-reduce instead and the results are computed from the
    sums (`metrics_result_from`).
    """
    context = tf.distribute.get_replica_context()
    variables, values = local_metric_values(model)
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, values)
    return metrics_result_from(model, variables, sums)


# --- TensorFlow graph internals ---------------------------------------------

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
    if function is None or not _context.context().has_function(
        function.function_def.signature.name
    ):
        # A function is registered in the eager context it was traced in;
        # a reset context (`context._reset_context()`, as Keras' and TF's
        # own distribute tests do between cases) no longer has it, and a
        # call of it then fails with "Can't find a function". Trace again.
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
