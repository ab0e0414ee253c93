"""Numpy / tensor input to HeteroModel.fit, evaluate and predict: sharded
automatically under several replicas, with Keras' semantics."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.data import arrays
from tests.conftest import DEVICES
from tests.support import helpers
from tests.support import training_workers

BATCH = 16


def _regression(cls, strategy, seconds_per_row=0.0):
    """Dense(4, tanh) -> Dense(1) after a SimulatedSpeed identity."""
    keras.utils.set_random_seed(5)
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed(seconds_per_row)(inputs)
        hidden = keras.layers.Dense(4, activation="tanh")(slow)
        model = cls(inputs, keras.layers.Dense(1)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"]
        )
    return model


class StepIds(keras.callbacks.Callback):
    """The ids a RecordIds layer saw, one sorted list per train step."""

    def __init__(self, seen):
        super().__init__()
        self.seen, self.steps = seen, []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.clear()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(sorted(self.seen))


def test_fit_on_arrays_with_rebalancing_equals_single_device():
    rows = BATCH * 24
    x, y, _, _ = helpers.arrays(rows)
    strategy = helpers.mirrored(DEVICES[:2])
    model = _regression(kh.HeteroModel, strategy, [0.002, 0.0005])
    reference = _regression(keras.Model, tf.distribute.get_strategy())
    reference.set_weights(model.get_weights())
    rebalancer = kh.callbacks.ShardRebalancer(
        every_n_steps=2, warmup_steps=1, window=3, tolerance=0.0
    )
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[rebalancer],
    )
    expected = reference.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    )
    # It acted on the input fit sharded: rows moved to the fast replica.
    assert rebalancer.changes
    assert rebalancer.dataset.shares[1] > 0.6
    assert rebalancer.dataset.global_batch_size == BATCH
    assert history.history["loss"] == pytest.approx(
        expected.history["loss"], rel=1e-5
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_shuffle_sees_every_example_once_per_epoch_in_a_new_order():
    rows = 30 * 8 + 7
    x, y, _, ids = helpers.arrays(rows)
    strategy = helpers.mirrored(DEVICES[:3])

    def run():
        seen = []
        keras.utils.set_random_seed(21)
        with strategy.scope():
            model = helpers.id_model(seen, [0.003, 0.001, 0.0])
        initial = model.get_weights()
        steps = StepIds(seen)
        rebalancer = kh.callbacks.ShardRebalancer(
            every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
        )
        model.fit(
            {"x": x, "id": ids},
            y,
            batch_size=30,
            epochs=3,
            verbose=0,
            callbacks=[rebalancer, steps],
        )
        return model, initial, steps.steps, rebalancer

    model, initial, steps, rebalancer = run()
    assert len(rebalancer.changes) >= 1
    per_epoch = len(steps) // 3
    epochs = [steps[e * per_epoch : (e + 1) * per_epoch] for e in range(3)]
    orders = [[row for batch in epoch for row in batch] for epoch in epochs]
    for order in orders:
        assert sorted(order) == list(range(rows))  # exactly once
    assert orders[0] != sorted(orders[0])
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # Reproducible: the same global seed gives the same batches.
    _, _, again, _ = run()
    assert again == steps
    # One device trained on the same global batches, epoch by epoch.
    reference = helpers.id_model([], 0.0)
    reference.set_weights(initial)
    for epoch in epochs:
        order = np.array([row for batch in epoch for row in batch])
        reference.fit(
            {"x": x[order], "id": ids[order]},
            y[order],
            batch_size=30,
            epochs=1,
            shuffle=False,
            verbose=0,
        )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_validation_split_takes_the_last_rows_as_keras_does():
    rows = BATCH * 10 + 3
    x, y, weights, _ = helpers.arrays(rows)
    strategy = helpers.mirrored(DEVICES[:2])
    model = _regression(kh.HeteroModel, strategy)
    reference = _regression(keras.Model, tf.distribute.get_strategy())
    reference.set_weights(model.get_weights())
    kwargs = dict(
        sample_weight=weights,
        batch_size=BATCH,
        epochs=2,
        validation_split=0.25,
        shuffle=False,
        verbose=0,
    )
    history = model.fit(x, y, **kwargs).history
    expected = reference.fit(x, y, **kwargs).history
    for key in ("loss", "val_loss", "val_mae"):
        assert history[key] == pytest.approx(expected[key], rel=1e-5), key
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_validation_split_is_taken_before_shuffling():
    rows = 100
    x, y, _, ids = helpers.arrays(rows)
    strategy = helpers.mirrored(DEVICES[:2])
    seen = []
    with strategy.scope():
        model = helpers.id_model(seen, 0.0)
    steps = StepIds(seen)
    model.fit(
        {"x": x, "id": ids},
        y,
        batch_size=8,
        validation_split=0.2,
        epochs=1,
        verbose=0,
        callbacks=[steps],
    )
    trained = [row for step in steps.steps for row in step]
    assert sorted(trained) == list(range(80))
    assert trained != list(range(80))  # and the training rows shuffled


def _classifier(cls, strategy, loss):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        hidden = keras.layers.Dense(6, activation="relu")(inputs)
        model = cls(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    return model


def _labels(form, rows):
    x, _, weights, _ = helpers.arrays(rows)
    classes = np.argmax(x[:, :3], axis=1)
    if form == "sparse":
        return (
            x,
            classes.astype("int64"),
            weights,
            "sparse_categorical_crossentropy",
        )
    if form == "column":
        return (
            x,
            classes[:, None].astype("float32"),
            weights,
            ("sparse_categorical_crossentropy"),
        )
    return (
        x,
        np.eye(3, dtype="float32")[classes],
        weights,
        ("categorical_crossentropy"),
    )


@pytest.mark.parametrize("form", ["sparse", "column", "one-hot"])
@pytest.mark.parametrize("weighting", ["class", "sample", "both"])
def test_class_and_sample_weights_equal_stock_keras(form, weighting):
    rows = BATCH * 6 + 5
    x, y, weights, loss = _labels(form, rows)
    strategy = helpers.mirrored(DEVICES[:2])
    model = _classifier(kh.HeteroModel, strategy, loss)
    reference = _classifier(keras.Model, tf.distribute.get_strategy(), loss)
    reference.set_weights(model.get_weights())
    kwargs = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    if weighting in ("class", "both"):
        kwargs["class_weight"] = {0: 1.0, 1: 3.0, 2: 0.5}
    if weighting in ("sample", "both"):
        kwargs["sample_weight"] = weights
    if weighting == "both" and kh.FLAVOUR == "keras3":
        # Keras 3 refuses the pair for arrays; so do we, before any step.
        for fit in (reference.fit, model.fit):
            with pytest.raises(ValueError, match="at the same time"):
                fit(x, y, **kwargs)
        return
    history = model.fit(x, y, **kwargs).history
    if weighting == "both":
        # tf-keras multiplies them; its own fit fails on the pair with 1-D
        # weights ("Cannot convert a partially known TensorShape"), so the
        # reference gets the product as sample weights.
        classes = np.argmax(x[:, :3], axis=1)
        factors = np.array([1.0, 3.0, 0.5], "float32")[classes]
        kwargs["sample_weight"] = weights * factors
        del kwargs["class_weight"]
    expected = reference.fit(x, y, **kwargs).history
    assert history["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def _two_towers(cls, strategy):
    keras.utils.set_random_seed(4)
    with strategy.scope():
        a = keras.Input((3,), name="a")
        b = keras.Input((2,), name="b")
        hidden = keras.layers.Dense(4, activation="tanh")(
            keras.layers.Concatenate()([a, b])
        )
        model = cls(
            {"a": a, "b": b},
            {
                "p": keras.layers.Dense(1, name="p")(hidden),
                "q": keras.layers.Dense(2, name="q")(hidden),
            },
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05), loss={"p": "mse", "q": "mae"}
        )
    return model


def test_dict_inputs_and_outputs_equal_stock_keras():
    rows = 50
    rng = np.random.default_rng(0)
    x = {
        "a": rng.normal(size=(rows, 3)).astype("float32"),
        "b": rng.normal(size=(rows, 2)),  # float64: cast to floatx, as Keras
    }
    y = {
        "p": rng.normal(size=(rows, 1)).astype("float32"),
        "q": tf.constant(rng.normal(size=(rows, 2)), tf.float32),
    }
    weights = rng.uniform(0.5, 2.0, size=(rows,)).astype("float32")
    model = _two_towers(kh.HeteroModel, helpers.mirrored(DEVICES[:3]))
    reference = _two_towers(keras.Model, tf.distribute.get_strategy())
    reference.set_weights(model.get_weights())
    kwargs = dict(
        sample_weight=weights, batch_size=8, epochs=2, shuffle=False, verbose=0
    )
    history = model.fit(x, y, **kwargs).history
    expected = reference.fit(x, y, **kwargs).history
    # (Keras 3's per-output loss logs, "p_loss", average the replicas'
    # means unweighted when their rows differ: not compared here.)
    assert history["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    got = model.evaluate(x, y, batch_size=7, return_dict=True, verbose=0)
    want = reference.evaluate(x, y, batch_size=7, return_dict=True, verbose=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    got = model.predict(x, batch_size=7, verbose=0)
    want = reference.predict(x, verbose=0)
    for name in ("p", "q"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_on_arrays_equal_stock_keras():
    reference, _ = helpers.reference_fit(epochs=1)
    strategy = helpers.mirrored(DEVICES[:3])
    with strategy.scope():
        model = helpers.hetero_model()
    model.set_weights(reference.get_weights())
    x, y, weights, _ = helpers.arrays()
    for batch_size in (10, None):  # None: Keras' 32
        got = model.evaluate(
            x,
            y,
            sample_weight=weights,
            batch_size=batch_size,
            return_dict=True,
            verbose=0,
        )
        want = reference.evaluate(
            x, y, sample_weight=weights, return_dict=True, verbose=0
        )
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["mae"] == pytest.approx(want["mae"], rel=1e-5)
    # Rows come back in input order, also with a partial last batch.
    expected = reference.predict(x, verbose=0)
    for batch_size in (7, 64):
        np.testing.assert_allclose(
            model.predict(tf.constant(x), batch_size=batch_size, verbose=0),
            expected,
            rtol=1e-5,
            atol=1e-6,
        )
    np.testing.assert_allclose(
        model.predict(x, steps=3, verbose=0),  # batch ceil(72 / 3) = 24
        expected,
        rtol=1e-5,
        atol=1e-6,
    )


def test_steps_per_epoch_is_honoured_as_keras_does():
    x, y, _, _ = helpers.arrays(BATCH * 6)
    strategy = helpers.mirrored(DEVICES[:2])
    model = _regression(kh.HeteroModel, strategy)
    reference = _regression(keras.Model, tf.distribute.get_strategy())
    reference.set_weights(model.get_weights())
    kwargs = dict(
        batch_size=BATCH, steps_per_epoch=4, epochs=3, shuffle=False, verbose=0
    )

    class Count(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = []

        def on_epoch_end(self, epoch, logs=None):
            self.steps.append(int(self.model.optimizer.iterations.numpy()))

    counts = [Count(), Count()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Your input ran out of data"
        model.fit(x, y, callbacks=[counts[0]], **kwargs)
        reference.fit(x, y, callbacks=[counts[1]], **kwargs)
    # Keras continues the pass over epochs: 6 batches, epochs of <= 4 steps.
    assert counts[0].steps == counts[1].steps
    assert counts[0].steps[0] == 4
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_one_replica_keeps_keras_own_array_path():
    x, y, _, _ = helpers.arrays()
    model = _regression(kh.HeteroModel, tf.distribute.get_strategy())
    reference = _regression(keras.Model, tf.distribute.get_strategy())
    rebalancer = kh.callbacks.ShardRebalancer()
    keras.utils.set_random_seed(8)
    model.fit(
        x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[rebalancer]
    )
    keras.utils.set_random_seed(8)
    reference.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    # Keras' own shuffle: the same batches as stock Keras.
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert rebalancer.dataset is None and not rebalancer.changes
    assert not arrays.converts(model)


def test_rebalancer_without_dataset_refuses_input_it_cannot_move():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model()
    with pytest.raises(ValueError, match="Received x of type"):
        model.fit(
            helpers.examples().batch(BATCH),
            verbose=0,
            callbacks=[kh.callbacks.ShardRebalancer()],
        )


def test_small_batch_size_names_the_argument():
    strategy = helpers.mirrored(DEVICES[:3])
    with strategy.scope():
        model = helpers.hetero_model()
    x, y, _, _ = helpers.arrays()
    with pytest.raises(ValueError, match="batch_size=2"):
        model.fit(x, y, batch_size=2, verbose=0)
    with pytest.raises(ValueError, match="batch_size=2"):
        model.fit(x, y, 2, verbose=0)  # positional, as keras.Model.fit takes it
    with pytest.raises(ValueError, match="cardinality is ambiguous"):
        model.fit(x, y[:10], verbose=0)


@pytest.mark.slow
@pytest.mark.both_flavours
def test_multi_worker_array_input_is_exact_and_shuffles_alike():
    rows = 24 * 10 + 5
    first, second = (
        r.value
        for r in kh.testing.run_workers(
            training_workers.arrays_mwms, 2, timeout=300, args=(rows,)
        )
    )
    x, y, weights, ids = helpers.arrays(rows)
    inputs = {"x": x, "id": ids}
    # In order: one device on the same global batches (ShardRebalancer
    # moved rows to worker 1's fast replica meanwhile).
    reference = helpers.id_model([], 0.0)
    reference.set_weights(first["initial"])
    expected = reference.fit(
        inputs, y, sample_weight=weights, **training_workers.ARRAYS_FIT
    ).history
    evaluation = reference.evaluate(
        inputs, y, sample_weight=weights, return_dict=True, verbose=0
    )
    predictions = reference.predict(inputs, verbose=0)
    for value in (first, second):
        assert value["changes"] >= 1
        assert value["shares"][1] > 0.6
        helpers.assert_weights_close(value["weights"], reference.get_weights())
        for key in ("loss", "val_loss"):
            assert value["history"][key] == pytest.approx(
                expected[key], rel=1e-5
            )
        assert value["evaluate"]["loss"] == pytest.approx(
            evaluation["loss"], rel=1e-5
        )
        np.testing.assert_allclose(
            value["predict"], predictions, rtol=1e-5, atol=1e-6
        )
    # Shuffled: one seed for both workers although their random states
    # differ; every example once per epoch across the workers' replicas.
    assert first["seed"] == second["seed"]
    steps = [
        sorted(a + b)
        for a, b in zip(first["shuffled_steps"], second["shuffled_steps"])
    ]
    per_epoch = len(steps) // 2
    orders = [
        [
            row
            for step in steps[e * per_epoch : (e + 1) * per_epoch]
            for row in step
        ]
        for e in range(2)
    ]
    for order in orders:
        assert sorted(order) == list(range(rows))
    assert orders[0] != orders[1]
    # kh.data.shard(shuffle=10) without seed: worker 0's rows come first in
    # each global batch of one shuffled order, the same on both workers.
    batches = [
        a[0] + b[0] for a, b in zip(first["shard_steps"], second["shard_steps"])
    ]
    passes = [
        [row for batch in batches[p * 11 : (p + 1) * 11] for row in batch]
        for p in range(2)
    ]
    for order in passes:
        assert sorted(order) == list(range(rows))
    assert passes[0] != passes[1] != list(range(rows))


def test_list_inputs_equal_stock_keras():
    rows = 40
    rng = np.random.default_rng(1)
    x = [
        rng.normal(size=(rows, 3)).astype("float32"),
        rng.normal(size=(rows, 2)).astype("float32"),
    ]
    y = rng.normal(size=(rows, 1)).astype("float32")

    def build(cls, strategy):
        keras.utils.set_random_seed(6)
        with strategy.scope():
            a, b = keras.Input((3,)), keras.Input((2,))
            joined = keras.layers.Concatenate()([a, b])
            model = cls([a, b], keras.layers.Dense(1)(joined))
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    model = build(kh.HeteroModel, helpers.mirrored(DEVICES[:2]))
    reference = build(keras.Model, tf.distribute.get_strategy())
    kwargs = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, **kwargs)
    reference.fit(x, y, **kwargs)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(
        model.predict(x, batch_size=6, verbose=0),
        reference.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
