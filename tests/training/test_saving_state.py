"""State that `.keras` files and checkpoints must carry for training to go on
exactly: partial gradient sums (`accumulation_steps`) and the optimizer of a
model made by `HeteroModel.from_model` from a non-functional one."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.training import state
from tests.conftest import DEVICES
from tests.support import helpers

SHARES = [0.75, 0.25]


def _data(strategy):
    # 72 rows, global batch 16: 5 micro-steps per epoch, so with
    # accumulation_steps=3 an epoch ends with 2 micro-steps not applied.
    return kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=SHARES,
    )


def _state(model):
    """Weights, then optimizer variables (iterations and slots)."""
    return [np.array(v) for v in model.get_weights()] + [
        np.array(v.numpy()) for v in model.optimizer.variables
    ]


def _assert_same_state(actual, expected):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_keras_file_saved_mid_accumulation_goes_on_exactly(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(accumulation_steps=3)
    model.fit(_data(strategy), epochs=1, verbose=0)
    assert int(state.run_state(model).accumulator.count.numpy()) == 2
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert int(state.run_state(loaded).accumulator.count.numpy()) == 2
    _assert_same_state(_state(loaded), _state(model))

    model.fit(_data(strategy), epochs=1, verbose=0)
    loaded.fit(_data(strategy), epochs=1, verbose=0)
    # 10 micro-steps: 3 updates, the third on micro-steps 7-9.
    assert int(loaded.optimizer.iterations.numpy()) == 3
    _assert_same_state(_state(loaded), _state(model))


def test_dropping_partial_sums_warns(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(accumulation_steps=3)
    model.fit(_data(strategy), epochs=1, verbose=0)
    path = os.path.join(tmp_path, "model.weights.h5")
    model.save_weights(path)
    with strategy.scope():
        other = helpers.hetero_model(accumulation_steps=1)
    with pytest.warns(UserWarning, match="2 micro-step"):
        other.load_weights(path)
    helpers.assert_weights_close(other.get_weights(), model.get_weights())


def test_saving_mid_accumulation_to_h5_warns(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(accumulation_steps=3)
    model.fit(_data(strategy), epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="2 micro-step"):
        model.save(os.path.join(tmp_path, "model.h5"))


def test_elastic_checkpoint_resumes_mid_accumulation_exactly(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        uninterrupted = helpers.hetero_model(accumulation_steps=3)
    uninterrupted.fit(_data(strategy), epochs=2, verbose=0)

    directory = os.path.join(tmp_path, "checkpoints")
    with strategy.scope():
        first = helpers.hetero_model(accumulation_steps=3)
    # Stops after micro-step 4 of epoch 1, the checkpoint saved after it:
    # one update made, one micro-step's sums pending.
    first.fit(
        _data(strategy),
        epochs=2,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(
                directory, save_every=1, async_save=False
            ),
            _StopAfter(4),
        ],
    )
    assert int(state.run_state(first).accumulator.count.numpy()) == 1

    keras.utils.set_random_seed(11)  # other initial weights
    with strategy.scope():
        resumed = kh.HeteroModel(*helpers.layers(), accumulation_steps=3)
        helpers.compile_model(resumed)
    resumed.fit(
        _data(strategy),
        epochs=2,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(
                directory, save_every=1, async_save=False
            )
        ],
    )
    assert int(resumed.optimizer.iterations.numpy()) == 3
    _assert_same_state(_state(resumed), _state(uninterrupted))
    np.testing.assert_allclose(
        state.run_state(resumed).accumulator.count.numpy(),
        state.run_state(uninterrupted).accumulator.count.numpy(),
    )


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.done = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.steps:
            self.model.stop_training = True


@keras.saving.register_keras_serializable("test_saving_state")
class TwoDense(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def _non_functional(kind):
    if kind == "sequential":
        return keras.Sequential(
            [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
        )
    return TwoDense()


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("kind", ["sequential", "subclassed"])
def test_from_model_of_compiled_non_functional_model_keeps_optimizer(
    tmp_path, kind, replicas
):
    x, y, _, _ = helpers.arrays()
    strategy = (
        helpers.mirrored(DEVICES[:2])
        if replicas == 2
        else tf.distribute.get_strategy()
    )
    keras.utils.set_random_seed(5)
    with strategy.scope():
        base = _non_functional(kind)
        base.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model = kh.HeteroModel.from_model(base)
    model.fit(x, y, batch_size=16, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert int(loaded.optimizer.iterations.numpy()) == 5
    _assert_same_state(_state(loaded), _state(model))

    for trained in (model, loaded):
        trained.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 15
    _assert_same_state(_state(loaded), _state(model))
