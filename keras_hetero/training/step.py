"""HeteroModel's train and test steps, per replica, in data order.

The synchronous train step (`train_step`):

1. the start reading (the step's input on the replica's device, the device
   done with the work queued before it: `telemetry.clock`);
2. the forward pass and the compiled loss as this replica's mean over its
   own rows (sample weights and regularisers included; cut into
   micro-batches with `pipeline_microbatches`), times its row count;
3. the gradients of that local SUM (unscaled when the loss is scaled);
4. the end reading (every gradient finished on its device); this replica's
   rows and seconds into the stats vector; the metrics updated;
5. one cross-replica SUM of the gradients, the stats vector (with several
   workers, also each one's stop request: `training.stopping`) and (Keras 3,
   several replicas) the metrics' sums (`aggregation.aggregate`); with
   `bucket_bytes`, one per bucket of gradients, last layers first, the
   stats and metrics in the last;
6. with `accumulation_steps=k`, addition to running sums (the update comes
   on every k-th micro-step);
7. division by the global row count, optional global-norm clipping, the
   finite check under float16 loss scaling, then the optimizer update with
   its own all-reduce skipped;
8. the logs: global, sample-weighted metrics.

Summed over replicas the gradient is `d/dw (SUM of per-example losses / global
rows + regularisers)`: exactly what one device computes on the concatenated
global batch, for any split of rows (a replica may have none).

Low-communication training (`local_step`) shares steps 1-4 and then applies
the replica's own gradient to its own weights: no collective.
"""

import time
import warnings

import tensorflow as tf

from keras_hetero import _batches
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero import _phases
from keras_hetero.training import aggregation
from keras_hetero.training import loss_scale as loss_scale_lib
from keras_hetero.training import runtime
from keras_hetero.training import state
from keras_hetero.training import telemetry

# The telemetry totals among the train function's outputs (Keras 3), taken
# out before Keras sees the logs.
_TOTALS_KEY = "__keras_hetero_telemetry_totals"


def train_step(model, data):
    """One train step of `model` on this replica's `data` (see above).

    Args:
        model: A `kh.HeteroModel`.
        data: This replica's batch: `x`, `(x, y)` or `(x, y, sample_weight)`.

    Returns:
        The logs (a dict of global metric values).
    """
    x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
    settings, run = state.settings(model), state.run_state(model)
    scale = run.loss_scale
    rows = _batches.batch_rows(x)
    # No clock readings in an XLA-compiled step, nor on a parameter-server
    # worker (its closures are timed on the worker by the runner).
    timed = not _compat.jit_compiled(model) and not (
        _distribute.is_parameter_server(tf.distribute.get_strategy())
    )
    x, y_pred, grads, variables, seconds = _replica_gradients(
        model, (x, y, sample_weight), rows, scale, timed
    )
    num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    stats = telemetry.stats_vector(num_replicas, rows, seconds)
    # Metrics read only this step's predictions: updated here, before the
    # update, they are the same as after it.
    _compat.update_metrics(model, x, y, y_pred, sample_weight)
    if settings.low_communication is not None:
        return local_step(model, grads, variables, rows, stats)

    if run.telemetry is not None:
        # Several workers: this worker's stop request rides along, so all
        # of them stop after the same step (`training.stopping`).
        stats = run.telemetry.with_stop_request(stats)
    packed = packs_metrics()
    metric_variables, metric_values = (
        _compat.local_metric_values(model) if packed else ((), ())
    )
    accumulator = runtime.accumulator(model) if variables else None

    def divisor(summed_stats):
        # The global rows (times the loss scale): divided in the
        # collective's output, once (see `aggregation.aggregate`).
        return loss_scale_lib.divisor(
            tf.reduce_sum(summed_stats[:num_replicas]), scale
        )

    grads, stats, *metric_sums = aggregation.aggregate(
        grads,
        stats,
        compression=settings.gradient_compression,
        options=settings.communication,
        extra=metric_values,
        bucket_bytes=settings.bucket_bytes,
        # Accumulated micro-steps divide their sum at the end instead.
        divisor=divisor if accumulator is None else None,
    )
    global_rows = tf.reduce_sum(stats[:num_replicas])
    stored = rows_so_far = ready = None
    if accumulator is not None:
        grads, rows_so_far, ready = accumulator.add(grads, global_rows)
        stored = grads
        grads = aggregation.divide(
            grads, loss_scale_lib.divisor(rows_so_far, scale)
        )
    grads = aggregation.clip_by_global_norm(grads, settings.global_clipnorm)
    _update(
        model,
        (grads, variables),
        scale,
        global_rows,
        (accumulator, stored, rows_so_far, ready),
    )
    if run.telemetry is not None:
        run.telemetry.record(stats)
    if packed:
        sums = metric_sums[0] if metric_sums else []
        return _compat.metrics_result_from(model, metric_variables, sums)
    return global_logs(model)


def _replica_gradients(model, data, rows, scale, timed):
    """`(x, y_pred, grads, variables, seconds)`: this replica's forward
    and backward pass on `data` (`(x, y, sample_weight)`), its gradients
    of its loss SUM (see `loss_scale`), timed by the in-step clock (`x`
    is returned as the clock's start orders it)."""
    x, y, sample_weight = data
    start = telemetry.clock([rows, *tf.nest.flatten(x)], timed)
    with tf.control_dependencies([start]):
        x = tf.nest.map_structure(
            lambda t: None if t is None else tf.identity(t), x
        )
    with tf.GradientTape() as tape:
        y_pred, mean_loss = forward(model, x, y, sample_weight, rows)
        row_count = tf.cast(rows, tf.float32)
        target = loss_scale_lib.loss_to_differentiate(
            mean_loss, row_count, scale
        )
    variables = _trainable_variables(model)
    grads = tape.gradient(target, variables) if variables else []
    grads = loss_scale_lib.gradients_of_sum(grads, row_count, scale)
    seconds = telemetry.clock([rows, *grads], timed) - start
    return x, y_pred, grads, variables, seconds


def _update(model, update, scale, global_rows, accumulated):
    """Applies the aggregated gradients `update` = `(grads, variables)`
    (skipped on a non-finite scaled step) after this step's data exists.
    `accumulated` = `(accumulator, stored, rows_so_far, ready)`, all None
    without gradient accumulation: with it, the update waits for `ready`
    and the accumulator stores its sums."""
    grads, variables = update
    accumulator, stored, rows_so_far, ready = accumulated

    def apply(grads):
        _compat.apply_aggregated_gradients(model.optimizer, grads, variables)

    # Nothing in the optimizer's update may run before this step's data
    # exists: its `iterations` increment reads no data, and in a
    # tf.function ops on different resources are not ordered. When the
    # input ends (an epoch of unknown length, a resumed epoch), the failing
    # get_next must not leave a phantom step behind (the control dependency
    # reaches the merge_call, see mirrored_run). The first local replica's
    # global rows are enough: they exist only once every replica's data
    # reached the collective, and the update's merge_call takes the control
    # dependencies of all replicas (each device's update then waited for
    # every replica's copy, R * (R - 1) cross-device edges per step;
    # benchmarks/RESULTS.md, "fewer cross-device edges"). An XLA-compiled step
    # keeps its own.
    first = _distribute.is_first_local_replica()
    waits_for = (
        [global_rows]
        if first is not False or _compat.jit_compiled(model)
        else []
    )
    with tf.control_dependencies(waits_for):
        # No variables: Keras skips the update too (nothing to update).
        if variables:
            loss_scale_lib.guarded_apply(apply, grads, scale, ready)
        if accumulator is not None:
            accumulator.store(stored, rows_so_far, ready)


def local_step(model, grads, variables, rows, stats):
    """A low-communication inner step: this replica's own gradient (of its
    loss SUM), applied to its own weights; no collective (see
    `training.low_communication`).

    Returns:
        This replica's own metrics (no collective between
        synchronisations).
    """
    local = runtime.local_training(model)
    # A replica without rows applies zero gradients; its weights then
    # count for nothing in the pseudo-gradient (weighted by rows).
    row_count = tf.maximum(tf.cast(rows, tf.float32), 1.0)
    grads = aggregation.divide(grads, row_count)
    grads = aggregation.clip_by_global_norm(
        grads, state.settings(model).global_clipnorm
    )
    with tf.control_dependencies([rows]):
        if variables:
            _compat.apply_aggregated_gradients(
                model.optimizer, grads, variables
            )
        local.record(rows, stats)
    return _compat.local_metrics_result(model)


def forward(model, x, y, sample_weight, rows):
    """Predictions and this replica's mean loss (float32) on its rows.

    With `pipeline_microbatches=M` the rows are cut into M contiguous
    micro-batches, each run through the model on its own; the mean is the
    row-weighted mean of the micro-batches' means, so the loss (and its
    gradient) is the one of the whole batch. TensorFlow runs each op when
    its inputs are ready, so stage k of micro-batch i+1 runs while stage
    k+1 works on micro-batch i, forward and backward (the GPipe schedule,
    with no extra collective or synchronisation).
    """
    count = state.settings(model).pipeline_microbatches
    if count == 1:
        y_pred = model(x, training=True)
        mean_loss = _compat.unscaled_mean_loss(
            model, x, y, y_pred, sample_weight, rows, training=True
        )
        return y_pred, tf.cast(mean_loss, tf.float32)
    predictions, weighted = [], []
    for chunk in range(count):
        start = rows * chunk // count
        end = rows * (chunk + 1) // count
        x_i, y_i, weight_i = _batches.row_slice(
            (x, y, sample_weight), start, end
        )
        y_pred_i = model(x_i, training=True)
        mean_i = _compat.unscaled_mean_loss(
            model, x_i, y_i, y_pred_i, weight_i, end - start, training=True
        )
        rows_i = tf.cast(end - start, tf.float32)
        weighted.append(tf.cast(mean_i, tf.float32) * rows_i)
        predictions.append(y_pred_i)
    y_pred = tf.nest.map_structure(
        lambda *parts: tf.concat(parts, axis=0), *predictions
    )
    mean_loss = tf.math.divide_no_nan(
        tf.add_n(weighted), tf.cast(rows, tf.float32)
    )
    return y_pred, mean_loss


def _trainable_variables(model):
    """The variables the step differentiates, read after the forward pass,
    as in Keras: a model whose layers build on their first call has its
    variables only now."""
    variables = model.trainable_variables
    if (
        variables
        and _compat.jit_compiled(model)
        and not tf.distribute.has_strategy()
    ):
        # A lazily built model's first trace: the optimizer's variables
        # now, not under the step's control dependencies (XLA cannot lift
        # variables created there). Under a strategy the model and optimizer
        # are built before tracing.
        _compat.build_optimizer(model)
    elif not variables:
        warnings.warn(
            "The model does not have any trainable weights.", stacklevel=4
        )
    return variables


def test_step(model, data):
    """One evaluation step: the loss and the metrics, global logs."""
    x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=False)
    _compat.unscaled_mean_loss(
        model,
        x,
        y,
        y_pred,
        sample_weight,
        _batches.batch_rows(x),
        training=False,
    )
    _compat.update_metrics(model, x, y, y_pred, sample_weight)
    return global_logs(model)


def packs_metrics():
    """Whether the step sums the metrics in the gradients' collective."""
    context = tf.distribute.get_replica_context()
    return (
        context is not None
        and context.num_replicas_in_sync > 1
        and not _distribute.is_parameter_server(context.strategy)
        # A collective in replica context never returns there.
        and not _distribute.replicas_on_missing_devices(context.strategy)
    )


def global_logs(model):
    """The metrics' results over every replica's rows."""
    # Metric variables are ON_READ sums: every replica's, summed in one
    # batched collective (see `_compat.global_metrics_result`).
    context = tf.distribute.get_replica_context()
    if (
        context is None
        or context.num_replicas_in_sync == 1
        or _distribute.is_parameter_server(context.strategy)
    ):
        return model.get_metrics_result()
    if _distribute.replicas_on_missing_devices(context.strategy):
        # Reduced in cross-replica context (see aggregation.all_reduce_sum).
        return context.merge_call(lambda _: model.get_metrics_result())
    return _compat.global_metrics_result(model)


def timed_train_function(model, function):
    """`function` (Keras' train function), followed on the host by the
    telemetry's snapshot of the steps it ran (and, in low-communication
    training, the round's synchronisation when due)."""
    run = state.run_state(model)
    if run.telemetry is None:
        return function
    local = runtime.local_training(model)

    def train_function(iterator):
        started = time.perf_counter()
        logs = function(iterator)
        _phases.mark(_phases.FIRST_STEP)
        totals = None
        if isinstance(logs, dict):
            # Keras 3: the call read them (`train_function_extras`).
            totals = logs.pop(_TOTALS_KEY, None)
        if local is not None:
            # Low-communication: a round's telemetry arrives with its
            # synchronisation; the calls before it cover no steps.
            local.maybe_synchronise()
        run.telemetry.snapshot(time.perf_counter() - started, totals)
        return logs

    return train_function


def train_function_extras(model):
    """Outputs the train function adds after the step (Keras 3,
    `training.loop`): the telemetry totals, read in the
    same call instead of by an eager op after it. Not under
    low-communication training, whose synchronisation after the call
    records more."""
    run = state.run_state(model)
    if state.settings(model).low_communication is not None or not isinstance(
        run.telemetry, telemetry.Telemetry
    ):
        return {}
    return {_TOTALS_KEY: run.telemetry.read_totals()}
