"""`kh.data.shard`: global batches split into per-replica slices by shares."""

import numpy as np
import tensorflow as tf

from keras_hetero.data import shares as shares_lib


class HeteroDataset:
    """A dataset of global batches split across replicas by `shares`.

    Created by `kh.data.shard`. Each run of `global_batch_size` consecutive
    examples is one global batch; replica `i` gets the contiguous rows
    `[start_i, end_i)` of it, in global replica order (worker 0's replicas
    first). `shares` may be assigned at any time, also during `fit`.

    Pass it to `HeteroModel.fit` / `evaluate` / `predict` like any dataset.
    `as_distributed_dataset()` gives the underlying
    `tf.distribute.DistributedDataset` for custom loops.

    Attributes:
        global_batch_size: Rows per global batch.
        num_replicas: Replicas the batches are split across.
        strategy: The `tf.distribute.Strategy` the split is for.
    """

    def __init__(
        self, examples, global_batch_size, strategy, shares, map_fn=None
    ):
        self._examples = examples
        self._map_fn = map_fn
        self.global_batch_size = global_batch_size
        self.strategy = strategy
        self.num_replicas = strategy.num_replicas_in_sync
        self._schedule = shares_lib.ShareSchedule(
            shares_lib.validate_shares(shares, self.num_replicas)
        )
        self._distributed = {}

    @property
    def shares(self):
        """Per-replica fractions of the global batch (sum 1), assignable."""
        return self._schedule.latest().copy()

    @shares.setter
    def shares(self, value):
        self.set_shares(value)

    def set_shares(self, shares, from_batch=None):
        """Changes the split from global batch `from_batch` onwards.

        Global batches are numbered within a *pass* of the input pipeline
        (one iteration over the data: an epoch under Keras 3, the whole `fit`
        under tf-keras, which repeats the data). A change never touches a
        batch the pipeline has already split.

        Args:
            shares: One non-negative number per replica (normalised to sum 1).
            from_batch: An index in the current pass, or a `(pass, index)`
                pair. Defaults to the next batch the input pipeline has not
                split yet. Multi-worker jobs must pass the same value on every
                worker (as `ShardRebalancer` does), since each worker's
                pipeline prefetches on its own.

        Returns:
            The `(pass, index)` from which the new shares apply.

        Raises:
            ValueError: If `shares` are invalid (see `shard`).
        """
        shares = shares_lib.validate_shares(shares, self.num_replicas)
        if from_batch is not None and not isinstance(from_batch, tuple):
            from_batch = (max(self._schedule.passes_started - 1, 0), from_batch)
        return self._schedule.set_shares(shares, from_batch)

    @property
    def position(self):
        """`(pass, index)` of the next global batch the pipeline will split."""
        return self._schedule.position

    @property
    def passes_started(self):
        """Passes over the data the input pipeline has started."""
        return self._schedule.passes_started

    def resume_after(self, examples):
        """Starts the next pass after its first `examples` examples.

        They were trained before a restart: the interrupted epoch then sees
        each of its examples exactly once. Global batches are cut from the
        first example not skipped. Used by `kh.callbacks.ElasticCheckpoint`;
        call before `fit`.

        Args:
            examples: How many examples of the pass to skip, >= 0.

        Raises:
            ValueError: If `examples` is negative or not an integer.
        """
        if (
            isinstance(examples, bool)
            or not isinstance(examples, (int, np.integer))
            or examples < 0
        ):
            raise ValueError(
                "Invalid value for argument `examples`. Received: "
                f"examples={examples!r}. Expected an integer >= 0."
            )
        self._schedule.skip_examples(int(examples))

    def shares_for_batch(self, batch):
        """The shares that split global batch `batch = (pass, index)`."""
        return self._schedule.shares_at(batch).copy()

    @property
    def rows(self):
        """Rows each replica gets from a full global batch at current shares."""
        return shares_lib.rows_from_shares(
            self._schedule.latest(), self.global_batch_size
        )

    @property
    def num_examples(self):
        """Examples per epoch, or None if unknown to tf.data."""
        examples = int(self._examples.cardinality())
        return None if examples < 0 else examples

    @property
    def num_batches(self):
        """Global batches per epoch, or None if the example count is unknown."""
        examples = self.num_examples
        if examples is None:
            return None
        return -(-examples // self.global_batch_size)

    def as_distributed_dataset(self, repeat=False):
        """The `tf.distribute.DistributedDataset` that `fit` iterates.

        Args:
            repeat: Repeat the epochs forever (each epoch keeps its own last,
                partial global batch), for loops that count steps per epoch
                instead of re-iterating. Defaults to `False`.

        Returns:
            A `tf.distribute.DistributedDataset` of per-replica slices.
        """
        if repeat not in self._distributed:
            distributed = self.strategy.distribute_datasets_from_function(
                lambda context: self._pipeline(context, repeat)
            )
            if self.num_batches is not None and not repeat:
                # A worker's pipeline yields one element per LOCAL replica
                # per global batch, and TF reports that count as the
                # dataset's cardinality; Keras reads it as steps per epoch.
                distributed._cardinality = self.num_batches
            self._distributed[repeat] = distributed
        return self._distributed[repeat]

    def _pipeline(self, input_context, repeat):
        local_replicas = self.num_replicas // input_context.num_input_pipelines
        first_replica = input_context.input_pipeline_id * local_replicas

        def examples_of_pass(_):
            # Evaluated when a pass starts: the examples trained before a
            # restart (see `resume_after`) are skipped, before any split or
            # per-example map.
            skip = tf.numpy_function(
                self._schedule.take_example_skip, [], tf.int64
            )
            skip.set_shape([])
            return self._examples.skip(skip)

        batches = (
            tf.data.Dataset.range(1)
            .flat_map(examples_of_pass)
            .batch(self.global_batch_size)
        )
        if repeat:
            batches = batches.repeat()

        def split(index, batch):
            total_rows = tf.shape(tf.nest.flatten(batch)[0])[0]
            bounds = tf.numpy_function(
                self._schedule.next_bounds, [index, total_rows], tf.int64
            )
            bounds.set_shape([self.num_replicas + 1])
            slices = []
            for replica in range(first_replica, first_replica + local_replicas):
                start, end = bounds[replica], bounds[replica + 1]
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

        split_batches = batches.enumerate().map(
            lambda index, *batch: split(
                index, batch[0] if len(batch) == 1 else batch
            )
        )
        if local_replicas == 1:
            dataset = split_batches.map(lambda part: part)
        else:
            dataset = split_batches.flat_map(one_after_another)
        if self._map_fn is not None:
            # After the split: each worker preprocesses only its own rows.
            dataset = dataset.map(
                self._map_fn,
                num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True,
            )
        # Bound what runs ahead of training after the split, so a share
        # change `ShardRebalancer.lag` batches ahead is never too late.
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return dataset.prefetch(1).with_options(options)


def shard(
    examples,
    global_batch_size,
    *,
    strategy=None,
    shares=None,
    map_fn=None,
):
    """Splits global batches of `examples` across replicas by `shares`.

    Each run of `global_batch_size` consecutive examples is one global batch;
    replica `i` gets the contiguous rows `[start_i, end_i)` of it, in global
    replica order (worker 0's replicas first). Rows per replica come from the
    shares by largest-remainder rounding and sum exactly to the global batch;
    a replica may get 0 rows. The last global batch of an epoch may be
    smaller and is split by the same shares. Training on the result equals
    single-device training on `examples.batch(global_batch_size)`.

    In multi-worker jobs every worker reads the whole example stream and keeps
    its own rows, so `examples` must produce the same order on every worker
    (seed any shuffle).

    Args:
        examples: An UNBATCHED `tf.data.Dataset` of `(x, y)` or
            `(x, y, sample_weight)` examples.
        global_batch_size: Rows per global batch, at least the number of
            replicas.
        strategy: The `tf.distribute.Strategy` the model trains under.
            Defaults to the current strategy (`tf.distribute.get_strategy()`).
        shares: One non-negative number per replica, normalised to sum 1.
            Defaults to equal shares.
        map_fn: Preprocessing applied AFTER the split, to one replica's
            slice of a global batch at a time (a batch, called like a
            `Dataset.map` function: `map_fn(x, y)`), in parallel. Put
            expensive decoding here: in multi-worker jobs each worker then
            runs it only on its own rows. Defaults to `None`.

    Returns:
        A `kh.data.HeteroDataset`.

    Raises:
        TypeError: If `examples` is not a `tf.data.Dataset`.
        ValueError: If `global_batch_size` is not an integer of at least the
            number of replicas, or `shares` is not one finite, non-negative
            number per replica with a positive sum.

    Example:

    >>> examples = tf.data.Dataset.from_tensor_slices(
    ...     (np.zeros((8, 3), "float32"), np.zeros((8, 1), "float32")))
    >>> ds = shard(examples, global_batch_size=4)
    >>> ds.rows
    array([4])
    """
    if not isinstance(examples, tf.data.Dataset):
        raise TypeError(
            "Invalid value for argument `examples`. Received: "
            f"examples={examples!r} of type {type(examples).__name__}. "
            "Expected an unbatched `tf.data.Dataset` of (x, y) examples."
        )
    strategy = strategy or tf.distribute.get_strategy()
    num_replicas = strategy.num_replicas_in_sync
    if (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, (int, np.integer))
        or global_batch_size < num_replicas
    ):
        raise ValueError(
            "Invalid value for argument `global_batch_size`. Received: "
            f"global_batch_size={global_batch_size!r}. Expected an integer of "
            f"at least the number of replicas ({num_replicas}) under "
            f"{type(strategy).__name__}."
        )
    if shares is None:
        shares = np.ones(num_replicas)
    if map_fn is not None and not callable(map_fn):
        raise TypeError(
            f"Invalid value for argument `map_fn`. Received: map_fn={map_fn!r}."
            " Expected a function of one replica's slice, or None."
        )
    return HeteroDataset(
        examples, int(global_batch_size), strategy, shares, map_fn=map_fn
    )
