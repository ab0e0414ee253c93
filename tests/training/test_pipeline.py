"""Pipeline micro-batching (`HeteroModel(pipeline_microbatches=M)`): the
update equals one device on the whole batch, whatever M, placement and split.
"""

import collections
import threading

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.testing import simulated_speed
from tests.conftest import DEVICES
from tests.support import helpers


def _placed_model(microbatches, regularizer=True, slow=None):
    """helpers.layers() with its two Dense layers on CPU:0 and CPU:1."""
    inputs = keras.Input((helpers.FEATURES,))
    hidden = inputs
    if slow is not None:
        hidden = kh.testing.SimulatedSpeed(slow)(hidden)
    hidden = kh.layers.Placed(
        keras.layers.Dense(
            4,
            activation="tanh",
            kernel_regularizer=(
                keras.regularizers.L2(0.01) if regularizer else None
            ),
        ),
        device=DEVICES[0],
    )(hidden)
    if slow is not None:
        hidden = kh.layers.Placed(
            kh.testing.SimulatedSpeed(slow), device=DEVICES[1]
        )(hidden)
    outputs = kh.layers.Placed(keras.layers.Dense(1), device=DEVICES[1])(hidden)
    model = helpers.compile_model(
        kh.HeteroModel(inputs, outputs, pipeline_microbatches=microbatches)
    )
    model.set_weights(helpers.initial_weights(regularizer))
    return model


# Global batch 16 over 72 rows: micro-batches of 5/5/6 and, in the last
# batch of 8 rows, 2/3/3; with M=16 that batch has 8 empty micro-batches.
@pytest.mark.parametrize("microbatches", [2, 3, 16])
def test_placed_pipeline_equals_single_device(microbatches):
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    model = _placed_model(microbatches)
    history = model.fit(
        helpers.examples(sample_weights=True).batch(helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    for key in ("loss", "mae"):
        assert history.history[key] == pytest.approx(
            reference_history[key], rel=1e-5
        )
    assert int(model.optimizer.iterations) == 10


def test_pipeline_with_uneven_shares_under_mirrored_strategy():
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(regularizer=True, pipeline_microbatches=4)
    data = kh.data.shard(
        helpers.examples(sample_weights=True),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.75, 0.25],
    )
    history = model.fit(data, epochs=2, verbose=0)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert history.history["loss"] == pytest.approx(
        reference_history["loss"], rel=1e-5
    )


def test_pipeline_composes_with_gradient_accumulation():
    # Two micro-steps of 8 rows accumulated = one step on 16 rows.
    model = helpers.hetero_model(accumulation_steps=2, pipeline_microbatches=3)
    model.fit(helpers.examples().take(64).batch(8), epochs=1, verbose=0)
    reference_4_steps = helpers.compile_model(keras.Model(*helpers.layers()))
    reference_4_steps.set_weights(helpers.initial_weights())
    reference_4_steps.fit(
        helpers.examples().take(64).batch(16), epochs=1, verbose=0
    )
    assert int(model.optimizer.iterations) == 4
    helpers.assert_weights_close(
        model.get_weights(), reference_4_steps.get_weights()
    )


def test_each_microbatch_runs_through_the_model():
    seen = []

    class Rows(keras.layers.Layer):
        def call(self, inputs):
            def record(rows):
                seen.append(int(rows))
                return np.float32(0.0)

            zero = tf.numpy_function(record, [tf.shape(inputs)[0]], tf.float32)
            zero.set_shape([])
            return inputs + zero

    inputs = keras.Input((helpers.FEATURES,))
    outputs = keras.layers.Dense(1)(Rows()(inputs))
    model = kh.HeteroModel(inputs, outputs, pipeline_microbatches=3)
    model.compile(optimizer="sgd", loss="mse")
    x, y, _, _ = helpers.arrays(rows=10)
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert sorted(seen) == [3, 3, 4]


def test_simulated_speed_sleeps_on_the_placed_stage_device(monkeypatch):
    # The dict of speeds is looked up by the device the stage runs on, and
    # each device's sleeps queue on that device's lock.
    used = []

    class Recording(collections.defaultdict):
        def __missing__(self, key):
            used.append(key)
            value = self[key] = threading.Lock()
            return value

    monkeypatch.setattr(simulated_speed, "_DEVICE_LOCKS", Recording())
    model = _placed_model(2, regularizer=False, slow={"CPU:1": 1e-4})
    x, y, _, _ = helpers.arrays(rows=8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(used) == 1 and used[0].endswith("CPU:1"), used


def test_batch_normalization_with_microbatches_warns():
    inputs = keras.Input((helpers.FEATURES,))
    hidden = keras.layers.BatchNormalization(name="bn")(inputs)
    model = kh.HeteroModel(
        inputs, keras.layers.Dense(1)(hidden), pipeline_microbatches=2
    )
    model.compile(optimizer="sgd", loss="mse")
    x, y, _, _ = helpers.arrays(rows=8)
    with pytest.warns(UserWarning, match=r"\['bn'\].*2 micro-batches"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
