"""The keras-io guide "Training & evaluation with the built-in methods"
(numpy input: fit with validation data, evaluate, predict, validation_split,
class_weight, sample_weight) with only the model class swapped.

MNIST is replaced by generated digits-shaped data (no downloads). With no
strategy, `kh.HeteroModel` must give stock `keras.Model`'s numbers on the
same random seed (Keras' own shuffle). Under MirroredStrategy the numbers
must equal stock `keras.Model` on one device trained on the same global
batches, epoch by epoch in the order `fit` shuffled them.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.data import arrays
from tests.conftest import DEVICES
from tests.support import helpers

SEED = 1234


def _digits(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(rows, 784)).astype("float32")
    labels = np.argmax(x @ rng.normal(size=(784, 10)), axis=1)
    return x, labels.astype("float32")


def _data():
    x_train, y_train = _digits(1280 + 256, 0)
    x_test, y_test = _digits(256, 1)
    # As in the guide: the last rows of the training set for validation.
    x_val, y_val = x_train[-256:], y_train[-256:]
    return x_train[:-256], y_train[:-256], x_val, y_val, x_test, y_test


def get_uncompiled_model(model_class):
    inputs = keras.Input(shape=(784,), name="digits")
    x = keras.layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="predictions")(
        x
    )
    return model_class(inputs=inputs, outputs=outputs)


def get_compiled_model(model_class, strategy):
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        model = get_uncompiled_model(model_class)
        model.compile(
            optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
    return model


CLASS_WEIGHT = {c: 2.0 if c == 5 else 1.0 for c in range(10)}


def _sections(data):
    """The guide's fits: (name, fit arguments, epochs)."""
    x_train, y_train, x_val, y_val, _, _ = data
    sample_weight = np.ones(shape=(len(y_train),))
    sample_weight[y_train == 5] = 2.0
    return [
        ("api-overview", dict(validation_data=(x_val, y_val)), 2),
        ("validation_split", dict(validation_split=0.2), 1),
        ("class_weight", dict(class_weight=CLASS_WEIGHT), 1),
        ("sample_weight", dict(sample_weight=sample_weight), 1),
    ]


def _guide(model_class, strategy, data):
    """Runs the guide; returns {section: (history, weights)} and more."""
    x_train, y_train, _, _, x_test, y_test = data
    results = {}
    for name, kwargs, epochs in _sections(data):
        model = get_compiled_model(model_class, strategy)
        keras.utils.set_random_seed(SEED)  # the shuffle's seed, every run
        history = model.fit(
            x_train, y_train, batch_size=64, epochs=epochs, verbose=0, **kwargs
        )
        results[name] = (history.history, model.get_weights())
        if name == "api-overview":
            results["evaluate"] = model.evaluate(
                x_test, y_test, batch_size=128, verbose=0
            )
            results["predict"] = model.predict(x_test[:3], verbose=0)
    return results


def _same_batches_on_one_device(data):
    """Stock keras.Model on one device, on the global batches `fit` makes
    under several replicas: the order of epoch e is a function of the seed
    drawn from numpy (docs/balancing.md) and e."""
    x_train, y_train, x_val, y_val, x_test, y_test = data
    default = tf.distribute.get_strategy()
    results = {}
    for name, kwargs, epochs in _sections(data):
        model = get_compiled_model(keras.Model, default)
        keras.utils.set_random_seed(SEED)
        seed = np.random.randint(0, 2**31 - 1)
        x, y = x_train, y_train
        weights = kwargs.get("sample_weight")
        validation = kwargs.get("validation_data")
        if name == "validation_split":
            split = int(len(x) * 0.8)
            x, y, validation = x[:split], y[:split], (x[split:], y[split:])
        if name == "class_weight":
            weights = np.where(y == 5, 2.0, 1.0)
        source = arrays.ArraySource((tf.constant(x),))
        history = {}
        for epoch in range(epochs):
            order = source.order(epoch, seed, True, 64)
            logs = model.fit(
                x[order],
                y[order],
                sample_weight=None if weights is None else weights[order],
                batch_size=64,
                epochs=1,
                shuffle=False,
                validation_data=validation,
                verbose=0,
            ).history
            for key, values in logs.items():
                history.setdefault(key, []).extend(values)
        results[name] = (history, model.get_weights())
        if name == "api-overview":
            results["evaluate"] = model.evaluate(
                x_test, y_test, batch_size=128, verbose=0
            )
            results["predict"] = model.predict(x_test[:3], verbose=0)
    return results


def _assert_same(got, want):
    for name, _, _ in _sections(_data()):
        history, weights = got[name]
        expected_history, expected_weights = want[name]
        for key, values in expected_history.items():
            assert history[key] == pytest.approx(values, rel=1e-5), (name, key)
        helpers.assert_weights_close(weights, expected_weights)
    np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5)
    np.testing.assert_allclose(
        got["predict"], want["predict"], rtol=1e-5, atol=1e-6
    )


def test_guide_without_strategy_gives_stock_numbers():
    data = _data()
    default = tf.distribute.get_strategy()
    _assert_same(
        _guide(kh.HeteroModel, default, data),
        _guide(keras.Model, default, data),
    )


def test_guide_under_mirrored_equals_one_device_on_the_same_batches():
    data = _data()
    strategy = helpers.mirrored(DEVICES[:2])
    _assert_same(
        _guide(kh.HeteroModel, strategy, data),
        _same_batches_on_one_device(data),
    )
