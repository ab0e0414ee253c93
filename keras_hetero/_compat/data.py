"""tf.data and Keras input internals: class weights, global shuffle, random
access, lengths, pipeline graphs."""

import tensorflow as tf

from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.flavour import _data_adapter
from keras_hetero._compat.flavour import _data_adapter_utils


def class_weight_map_fn(class_weight):
    """Keras' own `class_weight` -> sample weights map for dataset batches.

    `fit(dataset, class_weight=...)` maps the dataset with it; a
    distributed dataset has no `map` (both flavours fail with
    "'DistributedDatasetsFromFunction' object has no attribute 'map'"), so
    a HeteroDataset applies it itself. Keras 3 refuses `class_weight` with
    sample weights in the data and gives classes missing from the dict the
    weight 1; tf-keras multiplies them and wants every class a key.
    """
    if IS_LEGACY:
        return _data_adapter._make_class_weight_map_fn(class_weight)
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    return tf_dataset_adapter.make_class_weight_map_fn(class_weight)


def array_class_weights(y, sample_weight, class_weight):
    """Per-example weights for array input, as each flavour's `fit` makes
    them from `class_weight` (Keras 3: `class_weight_to_sample_weights`,
    an error together with `sample_weight`; tf-keras: its dataset map on
    the arrays, multiplied with `sample_weight`)."""
    if IS_LEGACY:
        tensor = tf.convert_to_tensor(y)
        data = (
            (tensor, tensor)
            if sample_weight is None
            else (
                tensor,
                tensor,
                tf.convert_to_tensor(sample_weight),
            )
        )
        _, _, weights = class_weight_map_fn(class_weight)(*data)
        return weights.numpy()
    if sample_weight is not None:
        raise ValueError(
            "You cannot `class_weight` and `sample_weight` at the same time."
        )
    return _data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def global_shuffle(examples, seed):
    """`examples` in a random-access shuffled order: a function of `seed`
    (and the graph-level seed) only.

    tf.data's global shuffle (TF >= 2.15) maps output position `j` to input
    index `perm(j)` without a buffer; it is public only as the private
    `global_shuffle_op._global_shuffle` in TF 2.19-2.21 (TODO(b/325112575)
    upstream: "Move the API to dataset_ops.py"). Its order is the same on
    TF 2.19 and 2.21 (measured). It needs every upstream stage to support
    random access (`supports_random_access`).
    """
    from tensorflow.python.data.experimental.ops import global_shuffle_op

    return global_shuffle_op._global_shuffle(
        examples, seed=seed, reshuffle_each_iteration=False
    )


def supports_random_access(examples):
    """Whether `global_shuffle(examples, ...)` can run.

    There is no public query; the op refuses unsupported upstream stages
    (`filter`, `shuffle`, `unbatch`, `from_generator`, `TFRecordDataset`,
    ...) with a `FailedPreconditionError` when its iterator starts, or at
    the first element (`enumerate`; an upstream stage of unknown length
    under `take`: `InvalidArgumentError`), so we start one and read one
    element (which runs the upstream stages for that element once).
    """
    with tf.init_scope():  # also when called while a pipeline is traced
        try:
            next(iter(global_shuffle(examples, 0)))
        except (
            tf.errors.FailedPreconditionError,
            tf.errors.InvalidArgumentError,
            tf.errors.UnimplementedError,
        ):
            return False
        except (StopIteration, tf.errors.OutOfRangeError):
            pass  # no examples: nothing to read
    return True


class _KnownLength(tf.data.Dataset):
    """`dataset` whose `cardinality()` reports `length` (see
    `with_known_length`)."""

    def __init__(self, dataset, length):
        self._dataset = dataset
        self._length = int(length)
        super().__init__(tf.data.experimental.to_variant(dataset))

    def _inputs(self):
        return [self._dataset]

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def cardinality(self):
        return tf.constant(self._length, tf.int64)


def with_known_length(dataset, length):
    """`dataset`, reporting `length` elements to Keras.

    Keras reads a dataset's length from `cardinality()`; an input pipeline
    built per pass (`flat_map`) reports "unknown", and Keras 3 then takes
    the length of the first epoch it sees. A resumed epoch is short on
    purpose (its first steps ran before a restart), so every later epoch
    would be cut to its length. Multi-replica strategies return a
    distributed dataset whose `_cardinality` we set; one replica (the
    default strategy) returns the dataset itself, hence this wrapper.
    `tf.data.experimental.assert_cardinality` would fail the short epoch.
    """
    return _KnownLength(dataset, length)


def dataset_graph(dataset):
    """The `GraphDef` of a `tf.data.Dataset`'s pipeline, with the bodies of
    its functions (`map`, `filter`, ...) in `graph.library`.

    tf.data has no public way to inspect a pipeline's stages; the private
    `Dataset._as_serialized_graph` (the same call `tf.data.experimental.
    service` and snapshotting use, unchanged in TF 2.19-2.21) serializes it.
    Stages with Python state (`from_generator`, `py_function`) would make it
    warn; the policy `IGNORE` keeps it quiet, since we only read the graph.
    It copies constants captured in the pipeline (`from_tensor_slices` of
    numpy arrays): ~3 s for 400 MB here, and it fails above protobuf's 2 GB.
    """
    from tensorflow.core.framework import graph_pb2

    serialized = dataset._as_serialized_graph(
        external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE
    )
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(serialized.numpy())
    return graph


def without_last_cardinality_assertion(dataset):
    """`dataset` without its last stage if that stage is
    `tf.data.experimental.assert_cardinality`, else `dataset`.

    A tf.data service in `"distributed_epoch"` mode runs the pipeline on
    each of its workers over a part of the data, where an asserted total
    fails ("Input dataset was expected to contain N elements but contained
    only M"); `kh.data.shard(service=...)` still reads the total from it.
    tf.data keeps the stage's input in the private `_input_dataset` of
    `_AssertCardinalityDataset` (tensorflow/python/data/experimental/ops/
    cardinality.py, unchanged in TF 2.19-2.21).
    """
    if type(dataset).__name__ == "_AssertCardinalityDataset":
        return dataset._input_dataset
    return dataset


def set_steps_of_distributed_dataset(distributed, steps):
    """Makes Keras read `steps` as a distributed dataset's length.

    TF reports a worker pipeline's element count (one per LOCAL replica per
    global batch) as the distributed dataset's cardinality, stored in its
    private `_cardinality`, which Keras reads as steps per epoch.
    """
    distributed._cardinality = steps


def without_partial_batch_check(distributed):
    """No per-step "does every replica have data" collective.

    Upstream (tensorflow/python/distribute/input_lib.py,
    `_enable_get_next_as_optional`, TF 2.19-2.21): an iterator of a finite
    distributed dataset whose element shapes are not static, or under a
    multi-worker strategy, all-reduces at every step whether each replica
    got a value (partial-batch handling): one collective per step, a round
    trip on the network under MultiWorkerMirroredStrategy. A
    `kh.data.shard` dataset gives every replica an element for every
    global batch (possibly with no rows), so all replicas run out at the
    same step and the check can go. The flag is read when an iterator is
    made; set on the distributed dataset, it holds for its iterators.
    """
    if hasattr(distributed, "_enable_get_next_as_optional"):
        distributed._enable_get_next_as_optional = False
    return distributed


def host_variable(initial_value, shape=None):
    """A plain resource variable on the current device, also inside a
    strategy's scope.

    `tf.Variable` inside `strategy.scope()` goes through the strategy's
    variable creator and becomes a MirroredVariable (or, under
    ParameterServerStrategy, lives on a parameter server). A `kh.data.shard`
    dataset is often made inside the scope, yet its pipeline's own state
    (data/bounds.py) must be one local variable next to the pipeline.
    Constructing TF's `ResourceVariable` class directly skips the creator
    stack (`VariableMetaclass.__call__` routes only `tf.Variable(...)`
    through it; unchanged in TF 2.19-2.21). Not trainable.
    """
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.ResourceVariable(
        initial_value, trainable=False, shape=shape
    )


def inline_map(dataset, map_func):
    """`dataset.map(map_func)`, its function run on the calling thread.

    For the split's own small per-element functions (data/shard.py): a few
    dozen scalar ops and slices. `Dataset.map` runs each call on TF's
    inter-op thread pool, and the hand-off costs more than such a function:
    measured on TF 2.21 (2-core VM; benchmarks/split_pipeline.py), about
    100 us of wall time per call over no map at all, whatever the function
    holds, against about 10 us with TF's single-threaded executor, which
    `MapDataset`'s `use_inter_op_parallelism=False` selects. The public
    `map` has no such argument (no upstream issue asks for one; TF uses it
    internally); the private `_MapDataset` has it, with this signature, in
    TF 2.19-2.21 (the tested range, pyproject.toml). Same
    element order, cardinality and results: only the executor differs. Not
    for user functions (whose control flow the single-threaded executor
    may not run) nor for parallel maps.
    """
    from tensorflow.python.data.ops import map_op

    return map_op._MapDataset(
        dataset,
        map_func,
        use_inter_op_parallelism=False,
        preserve_cardinality=True,
    )


def iterators_without_autotuning():
    """Every tf.data iterator made from now on runs without tf.data's
    autotuning thread (`options.autotune.enabled = False`); returns a
    function that undoes it.

    For the test suite only (tests/conftest.py), not for users' pipelines.
    Destroying an iterator joins that thread, which can first sleep out an
    optimization period of up to 60 s (benchmarks/RESULTS.md, "Input iterator
    teardown"; no upstream issue found). A fit stopped mid-epoch leaves its
    iterator to the garbage collector, so the wait lands in some later test
    or at exit: in CI, tests of a few seconds took 40-140 s at random.
    `kh.data.shard` already sets the option; stock pipelines built by
    tests (`experimental_distribute_dataset`, Keras' own adapters) do not.
    Every iterator passes its dataset through the private
    `Dataset._apply_debug_options` first (`OwnedIterator`,
    `MultiDeviceIterator` and `OwnedMultiDeviceIterator`, TF 2.19-2.21, the
    tested range, pyproject.toml); the hook sets the option there. Same
    elements, order and results: only the thread is gone (`AUTOTUNE`
    parallelism takes TF's default, the core count).
    """
    from tensorflow.python.data.ops import dataset_ops

    original = dataset_ops.DatasetV2._apply_debug_options

    def apply_debug_options(self):
        options = tf.data.Options()
        options.autotune.enabled = False
        return original(self.with_options(options))

    dataset_ops.DatasetV2._apply_debug_options = apply_debug_options

    def undo():
        dataset_ops.DatasetV2._apply_debug_options = original

    return undo
