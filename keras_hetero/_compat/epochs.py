"""The Keras and tf.data internals HeteroModel's epoch boundaries rest on
(the why and the policy: `training/epochs.py`): which ops a tf.data
pipeline runs and which stages draw new seeds per iterator (tf.data's
private `_inputs()` / `_functions()`), Keras 3's `TFEpochIterator` and
tf-keras' `DataHandler` made to read an input repeated and to release the
iterators they replace off the training thread, and Keras 3's variable
assignment without a read-back. Each subclass takes its decisions from the
`epochs` policy a HeteroModel carries (`_kh_epochs`); other models keep
Keras' own classes.
"""

import contextlib
import threading

import tensorflow as tf

from keras_hetero._compat.flavour import EPOCH_ITERATOR_YIELDS_STEP_RANGE
from keras_hetero._compat.flavour import IS_LEGACY

# Stateful random ops that keep their state in the kernel (also what
# `data.reproducibility` looks for in a pipeline). Each new iterator
# runs the pipeline's functions with new kernels, so re-iterating a pipeline
# draws the same numbers every pass, while a repeated one draws on (measured
# on TF 2.21: `map(lambda x: tf.random.uniform(...))`; Keras 3's array input
# with `shuffle=True` shuffles by `tf.random.shuffle` and so gives every
# epoch the same order). Seed generators (`Dataset.shuffle`,
# `Dataset.random`) and `tf.random.Generator` / Keras seed state live in
# resources and variables that outlive iterators: alike either way.
KERNEL_RANDOM_STATE = frozenset(
    {
        "Multinomial",
        "ParameterizedTruncatedNormal",
        "RandomCrop",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "SampleDistortedBoundingBox",
        "SampleDistortedBoundingBoxV2",
        "TruncatedNormal",
    }
)

# State outside the pipeline that the program may change between epochs: a
# variable a map reads (a curriculum or augmentation strength that a
# callback sets in `on_epoch_end`), Python code (`tf.py_function`). A new
# iterator per epoch makes every element of the next epoch after that
# change; one repeated iterator that prefetches makes the next epoch's first
# elements during this one, with the old value. Such pipelines keep an
# iterator per epoch (the same conservatism covers Keras preprocessing
# layers in a `map`, which read their variables).
OUTSIDE_STATE = frozenset(
    {
        "EagerPyFunc",
        "PyFunc",
        "PyFuncStateless",
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VarHandleOp",
    }
)


def finds(dataset, ops):
    """Whether a function of `dataset`'s pipeline (or one it calls) runs one
    of `ops`: True, False, or None where a stage cannot be seen into."""
    try:
        for stage in _stages(dataset):
            kind = type(stage)
            if not kind.__module__.startswith("tensorflow.python.data") or (
                kind.__name__ == "_VariantDataset"
            ):
                return None
            for function in stage._functions():
                if _runs_any(function.function.graph, ops):
                    return True
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return False


def _stages(dataset):
    """`dataset` and every dataset upstream of it (tf.data's `_inputs()`)."""
    stack, seen = [dataset], set()
    while stack:
        stage = stack.pop()
        if id(stage) not in seen:
            seen.add(id(stage))
            yield stage
            stack.extend(stage._inputs())


def draws_seeds(dataset):
    """Whether a new iterator of `dataset` draws new seeds from a stage's
    seed generator: `shuffle(reshuffle_each_iteration=True)`,
    `Dataset.random(rerandomize_each_iteration=True)` (the private
    attributes of their classes in TF 2.19-2.21). Anything it cannot see
    into (a distributed dataset, such as `kh.data.shard`'s under Keras 3)
    may: yes."""
    try:
        return any(
            getattr(stage, "_reshuffle_each_iteration", False)
            or getattr(stage, "_rerandomize", False)
            for stage in _stages(dataset)
        )
    except (AttributeError, NotImplementedError, TypeError):
        return True


def _runs_any(graph, ops):
    if any(op.type in ops for op in graph.get_operations()):
        return True
    return any(
        node.op in ops
        for called in graph._functions.values()
        for node in called.cached_definition.node_def
    )


def ends_in_prefetch(dataset):
    while type(dataset).__name__ == "_OptionsDataset":
        (dataset,) = dataset._inputs()
    return type(dataset).__name__ == "_PrefetchDataset"


_ASSIGNING_WITHOUT_READING = threading.local()


@contextlib.contextmanager
def assigns_without_reading(active=True):
    """Keras 3's TF variables assign without reading the value back, on
    this thread, while the context lasts.

    Keras 3.15's `Variable._direct_assign` (keras/src/backend/tensorflow/
    core.py) calls `tf.Variable.assign` with its default `read_value=True`,
    and `Variable.assign` drops what that returns. A metric's variables
    under a strategy are SyncOnRead: reading one is a cross-replica
    reduction, under MultiWorkerMirroredStrategy an all-reduce across the
    workers, one per metric variable every time `fit` resets its metrics
    (each epoch) - 20-60 ms per epoch for the loss alone (measured on a
    loaded 2-core machine, 2 workers).
    """
    if IS_LEGACY or not active:
        yield
        return
    _install_assign_without_reading()
    _ASSIGNING_WITHOUT_READING.active = True
    try:
        yield
    finally:
        _ASSIGNING_WITHOUT_READING.active = False


def _install_assign_without_reading():
    from keras.src.backend.tensorflow import core

    keras_assign = core.Variable._direct_assign
    if getattr(keras_assign, "_keras_hetero", False):
        return

    def _direct_assign(variable, value):
        if not getattr(_ASSIGNING_WITHOUT_READING, "active", False):
            return keras_assign(variable, value)
        variable._value.assign(
            tf.cast(value, variable._value.dtype), read_value=False
        )

    _direct_assign._keras_hetero = True
    core.Variable._direct_assign = _direct_assign


class EpochComplete(StopIteration):
    """Raised (by `callbacks.end_epoch_before_step`) when an epoch's data is
    done before Keras 3's step count for it: a resumed epoch. A repeated
    input then stands at the next epoch's first batch."""


if IS_LEGACY:
    _TFEpochIterator = object
else:
    from keras.src.backend.tensorflow.trainer import (
        TFEpochIterator as _TFEpochIterator,
    )


class _EpochIterator(_TFEpochIterator):
    """Keras 3's `TFEpochIterator`, reading its input repeated where
    the policy's `repeatable` allows (`_pass_steps` steps per epoch, from
    one iterator),
    else making one iterator per epoch (not two), and releasing the
    iterators it replaces off the training thread.

    `_current_iterator` is a property here: every iterator Keras' own code
    replaces or clears (`reset`, `catch_stop_iteration`) is retired, and
    released once the epoch loop has moved on to the next one.
    """

    @property
    def _current_iterator(self):
        return self.__dict__.get("_kh_iterator")

    @_current_iterator.setter
    def _current_iterator(self, iterator):
        previous = self.__dict__.get("_kh_iterator")
        if previous is not iterator:
            self._kh_retired.add(previous)
        self.__dict__["_kh_iterator"] = iterator

    def _entry(self, step, iterator):
        if EPOCH_ITERATOR_YIELDS_STEP_RANGE:
            return step, step + self.steps_per_execution - 1, iterator
        return step, iterator

    def _enumerate_iterator(self):
        if self._kh_pass_steps:
            yield from self._enumerate_pass()
            return
        # Keras 3.15's `EpochIterator._enumerate_iterator` (Apache-2.0) but
        # for two changes: no iterator made after an epoch's last step that
        # the next epoch replaces anyway (without `steps_per_epoch`; made
        # all the same where making it draws the input's shuffle seeds, so
        # each epoch's order stays Keras'), and an unknown-length input's
        # iterator held (to be retired) instead of living only in the
        # loop's variable.
        self.data_adapter.on_epoch_begin()
        steps_per_epoch = self.steps_per_epoch or self._num_batches or -1
        if steps_per_epoch > 0:
            if self._current_iterator is None or self.steps_per_epoch is None:
                self._current_iterator = iter(self._get_iterator())
                self._steps_seen = 0
            for step in range(0, steps_per_epoch, self.steps_per_execution):
                if self._num_batches and self._steps_seen >= self._num_batches:
                    if self.steps_per_epoch:
                        self._interrupted_warning()
                    break
                self._steps_seen += self.steps_per_execution
                yield self._entry(step, self._current_iterator)
                # Keras' loop holds this epoch's iterator now, not the last.
                self._kh_retired.release()
            if self._num_batches and self._steps_seen >= self._num_batches:
                if self.steps_per_epoch or self._kh_draws_seeds:
                    self._current_iterator = iter(self._get_iterator())
                self._steps_seen = 0
        else:
            self._current_iterator = iter(self._get_iterator())
            step = -self.steps_per_execution
            while True:
                step += self.steps_per_execution
                self._steps_seen = step + self.steps_per_execution
                yield self._entry(step, self._current_iterator)
                self._kh_retired.release()
        self.data_adapter.on_epoch_end()

    def _enumerate_pass(self):
        # The input repeated: an epoch is the next `_pass_steps` steps of
        # one iterator, which stands at a pass's start after a whole epoch.
        # A new iterator (a pass from its start, as Keras' would) follows
        # only an epoch that ended early (a callback, `stop_training`).
        self.data_adapter.on_epoch_begin()
        if self._current_iterator is None or not self._kh_at_pass_start:
            self._current_iterator = iter(self._get_iterator())
        self._kh_at_pass_start = False
        self._steps_seen = 0
        for step in range(0, self._kh_pass_steps, self.steps_per_execution):
            self._steps_seen += self.steps_per_execution
            yield self._entry(step, self._current_iterator)
            self._kh_retired.release()
        self._kh_at_pass_start = True
        self.data_adapter.on_epoch_end()

    def reset(self):
        # `evaluate` resets the validation iterator before each run; one
        # that stands at a pass's start reads on.
        kept = None
        if self._kh_pass_steps and self._kh_at_pass_start:
            kept = self.__dict__.pop("_kh_iterator", None)
        super().reset()
        if kept is not None:
            self.__dict__["_kh_iterator"] = kept

    @contextlib.contextmanager
    def catch_stop_iteration(self):
        with super().catch_stop_iteration():
            try:
                yield
            except EpochComplete:
                if not self._kh_endless:
                    raise
                # An endless input (a repeated `kh.data.shard` dataset) stands
                # at the next epoch's first batch: read on. Keras would drop
                # the iterator and take the short epoch for the input's
                # length (`EpochIterator.catch_stop_iteration`).
                self.data_adapter.on_epoch_end()

    def __del__(self):
        # The last iterator, usually when `fit` or `evaluate` returns.
        self._kh_policy.release([self.__dict__.pop("_kh_iterator", None)])
        self._kh_retired.release()


def adopt_epoch_iterator(iterator, strategy, policy):
    """Makes the `TFEpochIterator` Keras 3's `fit` / `evaluate` just made an
    `_EpochIterator` (HeteroModel's `_maybe_symbolic_build` calls this with
    it, before Keras iterates it), deciding with `policy` (the model's
    `_kh_epochs`: `keras_hetero.training.epochs`; None for Keras' own
    iterator). Idempotent; anything else is unchanged.
    """
    if (
        IS_LEGACY
        or type(iterator) is not _TFEpochIterator
        or policy is None
        or not policy.enabled()
    ):
        return
    from keras.src.trainers.data_adapters import array_data_adapter
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    current = iterator.__dict__.pop("_current_iterator", None)
    iterator._kh_policy = policy
    iterator._kh_retired = policy.RetiredIterators()
    # `steps_per_epoch` with an endless input: Keras keeps one iterator.
    iterator._kh_endless = bool(iterator.steps_per_epoch) and (
        iterator._num_batches is None
    )
    iterator._kh_pass_steps = None
    iterator._kh_at_pass_start = True
    iterator._kh_draws_seeds = False
    iterator.__class__ = _EpochIterator
    iterator.__dict__["_kh_iterator"] = current
    adapters = (
        tf_dataset_adapter.TFDatasetAdapter,
        array_data_adapter.ArrayDataAdapter,
    )
    adapter = iterator.data_adapter
    if iterator.steps_per_epoch is not None or not isinstance(
        adapter, adapters
    ):
        return
    dataset = adapter.get_tf_dataset()
    steps = iterator._num_batches
    iterator._kh_draws_seeds = draws_seeds(dataset)
    if policy.repeatable(dataset, steps, iterator.steps_per_execution):
        unread = "between" if iterator._kh_draws_seeds else None
        distributed = strategy.experimental_distribute_dataset(
            policy.repeated(dataset, unread)
        )
        iterator._distributed_dataset = distributed
        iterator._kh_pass_steps = steps


if IS_LEGACY:
    from tf_keras.src.engine import data_adapter as _data_adapter

    class _DataHandler(_data_adapter.DataHandler):
        """tf-keras' `DataHandler`, reading a `tf.data.Dataset` repeated
        where the policy's `repeatable` allows (one iterator while each
        epoch reads a whole pass, also across `evaluate` calls of the
        validation data), and releasing the iterators it replaces off the
        training thread once `fit` / `evaluate` hold the next one (at their
        next `steps`)."""

        def __init__(self, policy, *args, **kwargs):
            self._kh_policy = policy
            self._kh_retired = policy.RetiredIterators()
            self._kh_iterator = None
            self._kh_pass_steps = None
            self._kh_at_pass_start = True
            super().__init__(*args, **kwargs)

        def _configure_dataset_and_inferred_steps(
            self, strategy, x, steps_per_epoch, class_weight, distribute
        ):
            # tf-keras 2.21's own (Apache-2.0), but for the repeat.
            del x
            dataset = self._adapter.get_dataset()
            if class_weight:
                dataset = dataset.map(
                    _data_adapter._make_class_weight_map_fn(class_weight)
                )
            self._inferred_steps = self._infer_steps(steps_per_epoch, dataset)
            if (
                steps_per_epoch is None
                and distribute
                and isinstance(self._adapter, _data_adapter.DatasetAdapter)
                and self._kh_policy.repeatable(dataset, self._inferred_steps, 1)
            ):
                # tf-keras shortens a call to the epoch's remaining steps
                # (`DataHandler.steps`): any `steps_per_execution` works.
                unread = None
                if draws_seeds(dataset):
                    calls = self._epochs - self._initial_epoch
                    unread = "each" if calls == 1 else "first"
                dataset = self._kh_policy.repeated(dataset, unread)
                self._kh_pass_steps = self._inferred_steps
            if distribute and not _data_adapter._is_distributed_dataset(
                dataset
            ):
                dataset = strategy.experimental_distribute_dataset(dataset)
            self._dataset = dataset
            self._validate_data_handler()

        def enumerate_epochs(self):
            # tf-keras 2.21's own (Apache-2.0), but every iterator it lets go
            # is held (and released off the training thread), and a repeated
            # input is read on while each epoch ended at a pass's end (also
            # across `evaluate` calls).
            with self._truncate_execution_to_epoch():
                reads_on = self._kh_pass_steps and self._kh_at_pass_start
                if not reads_on or self._kh_iterator is None:
                    self._hold(iter(self._dataset))
                for epoch in range(self._initial_epoch, self._epochs):
                    if self._insufficient_data:
                        break
                    if not self._kh_pass_steps and (
                        self._adapter.should_recreate_iterator()
                    ):
                        self._hold(iter(self._dataset))
                        if not isinstance(
                            self._dataset, _data_adapter.DistributedDataset
                        ):
                            steps = self._infer_steps(
                                self._steps_per_epoch, self._dataset
                            )
                            if steps is not None:
                                self._inferred_steps = steps
                    self._kh_at_pass_start = False
                    yield epoch, self._kh_iterator
                    self._adapter.on_epoch_end()

        def _hold(self, iterator):
            if iterator is not self._kh_iterator:
                self._kh_retired.add(self._kh_iterator)
                self._kh_iterator = iterator

        def steps(self):
            self._kh_retired.release()
            first_step = self._initial_step
            yield from super().steps()
            # Reached only when the epoch ran all its steps.
            self._kh_at_pass_start = (
                first_step == 0
                and not self._insufficient_data
                and self._current_step == self._inferred_steps
            )

        def __del__(self):
            self._kh_policy.release([self.__dict__.pop("_kh_iterator", None)])
            self._kh_retired.release()

    _get_data_handler = _data_adapter.get_data_handler

    def _hetero_data_handler(*args, **kwargs):
        policy = getattr(kwargs.get("model"), "_kh_epochs", None)
        if (
            policy is None
            or getattr(kwargs["model"], "_cluster_coordinator", None)
            or not policy.enabled()
        ):
            return _get_data_handler(*args, **kwargs)
        return _DataHandler(policy, *args, **kwargs)


def install_data_handlers():
    """tf-keras: HeteroModels' `fit` / `evaluate` get `_DataHandler`s.

    tf-keras' `fit` and `evaluate` call `data_adapter.get_data_handler(...,
    model=self)` (tf_keras/src/engine/training.py); the replacement returns
    tf-keras' own handler for every other model (and under
    ParameterServerStrategy, whose coordinator handlers differ). Idempotent.
    """
    if IS_LEGACY and _data_adapter.get_data_handler is _get_data_handler:
        _data_adapter.get_data_handler = _hetero_data_handler
