"""`kh.HeteroModel`: a `keras.Model` whose step is right for unequal replicas.

One training step, per replica:

1. time stamp, forward pass, the compiled loss as this replica's mean over its
   own rows (sample weights and regularisers included), times its row count;
2. gradients of that local SUM, time stamp (compute seconds end here);
3. one cross-replica SUM of the gradients together with every replica's rows
   and seconds (`aggregation.aggregate`);
4. with `accumulation_steps=k`, addition to running sums (the update comes
   on every k-th micro-step);
5. division by the global row count, optional global-norm clipping, the
   finite check under float16 loss scaling, then the optimizer update with
   its own all-reduce skipped.

Summed over replicas the gradient is `d/dw (SUM of per-example losses / global
rows + regularisers)`: exactly what one device computes on the concatenated
global batch, for any split of rows (a replica may have none).
"""

import time
import warnings

import numpy as np
import tensorflow as tf

from keras_hetero import _batches
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero import precision as precision_lib
from keras_hetero._compat import keras
from keras_hetero.callbacks import base as callbacks_base
from keras_hetero.data import arrays
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.training import accumulation
from keras_hetero.training import aggregation
from keras_hetero.training import batch_statistics
from keras_hetero.training import keras_callbacks
from keras_hetero.training import loss_scale as loss_scale_lib
from keras_hetero.training import low_communication
from keras_hetero.training import options
from keras_hetero.training import parameter_server
from keras_hetero.training import telemetry

# Prefix of the partial gradient sums in a `.keras` file's model entry.
_ACCUMULATION_KEY = "keras_hetero_accumulation_"
# Prefix of low-communication training's state (anchor, outer optimizer).
_LOW_COMMUNICATION_KEY = "keras_hetero_low_communication_"
# The telemetry totals among the train function's outputs (Keras 3), taken
# out before Keras sees the logs.
_TOTALS_KEY = "__keras_hetero_telemetry_totals"


class HeteroModel(_compat.TrainerOverrides, keras.Model):
    """A `keras.Model` that trains correctly on unequal replicas.

    Use it wherever you would use `keras.Model`: functional
    (`HeteroModel(inputs, outputs)`), from an existing functional or
    Sequential model (`HeteroModel.from_model(model)`, layers shared), or as
    a base class with your own `call`. `compile`, `fit`, `evaluate`,
    `predict`, `.keras` saving and `keras.saving.load_model` work as usual.

    Under any synchronous `tf.distribute` strategy each replica's loss is
    weighted by its rows, so the update equals single-device training on the
    concatenated global batch even when replicas get different numbers of
    rows (see `kh.data.shard`). Logged loss and metrics are global and
    sample-weighted. After each train batch `model.step_stats` holds every
    replica's rows and compute seconds.

    Args:
        *args: What `keras.Model` takes (e.g. `inputs, outputs`).
        precision: `None`, `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"` or `"auto"` (see `kh.set_precision`, which
            sets the matching Keras policy; build the model after it). A
            named mixed policy is checked against the layers at `compile`.
            Whenever a layer computes in float16 the loss is scaled
            dynamically, and a step whose AGGREGATED gradient is not finite
            (an overflow on any replica or worker) is skipped everywhere,
            weights and optimizer state untouched. Defaults to `None`
            (follow the layers).
        gradient_compression: `None`, `"fp16"` or `"bf16"`: the gradients'
            dtype on the wire during the all-reduce only. Defaults to `None`.
        accumulation_steps: Micro-steps (train batches) per optimizer
            update. The update after `k` micro-steps equals one step on the
            union of their rows, weighted by rows even when the split of
            rows differs between micro-steps; `optimizer.iterations` counts
            updates. Partial sums carry over epoch ends; those left when
            `fit` returns are not applied. Defaults to `1`.
        pipeline_microbatches: Micro-batches per replica batch (GPipe).
            Each replica's rows are cut into this many contiguous pieces
            that go through the model one after another, so a model split
            across devices (`kh.layers.Placed`, `kh.placement`) keeps all
            its stages busy: stage k works on micro-batch i+1 while stage
            k+1 works on micro-batch i. The loss is the row-weighted mean of
            the pieces' means, so the update equals `1` micro-batch (layers
            that use batch statistics, such as BatchNormalization, see the
            micro-batches). Defaults to `1`.
        communication: A `tf.distribute.experimental.CommunicationOptions`
            passed to the gradient all-reduce. Defaults to `None`.
        global_clipnorm: Clip the AGGREGATED gradient to this global norm.
            Defaults to `None` (no clipping). With `low_communication`, each
            replica's own gradient.
        low_communication: A `kh.LowCommunication`: local steps with no
            gradient collective, a pseudo-gradient all-reduce every
            `sync_every` steps and an outer optimizer (DiLoCo-style, see
            docs/low-communication.md). Defaults to `None` (synchronous).
        **kwargs: What `keras.Model` takes.

    Raises:
        ValueError: For an unknown `precision` or `gradient_compression`,
            `accumulation_steps` or `pipeline_microbatches` below 1, a
            `global_clipnorm` that is not positive, or `low_communication`
            with `accumulation_steps` or `gradient_compression`.
        TypeError: If `communication` is not `CommunicationOptions`, or
            `low_communication` not a `kh.LowCommunication`.

    Example:

    >>> inputs = keras.Input((4,))
    >>> outputs = keras.layers.Dense(1)(inputs)
    >>> model = HeteroModel(inputs, outputs)
    >>> model.compile(optimizer="sgd", loss="mse")
    """

    def __new__(cls, *args, **kwargs):
        if cls is HeteroModel and _compat.functional_init_arguments(
            args, kwargs
        ):
            cls = _FunctionalHeteroModel
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        precision=None,
        gradient_compression=None,
        accumulation_steps=1,
        pipeline_microbatches=1,
        communication=None,
        global_clipnorm=None,
        low_communication=None,
        **kwargs,
    ):
        low_communication = options.from_config_value(low_communication)
        options.check_options(
            precision,
            gradient_compression,
            accumulation_steps,
            pipeline_microbatches,
            communication,
            global_clipnorm,
            low_communication,
        )
        if _compat.functional_init_arguments(args, kwargs):
            if not isinstance(self, _compat.Functional):
                # A subclass calling `super().__init__(inputs, outputs)`.
                _derive_from_functional(type(self))
            _compat.init_functional(self, args, kwargs)
        else:
            super().__init__(*args, **kwargs)
        self._hetero = options.Settings(
            precision=precision,
            gradient_compression=gradient_compression,
            accumulation_steps=accumulation_steps,
            pipeline_microbatches=pipeline_microbatches,
            communication=communication,
            global_clipnorm=global_clipnorm,
            low_communication=low_communication,
        )
        _compat.reduce_logs_to_first_replica(
            self,
            type(self).train_step is HeteroModel.train_step
            and type(self).test_step is HeteroModel.test_step,
        )

    @classmethod
    def from_model(cls, model, **kwargs):
        """A HeteroModel that trains the layers of an existing Keras model.

        A functional model, or a Sequential model that knows its input
        shape, gives a functional HeteroModel over the same layers (and so
        the same weights). Any other model (a Sequential without
        `keras.Input`, a subclassed model) is wrapped: the HeteroModel calls
        it, and it builds on the first data as it would alone. A compiled
        `model` passes its compile settings on (the same optimizer object,
        so its state carries over).

        Args:
            model: A `keras.Model`.
            **kwargs: HeteroModel arguments, e.g. `gradient_compression`.

        Returns:
            A `HeteroModel`.

        Raises:
            TypeError: If `model` is not a `keras.Model`.

        Example:

        >>> base = keras.Sequential([keras.layers.Dense(2)])
        >>> base.compile(optimizer="sgd", loss="mse")
        >>> model = HeteroModel.from_model(base)
        >>> model.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0)
        ... # doctest: +ELLIPSIS
        <...History object at ...>
        """
        if not isinstance(model, keras.Model):
            raise TypeError(
                "Invalid value for argument `model`. Received: "
                f"model={model!r} of type {type(model).__name__}. Expected a "
                "`keras.Model` (functional, Sequential or subclassed)."
            )
        kwargs.setdefault("name", model.name)
        inputs, outputs = _compat.symbolic_inputs_outputs(model)
        if inputs is not None:
            hetero = HeteroModel(inputs=inputs, outputs=outputs, **kwargs)
        else:
            hetero = _WrappedModel(model, **kwargs)
        arguments = _compat.compile_arguments(model)
        if arguments is not None:
            hetero.compile(**arguments)
        return hetero

    @property
    def step_stats(self):
        """`kh.StepStats` of the last executed train step(s), or None.

        None before the first train step. Under ParameterServerStrategy one
        entry per worker (see docs/strategies.md).
        """
        hetero = self.__dict__.get("_hetero")
        if hetero is None or hetero.telemetry is None:
            return None
        return hetero.telemetry.step_stats()

    # --- training -------------------------------------------------------

    def train_step(self, data):
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
        hetero = self._hetero
        rows = _batches.batch_rows(x)
        # No clock readings in an XLA-compiled step, nor on a parameter-server
        # worker (its closures are timed on the worker by the runner).
        timed = not _compat.jit_compiled(self) and not (
            _distribute.is_parameter_server(tf.distribute.get_strategy())
        )
        # The start: this step's input is on the replica's device and the
        # device has finished the work queued before it (telemetry.clock).
        start = telemetry.clock([rows, *tf.nest.flatten(x)], timed)
        with tf.control_dependencies([start]):
            x = tf.nest.map_structure(
                lambda t: None if t is None else tf.identity(t), x
            )
        with tf.GradientTape() as tape:
            y_pred, mean_loss = self._forward(x, y, sample_weight, rows)
            row_count = tf.cast(rows, tf.float32)
            scale = hetero.loss_scale
            target = loss_scale_lib.loss_to_differentiate(
                mean_loss, row_count, scale
            )
        # After the forward pass, as in Keras: a model whose layers build on
        # their first call has its variables only now.
        variables = self.trainable_variables
        if (
            variables
            and _compat.jit_compiled(self)
            and not tf.distribute.has_strategy()
        ):
            # A lazily built model's first trace: the optimizer's variables
            # now, not under the control dependencies below (XLA cannot lift
            # variables created there). Under a strategy the model and
            # optimizer are built before tracing.
            _compat.build_optimizer(self)
        elif not variables:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
        grads = tape.gradient(target, variables) if variables else []
        grads = loss_scale_lib.gradients_of_sum(grads, row_count, scale)
        if hetero.low_communication is not None:
            return self._local_step(
                (x, y, y_pred, sample_weight),
                grads,
                variables,
                rows,
                start,
                timed,
            )
        # The end: every gradient finished on its device (a data edge
        # through a host copy, telemetry.clock), before the collective.
        seconds = telemetry.clock([rows, *grads], timed) - start
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        stats = telemetry.stats_vector(num_replicas, rows, seconds)
        packed = self._packs_metrics()
        if packed:
            # The metrics' replica sums travel in the gradients' collective
            # (one all-reduce per step, not two). They read only this
            # step's predictions, so updating them first changes nothing.
            _compat.update_metrics(self, x, y, y_pred, sample_weight)
            metric_variables, metric_values = _compat.local_metric_values(self)
        accumulator = self._accumulator() if variables else None

        def divisor(summed_stats):
            # The global rows (times the loss scale): divided in the
            # collective's output, once (see `aggregation.aggregate`).
            return loss_scale_lib.divisor(
                tf.reduce_sum(summed_stats[:num_replicas]), scale
            )

        grads, stats, *metric_sums = aggregation.aggregate(
            grads,
            stats,
            compression=hetero.gradient_compression,
            options=hetero.communication,
            extra=metric_values if packed else (),
            # Accumulated micro-steps divide their sum at the end instead.
            divisor=divisor if accumulator is None else None,
        )
        global_rows = tf.reduce_sum(stats[:num_replicas])
        ready = None
        if accumulator is not None:
            grads, rows_so_far, ready = accumulator.add(grads, global_rows)
            stored = grads
            grads = aggregation.divide(
                grads, loss_scale_lib.divisor(rows_so_far, scale)
            )
        grads = aggregation.clip_by_global_norm(grads, hetero.global_clipnorm)

        # Nothing in the optimizer's update may run before this step's data
        # exists: its `iterations` increment reads no data, and in a
        # tf.function ops on different resources are not ordered. When the
        # input ends (an epoch of unknown length, a resumed epoch), the
        # failing get_next must not leave a phantom step behind (the
        # control dependency reaches the merge_call, see mirrored_run).
        def apply(grads):
            _compat.apply_aggregated_gradients(self.optimizer, grads, variables)

        # The first local replica's global rows are enough: they exist only
        # once every replica's data reached the collective, and the update's
        # merge_call takes the control dependencies of all replicas (each
        # device's update then waited for every replica's copy, R * (R - 1)
        # cross-device edges per step; docs/benchmarks.md, "Fewer
        # cross-device edges"). An XLA-compiled step keeps its own.
        first = _distribute.is_first_local_replica()
        waits_for = (
            [global_rows]
            if first is not False or _compat.jit_compiled(self)
            else []
        )
        with tf.control_dependencies(waits_for):
            # No variables: Keras skips the update too (nothing to update).
            if variables:
                loss_scale_lib.guarded_apply(apply, grads, scale, ready)
            if accumulator is not None:
                accumulator.store(stored, rows_so_far, ready)
        if hetero.telemetry is not None:
            hetero.telemetry.record(stats)
        if packed:
            sums = metric_sums[0] if metric_sums else []
            return _compat.metrics_result_from(self, metric_variables, sums)
        _compat.update_metrics(self, x, y, y_pred, sample_weight)
        return self._global_logs()

    def _local_step(self, data, grads, variables, rows, start, timed):
        """An inner step of low-communication training: this replica's own
        gradient, applied to its own weights; no collective (see
        `training.low_communication`)."""
        x, y, y_pred, sample_weight = data
        local = self._local_training()
        seconds = telemetry.clock([rows, *grads], timed) - start
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        stats = telemetry.stats_vector(num_replicas, rows, seconds)
        # A replica without rows applies zero gradients; its weights then
        # count for nothing in the pseudo-gradient (weighted by rows).
        row_count = tf.maximum(tf.cast(rows, tf.float32), 1.0)
        grads = aggregation.divide(grads, row_count)
        grads = aggregation.clip_by_global_norm(
            grads, self._hetero.global_clipnorm
        )
        with tf.control_dependencies([rows]):
            if variables:
                _compat.apply_aggregated_gradients(
                    self.optimizer, grads, variables
                )
            local.record(rows, stats)
        _compat.update_metrics(self, x, y, y_pred, sample_weight)
        # This replica's own metrics (no collective between synchronisations).
        return _compat.local_metrics_result(self)

    def _local_training(self):
        """The `LocalTraining` state (created once), or None."""
        hetero = self._hetero
        if hetero.low_communication is None:
            return None
        if getattr(hetero, "local_training", None) is None:
            if not self.trainable_variables:
                return None  # not built yet (`_check_low_communication`)
            hetero.local_training = low_communication.LocalTraining(
                self, hetero.low_communication
            )
        return hetero.local_training

    def _forward(self, x, y, sample_weight, rows):
        """Predictions and this replica's mean loss (float32) on its rows.

        With `pipeline_microbatches=M` the rows are cut into M contiguous
        micro-batches, each run through the model on its own; the mean is
        the row-weighted mean of the micro-batches' means, so the loss (and
        its gradient) is the one of the whole batch. TensorFlow runs each
        op when its inputs are ready, so stage k of micro-batch i+1 runs
        while stage k+1 works on micro-batch i, forward and backward (the
        GPipe schedule, with no extra collective or synchronisation).
        """
        count = self._hetero.pipeline_microbatches
        if count == 1:
            y_pred = self(x, training=True)
            mean_loss = _compat.unscaled_mean_loss(
                self, x, y, y_pred, sample_weight, rows, training=True
            )
            return y_pred, tf.cast(mean_loss, tf.float32)
        predictions, weighted = [], []
        for chunk in range(count):
            start = rows * chunk // count
            end = rows * (chunk + 1) // count
            x_i, y_i, weight_i = _batches.row_slice(
                (x, y, sample_weight), start, end
            )
            y_pred_i = self(x_i, training=True)
            mean_i = _compat.unscaled_mean_loss(
                self, x_i, y_i, y_pred_i, weight_i, end - start, training=True
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

    def test_step(self, data):
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        _compat.unscaled_mean_loss(
            self,
            x,
            y,
            y_pred,
            sample_weight,
            _batches.batch_rows(x),
            training=False,
        )
        _compat.update_metrics(self, x, y, y_pred, sample_weight)
        return self._global_logs()

    def _packs_metrics(self):
        """Whether the step sums the metrics in the gradients' collective."""
        context = tf.distribute.get_replica_context()
        return (
            _compat.PACKS_METRICS
            and context is not None
            and context.num_replicas_in_sync > 1
            and not _distribute.is_parameter_server(context.strategy)
            # A collective in replica context never returns there.
            and not _distribute.replicas_on_missing_devices(context.strategy)
        )

    def _global_logs(self):
        # Metric variables are ON_READ sums: every replica's, summed in one
        # batched collective (see `_compat.global_metrics_result`).
        context = tf.distribute.get_replica_context()
        if (
            context is None
            or context.num_replicas_in_sync == 1
            or _distribute.is_parameter_server(context.strategy)
        ):
            return self.get_metrics_result()
        if _distribute.replicas_on_missing_devices(context.strategy):
            # Reduced in cross-replica context (see aggregation.all_reduce_sum).
            return context.merge_call(lambda _: self.get_metrics_result())
        return _compat.global_metrics_result(self)

    def _parameter_server(self):
        """The `ParameterServerRunner` of this model (created once)."""
        hetero = self._hetero
        if getattr(hetero, "parameter_server", None) is None:
            hetero.parameter_server = parameter_server.ParameterServerRunner(
                self
            )
            hetero.telemetry = hetero.parameter_server.telemetry
        return hetero.parameter_server

    def _accumulator(self):
        """The `GradientAccumulator` (created once), or None for k = 1."""
        hetero = self._hetero
        if hetero.accumulation_steps == 1:
            return None
        if getattr(hetero, "accumulator", None) is None:
            with self.distribute_strategy.scope():
                hetero.accumulator = accumulation.GradientAccumulator(
                    self.trainable_variables, hetero.accumulation_steps
                )
        return hetero.accumulator

    def _hetero_variables(self):
        """Variables of HeteroModel's own state a checkpoint must hold."""
        hetero = self._hetero
        found = []
        if hetero.loss_scale is not None:
            found += hetero.loss_scale.variables
        if self._accumulator() is not None:
            found += hetero.accumulator.variables
        if self.built and self._local_training() is not None:
            found += hetero.local_training.variables
        return found

    # --- saving ------------------------------------------------------------

    def save(self, filepath, *args, **kwargs):
        accumulator = self._hetero.accumulator
        pending = 0 if accumulator is None else int(accumulator.count.numpy())
        if pending and not str(filepath).endswith(".keras"):
            # Legacy `.h5` files and tf-keras' SavedModel hold Keras'
            # variables only (see `save_own_variables`).
            warnings.warn(
                f"`{self.name}` is saved to {str(filepath)!r} with the "
                f"gradient sums of {pending} micro-step(s) that have not "
                "made an update yet (`accumulation_steps="
                f"{self._hetero.accumulation_steps}`); only `.keras` files "
                "hold them. A model loaded from this file does not go on "
                "exactly as this one: save to a `.keras` file, or after "
                "an update.",
                stacklevel=2,
            )
        return super().save(filepath, *args, **kwargs)

    def save_own_variables(self, store):
        """Saves the model's own variables and the partial gradient sums.

        With `accumulation_steps > 1` the sums of micro-steps that have not
        made an update yet go into the file too (they are not Keras
        variables), so a model saved mid-accumulation and loaded goes on
        exactly as the one that was saved.

        Args:
            store: The dict-like store Keras saves this model's state in.
        """
        super().save_own_variables(store)
        accumulator = self._hetero.accumulator
        if accumulator is not None:
            for name, value in accumulator.state().items():
                store[_ACCUMULATION_KEY + name] = value
        local = self._hetero.local_training
        if local is not None:
            # The anchor and the outer optimizer's state (e.g. its Nesterov
            # momentum): a loaded model goes on with the same outer steps.
            for index, variable in enumerate(local.variables):
                store[f"{_LOW_COMMUNICATION_KEY}{index}"] = np.array(
                    variable.numpy()
                )

    def load_own_variables(self, store):
        """Loads what `save_own_variables` saved.

        Args:
            store: The dict-like store Keras loads this model's state from.
        """
        names = list(store.keys())
        own = (_ACCUMULATION_KEY, _LOW_COMMUNICATION_KEY)
        keras_names = [n for n in names if not n.startswith(own)]
        super().load_own_variables({name: store[name] for name in keras_names})
        self._load_low_communication(
            [
                np.asarray(store[f"{_LOW_COMMUNICATION_KEY}{index}"])
                for index in range(
                    sum(n.startswith(_LOW_COMMUNICATION_KEY) for n in names)
                )
            ]
        )
        saved = {
            name[len(_ACCUMULATION_KEY) :]: np.asarray(store[name])
            for name in names
            if name.startswith(_ACCUMULATION_KEY)
        }
        if not saved:
            return
        accumulator = self._accumulator() if self.trainable_variables else None
        if accumulator is not None:
            accumulator.restore(saved)
        elif int(saved["micro_steps"]):
            micro_steps = int(saved["micro_steps"])
            warnings.warn(
                f"The file holds the gradient sums of {micro_steps} "
                "micro-step(s) that had not made an update yet, and "
                f"`{self.name}` has `accumulation_steps="
                f"{self._hetero.accumulation_steps}`: they are dropped, so "
                "training does not go on exactly as the saved model would.",
                stacklevel=2,
            )

    def _load_low_communication(self, arrays):
        if not arrays:
            return
        local = self._local_training() if self.built else None
        variables = [] if local is None else local.variables
        shapes = [tuple(np.shape(a)) for a in arrays]
        if shapes != [tuple(v.shape) for v in variables]:
            warnings.warn(
                f"The file holds low-communication state ({len(arrays)} "
                f"arrays: the anchor and the outer optimizer's state) that "
                f"`{self.name}` has no place for (low_communication="
                f"{self._hetero.low_communication!r}); it is dropped.",
                stacklevel=3,
            )
            return
        for variable, array in zip(variables, arrays):
            variable.assign(array)

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        strategy = self.distribute_strategy
        hetero = self._hetero
        if hetero.telemetry is None and not _distribute.is_parameter_server(
            strategy
        ):
            hetero.telemetry = telemetry.Telemetry(
                strategy,
                _distribute.global_replica_devices(strategy),
                waits=hetero.low_communication is not None,
            )
        if self.built:  # else its first trace builds the model and sums
            self._accumulator()
        if hetero.low_communication is not None:
            self._check_low_communication()
            self._local_training()
        super().make_train_function(force=force)
        function = self.train_function
        if hetero.telemetry is None:
            return function
        local = self._local_training()

        def train_function(iterator):
            started = time.perf_counter()
            logs = function(iterator)
            totals = None
            if isinstance(logs, dict):
                # Keras 3: the call read them (`_train_function_extras`).
                totals = logs.pop(_TOTALS_KEY, None)
            if local is not None:
                # Low-communication: a round's telemetry arrives with its
                # synchronisation; the calls before it cover no steps.
                local.maybe_synchronise()
            hetero.telemetry.snapshot(time.perf_counter() - started, totals)
            return logs

        self.train_function = train_function
        return train_function

    def _train_function_extras(self):
        """Outputs the train function adds after the step (Keras 3,
        `_compat.Keras3TrainerOverrides`): the telemetry totals, read in the
        same call instead of by an eager op after it. Not under
        low-communication training, whose synchronisation after the call
        records more."""
        hetero = self._hetero
        if hetero.low_communication is not None or not isinstance(
            hetero.telemetry, telemetry.Telemetry
        ):
            return {}
        return {_TOTALS_KEY: hetero.telemetry.read_totals()}

    # --- input and strategy checks ---------------------------------------

    def _check_low_communication(self):
        """Refuses, before the first step, what low-communication training
        cannot do."""
        mode = self._hetero.low_communication
        low_communication.check_strategy(self.distribute_strategy)
        if not self.built or not self.trainable_variables:
            raise ValueError(
                f"`{self.name}` with `low_communication` must be built before "
                "`fit`, with trainable weights (they are copied at the start "
                "of each round); it has "
                f"{len(self.trainable_variables)}. Give it `keras.Input`, or "
                "call the model on a batch first."
            )
        if self._hetero.loss_scale is not None:
            raise ValueError(
                f"`{self.name}` with `low_communication` computes in float16 "
                "and needs loss scaling, which low-communication training "
                "does not do (each replica would skip steps on its own). "
                'Use `precision="mixed_bfloat16"` or float32.'
            )
        steps = _compat.steps_per_execution(self)
        if mode.sync_every % steps:
            raise ValueError(
                f"`LowCommunication(sync_every={mode.sync_every})` is not a "
                f"multiple of `steps_per_execution={steps}`: the replicas "
                "synchronise between train-function calls. Choose a "
                "`sync_every` that is a multiple of it."
            )

    def compile(self, *args, **kwargs):
        self._check_strategy("compile")
        if self._hetero.low_communication is not None:
            low_communication.check_strategy(self.distribute_strategy)
        super().compile(*args, **kwargs)
        if _compat.is_loss_scale_optimizer(self.optimizer):
            # Keras wraps the optimizer itself under a mixed_float16 policy.
            # Its LossScaleOptimizer decides "finite" from replica 0's
            # gradients before the all-reduce; HeteroModel scales the loss
            # and checks the aggregated gradients (see `loss_scale`).
            self.optimizer = self.optimizer.inner_optimizer
        _compat.skip_optimizer_all_reduce(
            self.optimizer, self.distribute_strategy
        )
        hetero = self._hetero
        policy = precision_lib.resolve(
            hetero.precision, self.distribute_strategy
        )
        needs_scaling = precision_lib.check_model(self, policy)
        hetero.loss_scale = None
        # Keras 3's `compile(auto_scale_loss=False)`: no loss scaling.
        if needs_scaling and kwargs.get("auto_scale_loss", True):
            with self.distribute_strategy.scope():
                hetero.loss_scale = loss_scale_lib.DynamicLossScale()

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A HeteroModel from `get_config()`'s dict, with its settings.

        `HeteroModel.from_config` of a functional model's config gives the
        functional HeteroModel with the saved settings (tf-keras' own
        `from_config` rebuilt it from inputs and outputs alone, dropping
        them). Other configs go to Keras' `from_config`.

        Args:
            config: A dict from `get_config()`.
            custom_objects: As in `keras.Model.from_config`.

        Returns:
            A HeteroModel.
        """
        functional_keys = ("layers", "input_layers", "output_layers")
        if cls is HeteroModel and all(key in config for key in functional_keys):
            return _FunctionalHeteroModel.from_config(
                config, custom_objects=custom_objects
            )
        return super().from_config(config, custom_objects=custom_objects)

    def compile_from_config(self, config):
        """Compiles the model from `get_compile_config()` (used on load).

        Keras' own version skips compiling a model whose class overrides
        `compile`, as HeteroModel does (it adds to Keras' `compile`, so the
        saved arguments are the user's), which left loaded models
        uncompiled.

        Args:
            config: The dict `get_compile_config()` returned at save time.
        """
        if type(self).compile is not HeteroModel.compile:
            # As Keras does for a `compile` it does not know (the user's).
            warnings.warn(
                "`compile()` was not called as part of model loading "
                "because the model's `compile()` method is custom. "
                "All subclassed Models that have `compile()` "
                "overridden should also override "
                "`get_compile_config()` and `compile_from_config(config)`. "
                "Alternatively, you can call `compile()` manually after "
                "loading.",
                stacklevel=2,
            )
            return
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            _compat.build_optimizer(self)

    @property
    def loss_scale(self):
        """The current dynamic loss scale (float), or None without float16.

        Set at `compile` when any layer computes in float16: the loss is
        multiplied by it, and a step whose aggregated gradient is not finite
        on any replica is skipped everywhere and halves it.
        """
        scale = self.__dict__.get("_hetero")
        scale = None if scale is None else scale.loss_scale
        return None if scale is None else float(scale.scale.numpy())

    def fit(self, x=None, y=None, *args, **kwargs):
        # Keras' own file-writing callbacks write from the chief only.
        undo = keras_callbacks.prepare(self, kwargs.get("callbacks"))
        try:
            return self._fit(x, y, *args, **kwargs)
        finally:
            undo()

    def _fit(self, x=None, y=None, *args, **kwargs):
        self._check_strategy("fit")
        if isinstance(kwargs.get("callbacks"), (list, tuple)):
            kwargs["callbacks"] = callbacks_base.observers_last(
                kwargs["callbacks"]
            )
        if _distribute.is_parameter_server(self.distribute_strategy):
            x, kwargs = parameter_server.per_worker_input(
                x, kwargs, "steps_per_epoch", "validation_steps"
            )
            options = parameter_server.fit_arguments("fit", x, y, args, kwargs)
            runner = self._parameter_server()
            undo = callbacks_base.prepare_fit(
                self,
                parameter_server.ParameterServerInput(runner.num_workers),
                options.get("callbacks"),
                options,
            )
            try:
                return runner.fit(**options)
            finally:
                undo()
        converted = arrays.fit_arguments(self, x, y, args, kwargs)
        if converted is not None:
            x, y, args, kwargs = converted.pop("x"), None, (), converted
        dataset = x
        class_weight = None
        if isinstance(x, HeteroDataset):
            # Applied by the HeteroDataset: Keras would `.map` the
            # distributed dataset, which has no `map`.
            class_weight = kwargs.pop("class_weight", None)
            # Global batches keep their order; shuffle the examples instead.
            kwargs.setdefault("shuffle", False)
            if _compat.REPEATS_DISTRIBUTED_INPUT:
                kwargs.setdefault("steps_per_epoch", x.num_batches)
                if kwargs["steps_per_epoch"] is None:
                    raise ValueError(
                        "The examples passed to `kh.data.shard` have an "
                        "unknown length. Pass `steps_per_epoch=` to `fit` "
                        "(global batches per epoch) under tf-keras."
                    )
        batch_statistics.check_batch_normalization(
            self, dataset, kwargs.get("callbacks")
        )
        batch_statistics.check_microbatch_statistics(self)
        _compat.fix_synchronized_batch_norm(self)
        x = self._as_input(
            x,
            repeat=_compat.REPEATS_DISTRIBUTED_INPUT,
            class_weight=class_weight,
        )
        validation = kwargs.get("validation_data")
        if isinstance(validation, HeteroDataset):
            if _compat.REPEATS_DISTRIBUTED_INPUT:
                kwargs.setdefault("validation_steps", validation.num_batches)
            kwargs["validation_data"] = self._as_input(validation)
        if self._hetero.telemetry is not None:
            self._hetero.telemetry.reset()
        undo = callbacks_base.prepare_fit(
            self, dataset, kwargs.get("callbacks"), kwargs
        )
        local = self._local_training() if self.built else None
        if local is not None:
            # Evaluation, checkpoints and the end of the epoch see the same
            # weights on every replica: the round ends early there.
            callbacks = list(kwargs.get("callbacks") or [])
            kwargs["callbacks"] = [
                low_communication.SynchroniseAtEpochEnd(local),
                *callbacks,
            ]
        try:
            history = super().fit(x, y, *args, **kwargs)
        finally:
            undo()
        if local is not None:
            local.maybe_synchronise(force=True)
        return history

    def evaluate(self, x=None, y=None, *args, **kwargs):
        self._check_strategy("evaluate")
        if _distribute.is_parameter_server(self.distribute_strategy):
            x, kwargs = parameter_server.per_worker_input(x, kwargs, "steps")
            options = parameter_server.fit_arguments(
                "evaluate", x, y, args, kwargs
            )
            return_dict = options.pop("return_dict")
            logs = self._parameter_server().evaluate(**options)
            if return_dict:
                return logs
            values = list(logs.values())  # loss first, then the metrics
            return values[0] if len(values) == 1 else values
        local = self._hetero.__dict__.get("local_training")
        if local is not None:
            # The replicas' weights differ until the round ends.
            local.maybe_synchronise(force=True)
        converted = arrays.evaluate_arguments(self, x, y, args, kwargs)
        if converted is not None:
            x, y, args, kwargs = converted.pop("x"), None, (), converted
        if isinstance(x, HeteroDataset) and _compat.REPEATS_DISTRIBUTED_INPUT:
            if x.num_batches is not None and not args:
                kwargs.setdefault("steps", x.num_batches)
        return super().evaluate(self._as_input(x), y, *args, **kwargs)

    def predict(self, x, *args, **kwargs):
        self._check_strategy("predict")
        if _distribute.is_parameter_server(self.distribute_strategy):
            import inspect

            bound = inspect.signature(keras.Model.predict).bind(
                None, x, *args, **kwargs
            )
            given = {**bound.arguments, **bound.arguments.get("kwargs", {})}
            return self._parameter_server().predict(
                x,
                batch_size=given.get("batch_size"),
                steps=given.get("steps"),
            )
        converted = arrays.predict_arguments(self, x, args, kwargs)
        if converted is not None:
            x, args, kwargs = converted.pop("x"), (), converted
        if isinstance(x, HeteroDataset) and _compat.REPEATS_DISTRIBUTED_INPUT:
            if x.num_batches is not None and not args:
                kwargs.setdefault("steps", x.num_batches)
        return super().predict(self._as_input(x), *args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        # tf-keras with steps_per_execution > 1 asked its one batch for a
        # second (`_compat.one_batch_per_call`).
        with _compat.one_batch_per_call(self, "train"):
            return super().train_on_batch(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        with _compat.one_batch_per_call(self, "test"):
            return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, x):
        with _compat.one_batch_per_call(self, "predict"):
            outputs = super().predict_on_batch(x)
        if _distribute.num_workers(self.distribute_strategy) > 1:
            # Keras 3 gathers every worker's outputs, each of its own batch:
            # which rows are this worker's is not known here; as Keras.
            return outputs
        # Keras 3 with several replicas: each predicted the whole batch.
        return _compat.one_batch_outputs(self, x, outputs)

    def _check_strategy(self, method):
        if (
            method in ("fit", "evaluate")
            and _compat.jit_compiled(self)
            and _distribute.cpu_replicas(self.distribute_strategy)
        ):
            raise ValueError(
                f"`{self.name}.{method}()` with `jit_compile=True` under "
                f"{type(self.distribute_strategy).__name__} with "
                f"{self.distribute_strategy.num_replicas_in_sync} replicas on "
                "CPU devices: TensorFlow cannot compile the cross-replica "
                'all-reduce for CPUs with XLA ("Collectives are not yet '
                'implemented for CPU devices when compiling with XLA", '
                "b/194942685). Compile with `jit_compile=False`, or use one "
                "replica (no strategy, OneDeviceStrategy) or GPUs."
            )
        current = tf.distribute.get_strategy()
        created = _compat.model_strategy(self)
        if tf.distribute.has_strategy() and current is not created:
            raise ValueError(
                f"`{self.name}.{method}()` was called inside the scope of "
                f"{type(current).__name__}, but the model was created "
                + (
                    "outside any strategy scope"
                    if created is None
                    else f"under {type(created).__name__}"
                )
                + ". Create (and compile) the model inside `with "
                "strategy.scope():` of the strategy you train with."
            )

    def _as_input(self, x, repeat=False, class_weight=None):
        if not isinstance(x, HeteroDataset):
            return x
        strategy = self.distribute_strategy
        if x.strategy is not strategy and type(x.strategy) is type(strategy):
            raise ValueError(
                "Invalid value for argument `x`: a HeteroDataset sharded for "
                f"another {type(strategy).__name__} instance "
                f"({x.num_replicas} replicas) than the one `{self.name}` runs "
                f"under ({strategy.num_replicas_in_sync} replicas): the split "
                "is bound to the strategy object. Pass "
                "`strategy=model.distribute_strategy` to `kh.data.shard` (or "
                "call it inside the model's `strategy.scope()`)."
            )
        if x.strategy is not strategy:
            raise ValueError(
                "Invalid value for argument `x`: a HeteroDataset sharded for "
                f"{type(x.strategy).__name__} ({x.num_replicas} replicas), "
                f"but `{self.name}` runs under {type(strategy).__name__} "
                f"({strategy.num_replicas_in_sync} replicas). Pass "
                "`strategy=` to `kh.data.shard` (or call it inside the "
                "model's `strategy.scope()`)."
            )
        distributed = x.as_distributed_dataset(
            repeat=repeat, class_weight=class_weight
        )
        if self._hetero.low_communication is not None:
            # Inner steps run no collective, not even the input's.
            _compat.without_partial_batch_check(distributed)
        return distributed

    # No `get_config` here: a subclass gets what Keras gives a subclass of
    # `keras.Model` (its own `__init__` arguments, captured when it is
    # made), and HeteroModel's settings are not arguments of its `__init__`
    # unless it passes them on, when the capture has them. The functional
    # and wrapping classes below add the settings to their configs.


@_compat.register_serializable("HeteroModel")
class _FunctionalHeteroModel(
    options.SettingsInConfig, HeteroModel, _compat.Functional
):
    """The class of functional HeteroModels (`HeteroModel(inputs, outputs)`)."""

    def get_config(self):
        config = _compat.functional_config(
            self, super(HeteroModel, self).get_config
        )
        config.update(self._hetero.config())
        return config


# Keras names a model's class in configs, summaries and legacy `.h5` files by
# `__name__`; `__qualname__` stays the real one, so pickle can find it.
_FunctionalHeteroModel.__name__ = "HeteroModel"
_compat.register_plain_name("HeteroModel", _FunctionalHeteroModel)


@_compat.register_serializable("WrappedModel")
class _WrappedModel(HeteroModel):
    """A HeteroModel that calls a model with no symbolic inputs.

    Made by `HeteroModel.from_model` for a Sequential model without
    `keras.Input` or a subclassed model: it builds with its first data.
    """

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.wrapped = model
        self._optimizer_shared = False

    def call(self, inputs, training=None, mask=None):
        if mask is None:
            return self.wrapped(inputs, training=training)
        return self.wrapped(inputs, training=training, mask=mask)

    def get_config(self):
        config = {
            **super().get_config(),
            **self._hetero.config(),
            "model": keras.saving.serialize_keras_object(self.wrapped),
        }
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and (
            getattr(self.wrapped, "optimizer", None) is optimizer
        ):
            config["shares_optimizer"] = True
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        shared = config.pop("shares_optimizer", False)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        wrapper = cls(model, **config)
        wrapper._optimizer_shared = shared
        return wrapper

    def compile_from_config(self, config):
        # `from_model` of a compiled model shares its optimizer, so Keras
        # saves the optimizer's variables once, under the wrapped model (its
        # layers come first in the walk). Loading gives the wrapped model an
        # optimizer of its own from its compile config, which would take
        # them, leaving this model's new optimizer without its state.
        super().compile_from_config(config)
        if self._optimizer_shared and self.optimizer is not None:
            self.wrapped.optimizer = self.optimizer


def _derive_from_functional(cls):
    """Puts the functional HeteroModel under `cls` in place of HeteroModel.

    What Keras does for a `keras.Model` subclass whose `__init__` calls
    `super().__init__(inputs, outputs)` (`inject_functional_model_class`:
    `Model` becomes `Functional` in the bases of the subclass and of its
    parents up to `Model`), except that it stops at HeteroModel, which itself
    stays as it is: rewriting it would make every HeteroModel functional.

    Returns:
        `cls`, or the class that replaces it in the bases.
    """
    if cls is HeteroModel:
        return _FunctionalHeteroModel
    if not issubclass(cls, HeteroModel) or issubclass(cls, _compat.Functional):
        return cls
    cls.__bases__ = tuple(_derive_from_functional(b) for b in cls.__bases__)
    return cls
