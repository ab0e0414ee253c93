"""The gradient path after the backward pass, as small ordered pieces.

`compress -> all-reduce (with the telemetry, one collective) -> decompress ->
divide by global rows -> clip`. Each piece is a plain function over lists of
tensors so it can be tested alone.

For a small model (dense float32 gradients of at most `PACK_LIMIT`
elements, no wire compression, no `bytes_per_pack`) `aggregate` packs
gradients, telemetry and metric values into one flat vector itself and
divides the gradients' part once: fewer ops per step than a packing and a
division per tensor (measured; the history of docs/benchmarks.md), with the same
bits. Larger gradients go to the collective as they are (it packs them
itself) and each is divided on its own: copying them into one more vector
cost more than the ops it saves.
"""

import tensorflow as tf

from keras_hetero import _distribute

WIRE_DTYPES = {"fp16": tf.float16, "bf16": tf.bfloat16}
# `HeteroModel(gradient_compression=...)`'s values.
COMPRESSIONS = (None, *WIRE_DTYPES)

# Gradient elements up to which `aggregate` packs one vector itself. Above
# it the collective's own packing and a division per gradient were faster:
# packing a large model copies its gradients once more for fewer small ops
# (measured 2026-12-03, history of docs/benchmarks.md: 2-6 points of
# the step at 85,000 gradient elements, none measurable at 9,000).
PACK_LIMIT = 32768


def compress(grads, compression):
    """Casts floating gradients to the wire dtype of `compression`."""
    if compression is None:
        return grads
    wire = WIRE_DTYPES[compression]

    def cast(grad):
        if grad is None or not grad.dtype.is_floating:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(
                tf.cast(grad.values, wire), grad.indices, grad.dense_shape
            )
        return tf.cast(grad, wire)

    return [cast(g) for g in grads]


def decompress(grads, like):
    """Casts gradients back to the dtypes of `like`."""

    def cast(grad, original):
        if grad is None or grad.dtype == original.dtype:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(
                tf.cast(grad.values, original.dtype),
                grad.indices,
                grad.dense_shape,
            )
        return tf.cast(grad, original.dtype)

    return [cast(g, o) for g, o in zip(grads, like)]


def all_reduce_sum(tensors, options=None):
    """Cross-replica SUM of all non-None `tensors` (None stays None).

    One batched collective per dtype (the packing of some cross-device ops
    concatenates tensors, so dtypes must not mix). Outside a multi-replica
    context this is the identity.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return list(tensors)
    if _distribute.replicas_on_missing_devices(context.strategy):
        return _sum_in_cross_replica_context(context, tensors)
    by_dtype = {}
    for position, tensor in enumerate(tensors):
        if tensor is not None:
            by_dtype.setdefault(tensor.dtype, []).append(position)
    reduced = list(tensors)
    for positions in by_dtype.values():
        values = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            [tensors[p] for p in positions],
            options=options,
        )
        for position, value in zip(positions, values):
            reduced[position] = value
    return reduced


def _sum_in_cross_replica_context(context, tensors):
    """`all_reduce_sum` for replicas on devices this process does not have
    (see `_distribute.replicas_on_missing_devices`), where a collective in
    replica context would hang: one `strategy.reduce` per tensor in a
    `merge_call`, as Keras reduces its logs there."""
    present = [
        tf.convert_to_tensor(tensor) for tensor in tensors if tensor is not None
    ]

    def merge(strategy, *values):
        return [
            strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)
            for value in values
        ]

    summed = iter(context.merge_call(merge, args=tuple(present)))
    return [None if tensor is None else next(summed) for tensor in tensors]


def divide(grads, denominator):
    """Divides every gradient by the scalar `denominator` (e.g. global rows)."""

    def quotient(grad):
        if grad is None:
            return None
        value = tf.cast(denominator, grad.dtype)
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(
                grad.values / value, grad.indices, grad.dense_shape
            )
        return grad / value

    return [quotient(g) for g in grads]


def clip_by_global_norm(grads, clipnorm):
    """Clips aggregated gradients to global norm `clipnorm` (None: no-op)."""
    if clipnorm is None:
        return grads
    present = [g for g in grads if g is not None]
    clipped, _ = tf.clip_by_global_norm(present, clipnorm)
    clipped = iter(clipped)
    return [None if g is None else next(clipped) for g in grads]


def wire_bytes(variables, compression=None, num_replicas=1):
    """Bytes one replica sends into a step's all-reduce.

    The gradients (one per floating variable, in the wire dtype) plus the
    float32 telemetry vector (rows and seconds of every replica). What a
    link carries depends on the algorithm (a ring moves about twice this
    per replica); the ratio between settings does not.

    Args:
        variables: The trainable variables (their gradients are sent).
        compression: `None`, `"fp16"` or `"bf16"`.
        num_replicas: Replicas in sync (the telemetry vector's length).

    Returns:
        An int.

    Example:

    >>> v = tf.Variable(tf.zeros([1000]))
    >>> wire_bytes([v], "fp16", 2)
    2016
    """
    total = 0
    for variable in variables:
        dtype = tf.as_dtype(variable.dtype)
        if compression is not None and dtype.is_floating:
            dtype = WIRE_DTYPES[compression]
        elements = 1
        for size in variable.shape:
            elements *= int(size)
        total += elements * dtype.size
    return total + 2 * num_replicas * tf.float32.size


def aggregate(
    grads, stats, *, compression=None, options=None, extra=(), divisor=None
):
    """Sums row-weighted local gradients and telemetry across replicas.

    Args:
        grads: Gradients of this replica's loss SUM (mean times rows).
        stats: This replica's telemetry vector (float32); its SUM across
            replicas gives every replica's rows and seconds.
        compression: `None`, `"fp16"` or `"bf16"`: the gradients' dtype on the
            wire only. Defaults to `None`.
        options: `tf.distribute.experimental.CommunicationOptions` for the
            collective. Defaults to `None`.
        extra: More tensors to sum in the same collective (e.g. the metric
            variables' local values). Defaults to `()`.
        divisor: None, or a function of the summed stats returning what the
            summed gradients are divided by (`divide`), e.g. the global
            rows. Defaults to `None` (the sums are returned).

    Returns:
        `(summed_grads, summed_stats)`, gradients in their original dtypes
        (divided by `divisor(summed_stats)` if given); with `extra`,
        `(summed_grads, summed_stats, summed_extra)`.

    Example:

    >>> g, s = aggregate([tf.ones([2])], tf.constant([3.0, 0.0]))
    >>> g[0].numpy().tolist(), s.numpy().tolist()
    ([1.0, 1.0], [3.0, 0.0])
    """
    extra = list(extra)
    if _packs_in_one(grads, stats, extra, compression, options):
        summed_grads, summed_stats, summed_extra = _aggregate_packed(
            grads, stats, extra, divisor
        )
    else:
        wire = compress(grads, compression)
        reduced = all_reduce_sum(list(wire) + [stats] + extra, options=options)
        summed_grads = decompress(reduced[: len(wire)], grads)
        summed_stats = reduced[len(wire)]
        summed_extra = reduced[len(wire) + 1 :]
        if divisor is not None:
            summed_grads = divide(summed_grads, divisor(summed_stats))
    if not extra:
        return summed_grads, summed_stats
    return summed_grads, summed_stats, summed_extra


def _packs_in_one(grads, stats, extra, compression, options):
    """Whether `_aggregate_packed` applies: a multi-replica context whose
    replicas are all here, dense gradients (None allowed) of at most
    `PACK_LIMIT` elements in all and extras of the stats' dtype, no wire
    compression and no packing options."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return False
    if compression is not None or _distribute.replicas_on_missing_devices(
        context.strategy
    ):
        return False
    if options is not None and getattr(options, "bytes_per_pack", 0):
        return False  # the user's own packing of the collective
    tensors = [g for g in grads if g is not None] + list(extra)
    if not (
        all(
            isinstance(t, tf.Tensor)
            and t.dtype == stats.dtype
            and t.shape.is_fully_defined()
            for t in tensors
        )
        and stats.shape.is_fully_defined()
    ):
        return False
    # A larger model's gradients go to the collective's own packing.
    size = sum(g.shape.num_elements() for g in grads if g is not None)
    return size <= PACK_LIMIT


def _aggregate_packed(grads, stats, extra, divisor):
    """`aggregate` as ONE flat vector: gradients, stats, extras.

    The collective packs its inputs this way anyway; packing here first
    lets the division by `divisor` run once on the gradients' part instead
    of once per gradient (elementwise the same arithmetic, so the same
    bits), and the small tensors cost no per-tensor packing ops.
    """
    present = [g for g in grads if g is not None]
    grad_sizes = [g.shape.num_elements() for g in present]
    scalars = bool(extra) and all(t.shape.rank == 0 for t in extra)
    # Scalars (the metrics' values) as one vector: one op each way.
    small = [stats] + ([tf.stack(extra)] if scalars else list(extra))
    small_sizes = [t.shape.num_elements() for t in small]
    flat = tf.concat([tf.reshape(t, [-1]) for t in present + small], axis=0)
    (summed,) = all_reduce_sum([flat])
    summed_grads_flat, *summed_small = tf.split(
        summed, [sum(grad_sizes)] + small_sizes
    )
    summed_stats = summed_small[0]
    if scalars:
        summed_extra = tf.unstack(summed_small[1])
    else:
        summed_extra = [
            tf.reshape(value, t.shape)
            for value, t in zip(summed_small[1:], extra)
        ]
    if divisor is not None:
        summed_grads_flat = summed_grads_flat / tf.cast(
            divisor(summed_stats), summed_grads_flat.dtype
        )
    values = iter(tf.split(summed_grads_flat, grad_sizes) if present else [])
    summed_grads = [
        None if g is None else tf.reshape(next(values), g.shape) for g in grads
    ]
    return summed_grads, summed_stats, summed_extra
