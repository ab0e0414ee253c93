"""Epoch boundaries (`keras_hetero.training.epochs`): every epoch of a
HeteroModel reads the elements stock Keras' reads, in the same order; its
input iterators are made once per `fit` where that reads the same epochs
(else once per epoch); and none is destroyed on the training thread.

The elements are compared through the targets: `y` is each example's id
(scaled), and two metrics report the running mean of `y` and of `y**2`
after every batch, which pins each batch's ids (sum and sum of squares),
with no Python in the step. Final weights (SGD with momentum, so order
matters) are compared too.

Covered here, one process: every input kind (`INPUTS`: tf.data plain,
reshuffled each pass, shuffled once, with a stateful random map; numpy with
and without shuffling; a generator; a `PyDataset` / `Sequence`;
`steps_per_epoch` below a finite input's length and over a repeated one;
`validation_data`) x 1 or 3 steps per call (3 dividing the epoch, and not)
against stock `keras.Model` on one device; MirroredStrategy on 2 logical
CPUs; `kh.data.shard` with and without shuffling; a mid-epoch
`ElasticCheckpoint` resume in the order of an uninterrupted fit; share
changes at an epoch boundary. The 2-worker MultiWorkerMirrored cases are in
test_multi_worker.py (`test_epoch_boundaries_...`).
"""

import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import input_lib

import keras_hetero as kh
from keras_hetero import _compat
from keras_hetero._compat import keras
from keras_hetero.training import epochs as epochs_lib
from tests.conftest import DEVICES
from tests.support import helpers

ROWS = 72  # 4.5 batches: the last one is partial
BATCH = 16
EPOCHS = 3


def _arrays(rows=ROWS):
    x, _, _, ids = helpers.arrays(rows)
    return x, (ids / rows).astype("float32")[:, None]


def _examples(rows=ROWS):
    return tf.data.Dataset.from_tensor_slices(_arrays(rows))


def _jitter(x, y):
    # A stateful random op: a new iterator draws the same numbers again.
    return x + tf.random.uniform(tf.shape(x), maxval=1e-3, seed=5), y


INPUTS = {
    # name: (fit's arguments for `rows` examples, made fresh for each fit)
    "tf.data": lambda rows: {"x": _examples(rows).batch(BATCH)},
    "tf.data shuffled each pass": lambda rows: {
        "x": _examples(rows).shuffle(rows, seed=3).batch(BATCH)
    },
    "tf.data shuffled once": lambda rows: {
        "x": _examples(rows)
        .shuffle(rows, seed=3, reshuffle_each_iteration=False)
        .batch(BATCH)
    },
    "tf.data random map": lambda rows: {
        "x": _examples(rows).map(_jitter).batch(BATCH)
    },
    "numpy": lambda rows: dict(
        zip("xy", _arrays(rows)), batch_size=BATCH, shuffle=False
    ),
    "numpy shuffled": lambda rows: dict(
        zip("xy", _arrays(rows)), batch_size=BATCH, shuffle=True
    ),
    "generator": lambda rows: {"x": _generator(rows), "steps_per_epoch": 5},
    "sequence": lambda rows: {"x": _Sequence(rows)},
    "steps_per_epoch smaller": lambda rows: {
        "x": _examples(rows).batch(BATCH),
        "steps_per_epoch": 3,
    },
    "steps_per_epoch smaller, repeated": lambda rows: {
        "x": _examples(rows).shuffle(rows, seed=3).batch(BATCH).repeat(),
        "steps_per_epoch": 3,
    },
    "validation_data": lambda rows: {
        "x": _examples(rows).batch(BATCH),
        "validation_data": _examples(40).shuffle(40, seed=2).batch(BATCH),
    },
}


def _generator(rows):
    x, y = _arrays(rows)
    while True:
        for start in range(0, rows, BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]


_SEQUENCE = getattr(keras.utils, "PyDataset", None) or keras.utils.Sequence


class _Sequence(_SEQUENCE):
    """Batches in an order that `on_epoch_end` reverses."""

    def __init__(self, rows):
        super().__init__()
        self.x, self.y = _arrays(rows)
        self.order = list(range(-(-rows // BATCH)))

    def __len__(self):
        return len(self.order)

    def __getitem__(self, index):
        start = self.order[index] * BATCH
        return self.x[start : start + BATCH], self.y[start : start + BATCH]

    def on_epoch_end(self):
        self.order.reverse()


def _id_metrics():
    wrapper = keras.metrics.MeanMetricWrapper
    return [
        wrapper(lambda y_true, y_pred: y_true, name="id_mean"),
        wrapper(lambda y_true, y_pred: y_true * y_true, name="id_square"),
    ]


def _model(model_class, strategy, steps_per_execution=1):
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        hidden = keras.layers.Dense(4, activation="tanh")(inputs)
        model = model_class(inputs, keras.layers.Dense(1)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss="mse",
            metrics=_id_metrics(),
            steps_per_execution=steps_per_execution,
        )
    return model


class _Batches(keras.callbacks.Callback):
    """`[(epoch, running id mean, running id square mean)]`, one per call."""

    def on_train_begin(self, logs=None):
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(
            (self.epoch, float(logs["id_mean"]), float(logs["id_square"]))
        )


class _Iterators:
    """Counts the input iterators `fit`'s epoch loop makes (between
    `on_train_begin` and `on_train_end`), those of distributed datasets
    apart, and the threads their last references went on."""

    DISTRIBUTED = (
        input_lib.DistributedDataset,
        input_lib.DistributedDatasetsFromFunction,
    )

    def __init__(self, monkeypatch):
        self.watching = False
        self.reset()
        for cls in (tf.data.Dataset, *self.DISTRIBUTED):
            monkeypatch.setattr(
                cls, "__iter__", self._counting(cls, cls.__iter__)
            )

    def _counting(self, cls, make):
        def counted(dataset):
            iterator = make(dataset)
            if self.watching:
                self.made += 1
                self.distributed += cls in self.DISTRIBUTED
                weakref.finalize(iterator, self._destroyed)
            return iterator

        return counted

    def _destroyed(self):
        self.destroyed_on.append(threading.current_thread().name)

    def reset(self):
        self.made, self.distributed, self.destroyed_on = 0, 0, []

    def assert_none_destroyed_on_the_training_thread(self):
        assert threading.main_thread().name not in self.destroyed_on


class _Watch(keras.callbacks.Callback):
    def __init__(self, iterators):
        super().__init__()
        self.iterators = iterators

    def on_train_begin(self, logs=None):
        self.iterators.watching = True

    def on_train_end(self, logs=None):
        self.iterators.watching = False


@pytest.fixture
def iterators(monkeypatch):
    return _Iterators(monkeypatch)


def _fit(model_class, arguments, strategy, epochs=EPOCHS, iterators=None, **kw):
    """`(_Batches.seen, final weights, history)` of a fit of a new model on
    `arguments()`, with the random seed set first (the input's random ops
    take their seeds when the input is made)."""
    keras.utils.set_random_seed(11)
    arguments = arguments(kw.pop("rows", ROWS))
    model = _model(model_class, strategy, kw.pop("steps_per_execution", 1))
    batches = _Batches()
    callbacks = [batches] if iterators is None else [batches, _Watch(iterators)]
    history = model.fit(
        **arguments, epochs=epochs, callbacks=callbacks, verbose=0, **kw
    )
    return batches.seen, model.get_weights(), history.history


def _made(iterators, model_class, arguments, strategy, **kwargs):
    """`(iterators made by a 1-epoch fit, by an EPOCHS-epoch fit)`, each
    as `(all, distributed)`, and the EPOCHS-epoch fit's result."""
    made = []
    for epochs in (1, EPOCHS):
        iterators.reset()
        result = _fit(
            model_class, arguments, strategy, epochs, iterators, **kwargs
        )
        made.append((iterators.made, iterators.distributed))
    return made, result


def _assert_same_epochs(actual, expected, rtol=1e-6):
    (seen, weights, history), (want_seen, want_weights, want_history) = (
        actual,
        expected,
    )
    assert [epoch for epoch, *_ in seen] == [epoch for epoch, *_ in want_seen]
    np.testing.assert_allclose(
        [values for _, *values in seen],
        [values for _, *values in want_seen],
        rtol=rtol,
    )
    helpers.assert_weights_close(weights, want_weights, rtol=rtol, atol=1e-7)
    assert sorted(history) == sorted(want_history)
    for name in history:
        np.testing.assert_allclose(history[name], want_history[name], rtol=rtol)


def _one_device():
    return tf.distribute.get_strategy()


def _two_replicas():
    return helpers.mirrored(DEVICES[:2])


# Inputs whose epochs read one iterator per `fit` on one device: repeatable
# tf.data; Keras 3's array input without shuffling (a repeatable dataset
# too); tf-keras' array input, which repeats on its own; an endless input
# with `steps_per_epoch`, read on by both flavours. The others: one per
# epoch.
KEPT = {
    "tf.data",
    "tf.data shuffled each pass",
    "tf.data shuffled once",
    "validation_data",
}
ENDLESS = {"generator", "steps_per_epoch smaller, repeated"}
KEPT_ON_ONE_DEVICE = KEPT | ENDLESS | {"numpy"}
if _compat.IS_LEGACY:
    KEPT_ON_ONE_DEVICE |= {"numpy shuffled"}

# (steps per call, rows): 5 batches a call at a time; 6 batches 3 at a
# time; 5 batches 3 at a time, where Keras 3's last call of an epoch would
# read on into the next one from a repeated input, so each epoch reads an
# iterator of its own (tf-keras shortens that call: repeated all the same).
EXECUTIONS = {"1 per call": (1, ROWS), "3 per call": (3, 96)}
EXECUTIONS["3 per call, 5 steps"] = (3, ROWS)


def _kept_on_one_device(name, steps_per_execution, rows):
    if name in ENDLESS:
        return True
    divides = -(-rows // BATCH) % steps_per_execution == 0
    return name in KEPT_ON_ONE_DEVICE and (_compat.IS_LEGACY or divides)


@pytest.mark.parametrize("execution", sorted(EXECUTIONS))
@pytest.mark.parametrize("name", sorted(INPUTS))
def test_each_epoch_reads_what_stock_keras_reads(name, execution, iterators):
    steps_per_execution, rows = EXECUTIONS[execution]
    kwargs = {"steps_per_execution": steps_per_execution, "rows": rows}
    expected = _fit(keras.Model, INPUTS[name], _one_device(), **kwargs)
    made, actual = _made(
        iterators, kh.HeteroModel, INPUTS[name], _one_device(), **kwargs
    )
    _assert_same_epochs(actual, expected)
    iterators.assert_none_destroyed_on_the_training_thread()
    (once, _), (every, _) = made
    if _kept_on_one_device(name, steps_per_execution, rows):
        assert every == once
    elif name == "tf.data shuffled each pass":
        # Keras 3 makes two per epoch boundary, each drawing the shuffle's
        # seeds: so does HeteroModel where it falls back, to keep the order.
        assert every - once == 2 * (EPOCHS - 1)
    elif name != "steps_per_epoch smaller":
        # One more per epoch (stock Keras 3 makes two).
        assert every - once == EPOCHS - 1


@pytest.mark.parametrize(
    "name", ["tf.data", "tf.data shuffled each pass", "tf.data random map"]
)
def test_two_replicas(name, iterators):
    if name == "tf.data shuffled each pass":
        # Stock Keras 3 reads one batch from an extra iterator to build the
        # model under a strategy (`_maybe_symbolic_build`), which draws the
        # shuffle's seeds once more; HeteroModel never did.
        with epochs_lib.keras_own_epoch_iterators():
            expected = _fit(kh.HeteroModel, INPUTS[name], _two_replicas())
    else:
        expected = _fit(keras.Model, INPUTS[name], _two_replicas())
    made, actual = _made(
        iterators, kh.HeteroModel, INPUTS[name], _two_replicas()
    )
    # Replicas sum in another order than stock Keras' mean of means.
    _assert_same_epochs(actual, expected, rtol=1e-5)
    iterators.assert_none_destroyed_on_the_training_thread()
    (_, once), (_, every) = made
    assert every - once == (0 if name in KEPT else EPOCHS - 1)


def _sharded(strategy, shuffle=None):
    x, y = _arrays()
    return kh.data.shard(
        tf.data.Dataset.from_tensor_slices((x, y)),
        BATCH,
        strategy=strategy,
        shuffle=shuffle,
        seed=4 if shuffle else None,
    )


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("shuffle", [None, True])
def test_sharded_dataset_reads_its_passes_from_one_iterator(
    replicas, shuffle, iterators
):
    strategy = _two_replicas() if replicas == 2 else _one_device()

    def sharded(rows):
        return {"x": _sharded(strategy, shuffle)}

    made, actual = _made(iterators, kh.HeteroModel, sharded, strategy)
    (once, _), (every, _) = made
    assert every == once
    iterators.assert_none_destroyed_on_the_training_thread()
    if shuffle is None:
        # The global batches in order: stock Keras on the batched examples.
        expected = _fit(keras.Model, INPUTS["tf.data"], strategy)
    else:
        with epochs_lib.keras_own_epoch_iterators():
            expected = _fit(kh.HeteroModel, sharded, strategy)
    _assert_same_epochs(actual, expected, rtol=1e-5)


def test_sharded_dataset_with_steps_per_execution_not_dividing_the_epoch():
    # 5 batches, 2 steps per call: Keras 3 would read on into the next
    # epoch from a repeated input, so it iterates each epoch anew.
    strategy = _one_device()
    actual = _fit(
        kh.HeteroModel,
        lambda rows: {"x": _sharded(strategy)},
        strategy,
        steps_per_execution=2,
    )
    expected = _fit(
        keras.Model, INPUTS["tf.data"], strategy, steps_per_execution=2
    )
    _assert_same_epochs(actual, expected)


def test_steps_per_execution_dividing_the_epoch(iterators):
    def arguments(rows):
        # 72 rows in batches of 18: 4 batches, 2 per call.
        return {"x": _examples().shuffle(ROWS, seed=3).batch(18)}

    expected = _fit(
        keras.Model, arguments, _one_device(), steps_per_execution=2
    )
    made, actual = _made(
        iterators,
        kh.HeteroModel,
        arguments,
        _one_device(),
        steps_per_execution=2,
    )
    _assert_same_epochs(actual, expected)
    (once, _), (every, _) = made
    assert every == once


def test_after_a_stopped_fit_the_next_starts_a_new_pass():
    # `stop_training` ends `fit` mid-epoch; the next `fit` reads the input
    # from a pass's start, as stock Keras does.
    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    results = []
    for model_class in (keras.Model, kh.HeteroModel):
        keras.utils.set_random_seed(11)
        dataset = _examples().shuffle(ROWS, seed=3).batch(BATCH)
        model = _model(model_class, _one_device())
        model.fit(dataset, epochs=2, callbacks=[StopAt()], verbose=0)
        batches = _Batches()
        history = model.fit(dataset, epochs=2, callbacks=[batches], verbose=0)
        results.append((batches.seen, model.get_weights(), history.history))
    _assert_same_epochs(results[1], results[0])


@pytest.mark.parametrize(
    "dataset, alike",
    [
        (_examples().batch(BATCH), True),
        (_examples().shuffle(ROWS).batch(BATCH), True),
        (tf.data.Dataset.random(seed=1).take(4), True),
        (
            _examples().map(
                lambda x, y: (x + tf.random.stateless_uniform([], [1, 2]), y)
            ),
            True,
        ),
        (_examples().map(_jitter), False),
        (
            _examples().map(
                tf.function(lambda x, y: (tf.random.shuffle(x), y))
            ),
            False,
        ),
        (
            tf.data.Dataset.range(2).flat_map(
                lambda i: tf.data.Dataset.from_tensors(tf.random.normal([]))
            ),
            False,
        ),
    ],
)
def test_repeats_alike_finds_kernel_random_state(dataset, alike):
    assert epochs_lib.repeats_alike(dataset) is alike


_SCALE = tf.Variable(1.0)


@pytest.mark.parametrize(
    "dataset",
    [
        _examples().map(lambda x, y: (x * _SCALE, y)),
        _examples().map(
            lambda x, y: (tf.py_function(lambda v: v, [x], tf.float32), y)
        ),
    ],
    ids=["reads a variable", "py_function"],
)
def test_repeats_alike_refuses_state_outside_the_pipeline(dataset):
    assert epochs_lib.repeats_alike(dataset) is False
    assert epochs_lib.reads_outside_state(dataset) is True


def _curriculum_fit(model_class, strategy, kind="tf.data"):
    """A pipeline that reads a variable which a callback sets at every
    epoch's end (a curriculum): in a `map` of the examples behind a prefetch
    that holds more than an epoch, or of `kh.data.shard`'s examples, or in
    its `map_fn` (on batches)."""
    keras.utils.set_random_seed(11)
    scale = tf.Variable(1.0)
    x, y = _arrays()
    examples = tf.data.Dataset.from_tensor_slices((x, y))

    def scaled(a, b):
        return a, b * scale

    if kind == "tf.data":
        data = examples.map(scaled).batch(BATCH).prefetch(8)
    elif kind == "shard":
        data = kh.data.shard(examples.map(scaled), BATCH, strategy=strategy)
    else:  # "shard map_fn"
        data = kh.data.shard(examples, BATCH, strategy=strategy, map_fn=scaled)

    class Curriculum(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            scale.assign(float(epoch + 2))

    model = _model(model_class, strategy)
    batches = _Batches()
    history = model.fit(
        data, epochs=EPOCHS, callbacks=[batches, Curriculum()], verbose=0
    )
    return batches.seen, model.get_weights(), history.history


@pytest.mark.parametrize("strategy", [_one_device, _two_replicas])
def test_a_variable_set_between_epochs_reaches_every_element_of_the_next(
    strategy,
):
    # One repeated iterator would make the next epoch's first elements
    # before the callback's change where something prefetches after the
    # repeat (a distributed dataset's per-device prefetch does): targets of
    # the old scale.
    actual = _curriculum_fit(kh.HeteroModel, strategy())
    expected = _curriculum_fit(keras.Model, strategy())
    _assert_same_epochs(actual, expected)
    means = {epoch: mean for epoch, mean, _ in actual[0]}
    assert means[1] > 1.5 * means[0]  # the scale did change the targets


@pytest.mark.parametrize("kind", ["shard", "shard map_fn"])
@pytest.mark.parametrize("strategy", [_one_device, _two_replicas])
def test_a_variable_set_between_epochs_reaches_a_sharded_dataset(
    strategy, kind, iterators
):
    if _compat.IS_LEGACY:
        # tf-keras reads a distributed dataset from one iterator: it warns.
        with pytest.warns(UserWarning, match="reads a variable or runs"):
            _curriculum_fit(kh.HeteroModel, strategy(), kind)
        return
    iterators.watching = True
    actual = _curriculum_fit(kh.HeteroModel, strategy(), kind)
    assert iterators.made >= EPOCHS  # an iterator per epoch
    iterators.watching = False
    with epochs_lib.keras_own_epoch_iterators():
        expected = _curriculum_fit(kh.HeteroModel, strategy(), kind)
    _assert_same_epochs(actual, expected, rtol=1e-5)
    means = {epoch: mean for epoch, mean, _ in actual[0]}
    assert means[1] > 1.5 * means[0]


class _StepIds(keras.callbacks.Callback):
    """The ids each call trained on (sorted: replicas record in any order),
    `model.step_stats.rows` after it, and stops `fit` after `stop_after`
    calls."""

    def __init__(self, seen, stop_after=None):
        super().__init__()
        self.seen, self.stop_after = seen, stop_after
        self.calls, self.rows, self._mark = [], [], 0

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(sorted(self.seen[self._mark :]))
        self._mark = len(self.seen)
        self.rows.append(self.model.step_stats.rows.tolist())
        if len(self.calls) == self.stop_after:
            self.model.stop_training = True


def _id_fit(strategy, data, seed, steps_per_execution, callbacks, epochs=3):
    seen = []
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = helpers.id_model(seen, 0.0, steps_per_execution, momentum=0.9)
    steps = _StepIds(seen, callbacks.pop("stop_after", None))
    model.fit(
        data,
        epochs=epochs,
        verbose=0,
        callbacks=[steps, *callbacks.pop("more", [])],
    )
    return model, steps


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_mid_epoch_resume_reads_the_order_of_an_uninterrupted_fit(
    tmp_path, steps_per_execution, iterators
):
    # 96 rows, 6 global batches per epoch: one iterator for the whole fit
    # (a call's steps divide the epoch), shuffled anew each pass; stopped
    # in the second epoch, resumed by a new model from the checkpoint.
    rows, strategy = 96, _two_replicas()

    def data():
        return kh.data.shard(
            helpers.id_examples(rows),
            BATCH,
            strategy=strategy,
            shuffle=True,
            seed=4,
        )

    reference, uninterrupted = _id_fit(
        strategy, data(), 1, steps_per_execution, {"more": [_Watch(iterators)]}
    )
    # One iterator for the whole fit.
    assert iterators.distributed == 1
    stop_after = 8 // steps_per_execution
    _, first = _id_fit(
        strategy,
        data(),
        1,
        steps_per_execution,
        {
            "stop_after": stop_after,
            "more": [
                kh.callbacks.ElasticCheckpoint(
                    tmp_path, save_every=steps_per_execution
                )
            ],
        },
    )
    resumed, second = _id_fit(
        strategy,
        data(),
        99,
        steps_per_execution,
        {"more": [kh.callbacks.ElasticCheckpoint(tmp_path)]},
    )
    assert len(first.calls) == stop_after
    assert first.calls + second.calls == uninterrupted.calls
    for epoch in range(3):
        ids = [
            row
            for call in uninterrupted.calls[
                epoch * 6 // steps_per_execution : (epoch + 1)
                * 6
                // steps_per_execution
            ]
            for row in call
        ]
        assert sorted(ids) == list(range(rows))
    helpers.assert_weights_close(
        resumed.get_weights(), reference.get_weights(), rtol=1e-5
    )


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_share_changes_apply_from_the_batch_they_name(steps_per_execution):
    # One iterator across epochs: the pipeline splits the next epoch's first
    # global batch before the epoch ends (it runs one batch ahead, as within
    # an epoch). A change named ahead, as `ShardRebalancer` names them,
    # takes effect exactly there; one made at `on_epoch_end` with the
    # default `from_batch` from the first batch not yet split, which
    # `set_shares` returns.
    rows, strategy = 96, _two_replicas()
    data = kh.data.shard(
        helpers.id_examples(rows), BATCH, strategy=strategy, shares=[0.5, 0.5]
    )
    starts = []

    def key(epoch, index):
        # `(pass, index)`: a pass per epoch under Keras 3, as when each
        # epoch iterates the dataset anew; one per `fit` under tf-keras.
        if _compat.IS_LEGACY:
            return (0, epoch * 6 + index)
        return (epoch, index)

    class Move(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 0:
                starts.append(
                    data.set_shares([0.25, 0.75], from_batch=key(1, 0))
                )

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                starts.append(data.set_shares([0.75, 0.25]))

    model, steps = _id_fit(
        strategy, data, 1, steps_per_execution, {"more": [Move()]}
    )
    assert starts[0] == key(1, 0)
    # The pipeline runs a few batches ahead (as `ShardRebalancer.lag` allows).
    # Under Keras 3 it may not have started the next pass yet at
    # `on_epoch_end` (a busy machine): the change then names the batch after
    # the pass's last, `(1, 6)`, and applies from the next pass's first.
    assert key(1, 6) <= starts[1] < key(2, 6)
    schedule = [((0, 0), [8, 8]), (starts[0], [4, 12]), (starts[1], [12, 4])]
    expected = []
    for batch in [
        key(epoch, index) for epoch in range(3) for index in range(6)
    ]:
        expected.append([rows for at, rows in schedule if at <= batch][-1])
    # Telemetry sums a call's steps.
    calls = np.reshape(expected, (-1, steps_per_execution, 2)).sum(axis=1)
    assert steps.rows == calls.tolist()
    # Every epoch in order, every example once: one device's global batches.
    assert [row for call in steps.calls for row in call] == list(
        range(rows)
    ) * 3
    reference, _ = _id_fit(
        _one_device(),
        helpers.id_examples(rows).batch(BATCH),
        1,
        steps_per_execution,
        {},
    )
    helpers.assert_weights_close(
        model.get_weights(), reference.get_weights(), rtol=1e-5
    )


RELEASE_AT_EXIT = """
import pathlib
import sys
import time

from keras_hetero.training import epochs

marker = pathlib.Path(sys.argv[1])


class SlowToDestroy:  # as a tf.data iterator joining its autotuning thread
    def __del__(self):
        time.sleep(1.0)
        marker.write_text("destroyed")


epochs.release([SlowToDestroy()])
# The script ends at once: the release is still under way.
"""


def test_the_interpreter_waits_at_exit_for_iterators_being_released(
    tmp_path,
):
    # A release thread stopped by the interpreter's exit in the middle of
    # TensorFlow's C++ aborted a finished worker (exit 134, "FATAL:
    # exception not rethrown"); the releases finish before exit instead.
    script = tmp_path / "release_at_exit.py"
    script.write_text(RELEASE_AT_EXIT)
    marker = tmp_path / "marker"
    result = subprocess.run(
        [sys.executable, str(script), str(marker)],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.read_text() == "destroyed"
