"""The gradient path after the backward pass, as small ordered pieces.

`compress -> all-reduce (with the telemetry, one collective) -> decompress ->
divide by global rows -> clip`. Each piece is a plain function over lists of
tensors so it can be tested alone.
"""

import tensorflow as tf

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


def aggregate(grads, stats, *, compression=None, options=None):
    """Sums row-weighted local gradients and telemetry across replicas.

    Args:
        grads: Gradients of this replica's loss SUM (mean times rows).
        stats: This replica's telemetry vector (float32); its SUM across
            replicas gives every replica's rows and seconds.
        compression: `None`, `"fp16"` or `"bf16"`: the gradients' dtype on the
            wire only. Defaults to `None`.
        options: `tf.distribute.experimental.CommunicationOptions` for the
            collective. Defaults to `None`.

    Returns:
        `(summed_grads, summed_stats)`, gradients in their original dtypes.
    """
    wire = compress(grads, compression)
    reduced = all_reduce_sum(list(wire) + [stats], options=options)
    return decompress(reduced[:-1], grads), reduced[-1]
