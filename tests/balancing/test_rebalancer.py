"""ShardRebalancer inside fit: convergence, exact math, exactly-once, errors."""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import helpers
from tests.support import training_workers


def _slow_model(strategy, seconds_per_row, width=8):
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed(seconds_per_row)(inputs)
        hidden = keras.layers.Dense(width, activation="tanh")(slow)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
    return model, model.layers[1]


def test_shares_converge_to_simulated_speeds_and_follow_a_slowdown():
    strategy = helpers.mirrored(DEVICES[:3])
    model, slow = _slow_model(strategy, [0.004, 0.002, 0.001])  # 1 : 2 : 4
    data = kh.data.shard(helpers.examples(rows=42 * 40), 42, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=4, window=4)
    model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    np.testing.assert_allclose(data.shares, [1 / 7, 2 / 7, 4 / 7], atol=0.05)

    slow.seconds_per_row = [0.004, 0.002, 0.004]  # replica 2 slows 4x
    history = model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    np.testing.assert_allclose(data.shares, [1 / 4, 2 / 4, 1 / 4], atol=0.05)
    assert history.history["share/replica_1"][0] == pytest.approx(
        data.shares[1]
    )
    assert rebalancer.changes  # it acted in the second fit too


def test_weights_equal_single_device_with_rebalancing_on():
    strategy = helpers.mirrored(DEVICES[:2])
    seconds = [0.002, 0.0005]
    model, _ = _slow_model(strategy, seconds, width=4)
    reference, _ = _slow_model(tf.distribute.get_strategy(), 0.0, width=4)
    reference.compile(
        optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"]
    )
    model.set_weights(reference.get_weights())
    rows = 16 * 24
    data = kh.data.shard(helpers.examples(rows=rows), 16, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])
    reference.fit(helpers.examples(rows=rows).batch(16), epochs=2, verbose=0)
    assert len(rebalancer.changes) >= 1
    assert data.shares[1] > 0.6  # the fast replica got more rows
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_each_example_trains_exactly_once_per_epoch_while_shares_move():
    strategy = helpers.mirrored(DEVICES[:3])
    seen = []
    with strategy.scope():
        model = helpers.id_model(seen, [0.003, 0.001, 0.0])
    rows = 30 * 24 + 7
    data = kh.data.shard(helpers.id_examples(rows), 30, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])
    assert len(rebalancer.changes) >= 2
    counts = np.bincount(seen, minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)


@pytest.mark.slow
@pytest.mark.both_flavours
def test_multi_worker_rebalancing_is_identical_everywhere_and_exact():
    rows = 24 * 20 + 5
    results = kh.testing.run_workers(
        training_workers.rebalance_mwms, 2, timeout=240, args=(rows,)
    )
    first, second = (r.value for r in results)
    # Every worker took the same decisions from the same gathered stats.
    assert first["changes"] == second["changes"]
    assert len(first["changes"]) >= 1
    np.testing.assert_array_equal(first["shares"], second["shares"])
    assert first["shares"][1] > 0.6  # worker 1's replica is the fast one
    # Exactly once per epoch across both workers' replicas.
    counts = np.bincount(first["seen"] + second["seen"], minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)
    # Training math unchanged: one device on the same global batches.
    reference = helpers.id_model([], 0.0)
    reference.set_weights(first["initial"])
    reference.fit(helpers.id_examples(rows).batch(24), epochs=2, verbose=0)
    helpers.assert_weights_close(first["weights"], reference.get_weights())


def test_bad_arguments():
    data = kh.data.shard(helpers.examples(), 16)
    with pytest.raises(TypeError, match="HeteroDataset"):
        kh.callbacks.ShardRebalancer(helpers.examples())
    for kwargs, match in (
        ({"every_n_steps": 0}, "every_n_steps=0"),
        ({"every_n_steps": -3}, "every_n_steps"),
        ({"window": 0}, "window"),
        ({"lag": 0}, "lag"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"min_share": 2.0}, "min_share"),
        ({"max_rows": 0}, "max_rows"),
        ({"tolerance": -0.1}, "tolerance"),
    ):
        with pytest.raises(ValueError, match=match):
            kh.callbacks.ShardRebalancer(data, **kwargs)


def test_the_dataset_state_carries_shares_and_the_rebalancer_its_readings():
    data = kh.data.shard(
        helpers.examples(), 16, strategy=helpers.mirrored(DEVICES[:2])
    )
    rebalancer = kh.callbacks.ShardRebalancer(data)
    data.shares = [0.7, 0.3]
    state, data_state = rebalancer.get_state(), data.get_state()
    assert "schedule" not in state
    data.shares = [0.5, 0.5]
    rebalancer.set_state(state)
    np.testing.assert_allclose(data.shares, [0.5, 0.5])
    data.set_state(data_state)
    np.testing.assert_allclose(data.shares, [0.7, 0.3])
    # A rebalancer state written by 0.1.0 held the schedule: still restored.
    data.shares = [0.5, 0.5]
    rebalancer.set_state({**state, **data_state})
    np.testing.assert_allclose(data.shares, [0.7, 0.3])
    with pytest.raises(ValueError, match="HeteroDataset.get_state"):
        data.set_state({"changes": []})
