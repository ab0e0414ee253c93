"""Each worker's part of a `kh.data.shard` dataset: its replicas' rows of
every global batch, cut in the pipeline by the share schedule's in-graph
copy (`bounds.PipelineSplit`), then `map_fn` and class weights on those
rows only."""

import tensorflow as tf

from keras_hetero import _batches
from keras_hetero import _compat


def replica_pipeline(
    batches,
    mirror,
    num_replicas,
    input_context,
    map_fn=None,
    class_weight=None,
    options=None,
    read=None,
):
    """The per-replica elements one worker's input pipeline yields.

    Args:
        batches: `(index, global batch)` elements, numbered as the share
            schedule numbers them.
        mirror: The schedule's `bounds.PipelineSplit`.
        num_replicas: Replicas in the job.
        input_context: The worker's `tf.distribute.InputContext`.
        map_fn: Run on each replica's rows after the split, or None.
        class_weight: `{class: weight}` applied after `map_fn`, or None.
        options: `tf.data.Options` for the pipeline, or None.
        read: Under `reads="own"` or a tf.data service, the
            `passes.BlockSource` that reads this worker's rows once a
            batch's bounds are known (`read(bounds, first, count)`);
            `batches` then hold each global batch's row count. None:
            `batches` hold the global batches.

    Returns:
        A `tf.data.Dataset` giving the worker's replicas their slices in
        turn, one global batch after another.
    """
    local_replicas = num_replicas // input_context.num_input_pipelines
    first_replica = input_context.input_pipeline_id * local_replicas

    def split(index, batch, stacked):
        # In-graph, from the schedule's copy: no Python per batch.
        if read is None:
            total = _batches.batch_rows(batch)
            bounds = mirror.bounds(index, total)
            local = bounds[first_replica : first_replica + local_replicas + 1]
        else:
            # Only this worker's rows, its replicas' in order.
            batch, local = read.read(
                mirror.bounds(index, batch), first_replica, local_replicas
            )
            total = local[-1]
        if stacked:
            return _gather_padded(batch, local, total)
        slices = []
        for replica in range(local_replicas):
            start, end = local[replica], local[replica + 1]
            slices.append(
                tf.nest.map_structure(
                    lambda t, start=start, end=end: t[start:end], batch
                )
            )
        return tuple(slices)

    def one_after_another(*slices):
        # Consecutive elements go to the worker's replicas in turn.
        datasets = [tf.data.Dataset.from_tensors(s) for s in slices]
        dataset = datasets[0]
        for more in datasets[1:]:
            dataset = dataset.concatenate(more)
        return dataset

    stacked = (
        read is None and local_replicas > 1 and _all_dense(batches.element_spec)
    )
    # Our own small functions run inline: a thread-pool hand-off per
    # call cost more than each of them (`_compat.inline_map`).
    split_batches = _compat.inline_map(
        batches,
        lambda index, *batch: split(
            index, batch[0] if len(batch) == 1 else batch, stacked
        ),
    )
    if local_replicas == 1:
        dataset = split_batches.map(lambda part: part)
    elif stacked:
        # The slices padded to one length, stacked, unbatched and cut
        # back: a third of the pipeline's CPU time per global batch
        # that `flat_map` spends making two datasets per element.
        dataset = _compat.inline_map(split_batches.unbatch(), _unpad)
    else:
        dataset = split_batches.flat_map(one_after_another)
    if map_fn is not None:
        # After the split: each worker preprocesses only its own rows.
        dataset = dataset.map(
            map_fn,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
    if class_weight is not None:
        # Per example, from the labels the model gets: the same on each
        # replica's rows as on the whole global batch.
        dataset = dataset.map(_compat.class_weight_map_fn(class_weight))
    if options is not None:
        dataset = dataset.with_options(options)
    return dataset.prefetch(1).with_options(pipeline_options())


def pipeline_options():
    """The tf.data options of the split's pipeline (after the split)."""
    # Bound what runs ahead of training after the split, so a share
    # change `ShardRebalancer.lag` batches ahead is never too late.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    # Nor may tf.data run the stateless maps after the split in parallel
    # (which would pull global batches ahead).
    options.experimental_optimization.map_parallelization = False
    # No tf.data autotuning thread. Destroying an iterator (after a fit,
    # or when Python collects one a stopped fit left behind) joins that
    # thread, which at random sleeps out its optimization period first,
    # a period that doubles up to 60 s while the iterator lives (TF 2.21;
    # stock pipelines too; no upstream issue found): tests stalled for
    # minutes (benchmarks/RESULTS.md, "Input iterator teardown"). `AUTOTUNE`
    # parallelism in `map_fn` or the examples' pipeline then takes TF's
    # default, the core count.
    options.autotune.enabled = False
    return options


def _all_dense(spec):
    return all(
        isinstance(leaf, tf.TensorSpec) and (leaf.shape.rank or 0) >= 1
        for leaf in tf.nest.flatten(spec)
    )


def _gather_padded(batch, bounds, total):
    """`(the slices [bounds[i], bounds[i + 1]) of batch, stacked, each padded
    to the longest; their row counts)`. `total` is the batch's rows.

    One gather per tensor: slicing, padding and stacking each replica's
    rows cost about 0.1-0.35 ms more CPU per global batch with 4 replicas
    (measured 2026-12-03 with benchmarks/interleaved.py; the table is in
    docs/benchmarks.md's history). Padding rows repeat the batch's last
    row; `_unpad` cuts them off.
    """
    starts = bounds[:-1]
    rows = bounds[1:] - starts
    longest = tf.reduce_max(rows)
    index = starts[:, None] + tf.range(longest)[None, :]
    last = tf.maximum(tf.cast(total, tf.int64) - 1, 0)
    index = tf.minimum(index, last)
    return tf.nest.map_structure(lambda t: tf.gather(t, index), batch), rows


def _unpad(part, rows):
    return tf.nest.map_structure(lambda t: t[:rows], part)


def check_options(options):
    """Raises unless `options` (for `HeteroDataset.with_options`) keep the
    split exact: a `tf.data.Options` whose auto-shard policy is OFF or
    AUTO (every worker reads all examples) and not `deterministic=False`.

    Raises:
        TypeError: If `options` is not a `tf.data.Options`.
        ValueError: For another auto-shard policy, or `deterministic=False`.
    """
    if not isinstance(options, tf.data.Options):
        raise TypeError(
            "Invalid value for argument `options`. Received: "
            f"options={options!r}. Expected a `tf.data.Options`."
        )
    policy = options.experimental_distribute.auto_shard_policy
    allowed = (
        tf.data.experimental.AutoShardPolicy.OFF,
        tf.data.experimental.AutoShardPolicy.AUTO,
    )
    if policy not in allowed:
        raise ValueError(
            "Invalid value for argument `options`: "
            f"experimental_distribute.auto_shard_policy={policy!r}. A "
            "HeteroDataset splits each global batch between workers by "
            "shares, so every worker reads all examples; use "
            "AutoShardPolicy.OFF (or leave it unset)."
        )
    if options.deterministic is False:
        raise ValueError(
            "Invalid value for argument `options`: deterministic=False. "
            "A HeteroDataset needs the same order of examples on every "
            "worker (each keeps its rows of every global batch); leave "
            "`deterministic` unset or True."
        )
