"""A multi-output model with per-output losses under uneven shares: the
per-output loss logs equal single-device Keras on the same global batches."""

import numpy as np
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import helpers

GLOBAL_BATCH = 16
ROWS = 48  # Full global batches: Keras 3 weights a partial one otherwise.


def _layers():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    first = keras.layers.Dense(1, name="first")(hidden)
    second = keras.layers.Dense(2, name="second")(hidden)
    return inputs, [first, second]


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"first": "mse", "second": "mae"},
        loss_weights={"first": 0.3, "second": 2.0},
    )
    return model


def _examples():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    labels = {
        "first": rng.normal(size=(ROWS, 1)).astype("float32"),
        "second": rng.normal(size=(ROWS, 2)).astype("float32"),
    }
    return tf.data.Dataset.from_tensor_slices((x, labels))


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def test_per_output_loss_logs_equal_single_device_under_uneven_shares():
    reference = _compile(keras.Model(*_layers()))
    initial = reference.get_weights()
    reference_batches = _BatchLogs()
    reference_history = reference.fit(
        _examples().batch(GLOBAL_BATCH),
        epochs=2,
        callbacks=[reference_batches],
        verbose=0,
    ).history
    reference_eval = reference.evaluate(
        _examples().batch(GLOBAL_BATCH), return_dict=True, verbose=0
    )

    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = _compile(kh.HeteroModel(*_layers()))
    model.set_weights(initial)
    dataset = kh.data.shard(
        _examples(), GLOBAL_BATCH, strategy=strategy, shares=[0.75, 0.25]
    )
    batches = _BatchLogs()
    history = model.fit(
        dataset, epochs=2, callbacks=[batches], verbose=0
    ).history
    logs = model.evaluate(dataset, return_dict=True, verbose=0)

    names = {"loss", "first_loss", "second_loss"}
    assert names <= set(reference_history) and names <= set(history)
    for name in names:
        np.testing.assert_allclose(
            history[name], reference_history[name], rtol=1e-5, err_msg=name
        )
        np.testing.assert_allclose(
            [step[name] for step in batches.logs],
            [step[name] for step in reference_batches.logs],
            rtol=1e-5,
            err_msg=name,
        )
        np.testing.assert_allclose(
            logs[name], reference_eval[name], rtol=1e-5, err_msg=name
        )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_one_replica_logs_equal_stock_also_with_a_partial_last_batch():
    # 48 rows in batches of 20: the last batch has 8. Stock Keras 3 counts
    # each batch once in `<output>_loss`; with one replica HeteroModel's
    # logs are stock's (several replicas weigh rows, see the test above).
    def fit(model):
        return model.fit(_examples().batch(20), epochs=1, verbose=0).history

    reference = fit(_compile(keras.Model(*_layers())))
    ours = fit(_compile(kh.HeteroModel(*_layers())))
    for name in ("loss", "first_loss", "second_loss"):
        np.testing.assert_allclose(
            ours[name], reference[name], rtol=1e-5, err_msg=name
        )
