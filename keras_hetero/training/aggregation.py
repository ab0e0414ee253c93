"""The gradient path after the backward pass, as small ordered pieces.

`compress -> all-reduce (with the telemetry, one collective) -> decompress ->
divide by global rows -> clip`. Each piece is a plain function over lists of
tensors so it can be tested alone. With `bucket_bytes` the all-reduce is
several collectives, one per bucket of gradients, last layers first
(`buckets`); the telemetry rides in the last.

For a small model or bucket (dense float32 gradients of at most
`PACK_LIMIT` elements, no wire compression, no `bytes_per_pack`) `aggregate`
packs gradients, telemetry and metric values into one flat vector itself and
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
    grads,
    stats,
    *,
    compression=None,
    options=None,
    extra=(),
    divisor=None,
    bucket_bytes=None,
):
    """Sums row-weighted local gradients and telemetry across replicas.

    Args:
        grads: Gradients of this replica's loss SUM (mean times rows), in
            the variables' order (the first layers' first).
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
        bucket_bytes: None, or the wire bytes of gradients per collective:
            the gradients go in buckets (`buckets`), last gradient first,
            one collective each, so a bucket's all-reduce can run while
            the backward pass still computes the earlier layers'
            gradients; `stats` and `extra` ride in the last one. Defaults
            to `None` (one collective).

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
    groups = [[p for p, g in enumerate(grads) if g is not None]]
    if bucket_bytes is not None and _buckets_apply():
        groups = buckets(grads, bucket_bytes, compression) or groups
    summed_grads = list(grads)
    finishers = []
    # Issued in order: TF orders a launcher's collectives as they are made
    # (see `buckets`), so the last layers' bucket goes first.
    for number, positions in enumerate(groups):
        carries = number == len(groups) - 1
        bucket = [grads[p] for p in positions]
        finish, summed_stats, summed_extra = _sum_bucket(
            bucket,
            stats if carries else None,
            extra if carries else [],
            compression,
            options,
        )
        finishers.append((positions, finish))
    denominator = None if divisor is None else divisor(summed_stats)
    for positions, finish in finishers:
        for position, summed in zip(positions, finish(denominator)):
            summed_grads[position] = summed
    if not extra:
        return summed_grads, summed_stats
    return summed_grads, summed_stats, summed_extra


def buckets(grads, bucket_bytes, compression=None):
    """Positions of `grads` by all-reduce bucket, in the order to issue them.

    As PyTorch's DistributedDataParallel: the last gradient first (the
    backward pass computes the last layers' gradients first), a bucket
    closed once it holds at least `bucket_bytes` on the wire (so a tensor
    larger than that is a bucket of its own, and a model of at most
    `bucket_bytes` is one bucket). None gradients take no place.

    Why this overlaps the backward pass in a `tf.function` (lines of the TF
    2.21.0 wheel's tensorflow/python sources): each bucket is one
    `all_reduce_v2` whose inputs are its own gradients
    (`CollectiveReplicaLauncher.all_reduce`, distribute/
    cross_device_utils.py:351-380, reached from `ReplicaContext.all_reduce`
    without a `merge_call` under MultiWorkerMirroredStrategy:
    collective_all_reduce_strategy.py:964-985). Collectives of one launcher
    share its ordering token, a resource (cross_device_utils.py:287-292,
    343-345); automatic control dependencies chain ops on one resource in
    the order they were made (framework/auto_control_deps.py:456-488), so
    bucket k+1 starts after bucket k, and nothing ties bucket k to the
    gradients of later buckets: the executor starts it once its own inputs
    are ready. TF reverses the same way for `bytes_per_pack`
    (cross_device_ops.py:1140-1151), but there the telemetry at the end of
    the list would land in the first pack and hold every pack back.

    Args:
        grads: The gradients (tensors, `tf.IndexedSlices` or None).
        bucket_bytes: The bytes at which a bucket is closed.
        compression: `None`, `"fp16"` or `"bf16"` (the wire dtype).
            Defaults to `None`.

    Returns:
        A list of lists of positions into `grads`; `[]` if all are None.

    Example:

    >>> grads = [tf.ones([100]), None, tf.ones([10]), tf.ones([300])]
    >>> buckets(grads, 800)
    [[3], [2, 0]]
    """
    groups, current, size = [], [], 0
    for position in reversed(range(len(grads))):
        grad = grads[position]
        if grad is None:
            continue
        current.append(position)
        size += _wire_size(grad, compression)
        if size >= bucket_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _wire_size(grad, compression):
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    dtype = values.dtype
    if compression is not None and dtype.is_floating:
        dtype = WIRE_DTYPES[compression]
    elements = values.shape.num_elements()
    # An unknown shape (a sparse gradient's rows): counted as one element.
    return (1 if elements is None else elements) * dtype.size


def _buckets_apply():
    """Whether the collective can be split: several replicas, all of them
    reachable from replica context (a `merge_call` reduction has no
    backward pass to overlap)."""
    context = tf.distribute.get_replica_context()
    return (
        context is not None
        and context.num_replicas_in_sync > 1
        and not _distribute.replicas_on_missing_devices(context.strategy)
    )


def _sum_bucket(grads, stats, extra, compression, options):
    """One bucket's collective: `grads` (none None), and `stats` and
    `extra` when it carries them (`stats` None: it does not).

    Returns:
        `(finish, summed_stats, summed_extra)`; `finish(denominator)` gives
        the summed gradients, divided by `denominator` unless it is None.
    """
    if _packs_in_one(grads, stats, extra, compression, options):
        return _sum_packed(grads, stats, extra)
    small = [] if stats is None else [stats]
    wire = compress(grads, compression)
    reduced = all_reduce_sum(list(wire) + small + extra, options=options)
    summed = decompress(reduced[: len(wire)], grads)
    summed_stats = reduced[len(wire)] if small else None

    def finish(denominator):
        if denominator is None:
            return summed
        return divide(summed, denominator)

    return finish, summed_stats, reduced[len(wire) + len(small) :]


def _packs_in_one(grads, stats, extra, compression, options):
    """Whether `_sum_packed` applies: a multi-replica context whose
    replicas are all here, dense gradients (None allowed) of at most
    `PACK_LIMIT` elements in all and extras and stats (None: a bucket
    without them) of one dtype, no wire compression and no packing
    options."""
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
    if stats is not None:
        tensors.append(stats)
    if not tensors or not all(
        isinstance(t, tf.Tensor)
        and t.dtype == tensors[-1].dtype
        and t.shape.is_fully_defined()
        for t in tensors
    ):
        return False
    # A larger model's gradients go to the collective's own packing.
    size = sum(g.shape.num_elements() for g in grads if g is not None)
    return size <= PACK_LIMIT


def _sum_packed(grads, stats, extra):
    """`_sum_bucket` as ONE flat vector: gradients, stats (unless None),
    extras.

    The collective packs its inputs this way anyway; packing here first
    lets the division run once on the gradients' part instead of once per
    gradient (elementwise the same arithmetic, so the same bits), and the
    small tensors cost no per-tensor packing ops.
    """
    grad_sizes = [g.shape.num_elements() for g in grads]
    scalars = bool(extra) and all(t.shape.rank == 0 for t in extra)
    # Scalars (the metrics' values) as one vector: one op each way.
    small = [] if stats is None else [stats]
    small += [tf.stack(extra)] if scalars else list(extra)
    small_sizes = [t.shape.num_elements() for t in small]
    flat = tf.concat([tf.reshape(t, [-1]) for t in grads + small], axis=0)
    (summed,) = all_reduce_sum([flat])
    summed_grads_flat, *summed_small = tf.split(
        summed, [sum(grad_sizes)] + small_sizes
    )
    summed_stats = None if stats is None else summed_small.pop(0)
    if scalars:
        summed_extra = tf.unstack(summed_small[0])
    else:
        summed_extra = [
            tf.reshape(value, t.shape) for value, t in zip(summed_small, extra)
        ]

    def finish(denominator):
        if not grads:
            return []
        values = summed_grads_flat
        if denominator is not None:
            values = values / tf.cast(denominator, values.dtype)
        return [
            tf.reshape(value, grad.shape)
            for value, grad in zip(tf.split(values, grad_sizes), grads)
        ]

    return finish, summed_stats, summed_extra
