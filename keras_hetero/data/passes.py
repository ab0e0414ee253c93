"""The passes over a `kh.data.shard` dataset's examples: their numbers,
their shuffle seeds, and the examples of one pass in its order. Pass `p`'s
order is a function of `(seed, p)` only, the same on every worker and
after a restart."""

import threading
import warnings

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero.data import reproducibility

# The graph-level seed of the function that shuffles one pass (see
# `DatasetSource.pass_batches`); any constant but 0 (TensorFlow reads a
# (0, 0) seed pair as "no seed").
_GRAPH_SEED = 20240517


class PassOrder:
    """Numbers the passes over the examples and holds the shuffle seed.

    Pass `p`'s order is a function of `(seed, p)` only: every worker runs
    the same passes in the same order, so all of them shuffle alike, and a
    restart that resumes pass `p` with the same seed repeats its order.
    Shared by the views `with_options` / `prefetch` / `cache` return.
    """

    def __init__(self, shuffle, seed, first_pass=0):
        self._lock = threading.Lock()
        self.shuffle = shuffle
        self.seed = seed
        self._next = int(first_pass)

    @property
    def next_pass(self):
        with self._lock:
            return self._next

    def choose_seed(self, strategy):
        """Picks a seed if the passes are shuffled and none was given."""
        if self.shuffle is None or self.seed is not None:
            return
        drawn = int(np.random.randint(0, 2**31 - 1))
        seed = _distribute.broadcast_from_first_replica(strategy, drawn)
        with self._lock:
            if self.seed is None:
                self.seed = seed

    def restart(self, pass_number=None, seed=None):
        with self._lock:
            if pass_number is not None:
                self._next = int(pass_number)
            if seed is not None:
                self.seed = int(seed)

    def start(self):
        """`(number, seed)` of the pass that starts now."""
        with self._lock:
            number, self._next = self._next, self._next + 1
            return number, self.seed


# `pass_seed(seed, p) = (seed * A + p * B + 1) mod M`: simple enough to compute
# in TensorFlow ops too (`tf_pass_seed`), for pipelines that run without
# Python (parameter-server workers), so every strategy sees the same orders.
_SEED_MODULUS, _SEED_FACTOR, _PASS_FACTOR = 2147483647, 48271, 69621


def pass_seed(seed, pass_number):
    """A 31-bit integer that is a function of `(seed, pass_number)`."""
    mixed = (int(seed) % _SEED_MODULUS) * _SEED_FACTOR
    return (mixed + int(pass_number) * _PASS_FACTOR + 1) % _SEED_MODULUS


def tf_pass_seed(seed, pass_number):
    """`pass_seed` of a tensor `pass_number`, as an int64 tensor."""
    mixed = tf.constant((int(seed) % _SEED_MODULUS) * _SEED_FACTOR, tf.int64)
    mixed += tf.cast(pass_number, tf.int64) * _PASS_FACTOR + 1
    return mixed % _SEED_MODULUS


# `HeteroDataset.shuffle_mechanism` values (recorded in checkpoints).
ARROW_PERMUTATION = "arrow permutation"
GLOBAL_SHUFFLE = "global shuffle"


def mechanism_before_record(mechanism):
    """The shuffle mechanism of a checkpoint written before checkpoints
    recorded it, for a dataset that now shuffles by `mechanism`: until
    then `shuffle=True` over tf.data and `from_arrow` examples took a
    buffer of the pass; arrays and buffer sizes shuffle as they did."""
    if mechanism in (ARROW_PERMUTATION, GLOBAL_SHUFFLE):
        return "buffer of the pass"
    return mechanism


def shuffled(source, shuffle, seed):
    """The examples of `source` (a `DatasetSource`) in the order of one
    shuffled pass.

    Chosen by measurement (benchmarks/input.py --mode shuffle,
    docs/checkpoints.md): `shuffle=True` over `kh.data.from_arrow` examples
    converts the pass whole and permutes it (`shuffled_pass`: the skipped
    examples of a resumed pass are only indices). Over examples that
    support random access (`DatasetSource.random_access`) it is tf.data's
    global shuffle, a pure function of `seed` with no buffer: for 10^6
    examples a pass starts 17-21x sooner than through a buffer of the
    pass, resumes after 500,000 of them 1.6-4.6x sooner (`.skip` still
    fetches each skipped example, but fills no buffer) and runs 1.9-2.4x
    faster. Other examples, and a buffer size, go through
    `Dataset.shuffle`, whose `.skip(k)` fills the buffer (with `True`: the
    whole pass) and reads k examples.

    tf.data's shuffles seed themselves from the graph-level seed too, which
    is the process's global seed (`tf.random.set_seed`) and may differ
    between workers. Fixing the calling function's own graph-level seed
    makes the order a function of `seed` alone.
    """
    tf.random.set_seed(_GRAPH_SEED)
    mechanism = source.shuffle_mechanism(shuffle)
    if mechanism == ARROW_PERMUTATION:
        return source.examples.shuffled_pass(seed)  # `kh.data.from_arrow`
    if mechanism == GLOBAL_SHUFFLE:
        return _compat.global_shuffle(source.examples, seed)
    buffer = source.num_examples if shuffle is True else shuffle
    return source.examples.shuffle(
        buffer, seed=seed, reshuffle_each_iteration=False
    )


class DatasetSource:
    """Examples from an unbatched `tf.data.Dataset`."""

    def __init__(self, examples):
        self.examples = examples
        count = int(examples.cardinality())
        self.num_examples = None if count < 0 else count
        self._random_access = None
        self._stages = None
        self._readers = None
        self._map_fn_stages = None

    @property
    def random_access(self):
        """Whether the examples support random access (checked once, by
        reading one example through tf.data's global shuffle)."""
        if self._random_access is None:
            self._random_access = _compat.supports_random_access(self.examples)
        return self._random_access

    def cache(self, filename):
        return DatasetSource(self.examples.cache(filename))

    def shuffle_mechanism(self, shuffle):
        """How `shuffled` orders a pass (`HeteroDataset.shuffle_mechanism`)."""
        if shuffle is True and hasattr(self.examples, "shuffled_pass"):
            return ARROW_PERMUTATION
        if shuffle is True and self.random_access:
            return GLOBAL_SHUFFLE
        return (
            "buffer of the pass" if shuffle is True else f"buffer of {shuffle}"
        )

    def unreproducible_stages(self):
        self._inspect()
        return list(self._stages)

    def file_readers(self):
        """The file-reading tf.data sources of the examples (their class
        names), from the same inspection as `unreproducible_stages`."""
        self._inspect()
        return list(self._readers)

    def _inspect(self):
        if self._stages is None:  # the pipeline never changes
            try:
                self._stages, self._readers = reproducibility.inspect(
                    self.examples
                )
            except ValueError as error:
                # Not a reason to refuse input that may well be fine.
                warnings.warn(
                    f"{error} Exact resume and multi-worker training need "
                    "the examples in the same order in every process; make "
                    'sure they are (docs/checkpoints.md, "Input pipelines '
                    'and exact resume").',
                    UserWarning,
                    stacklevel=3,
                )
                self._stages, self._readers = [], []

    def map_fn_stages(self, map_fn):
        """`reproducibility.map_fn_stages` of `map_fn` (or `[]`), once."""
        if map_fn is None:
            return []
        if self._map_fn_stages is None or self._map_fn_stages[0] is not map_fn:
            try:
                found = reproducibility.map_fn_stages(self.examples, map_fn)
            except ValueError as error:
                warnings.warn(str(error), UserWarning, stacklevel=2)
                found = []
            self._map_fn_stages = (map_fn, found)
        return list(self._map_fn_stages[1])

    def pass_batches(self, start_pass, global_batch_size, shuffle):
        """One pass's global batches (traced once, run at each pass)."""

        def start():
            skip, number, seed = start_pass()
            order_seed = 0 if shuffle is None else pass_seed(seed, number)
            return np.array([skip, order_seed], np.int64)

        info = tf.numpy_function(start, [], tf.int64)
        info.set_shape([2])
        examples = self.examples
        if shuffle is not None:
            examples = shuffled(self, shuffle, info[1])
        return examples.skip(info[0]).batch(global_batch_size)


def endless_batches(source, global_batch_size, shuffle, seed, first_pass):
    """The global batches of pass `first_pass` and every later one, in the
    order `DatasetSource.pass_batches` gives each pass, built without
    Python (parameter-server workers run the pipeline on their own).

    Args:
        source: A `DatasetSource`.
        global_batch_size: Rows per global batch.
        shuffle: None, True or a buffer size.
        seed: The passes' seed (None when not shuffled).
        first_pass: The number of the first pass.

    Returns:
        An endless, batched `tf.data.Dataset`.
    """

    def one_pass(number):
        passed = source.examples
        if shuffle is not None:
            passed = shuffled(source, shuffle, tf_pass_seed(seed, number))
        return passed.batch(global_batch_size)

    return tf.data.Dataset.range(first_pass, 2**62).flat_map(one_pass)


# `HeteroDataset.shuffle_mechanism` under `reads="own"`.
BLOCK_ORDER = "block order and rows within blocks"


class BlockSource:
    """`kh.data.from_arrow` or `from_tfrecords` examples read in blocks,
    each worker only the blocks with rows of its replicas
    (`kh.data.shard(reads="own")`).

    A pass's elements are its global batches' row counts; the split reads
    each worker's rows once it knows the batch's bounds
    (`split.replica_pipeline(read=...)`), through a `blocks.BlockReader`.

    Args:
        examples: What `kh.data.from_arrow` or `from_tfrecords` returned,
            untransformed.
    """

    def __init__(self, examples):
        self.examples = examples
        self.num_examples = int(examples.cardinality())
        self.reader = None
        self._resume = None

    def shuffle_mechanism(self, shuffle):
        return BLOCK_ORDER

    def unreproducible_stages(self):
        return []  # blocks are read by number, in an order of (seed, pass)

    def map_fn_stages(self, map_fn):
        return []  # `map_fn` runs after the split, on each worker's rows

    def cache(self, filename):
        raise ValueError(
            '`cache` has no use under `reads="own"`: each worker keeps the '
            "blocks it reads only while their rows last. Cache the files "
            "on local disk instead."
        )

    def attach(self, input_context, num_replicas):
        """Makes this worker's `blocks.BlockReader` (once per process)."""
        from keras_hetero.data import blocks

        workers = input_context.num_input_pipelines
        if self.reader is None:
            self.reader = blocks.BlockReader(
                self.examples.stream,
                num_replicas // workers,
                input_context.input_pipeline_id,
                workers,
            )

    def resume_at(self, state):
        """The next pass with a skip starts at the queue `state` (from
        `state_after` of the interrupted run)."""
        self._resume = state

    def state_after(self, pass_number, steps):
        """The queue's state after `steps` steps of a pass, or None."""
        if self.reader is None:
            return None
        return self.reader.state_after(pass_number, steps)

    def pass_batches(self, start_pass, global_batch_size, shuffle):
        """One pass's global batches as their row counts."""

        def start():
            return np.int64(self.start_reader(*start_pass(), shuffle))

        left = tf.numpy_function(start, [], tf.int64, stateful=True)
        left.set_shape([])
        size = tf.constant(global_batch_size, tf.int64)
        steps = (left + size - 1) // size
        return tf.data.Dataset.range(steps).map(
            lambda step: tf.minimum(size, left - step * size)
        )

    def start_reader(self, skip, number, seed, shuffle):
        """Starts pass `number` on this worker's reader, `skip` examples
        in (a resumed pass).

        Returns:
            The rows the pass has left to train.
        """
        order_seed = None if shuffle is None else pass_seed(seed, number)
        state = None
        if skip:
            state, self._resume = self._resume, None
            if state is None:
                raise ValueError(
                    f"Resuming pass {number} after {skip} examples "
                    'under `reads="own"` needs the block queue\'s state '
                    "of that step, which the checkpoint does not hold."
                )
        return self.reader.start_pass(number, order_seed, state)

    def read(self, bounds, first, count):
        """This worker's rows of a global batch.

        Args:
            bounds: The global batch's replica row bounds.
            first: This worker's first replica.
            count: This worker's replicas.

        Returns:
            `(rows, local bounds)`: the rows of this worker's replicas, and
            their `count + 1` bounds in them.
        """
        stream = self.examples.stream
        spec = stream.spec()
        flat_spec = tf.nest.flatten(spec)

        def read_rows(bounds):
            values = self.reader.step(bounds)
            if values is None:
                values = stream.empty()
            return tf.nest.flatten(stream.nest(values))

        flat = tf.numpy_function(
            read_rows, [bounds], [s.dtype for s in flat_spec], stateful=True
        )
        for tensor, s in zip(flat, flat_spec):
            tensor.set_shape(s.shape)
        local = bounds[first : first + count + 1]
        return tf.nest.pack_sequence_as(spec, flat), local - local[0]
