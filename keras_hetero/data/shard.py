"""`kh.data.shard`: global batches split into per-replica slices by shares."""

import copy
import logging
import numbers

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._checks import check_int
from keras_hetero.data import bounds as bounds_lib
from keras_hetero.data import passes as passes_lib
from keras_hetero.data import reproducibility
from keras_hetero.data import service as service_lib
from keras_hetero.data import shares as shares_lib
from keras_hetero.data import split as split_lib

logger = logging.getLogger("keras_hetero")
# Whether this process has said once how whole-stream reads can be avoided.
_ADVISED = []

# tf.data methods a HeteroDataset has no use for, and what to do instead.
_INSTEAD = {
    "map": "apply `.map` to the examples before `kh.data.shard`, or pass "
    "`map_fn=` to it (it runs after the split, on each replica's rows)",
    "batch": "`kh.data.shard` batches: give it UNBATCHED examples and the "
    "global batch size (`global_batch_size=`)",
    "padded_batch": "pad the examples before `kh.data.shard` (it batches)",
    "unbatch": "give `kh.data.shard` the unbatched examples",
    "rebatch": "pass another `global_batch_size=` to `kh.data.shard`",
    "shuffle": "pass `shuffle=` (and `seed=`) to `kh.data.shard`: it "
    "shuffles the examples before they are batched, in an order that is "
    "the same on every worker",
    "repeat": "`fit` runs the epochs; for a custom loop use "
    "`as_distributed_dataset(repeat=True)`",
    "shard": "`kh.data.shard` already splits every global batch between "
    "replicas and workers",
    "filter": "apply `.filter` to the examples before `kh.data.shard`",
    "take": "apply `.take` to the examples before `kh.data.shard`, or pass "
    "`steps_per_epoch=` to `fit`",
    "skip": "apply `.skip` to the examples before `kh.data.shard` (to resume "
    "mid-epoch, use `resume_after`)",
    "flat_map": "apply `.flat_map` to the examples before `kh.data.shard`",
    "interleave": "apply `.interleave` to the examples before `kh.data.shard`",
    "apply": "apply the transformation to the examples before `kh.data.shard`",
    "enumerate": "enumerate the examples before `kh.data.shard`",
    "cardinality": "use `.num_batches` (global batches per epoch) or "
    "`.num_examples`",
}


class HeteroDataset:
    """A dataset of global batches split across replicas by `shares`.

    Created by `kh.data.shard`. Each run of `global_batch_size` consecutive
    examples is one global batch; replica `i` gets the contiguous rows
    `[start_i, end_i)` of it, in global replica order (worker 0's replicas
    first). `shares` may be assigned at any time, also during `fit`.

    Pass it to `HeteroModel.fit` / `evaluate` / `predict` like any dataset
    (`fit(..., class_weight=...)` included). `as_distributed_dataset()`
    gives the underlying `tf.distribute.DistributedDataset` for custom
    loops. `HeteroModel.fit` also makes one from numpy arrays under several
    replicas.

    Of the `tf.data.Dataset` methods it has `with_options`, `prefetch` and
    `cache`; the others (`map`, `batch`, `shuffle`, `repeat`, ...) raise an
    `AttributeError` that says what to do instead, since the examples are
    already batched and split.

    Attributes:
        global_batch_size: Rows per global batch.
        num_replicas: Replicas the batches are split across.
        strategy: The `tf.distribute.Strategy` the split is for.
    """

    def __init__(
        self,
        examples,
        global_batch_size,
        strategy,
        shares,
        map_fn=None,
        shuffle=None,
        seed=None,
        first_pass=0,
        reads="all",
        service=None,
    ):
        if service is not None:
            self._source = service_lib.ServiceSource(
                examples, service, global_batch_size
            )
        elif reads == "own":
            self._source = passes_lib.BlockSource(examples)
        elif hasattr(examples, "pass_batches"):
            self._source = examples
        else:
            self._source = passes_lib.DatasetSource(examples)
        self._map_fn = map_fn
        self.global_batch_size = global_batch_size
        self.strategy = strategy
        self.num_replicas = strategy.num_replicas_in_sync
        self._schedule = shares_lib.ShareSchedule(
            shares_lib.validate_shares(shares, self.num_replicas)
        )
        self._order = passes_lib.PassOrder(shuffle, seed, first_pass)
        self._options = None
        self._prefetch = None
        self._distributed = {}

    @property
    def shuffling(self):
        """How each pass is shuffled: None (not), a buffer size, True (the
        whole pass) or "batch" (within each global batch; array input)."""
        return self._order.shuffle

    @property
    def shuffle_mechanism(self):
        """How the passes are put in their order, or None (not shuffled).

        The order of a pass is a function of `(seed, pass)` and of this
        mechanism, which `kh.data.shard` picks from the examples (see
        docs/checkpoints.md, "What resuming mid-epoch costs, and why"):
        `"numpy permutation"` (arrays; `"numpy permutation within
        batches"` for `shuffle="batch"`), `"arrow permutation"`
        (`kh.data.from_arrow` with `shuffle=True`), `"global shuffle"`
        (tf.data examples with random access and `shuffle=True`),
        `"buffer of the pass"` (`shuffle=True` otherwise) or `"buffer of
        N"` (`shuffle=N`). `kh.callbacks.ElasticCheckpoint` records it, so
        that a pipeline edit that changes it (say a `filter` upstream: no
        random access) cannot resume an epoch in another order.
        """
        if self.shuffling is None:
            return None
        return self._source.shuffle_mechanism(self.shuffling)

    @property
    def example_spec(self):
        """The `element_spec` of the examples given (before `map_fn`), or
        None for a source that is not a `tf.data.Dataset`."""
        examples = getattr(self._source, "examples", None)
        return getattr(examples, "element_spec", None)

    @property
    def seed(self):
        """The shuffle seed: given to `kh.data.shard`, else chosen when
        training starts (the same on every worker), None before that."""
        return self._order.seed

    @property
    def next_pass(self):
        """The number of the next pass over the examples; its order is a
        function of `(seed, next_pass)`."""
        return self._order.next_pass

    @property
    def shares(self):
        """Per-replica fractions of the global batch (sum 1), assignable."""
        return self._schedule.latest().copy()

    @shares.setter
    def shares(self, value):
        self.set_shares(value)

    def get_state(self):
        """The share schedule as plain data: the shares in force and the
        changes still to come, keyed by this process's input passes.

        Returns:
            A JSON-serialisable dict for `set_state`.

        Example:

        >>> state = data.get_state()  # doctest: +SKIP
        >>> data.set_state(state)  # doctest: +SKIP
        """
        return {"schedule": self._schedule.get_state()}

    def set_state(self, state):
        """Restores what `get_state` returned (same process: the passes of
        the schedule are this process's; after a restart,
        `ElasticCheckpoint` restores the shares instead).

        Args:
            state: A dict from `get_state`.

        Raises:
            ValueError: If `state` has no `"schedule"`.
        """
        if not isinstance(state, dict) or "schedule" not in state:
            raise ValueError(
                "Invalid value for argument `state`. Received: "
                f"state={state!r}. Expected a dict from "
                "`HeteroDataset.get_state()`."
            )
        self._schedule.set_state(state["schedule"])

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

    def resume_after(self, examples, pass_number=None, seed=None):
        """Starts the next pass after its first `examples` examples.

        They were trained before a restart: the interrupted epoch then sees
        each of its examples exactly once. Global batches are cut from the
        first example not skipped (after shuffling: the skipped examples are
        the first ones of the pass's order). Used by
        `kh.callbacks.ElasticCheckpoint`; call before `fit`.

        Args:
            examples: How many examples of the pass to skip, >= 0.
            pass_number: The number of the interrupted pass, so it is
                shuffled as it was. Defaults to `None` (keep counting).
            seed: The shuffle seed of the interrupted run. Defaults to
                `None` (keep this dataset's).

        Raises:
            ValueError: If `examples` or `pass_number` is negative or not an
                integer.
        """
        examples = check_int("examples", examples, 0)
        if pass_number is not None:
            check_int("pass_number", _plain_int(pass_number), 0)
        self._schedule.skip_examples(int(examples))
        self._order.restart(pass_number, seed)

    @property
    def reads(self):
        """`"own"`: each worker reads only the blocks of its replicas' rows
        (`kh.data.shard(reads="own")`); `"service"`: each worker pulls its
        replicas' rows from a tf.data service (`kh.data.shard(service=)`);
        `"all"`: every worker reads every example."""
        if isinstance(self._source, service_lib.ServiceSource):
            return service_lib.SERVICE
        if isinstance(self._source, passes_lib.BlockSource):
            return "own"
        return "all"

    @property
    def reads_done(self):
        """Under `reads="own"` or a service input, what this worker has
        read so far: `{"bytes": ..., "rows": ..., "passes": {pass:
        {"bytes": ..., "rows": ...}}}` (bytes: for Parquet the column
        chunks' compressed sizes from the footers; for IPC and tables the
        record batches' sizes; from a service the rows' bytes as
        received), also per pass over the data (a pipeline may read ahead
        into the next pass). None under `reads="all"`."""
        reader = getattr(self._source, "reader", None)
        if reader is None:
            return None
        return {
            "bytes": reader.bytes_read,
            "rows": reader.rows_read,
            "passes": {
                number: {"bytes": read, "rows": rows}
                for number, (read, rows) in sorted(reader.by_pass.items())
            },
        }

    def input_state(self, pass_number, examples):
        """What resuming pass `pass_number` after `examples` of its examples
        needs besides their count (`ElasticCheckpoint` saves it).

        Args:
            pass_number: The pass (as `next_pass` numbers them).
            examples: Examples of the pass trained so far.

        Returns:
            Under `reads="own"`, the block queue's state after those steps
            as plain data (None if no longer kept: the pipeline ran more
            than 256 steps past them); under `reads="all"`, or at the
            pass's start, None.
        """
        if self.reads != "own" or not examples or pass_number is None:
            return None
        steps = -(-int(examples) // self.global_batch_size)
        return self._source.state_after(pass_number, steps)

    def resume_input(self, state):
        """Restores what `input_state` returned; call before `resume_after`
        (`ElasticCheckpoint` does both).

        Args:
            state: `input_state`'s result, or None (nothing to restore).
        """
        if state is not None and self.reads == "own":
            self._source.resume_at(state)

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
        return self._source.num_examples

    @property
    def num_batches(self):
        """Global batches per epoch, or None if the example count is unknown."""
        examples = self.num_examples
        if examples is None:
            return None
        return -(-examples // self.global_batch_size)

    def as_distributed_dataset(self, repeat=False, class_weight=None):
        """The `tf.distribute.DistributedDataset` that `fit` iterates.

        A shuffled dataset without a seed gets one here (on the first
        replica's worker, from numpy's global random state, so
        `keras.utils.set_random_seed` makes it reproducible), sent to every
        worker with one collective under multi-worker strategies: call it on
        every worker.

        Args:
            repeat: Repeat the epochs forever (each epoch keeps its own last,
                partial global batch), for loops that count steps per epoch
                instead of re-iterating: `True` reads them as one pass (its
                global batches numbered on across epochs, as under
                tf-keras), `"epochs"` as a pass per epoch (numbered from 0
                in each, as when the dataset is iterated anew each epoch).
                Defaults to `False`.
            class_weight: `{class: weight}`, applied as Keras' `fit` does
                (`class_weight=`) to each replica's rows, after `map_fn`.
                Defaults to `None`.

        Returns:
            A `tf.distribute.DistributedDataset` of per-replica slices.
        """
        if repeat not in (False, True, "epochs"):
            raise ValueError(
                "Invalid value for argument `repeat`. Received: "
                f'repeat={repeat!r}. Expected False, True or "epochs".'
            )
        self._order.choose_seed(self.strategy)
        agree = getattr(self._source, "agree", None)
        if agree is not None:
            agree(self.strategy)
        key = (
            repeat,
            None
            if class_weight is None
            else tuple(sorted(class_weight.items())),
        )
        if key not in self._distributed:
            distributed = self.strategy.distribute_datasets_from_function(
                lambda context: self._pipeline(context, repeat, class_weight)
            )
            if self.num_batches is not None and not repeat:
                if isinstance(distributed, tf.data.Dataset):
                    # One replica: the pipeline itself (length unknown).
                    distributed = _compat.with_known_length(
                        distributed, self.num_batches
                    )
                else:
                    # A worker's pipeline yields one element per LOCAL
                    # replica per global batch, and TF reports that count
                    # as the dataset's cardinality; Keras reads it as steps
                    # per epoch.
                    _compat.set_steps_of_distributed_dataset(
                        distributed, self.num_batches
                    )
            self._distributed[key] = distributed
        return self._distributed[key]

    def parameter_server_dataset(self):
        """The global batches as ParameterServerStrategy takes them.

        Under ParameterServerStrategy each worker steps on its own (there
        are no replicas in sync to split a batch between), so a step is one
        whole global batch. Each worker iterates its own copy of the global
        batches, pass after pass, in the order one device would see them
        (shuffled by `(seed, pass)` as under any other strategy), as it
        would a batched `tf.data.Dataset`: over a run each worker trains on
        every batch, and an "epoch" of `num_batches` steps is not exactly
        once across workers (docs/strategies.md). `shares` do not apply;
        `map_fn` runs on the worker, on each batch. `HeteroModel.fit` /
        `evaluate` call this for you.

        Returns:
            An endless, batched `tf.data.Dataset`.

        Raises:
            ValueError: If the examples are not a `tf.data.Dataset` (array
                input is converted by `fit` first).
        """
        examples = getattr(self._source, "examples", None)
        if examples is None:
            raise ValueError(
                "Under ParameterServerStrategy a `kh.data.HeteroDataset` "
                "needs `tf.data.Dataset` examples (workers run the input "
                "pipeline without Python)."
            )
        self._order.choose_seed(self.strategy)
        dataset = passes_lib.endless_batches(
            self._source,
            self.global_batch_size,
            self.shuffling,
            self._order.seed,
            self._order.next_pass,
        )
        if self._map_fn is not None:
            dataset = dataset.map(self._map_fn)
        if self._options is not None:
            dataset = dataset.with_options(self._options)
        return dataset

    def unreproducible_stages(self):
        """The stages of the examples whose order or values a restart (or
        another worker) cannot reproduce: `[]` for arrays and
        `kh.data.from_arrow` input, which keep their order.

        `kh.callbacks.ElasticCheckpoint` refuses a dataset with any (before
        the first step); `kh.data.shard` under several workers refuses
        those whose order may differ between workers (`across_workers`).
        A pipeline that cannot be inspected (more than 2 GB of captured
        constants) gives a warning and `[]`.

        Returns:
            A list of `keras_hetero.data.reproducibility.Stage`, each with
            the stage, its op, the function it runs in, the problem and the
            fix (see docs/checkpoints.md, "Input pipelines and exact
            resume").

        Example:

        >>> examples = tf.data.Dataset.range(8).map(lambda i: (i, i))
        >>> ds = shard(examples.shuffle(8, seed=1), global_batch_size=4)
        >>> [stage.op for stage in ds.unreproducible_stages()]
        ['ShuffleDatasetV3']
        """
        # Sources we build (arrays) keep their order by construction.
        stages = getattr(self._source, "unreproducible_stages", None)
        if stages is None:
            return []
        return stages() + self._source.map_fn_stages(self._map_fn)

    # --- tf.data methods --------------------------------------------------

    def with_options(self, options, name=None):
        """This dataset with `tf.data.Options` applied to its pipeline.

        A HeteroDataset never auto-shards: every worker reads all examples
        and keeps its replicas' rows of each global batch, so
        `experimental_distribute.auto_shard_policy = OFF` (as in the
        multi-worker tutorial) is already how it reads, and is accepted.
        Other options (threading, optimization, ...) apply to the pipeline,
        except `autotune.enabled`: the pipeline runs without tf.data's
        autotuning thread, whose shutdown stalls the end of a fit (see
        benchmarks/RESULTS.md, "Input iterator teardown"), so `AUTOTUNE`
        parallelism takes TF's default, the core count.

        Args:
            options: A `tf.data.Options`.
            name: Unused; accepted for `tf.data.Dataset.with_options`
                compatibility. Defaults to `None`.

        Returns:
            A HeteroDataset over the same examples that shares this one's
            shares and positions (a `ShardRebalancer` of either acts on
            both).

        Raises:
            TypeError: If `options` is not a `tf.data.Options`.
            ValueError: For an auto-shard policy other than OFF or AUTO, or
                `deterministic=False` (both would break exactly-once).
        """
        split_lib.check_options(options)
        merged = (
            options if self._options is None else self._options.merge(options)
        )
        return self._derive(_options=merged)

    def prefetch(self, buffer_size, name=None):
        """This dataset with `buffer_size` global batches prefetched.

        They are prefetched BEFORE the split into replicas' rows, so share
        changes still apply to every batch not yet split. Without a call
        nothing is prefetched there (the pipeline prefetches one replica's
        slice after the split).

        Args:
            buffer_size: Global batches to prefetch (0: none), or
                `tf.data.AUTOTUNE`.
            name: Unused; accepted for `tf.data.Dataset.prefetch`
                compatibility. Defaults to `None`.

        Returns:
            A HeteroDataset that shares this one's shares and positions.

        Raises:
            ValueError: If `buffer_size` is neither an integer >= 0 nor
                `tf.data.AUTOTUNE`.

        Example:

        >>> examples = tf.data.Dataset.range(8).map(lambda i: (i, i))
        >>> data = kh.data.shard(examples, global_batch_size=4).prefetch(2)
        >>> data.num_batches
        2
        """
        autotune = (
            isinstance(buffer_size, numbers.Integral)
            and not isinstance(buffer_size, bool)
            and buffer_size == tf.data.AUTOTUNE
        )
        if not autotune:
            buffer_size = check_int(
                "buffer_size",
                buffer_size,
                minimum=0,
                expected="an integer >= 0 or tf.data.AUTOTUNE",
            )
        return self._derive(_prefetch=buffer_size)

    def cache(self, filename="", name=None):
        """This dataset with its examples cached (`tf.data.Dataset.cache`).

        The examples are cached before they are shuffled and split, so each
        pass still has its own order.

        Args:
            filename: As for `tf.data.Dataset.cache`. Defaults to `""`
                (memory).
            name: Unused. Defaults to `None`.

        Returns:
            A HeteroDataset that shares this one's shares and positions.
        """
        return self._derive(_source=self._source.cache(filename))

    def __getattr__(self, name):
        if name in _INSTEAD:
            raise AttributeError(
                f"`kh.data.HeteroDataset` has no `.{name}()`: it holds "
                "global batches already split between replicas. Instead, "
                f"{_INSTEAD[name]}."
            )
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '{name}'"
        )

    def _derive(self, **changes):
        # A view: the same schedule and pass order, its own pipelines.
        derived = copy.copy(self)
        derived.__dict__.update(changes)
        derived._distributed = {}
        return derived

    # --- the input pipeline -------------------------------------------------

    def _start_pass(self):
        """`(skip, pass number, seed)` of the pass that starts now."""
        skip = int(self._schedule.take_example_skip())
        number, seed = self._order.start()
        return skip, number, seed

    def _pipeline(self, input_context, repeat, class_weight=None):
        def batches_of_pass(_):
            # Evaluated when a pass starts: its order (shuffle) and the
            # examples trained before a restart (see `resume_after`), which
            # are skipped before any split or per-example map.
            return self._source.pass_batches(
                self._start_pass, self.global_batch_size, self.shuffling
            )

        batches = tf.data.Dataset.range(1).flat_map(batches_of_pass)
        # No prefetch here unless asked: one global batch prefetched before
        # the split by default measured either sign, -10.7 to +3.2 points
        # of the live step with 3 replicas (benchmarks/RESULTS.md, "The live
        # input's part, separated").
        if self._prefetch:
            batches = batches.prefetch(self._prefetch)
        if repeat == "epochs":
            # Numbered within each pass: index 0 starts the next one.
            batches = batches.enumerate().repeat()
        else:
            if repeat:
                batches = batches.repeat()
            batches = batches.enumerate()

        if self._schedule.mirror is None:
            # Views (`with_options`, ...) share the schedule and its copy.
            self._schedule.attach(bounds_lib.PipelineSplit(self.num_replicas))
        read = None
        if isinstance(self._source, passes_lib.BlockSource):
            self._source.attach(input_context, self.num_replicas)
            read = self._source
        return split_lib.replica_pipeline(
            batches,
            self._schedule.mirror,
            self.num_replicas,
            input_context,
            map_fn=self._map_fn,
            class_weight=class_weight,
            options=self._options,
            read=read,
        )


def shard(
    examples,
    global_batch_size,
    *,
    strategy=None,
    shares=None,
    map_fn=None,
    shuffle=None,
    seed=None,
    reads="all",
    service=None,
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
    its own rows, so `examples` must produce the same order on every worker:
    shuffle with `shuffle=` here (or seed your own shuffle). Under more than
    one worker (not ParameterServerStrategy, whose workers do not split
    batches) `shard` reads the examples' tf.data pipeline and refuses stages
    whose order may differ between workers: a shuffle or `Dataset.random`
    without a seed (nor `tf.random.set_seed`), `deterministic=False` in a
    parallel `map` / `interleave` / `batch` or in `tf.data.Options`, an
    unseeded random op in a `filter`. On one worker nothing is checked here
    (`kh.callbacks.ElasticCheckpoint` checks what a restart needs).

    With `shuffle`, each pass over the examples (an epoch) has its own
    order, a function of `(seed, pass)` only: the same on every worker, and
    the same after a restart that resumes the pass (`ElasticCheckpoint`
    saves the seed and pass). The examples are shuffled before they are
    batched, so every example is still seen once per pass.

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
        shuffle: `None` (or `False`): keep the order. An int: shuffle with
            a buffer of that many examples, as `tf.data.Dataset.shuffle`
            does. `True`: shuffle the whole pass (their number must be
            known): by random access (tf.data's global shuffle, no
            buffer) if the examples support it, `kh.data.from_arrow`
            examples converted whole and permuted, others through a
            buffer of all examples. Defaults to `None`.
        seed: The shuffle seed (an int >= 0). Defaults to `None`: one is
            drawn when training starts, from numpy's global random state
            (so `keras.utils.set_random_seed` fixes it) on the first
            replica's worker, and sent to the others.
        reads: `"all"`: every worker reads every example and keeps its
            replicas' rows of each global batch (the global batches are
            `examples.batch(global_batch_size)`). `"own"`: for
            `kh.data.from_arrow` examples (files or a table) or
            `kh.data.from_tfrecords` records, not transformed, each worker
            reads only the blocks (Parquet row groups, IPC record batches,
            blocks of records) whose rows its replicas train on:
            the data is read about once per epoch between all workers, not
            once per worker. Blocks are dealt to workers as their shares
            need rows, so a global batch is made of rows of several
            blocks (docs/arrow.md, "Each worker reads its own rows");
            with `shuffle=True` the block order and the rows within each
            block are shuffled per pass. Every example is still trained
            once per epoch, whatever the shares do. Defaults to `"all"`.
        service: A tf.data service dispatcher (`"grpc://host:port"`,
            `"host:port"` or a
            `tf.data.experimental.service.DispatchServer`): the service's
            workers run `examples` (their whole pipeline, reading and
            parsing included) once per epoch in `"distributed_epoch"`
            mode, and each training worker pulls the rows of its
            replicas, step by step as the shares ask. The number of
            examples must be known (or asserted by
            `tf.data.experimental.assert_cardinality` as the last stage,
            which the service does not run); `take`, `skip`, `shard` and
            `repeat` stages are refused (each service worker would apply
            them to its part of the data). Every example the service hands out
            trains once per epoch, a worker that runs out early trains
            fewer rows at the epoch's end, and the others train what they
            still hold at its last step. Not with `shuffle` (shuffle in
            the pipeline), `reads="own"` or ParameterServerStrategy;
            `ElasticCheckpoint` saves only at epochs' ends (docs/arrow.md,
            "Three ways to read"). Defaults to `None`.

    Returns:
        A `kh.data.HeteroDataset`.

    Raises:
        TypeError: If `examples` is not a `tf.data.Dataset`.
        ValueError: If `global_batch_size` is not an integer of at least the
            number of replicas, `shares` is not one finite, non-negative
            number per replica with a positive sum, `shuffle` is not None,
            a bool or a positive int (or `True` with an unknown number of
            examples), or `seed` is not None or an int >= 0; under more than
            one worker, if a stage of `examples` may give each worker
            another order (the message names it and the fix).

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
    global_batch_size = check_int(
        "global_batch_size",
        global_batch_size,
        num_replicas,
        expected="an integer of at least the number of replicas "
        f"({num_replicas}) under {type(strategy).__name__}",
    )
    if shares is None:
        shares = np.ones(num_replicas)
    if map_fn is not None and not callable(map_fn):
        raise TypeError(
            f"Invalid value for argument `map_fn`. Received: map_fn={map_fn!r}."
            " Expected a function of one replica's slice, or None."
        )
    shuffle = check_shuffle(shuffle, examples)
    seed = check_seed(seed)
    _check_reads(reads, examples, shuffle, strategy)
    if service is not None:
        service = _check_service(service, reads, examples, shuffle, strategy)
    dataset = HeteroDataset(
        examples,
        int(global_batch_size),
        strategy,
        shares,
        map_fn=map_fn,
        shuffle=shuffle,
        seed=seed,
        reads=reads,
        service=service,
    )
    _check_same_order_on_workers(dataset)
    return dataset


def _check_reads(reads, examples, shuffle, strategy):
    """Raises unless `reads` is "all", or "own" over examples it can read
    block by block.

    Raises:
        ValueError: For another `reads`, or "own" over other examples, a
            shuffle buffer or ParameterServerStrategy.
    """
    if reads not in ("all", "own"):
        raise ValueError(
            f"Invalid value for argument `reads`. Received: reads={reads!r}. "
            'Expected "all" (every worker reads every example) or "own" '
            "(each worker reads the blocks of its own rows)."
        )
    if reads == "all":
        return
    if not getattr(examples, "whole", False):
        raise ValueError(
            'Invalid value for argument `examples`: `reads="own"` reads '
            "blocks of `kh.data.from_arrow` examples (Parquet or Arrow IPC "
            "files, or a pyarrow.Table) or `kh.data.from_tfrecords` records "
            "by number. Received: "
            f"{type(examples).__name__} {examples.element_spec}. Pass what "
            "`from_arrow` / `from_tfrecords` returned, untransformed "
            "(per-batch work goes in "
            '`map_fn`), or use reads="all".'
        )
    examples.stream.blocks()  # a RecordBatchReader says it has none
    if shuffle not in (None, True):
        raise ValueError(
            f"Invalid value for argument `shuffle`. Received: "
            f'shuffle={shuffle!r} with reads="own". Expected None or True '
            "(the block order and the rows within each block are "
            "shuffled per pass; there is no buffer)."
        )
    if _distribute.is_parameter_server(strategy):
        raise ValueError(
            'Invalid value for argument `reads`. Received: reads="own" '
            "under ParameterServerStrategy, whose workers each train "
            "whole global batches of their own stream. Expected "
            'reads="all" there.'
        )


def _check_service(service, reads, examples, shuffle, strategy):
    """The checked dispatcher address of a service input.

    Raises:
        ValueError: With `reads="own"`, `shuffle`, examples of unknown
            number or with stages that would apply to each service
            worker's part (`take`, `skip`, `shard`, `repeat`, an
            `assert_cardinality` before the last stage),
            ParameterServerStrategy, or an address that is not one or that
            nothing listens on.
    """
    problem = None
    if reads != "all":
        problem = f"reads={reads!r} (the service's workers read the data)"
    elif shuffle is not None:
        problem = (
            f"shuffle={shuffle!r} (shuffle in the examples' pipeline, which "
            "the service runs)"
        )
    elif int(examples.cardinality()) < 0:
        problem = (
            "examples of unknown number (every worker must know a pass's "
            "steps; apply "
            "`tf.data.experimental.assert_cardinality(n)` to them as "
            "their last stage)"
        )
    elif _distribute.is_parameter_server(strategy):
        problem = (
            "ParameterServerStrategy (its workers each train whole global "
            "batches of their own stream)"
        )
    if problem is not None:
        raise ValueError(
            "Invalid value for argument `service`: a tf.data service input "
            f"does not go with {problem}. Received: service={service!r}."
        )
    service_lib.check_pipeline(examples)
    return service_lib.check_address(service)


def _check_same_order_on_workers(dataset):
    """Refuses examples whose order may differ between workers.

    Every worker reads the whole example stream and keeps its replicas' rows
    of each global batch, so two workers that see another order lose some
    examples and train others twice, at every step. (ParameterServerStrategy
    workers each train whole batches of their own stream: no split.)
    """
    strategy = dataset.strategy
    if _distribute.is_parameter_server(strategy):
        return
    if _distribute.num_workers(strategy) < 2:
        return
    # The examples' own stages only: `map_fn` runs after the split, on each
    # worker's rows, so it cannot change which rows a worker keeps.
    _advise_on_whole_stream_reads(dataset)
    stages = [
        s for s in dataset._source.unreproducible_stages() if s.across_workers
    ]
    if stages:
        raise ValueError(
            "Invalid value for argument `examples`: under "
            f"{type(strategy).__name__} with "
            f"{_distribute.num_workers(strategy)} workers every worker reads "
            "all examples and keeps its rows of each global batch, so they "
            "must come out in the same order on every worker. These stages "
            "may give each worker another order (some examples would be "
            "trained twice, others never):\n" + reproducibility.describe(stages)
        )


def _advise_on_whole_stream_reads(dataset):
    """Logs once per process, under `reads="all"` and several workers, that
    every worker reads all of a file-backed input, and what reads less."""
    if _ADVISED or dataset.reads != "all":
        return
    workers = _distribute.num_workers(dataset.strategy)
    examples = getattr(dataset._source, "examples", None)
    stream = getattr(examples, "stream", None)
    files = getattr(stream, "files", None) or getattr(
        getattr(stream, "source", None), "files", None
    )
    if files:
        advice = (
            f"all {len(files)} file(s) of its `kh.data.from_arrow` / "
            "`from_tfrecords` examples. With `kh.data.shard(..., "
            'reads="own")` each reads only the blocks of its own rows '
            "(docs/arrow.md)."
        )
    else:
        find = getattr(dataset._source, "file_readers", None)
        readers = [] if find is None else find()
        if not readers:
            return
        advice = (
            f"the whole {' and '.join(readers)} stream and keeps its rows of "
            "each global batch. Parse and decode in `kh.data.shard(..., "
            "map_fn=...)`, which runs on each worker's own rows only; "
            "indexed TFRecords (`kh.data.from_tfrecords`) or Parquet "
            '(`kh.data.from_arrow`) with `reads="own"` are read each '
            "worker's rows alone (docs/arrow.md)."
        )
    _ADVISED.append(True)
    logger.warning(
        "kh.data.shard: each of the %d workers reads %s", workers, advice
    )


def check_shuffle(shuffle, examples):
    """`shuffle` for `shard` as None, True or a buffer size.

    Raises:
        ValueError: For another value, or `True` with examples of unknown
            number.
    """
    if shuffle is None or shuffle is False:
        return None
    if shuffle is True:
        if int(examples.cardinality()) < 0:
            raise ValueError(
                "Invalid value for argument `shuffle`. Received: shuffle=True "
                "(the whole pass) for examples of unknown or infinite number. "
                "Pass a buffer size (`shuffle=10_000`), or "
                "`examples.apply(tf.data.experimental.assert_cardinality(n))`."
            )
        return True
    return check_int(
        "shuffle",
        _plain_int(shuffle),
        expected="None, True or a buffer size (an integer >= 1)",
    )


def check_seed(seed):
    """`seed` as None or an int >= 0.

    Raises:
        ValueError: For another value.
    """
    if seed is None:
        return None
    return check_int(
        "seed", _plain_int(seed), 0, expected="None or an integer >= 0"
    )


def _plain_int(value):
    return int(value) if isinstance(value, np.integer) else value
