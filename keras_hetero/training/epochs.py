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
  where each draws a reshuffling input's seeds (`_compat.epochs.draws_seeds`).
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

from keras_hetero import _compat
from keras_hetero._compat import epochs as keras_epochs

_EPOCH_DEPENDENT = keras_epochs.KERNEL_RANDOM_STATE | keras_epochs.OUTSIDE_STATE


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


def enabled():
    """Whether HeteroModels' epoch boundaries are on (off only inside
    `keras_own_epoch_iterators`)."""
    return _ENABLED.is_set()


def repeats_alike(dataset):
    """Whether each pass of `dataset.repeat()` gives what a new iterator of
    `dataset` gives.

    Walks the pipeline through tf.data's private `_inputs()` and
    `_functions()` (TF 2.19-2.21) and looks for `KERNEL_RANDOM_STATE` and
    `_OUTSIDE_STATE` ops in its functions (and the functions they call). A
    stage it cannot see into (a dataset class from outside
    `tensorflow.python.data`, or one rebuilt from a variant) answers no.
    """
    return keras_epochs.finds(dataset, _EPOCH_DEPENDENT) is False


def reads_outside_state(dataset):
    """Whether `dataset`'s functions read `_OUTSIDE_STATE` (a variable,
    Python code), which the program may change between epochs: True,
    False, or None where a stage cannot be seen into (as in
    `repeats_alike`)."""
    return keras_epochs.finds(dataset, keras_epochs.OUTSIDE_STATE)


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


def repeatable(dataset, steps, execution_steps):
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


def repeated(dataset, unread=None):
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
    if autotune and inject and not keras_epochs.ends_in_prefetch(dataset):
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


def release(iterators):
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


class RetiredIterators:
    """Iterators an epoch loop let go of, held until Keras' own loop no
    longer refers to them either, then released off the training thread."""

    def __init__(self):
        self._held = []

    def add(self, iterator):
        if iterator is not None:
            self._held.append(iterator)

    def release(self):
        # The list itself goes to the releasing thread (see `release`).
        held = self._held
        self._held = []
        release(held)


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
    if _compat.REPEATS_DISTRIBUTED_INPUT:
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
        or num_batches % _compat.steps_per_execution(model)
        or _sharded_reads_outside_state(dataset) is not False
    ):
        return False
    kwargs["steps_per_epoch"] = num_batches
    return "epochs"
