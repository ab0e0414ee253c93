"""The gradient path after the backward pass, as small ordered pieces.

`compress -> all-reduce (with the telemetry, one collective) -> decompress ->
divide by global rows -> clip`. Each piece is a plain function over lists of
tensors so it can be tested alone.
"""

import tensorflow as tf

from keras_hetero import _distribute

WIRE_DTYPES = {"fp16": tf.float16, "bf16": tf.bfloat16}


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


def aggregate(grads, stats, *, compression=None, options=None, extra=()):
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

    Returns:
        `(summed_grads, summed_stats)`, gradients in their original dtypes;
        with `extra`, `(summed_grads, summed_stats, summed_extra)`.
    """
    wire = compress(grads, compression)
    extra = list(extra)
    reduced = all_reduce_sum(list(wire) + [stats] + extra, options=options)
    summed_grads = decompress(reduced[: len(wire)], grads)
    summed_stats = reduced[len(wire)]
    if not extra:
        return summed_grads, summed_stats
    return summed_grads, summed_stats, reduced[len(wire) + 1 :]
