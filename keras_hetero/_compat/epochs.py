"""Epoch boundaries: the input iterator each epoch reads, made once where
that reads the same epochs, and released off the training thread.

What stock Keras pays at every epoch boundary (measured on TF 2.21, Keras
3.15 and tf-keras 2.21; docs/benchmarks.md, "Epoch boundaries"):

- Tearing down the iterator of the epoch that ended. A tf.data iterator
  with autotuning (the default) joins its autotuning thread when it is
  destroyed, and that thread may first sleep out its optimization period,
  which doubles up to 60 s while the iterator lives: 0.6-1 s at random
  after 12 steps of 0.14 s. Keras drops the iterator on the training
  thread: Keras 3.15 when `fit`'s loop variable (`for begin_step,
  end_step, iterator in epoch_iterator`, keras/src/backend/tensorflow/
  trainer.py) moves to the next epoch's; tf-keras 2.21 likewise (`for
  epoch, iterator in data_handler.enumerate_epochs()`, tf_keras/src/
  engine/training.py). The join does not hold the GIL: here the last
  reference goes on a thread of its own.
- Making the next iterator: ~1 ms for a dataset, 0.1-0.3 s for a
  distributed one over 2 devices (`MultiDeviceIterator` traces its
  per-device functions again), about 0.2 s under MultiWorkerMirrored-
  Strategy with 2 workers. Keras 3 makes two per boundary
  (`EpochIterator._enumerate_iterator`, keras/src/trainers/
  epoch_iterator.py, makes one after an epoch's last step, and without
  `steps_per_epoch` another at the next epoch's start); here none where
  the input is read repeated: a `kh.data.shard` dataset (pass `p` is a
  function of `(seed, p)` however it is iterated; tf-keras already reads
  it so), and a finite `tf.data.Dataset` (or Keras 3's unshuffled array
  input) whose passes come out the same either way (`repeats_alike`),
  also under MultiWorkerMirroredStrategy. Elsewhere one, or Keras' two
  where each draws a reshuffling input's seeds (`_draws_seeds`).
- Keras 3's metric reset reads every metric variable back: an all-reduce
  per variable under a strategy (`assigns_without_reading`).

`keras_own_epoch_iterators` switches all of this off, for side-by-side
measurements and tests.
"""

import atexit
import contextlib
import sys
import threading
import time
import warnings

import tensorflow as tf

from keras_hetero._compat.flavour import EPOCH_ITERATOR_YIELDS_STEP_RANGE
from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.model import steps_per_execution

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
_OUTSIDE_STATE = frozenset(
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
_EPOCH_DEPENDENT = KERNEL_RANDOM_STATE | _OUTSIDE_STATE


# Off inside `keras_own_epoch_iterators`.
_ENABLED = threading.Event()
_ENABLED.set()


@contextlib.contextmanager
def keras_own_epoch_iterators():
    """HeteroModel as without this module, while the context lasts: Keras'
    own epoch iterators (tf-keras' data handlers), a `kh.data.shard`
    dataset iterated anew each epoch under Keras 3, metric resets that read
    back. For side-by-side measurements (benchmarks/epoch_boundary.py) and
    tests; not thread-safe, not nestable."""
    _ENABLED.clear()
    try:
        yield
    finally:
        _ENABLED.set()


def repeats_alike(dataset):
    """Whether each pass of `dataset.repeat()` gives what a new iterator of
    `dataset` gives.

    Walks the pipeline through tf.data's private `_inputs()` and
    `_functions()` (TF 2.19-2.21) and looks for `KERNEL_RANDOM_STATE` and
    `_OUTSIDE_STATE` ops in its functions (and the functions they call). A
    stage it cannot see into (a dataset class from outside
    `tensorflow.python.data`, or one rebuilt from a variant) answers no.
    """
    return _finds(dataset, _EPOCH_DEPENDENT) is False


def _finds(dataset, ops):
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


def _draws_seeds(dataset):
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


def reads_outside_state(dataset):
    """Whether `dataset`'s functions read `_OUTSIDE_STATE` (a variable,
    Python code), which the program may change between epochs: True,
    False, or None where a stage cannot be seen into (as in
    `repeats_alike`)."""
    return _finds(dataset, _OUTSIDE_STATE)


def _sharded_reads_outside_state(dataset):
    """`reads_outside_state` for a `kh.data.shard` dataset: its examples
    and its `map_fn` (traced on batches of the examples). A source that is
    not a `tf.data.Dataset` (arrays, Arrow) reads none; its `map_fn`, which
    cannot be traced without one: None."""
    examples = getattr(dataset._source, "examples", None)
    map_fn = dataset._map_fn
    if not isinstance(examples, tf.data.Dataset):
        return None if map_fn is not None else False
    found = reads_outside_state(examples)
    if found is not False or map_fn is None:
        return found
    try:
        batches = examples.batch(dataset.global_batch_size).map(map_fn)
    except Exception:  # noqa: BLE001 - fit raises it in its own words
        return None
    return reads_outside_state(batches)


def _runs_any(graph, ops):
    if any(op.type in ops for op in graph.get_operations()):
        return True
    return any(
        node.op in ops
        for called in graph._functions.values()
        for node in called.cached_definition.node_def
    )


def _repeatable(dataset, steps, execution_steps):
    """Whether an epoch of `steps` steps may read `dataset.repeat()`: a
    finite `tf.data.Dataset` that `repeats_alike`, `execution_steps`
    dividing `steps` (Keras 3 runs all of a call's steps while data lasts,
    so a call would read on into the next epoch).

    Also under MultiWorkerMirroredStrategy: its auto-sharding splits each
    global batch into one piece per replica, so every pass of the repeat
    gives each worker the pieces a new iterator would (checked against
    per-epoch iterators, shuffled, with a partial last batch:
    tests/training/test_epoch_boundary.py)."""
    return (
        isinstance(dataset, tf.data.Dataset)
        and bool(steps)
        and steps % execution_steps == 0
        and repeats_alike(dataset)
    )


def _repeated(dataset, unread=None):
    """`dataset.repeat()` reading each pass as a new iterator would.

    A pass starts only when asked for its first element: tf.data's
    default `inject_prefetch` would put an autotuned prefetch after the
    repeat, reading the next pass (and drawing its shuffle seeds) before
    the epoch's callbacks ran; it goes inside each pass instead, where it
    would be without the repeat.

    `unread`: where Keras makes an iterator that it never reads, which
    draws the next seeds of the input's `shuffle` stages all the same: one
    more iterator of `dataset` is made there, so each pass is shuffled as
    under Keras. `"between"` passes (Keras 3: after each whole pass, see
    `_EpochIterator`), `"first"` before the first pass (tf-keras' `fit`:
    `DataHandler.enumerate_epochs` makes one before the first epoch, then
    one per epoch), `"each"` before every pass (tf-keras' `evaluate`, one
    epoch per call). `choose_from_datasets` makes an iterator of each input
    when it starts, and with its selector choosing an empty one reads none
    (measured on TF 2.21; a zip reads its inputs, filling a shuffle buffer).
    It runs inside `flat_map` only: at the top of a pipeline, TF 2.21's
    rewrites of it fail when the iterator is made ("Incompatible shapes").
    """
    options = dataset.options()
    autotune = options.autotune.enabled is not False
    inject = options.experimental_optimization.inject_prefetch is not False
    if autotune and inject and not _ends_in_prefetch(dataset):
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
    if unread is None:
        repeated = dataset.repeat()
    else:
        made = tf.data.Dataset.choose_from_datasets(
            [dataset, dataset.take(0)],
            tf.data.Dataset.from_tensors(tf.constant(1, tf.int64)),
        )

        def passes(count=None):  # None: endless
            return (
                tf.data.Dataset.range(1)
                .repeat(count)
                .flat_map(lambda _: made.concatenate(dataset))
            )

        repeated = {
            "between": lambda: dataset.concatenate(passes()),
            "first": lambda: passes(1).concatenate(dataset.repeat()),
            "each": passes,
        }[unread]()
    within_passes = tf.data.Options()
    within_passes.experimental_optimization.inject_prefetch = False
    return repeated.with_options(within_passes)


def _ends_in_prefetch(dataset):
    while type(dataset).__name__ == "_OptionsDataset":
        (dataset,) = dataset._inputs()
    return type(dataset).__name__ == "_PrefetchDataset"


def _release(iterators):
    """Empties the list `iterators` on a thread of its own.

    Destroying a tf.data iterator may block for seconds (see the module
    docstring); the training thread goes on meanwhile. The caller hands
    over the list and keeps no other reference to its iterators; one still
    held elsewhere (a loop variable of Keras' `fit` that has not been
    cleared yet) is waited for, up to a second.
    """
    if not any(iterator is not None for iterator in iterators):
        return
    if sys.is_finalizing():
        # A `__del__` at interpreter exit: a thread started now never runs,
        # and `Thread.start` would wait for it forever.
        iterators.clear()
        return
    thread = threading.Thread(
        target=_drop_when_last,
        args=(iterators,),
        name="keras_hetero-iterator-release",
        daemon=True,
    )
    try:
        thread.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        iterators.clear()
        return
    with _RELEASING_LOCK:
        _RELEASING[:] = [t for t in _RELEASING if t.is_alive()] + [thread]


# The release threads that may still run. They are daemon threads (a
# release must never keep a process alive), so the interpreter would stop
# one at exit in the middle of TensorFlow's C++ (destroying an iterator):
# CPython 3.11 ends a daemon thread that wants the GIL after finalization
# began with a forced unwind, which TensorFlow's `catch (...)` blocks turn
# into "FATAL: exception not rethrown" and SIGABRT, a training process
# that had finished exiting with 134 (seen under the launcher). `atexit`
# runs before that: the releases are waited for there.
_RELEASING = []
_RELEASING_LOCK = threading.Lock()
# Destroying an iterator waits for its autotuning thread, which sleeps at
# most its optimization period (up to 60 s in tf.data).
_EXIT_WAIT_SECONDS = 90.0


def wait_for_releases(timeout=_EXIT_WAIT_SECONDS):
    """Waits up to `timeout` seconds in all for the iterators released off
    the training thread to be destroyed; returns whether they all were.
    Registered with `atexit`."""
    deadline = time.monotonic() + timeout
    with _RELEASING_LOCK:
        threads = list(_RELEASING)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _RELEASING_LOCK:
        _RELEASING[:] = [t for t in _RELEASING if t.is_alive()]
        return not _RELEASING


atexit.register(wait_for_releases)


def _drop_when_last(iterators):
    while iterators:
        iterator = iterators.pop()
        for _ in range(100):
            # This frame's reference and `getrefcount`'s argument.
            if sys.getrefcount(iterator) <= 2:
                break
            time.sleep(0.01)
        del iterator


class _RetiredIterators:
    """Iterators an epoch loop let go of, held until Keras' own loop no
    longer refers to them either, then released off the training thread."""

    def __init__(self):
        self._held = []

    def add(self, iterator):
        if iterator is not None:
            self._held.append(iterator)

    def release(self):
        # The list itself goes to the releasing thread (see `_release`).
        held = self._held
        self._held = []
        _release(held)


_ASSIGNING_WITHOUT_READING = threading.local()


@contextlib.contextmanager
def assigns_without_reading():
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
    if IS_LEGACY or not _ENABLED.is_set():
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
    `_repeatable` allows (`_pass_steps` steps per epoch, from one iterator),
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
        _release([self.__dict__.pop("_kh_iterator", None)])
        self._kh_retired.release()


def adopt_epoch_iterator(iterator, strategy):
    """Makes the `TFEpochIterator` Keras 3's `fit` / `evaluate` just made an
    `_EpochIterator` (HeteroModel's `_maybe_symbolic_build` calls this with
    it, before Keras iterates it). Idempotent; anything else is unchanged.
    """
    if (
        IS_LEGACY
        or type(iterator) is not _TFEpochIterator
        or not _ENABLED.is_set()
    ):
        return
    from keras.src.trainers.data_adapters import array_data_adapter
    from keras.src.trainers.data_adapters import tf_dataset_adapter

    current = iterator.__dict__.pop("_current_iterator", None)
    iterator._kh_retired = _RetiredIterators()
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
    iterator._kh_draws_seeds = _draws_seeds(dataset)
    if _repeatable(dataset, steps, iterator.steps_per_execution):
        unread = "between" if iterator._kh_draws_seeds else None
        distributed = strategy.experimental_distribute_dataset(
            _repeated(dataset, unread)
        )
        iterator._distributed_dataset = distributed
        iterator._kh_pass_steps = steps


if IS_LEGACY:
    from tf_keras.src.engine import data_adapter as _data_adapter

    class _DataHandler(_data_adapter.DataHandler):
        """tf-keras' `DataHandler`, reading a `tf.data.Dataset` repeated
        where `_repeatable` allows (one iterator while each epoch reads a
        whole pass, also across `evaluate` calls of the validation data),
        and releasing the iterators it replaces off the training thread
        once `fit` / `evaluate` hold the next one (at their next `steps`).
        """

        def __init__(self, *args, **kwargs):
            self._kh_retired = _RetiredIterators()
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
                and _repeatable(dataset, self._inferred_steps, 1)
            ):
                # tf-keras shortens a call to the epoch's remaining steps
                # (`DataHandler.steps`): any `steps_per_execution` works.
                unread = None
                if _draws_seeds(dataset):
                    calls = self._epochs - self._initial_epoch
                    unread = "each" if calls == 1 else "first"
                dataset = _repeated(dataset, unread)
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
            _release([self.__dict__.pop("_kh_iterator", None)])
            self._kh_retired.release()

    _get_data_handler = _data_adapter.get_data_handler

    def _hetero_data_handler(*args, **kwargs):
        model = kwargs.get("model")
        if (
            not getattr(model, "_kh_epoch_boundaries", False)
            or getattr(model, "_cluster_coordinator", None)
            or not _ENABLED.is_set()
        ):
            return _get_data_handler(*args, **kwargs)
        return _DataHandler(*args, **kwargs)


def install_data_handlers():
    """tf-keras: HeteroModels' `fit` / `evaluate` get `_DataHandler`s.

    tf-keras' `fit` and `evaluate` call `data_adapter.get_data_handler(...,
    model=self)` (tf_keras/src/engine/training.py); the replacement returns
    tf-keras' own handler for every other model (and under
    ParameterServerStrategy, whose coordinator handlers differ). Idempotent.
    """
    if IS_LEGACY and _data_adapter.get_data_handler is _get_data_handler:
        _data_adapter.get_data_handler = _hetero_data_handler


def repeats_sharded_input(model, dataset, kwargs):
    """How `fit` reads a `kh.data.shard` dataset: its `repeat` argument
    (`HeteroDataset.as_distributed_dataset`), with `steps_per_epoch` its
    length (set in `kwargs`) when repeated.

    tf-keras: `True`, one pass for the whole `fit` (`REPEATS_DISTRIBUTED_
    INPUT`; `fit` checks the length). Keras 3: `"epochs"`, one iterator for
    the whole `fit` but a pass per epoch (so `position`, `passes_started`
    and `set_shares(from_batch=)` count as when each epoch iterates the
    dataset anew), where the epochs stay the same: a known length, no other
    `steps_per_epoch`, and `steps_per_execution` dividing the length (Keras
    3 runs all of a call's steps while data lasts, so a call would read on
    into the next epoch), and the pipeline reads no state the program may
    change between epochs (`reads_outside_state`: one iterator would make
    the next epoch's first batches before `on_epoch_end`); else `False`.
    """
    if IS_LEGACY:
        if _sharded_reads_outside_state(dataset):  # found, not unknown
            # tf-keras never iterates a distributed dataset anew
            # (`REPEATS_DISTRIBUTED_INPUT`): no iterator per epoch to fall
            # back to.
            warnings.warn(
                "This kh.data.shard dataset's pipeline reads a variable or "
                "runs Python code (tf.py_function). Under tf-keras `fit` "
                "reads it from one iterator for all epochs, which prepares "
                "the next epoch's first batches before `on_epoch_end`: if "
                "your program changes that state between epochs (a "
                "curriculum, an augmentation strength), the change reaches "
                "those batches late. Under Keras 3 such a pipeline is read "
                "anew each epoch; under tf-keras, change the state from "
                "`on_train_batch_begin` at a known step instead, or pass "
                "the value through the dataset (docs/drop-in.md, 'Epoch "
                "boundaries').",
                UserWarning,
                stacklevel=4,
            )
        return True
    steps = kwargs.get("steps_per_epoch")
    if not _ENABLED.is_set():
        return False
    num_batches = dataset.num_batches
    if (
        num_batches is None
        or steps not in (None, num_batches)
        or num_batches % steps_per_execution(model)
        or _sharded_reads_outside_state(dataset) is not False
    ):
        return False
    kwargs["steps_per_epoch"] = num_batches
    return "epochs"
