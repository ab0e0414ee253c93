"""Low-communication training: DiLoCo-style local steps, an outer optimizer.

Between two synchronisations every replica (under MultiWorkerMirroredStrategy
one per worker) trains alone: its step computes the gradients of its own
rows and applies them to its own copy of the weights with the compiled
(inner) optimizer, whose state stays local. No collective runs in those
steps. Every `sync_every` steps all replicas meet once:

    pseudo_gradient = sum_i rows_i * (anchor - weights_i) / sum_i rows_i

(`rows_i`: the rows replica i trained since the last synchronisation), the
outer optimizer applies it to the anchor (the weights at the last
synchronisation) and every replica continues from the result. With
`sync_every=1`, plain SGD inside and `SGD(learning_rate=1.0)` outside, this
is synchronous data-parallel training, step for step.

The inner steps update each replica's component of the distributed
variables directly (the optimizer applies per-replica gradients without an
all-reduce, as HeteroModel's synchronous step does with aggregated ones),
so the components differ until the next synchronisation.
"""

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._checks import check_choice
from keras_hetero._checks import check_int
from keras_hetero._compat import keras
from keras_hetero.training import aggregation
from keras_hetero.training import state
from keras_hetero.training.telemetry import clock

# The gradients' wire dtypes, and int8 (the pseudo-gradient only).
COMPRESSIONS = (*aggregation.COMPRESSIONS, "int8")


class LowCommunication:
    """Local steps with periodic averaging and an outer optimizer.

    Give it to `kh.HeteroModel(low_communication=...)`. Each replica (one
    per worker under MultiWorkerMirroredStrategy) runs `sync_every` steps on
    its own rows with the compiled optimizer and no gradient collective;
    then the replicas all-reduce the pseudo-gradient (the weights at the
    last synchronisation minus their own, weighted by the rows each
    trained) and `outer_optimizer` applies it. See
    docs/low-communication.md.

    Args:
        sync_every: Steps between synchronisations, a positive int. With
            `steps_per_execution=k` a multiple of k.
        outer_optimizer: A Keras optimizer for the outer step, or None for
            DiLoCo's `SGD(learning_rate=0.7, momentum=0.9, nesterov=True)`.
            Each model gets its own copy (from the optimizer's config).
        compression: The pseudo-gradient on the wire: None (its own dtype),
            `"fp16"`, `"bf16"`, or `"int8"` (a per-tensor scale, gathered
            from every replica and summed locally).

    Raises:
        ValueError: For a `sync_every` that is not a positive int, or an
            unknown `compression`.
        TypeError: For an `outer_optimizer` that is not a Keras optimizer.

    Example:

    >>> import keras_hetero as kh
    >>> mode = kh.LowCommunication(sync_every=50, compression="bf16")
    >>> inputs = kh.keras.Input((4,))
    >>> model = kh.HeteroModel(
    ...     inputs, kh.keras.layers.Dense(1)(inputs), low_communication=mode
    ... )
    """

    def __init__(self, sync_every, outer_optimizer=None, compression=None):
        self.sync_every = check_int("sync_every", sync_every)
        self.compression = check_choice(
            "compression", compression, COMPRESSIONS
        )
        if outer_optimizer is None:
            outer_optimizer = keras.optimizers.SGD(
                learning_rate=0.7, momentum=0.9, nesterov=True
            )
        if not _compat.is_keras_optimizer(outer_optimizer):
            raise TypeError(
                "Invalid value for argument `outer_optimizer`. Received: "
                f"outer_optimizer={outer_optimizer!r}. Expected a Keras "
                "optimizer (e.g. `keras.optimizers.SGD(0.7, momentum=0.9, "
                "nesterov=True)`) or None."
            )
        self.outer_config = keras.optimizers.serialize(outer_optimizer)

    def outer_optimizer(self):
        """A new outer optimizer from the stored config."""
        return keras.optimizers.deserialize(self.outer_config)

    def get_config(self):
        """The arguments, JSON-serialisable (they ride in a model's config).

        Returns:
            A dict for `from_config`.
        """
        return {
            "sync_every": self.sync_every,
            "outer_optimizer": self.outer_config,
            "compression": self.compression,
        }

    @classmethod
    def from_config(cls, config):
        """The `LowCommunication` of `get_config()`'s dict.

        Args:
            config: A dict from `get_config`.

        Returns:
            A `LowCommunication`.
        """
        config = dict(config)
        outer = keras.optimizers.deserialize(config.pop("outer_optimizer"))
        return cls(outer_optimizer=outer, **config)

    def __repr__(self):
        return (
            f"LowCommunication(sync_every={self.sync_every}, outer_optimizer="
            f"{self.outer_config.get('class_name')}, compression="
            f"{self.compression!r})"
        )


def check_strategy(strategy):
    """Refuses strategies whose variables have no per-replica copies."""
    if _distribute.is_parameter_server(strategy) or isinstance(
        strategy, tf.distribute.experimental.CentralStorageStrategy
    ):
        raise ValueError(
            "`low_communication` needs a copy of the weights per replica "
            f"(MultiWorkerMirroredStrategy, MirroredStrategy, one device); "
            f"{type(strategy).__name__} keeps one shared copy. Its replicas "
            "cannot train apart between synchronisations."
        )


class LocalTraining:
    """The state of low-communication training; create in the scope.

    Args:
        model: The HeteroModel (built, compiled).
        mode: Its `LowCommunication`.
    """

    def __init__(self, model, mode):
        self.model = model
        self.mode = mode
        self.sync_every = mode.sync_every
        strategy = model.distribute_strategy
        self.num_replicas = strategy.num_replicas_in_sync
        weights = model.trainable_variables
        local = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        with strategy.scope():
            # The weights at the last synchronisation (identical everywhere).
            self.anchors = [
                tf.Variable(
                    tf.convert_to_tensor(v),
                    trainable=False,
                    name=f"low_communication_anchor_{index}",
                )
                for index, v in enumerate(weights)
            ]
            # Rows this replica trained since the last synchronisation, and
            # its inner steps (local: no collective in the inner steps).
            self.rows = tf.Variable(0.0, name="low_communication_rows", **local)
            self.steps = tf.Variable(
                0, dtype=tf.int64, name="low_communication_steps", **local
            )
            # [rows_0..R-1, seconds_0..R-1] of the replicas since then.
            self.round_stats = tf.Variable(
                tf.zeros([2 * self.num_replicas], tf.float32),
                name="low_communication_round_stats",
                **local,
            )
            # This replica's wait at the last synchronisation (sent in the
            # next one's collective).
            self.last_wait = tf.Variable(
                0.0, name="low_communication_last_wait", **local
            )
            self.synchronisations = tf.Variable(
                0, dtype=tf.int64, name="low_communication_synchronisations"
            )
            self.outer = mode.outer_optimizer()
            self.outer.build(weights)
        _compat.skip_optimizer_all_reduce(self.outer, strategy)
        self._sync_function = None
        self._gather_function = None
        self.save_requested = False  # set by ElasticCheckpoint (chief)
        self.save_agreed = False

    @property
    def variables(self):
        """What a checkpoint must hold besides the model and its optimizer."""
        return [
            *self.anchors,
            self.rows,
            self.steps,
            self.round_stats,
            self.last_wait,
            self.synchronisations,
            *_compat.optimizer_variables(self.outer),
        ]

    # --- inside the replica step ------------------------------------------

    def record(self, rows, stats):
        """Adds this replica's step to the round's counts (no collective)."""
        updates = [
            self.rows.assign_add(tf.cast(rows, tf.float32)),
            self.steps.assign_add(1),
            self.round_stats.assign_add(stats),
        ]
        telemetry = state.run_state(self.model).telemetry
        if telemetry is not None:
            updates.append(telemetry.count_step())
        return updates

    # --- between train-function calls ---------------------------------------

    def pending_steps(self):
        """Inner steps since the last synchronisation (a host read of the
        first local copy; all replicas count the same steps)."""
        return int(self.steps.numpy())

    def maybe_synchronise(self, force=False):
        """Synchronises after `sync_every` inner steps (or any, if `force`).

        Returns:
            True if it synchronised.
        """
        pending = self.pending_steps()
        if pending == 0 or (pending < self.sync_every and not force):
            return False
        if self._sync_function is None:
            self._sync_function = tf.function(self._synchronise)
        request = tf.constant(1.0 if self.save_requested else 0.0)
        self.save_requested = False
        agreed = self._sync_function(request)
        # Every worker learns in the same collective whether the chief asked
        # for a checkpoint: all of them then gather the per-replica state.
        self.save_agreed = bool(agreed.numpy() > 0)
        return True

    def _synchronise(self, request):
        strategy = self.model.distribute_strategy
        weights = self.model.trainable_variables
        pseudo, averaged, agreed = strategy.run(
            self._replica_pseudo_gradients, args=(request,)
        )
        # Every replica continues from the anchor, the outer optimizer moves
        # it by the pseudo-gradient, and the result is the new anchor.
        for weight, anchor in zip(weights, self.anchors):
            weight.assign(anchor.read_value())
        strategy.run(self._apply_outer, args=(pseudo,))
        for weight, anchor in zip(weights, self.anchors):
            anchor.assign(tf.convert_to_tensor(weight))
        for variable, value in zip(self._averaged(), averaged):
            # The row-weighted mean, identical on every replica.
            variable.assign(strategy.experimental_local_results(value)[0])
        self.rows.assign(0.0)
        self.steps.assign(0)
        self.round_stats.assign(tf.zeros_like(self.round_stats))
        self.synchronisations.assign_add(1)
        return strategy.experimental_local_results(agreed)[0]

    def _averaged(self):
        """The model's floating non-trainable state (e.g. BatchNormalization
        moving statistics), averaged by rows at each synchronisation."""
        return [
            v
            for v in self.model.non_trainable_variables
            if tf.as_dtype(v.dtype).is_floating
        ]

    def _replica_pseudo_gradients(self, request):
        weights = self.model.trainable_variables
        rows = tf.identity(self.rows)
        deltas = [
            tf.cast(anchor, tf.float32) - tf.cast(weight, tf.float32)
            for anchor, weight in zip(self.anchors, weights)
        ]
        context = tf.distribute.get_replica_context()
        # Arrival: this replica's local work finished on its device (its
        # deltas; a data edge through a host copy, see `clock`).
        arrived = clock([rows, *deltas])
        waits = tf.one_hot(
            _distribute.replica_id(), self.num_replicas, dtype=tf.float32
        ) * tf.identity(self.last_wait)
        # One collective for the rows, the checkpoint request, the round's
        # telemetry and the last waits; then the deltas weighted by each
        # replica's share of the rows (bounded by the largest delta, so
        # fp16 does not overflow whatever the rows).
        with tf.control_dependencies([arrived]):
            # The arrival is read BEFORE the collective starts (nothing else
            # orders the two: it would be read after it, measuring no wait).
            payload = tf.concat(
                [
                    tf.reshape(rows, [1]),
                    tf.reshape(request, [1]),
                    self.round_stats,
                    waits,
                ],
                axis=0,
            )
        head = context.all_reduce(tf.distribute.ReduceOp.SUM, payload)
        wait = clock(head) - arrived
        telemetry = state.run_state(self.model).telemetry
        if telemetry is not None:
            # The round's steps, every replica's rows, seconds, last waits.
            telemetry.record(head[2:], steps=tf.cast(self.steps, tf.float64))
        share = tf.math.divide_no_nan(rows, head[0])
        pseudo = self._sum(context, [delta * share for delta in deltas])
        pseudo = [tf.cast(p, w.dtype) for p, w in zip(pseudo, weights)]
        moving = self._averaged()
        averaged = []
        if moving:
            sums = context.all_reduce(
                tf.distribute.ReduceOp.SUM,
                [tf.cast(v, tf.float32) * share for v in moving],
            )
            averaged = [tf.cast(a, v.dtype) for a, v in zip(sums, moving)]
        with tf.control_dependencies(
            [self.last_wait.assign(tf.cast(wait, tf.float32))]
        ):
            return pseudo, averaged, tf.identity(head[1])

    def _sum(self, context, tensors):
        compression = self.mode.compression
        if compression is None:
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)
        if compression in aggregation.WIRE_DTYPES:
            # The same wire dtypes as the synchronous gradients'.
            wire = aggregation.WIRE_DTYPES[compression]
            sums = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [tf.cast(t, wire) for t in tensors]
            )
            return [tf.cast(s, tf.float32) for s in sums]
        return _int8_sum(context, tensors)

    def _apply_outer(self, pseudo):
        _compat.apply_aggregated_gradients(
            self.outer, list(pseudo), self.model.trainable_variables
        )

    # --- checkpoints -------------------------------------------------------

    def replica_variables(self):
        """The state that differs between replicas at a synchronisation:
        the inner optimizer's variables (its slots stay local)."""
        return _compat.optimizer_variables(self.model.optimizer)

    def gather_replica_state(self):
        """Every global replica's copy of `replica_variables()`, gathered
        (a collective: call on every worker, after an agreed save).

        Returns:
            One array per variable, shaped `[replicas, *variable.shape]`.
        """
        if self._gather_function is None:
            strategy = self.model.distribute_strategy
            variables = self.replica_variables()

            def gather():
                context = tf.distribute.get_replica_context()
                return [
                    context.all_gather(tf.expand_dims(tf.identity(v), 0), 0)
                    for v in variables
                ]

            self._gather_function = tf.function(lambda: strategy.run(gather))
        gathered = self._gather_function()
        strategy = self.model.distribute_strategy
        return [
            np.array(strategy.experimental_local_results(g)[0].numpy())
            for g in gathered
        ]

    def restore_replica_state(self, arrays):
        """Gives each local replica its own copy of `replica_variables()`
        from `gather_replica_state()`'s arrays (of the same replica count).
        """
        strategy = self.model.distribute_strategy
        ids = strategy.experimental_local_results(
            strategy.run(
                lambda: (
                    tf.distribute.get_replica_context().replica_id_in_sync_group
                )
            )
        )
        ids = [int(tf.get_static_value(i)) for i in ids]
        for variable, array in zip(self.replica_variables(), arrays):
            copies = strategy.experimental_local_results(
                _compat.distributed_variable(variable)
            )
            for replica, copy in zip(ids, copies):
                copy.assign(array[replica])


def check_model(model):
    """Refuses, before the first step, what low-communication training
    cannot do with `model` (a HeteroModel with `low_communication`).

    Raises:
        ValueError: For a model without weights yet, float16 loss scaling,
            or a `sync_every` that is not a multiple of
            `steps_per_execution`.
    """
    mode = state.settings(model).low_communication
    check_strategy(model.distribute_strategy)
    if not model.built or not model.trainable_variables:
        raise ValueError(
            f"`{model.name}` with `low_communication` must be built before "
            "`fit`, with trainable weights (they are copied at the start "
            "of each round); it has "
            f"{len(model.trainable_variables)}. Give it `keras.Input`, or "
            "call the model on a batch first."
        )
    if state.run_state(model).loss_scale is not None:
        raise ValueError(
            f"`{model.name}` with `low_communication` computes in float16 "
            "and needs loss scaling, which low-communication training "
            "does not do (each replica would skip steps on its own). "
            'Use `precision="mixed_bfloat16"` or float32.'
        )
    steps = _compat.steps_per_execution(model)
    if mode.sync_every % steps:
        raise ValueError(
            f"`LowCommunication(sync_every={mode.sync_every})` is not a "
            f"multiple of `steps_per_execution={steps}`: the replicas "
            "synchronise between train-function calls. Choose a "
            "`sync_every` that is a multiple of it."
        )


def _int8_sum(context, tensors):
    """SUM across replicas of int8-quantised tensors (per-tensor scale).

    Each replica sends `round(t / scale)` as int8 with its float32 `scale`
    (`max|t| / 127`); the values and scales of all replicas are gathered
    and summed locally (a SUM of int8 values would overflow). TensorFlow's
    collectives gather no int8 (allowed: float16/32/64, int32/64), so four
    int8 values travel bitcast as one int32; all tensors in one gather.
    """
    scales = tf.stack([tf.reduce_max(tf.abs(t)) / 127.0 for t in tensors])
    flat = tf.concat(
        [
            tf.reshape(
                tf.cast(tf.round(tf.math.divide_no_nan(t, s)), tf.int8), [-1]
            )
            for t, s in zip(tensors, tf.unstack(scales))
        ],
        axis=0,
    )
    size = tf.size(flat)
    padded = tf.pad(flat, [[0, (-size) % 4]])
    words = tf.bitcast(tf.reshape(padded, [-1, 4]), tf.int32)
    gathered = context.all_gather(tf.expand_dims(words, 0), axis=0)
    all_scales = context.all_gather(tf.expand_dims(scales, 0), axis=0)
    replicas = tf.shape(gathered)[0]
    values = tf.reshape(tf.bitcast(gathered, tf.int8), [replicas, -1])
    values = tf.cast(values[:, :size], tf.float32)
    sums, offset = [], 0
    for index, tensor in enumerate(tensors):
        count = int(np.prod(tensor.shape))
        part = (
            values[:, offset : offset + count]
            * all_scales[:, index : index + 1]
        )
        sums.append(tf.reshape(tf.reduce_sum(part, 0), tf.shape(tensor)))
        offset += count
    return sums


class SynchroniseAtEpochEnd(keras.callbacks.Callback):
    """Ends the round at each epoch end, before the user's callbacks (and
    before validation, which `HeteroModel.evaluate` synchronises for)."""

    def __init__(self, local):
        super().__init__()
        self.local = local

    def on_epoch_end(self, epoch, logs=None):
        if self.local.maybe_synchronise(force=True):
            # The round's numbers belong to this epoch (a rebalancer counts
            # batches per pass of the input); callbacks after this one see
            # them at `on_epoch_end`, the next batch starts from zero.
            telemetry = state.run_state(self.local.model).telemetry
            if telemetry is not None:
                telemetry.snapshot()
