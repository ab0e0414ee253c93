"""Memory-aware shares: `ShardRebalancer(max_rows="auto")` caps each
replica's rows by what its device's memory is estimated to hold, on an
emulated fleet (`kh.testing.emulated_fleet`: replicas described as a GPU
with a small memory figure, through the same description a real GPU's
memory comes from)."""

import logging
import math

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import devices as devices_lib
from keras_hetero._compat import keras
from keras_hetero.balancing import core as rebalance
from keras_hetero.balancing import memory
from tests.conftest import DEVICES
from tests.support import helpers
from tests.support import training_workers


def _dense_model():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _variable_bytes(variables):
    return sum(v.numpy().nbytes for v in variables)


def test_the_estimate_counts_state_and_each_layers_outputs():
    model = _dense_model()
    model.fit(np.ones((4, 8)), np.ones((4, 1)), verbose=0)  # builds slots
    weights = (8 * 4 + 4 + 4 * 1 + 1) * 4
    optimizer = model.optimizer.variables
    optimizer = optimizer() if callable(optimizer) else optimizer
    assert memory.state_bytes(model) == 2 * weights + _variable_bytes(optimizer)
    assert _variable_bytes(optimizer) >= weights  # the momentum slots
    # Twice (outputs and their gradients) the input's 8, the hidden 4 and
    # the output's 1 float32 per row.
    assert memory.activation_bytes_per_row(model) == 2 * (8 + 4 + 1) * 4


def test_the_estimate_counts_float16_outputs_at_two_bytes():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(4)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert memory.activation_bytes_per_row(model) == 2 * (8 * 4 + 4 * 2 + 2)


def test_a_subclassed_model_has_no_per_row_estimate():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Net()
    model(np.ones((2, 3), np.float32))
    assert memory.activation_bytes_per_row(model) is None
    device = devices_lib.DeviceDescription("/cpu:0", "GPU", "T4", None, 2**30)
    caps, per_row = memory.replica_caps(model, [[device]])
    assert caps == [None] and per_row is None


def test_rows_that_fit_and_each_replicas_memory():
    assert memory.rows_that_fit(1000, 100, 8) == 100  # (900 - 100) / 8
    assert memory.rows_that_fit(1000, 5000, 8) == 0
    assert memory.rows_that_fit(None, 100, 8) is None
    assert memory.rows_that_fit(1000, 100, None) is None
    cpu = devices_lib.DeviceDescription("/cpu:0", "CPU", "host CPU", None, 900)
    gpu = devices_lib.DeviceDescription("/gpu:0", "GPU", "Tesla T4", None, 500)
    unknown = devices_lib.DeviceDescription("/gpu:1", "GPU", "GPU")
    # A worker's CPU replicas share its host's memory; a GPU has its own.
    assert memory.replica_memory([[cpu, cpu, cpu], [gpu, unknown]]) == [
        300,
        300,
        300,
        500,
        None,
    ]


def test_a_replica_over_its_cap_moves_down_whatever_the_gain():
    window = rebalance.SpeedWindow.empty(2, 3)
    for _ in range(3):
        window = window.add([8, 8], [0.008, 0.008])  # equal speeds
    shares = rebalance.decide(
        window, [0.5, 0.5], 16, max_rows=np.array([12.0, 6.0]), tolerance=9
    )
    np.testing.assert_allclose(shares * 16, [10, 6])
    # Within the caps, the tolerance holds the shares as before.
    assert (
        rebalance.decide(
            window, [0.5, 0.5], 16, max_rows=np.array([12.0, 8.0]), tolerance=9
        )
        is None
    )


def _slow_model(strategy, seconds_per_row):
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed(seconds_per_row)(inputs)
        hidden = keras.layers.Dense(4, activation="tanh")(slow)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        # Its variables count in the state (tf-keras' SGD has a slot per
        # weight even without momentum): built now, the estimate is final.
        model.optimizer.build(model.trainable_variables)
    return model


def small_gpu(model, rows):
    """A "Tesla T4" whose memory holds `rows` rows of `model` (half a row
    more, so that rounding does not decide; `model`'s optimizer built)."""
    need = memory.state_bytes(model) + (rows + 0.5) * (
        memory.activation_bytes_per_row(model)
    )
    return {
        "kind": "GPU",
        "model": "Tesla T4",
        "compute_capability": [7, 5],
        "memory_bytes": int(math.ceil(need / (1 - memory.MEMORY_HEADROOM))),
    }


def _rows(changes, global_batch):
    return [rows_from(shares, global_batch) for _, _, shares in changes]


def rows_from(shares, global_batch):
    from keras_hetero.data.shares import rows_from_shares

    return [int(r) for r in rows_from_shares(np.asarray(shares), global_batch)]


def test_a_fast_small_gpu_is_held_at_its_cap_and_training_stays_exact(caplog):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _slow_model(strategy, [0.002, 0.0005])  # replica 1 is 4x faster
    reference = _slow_model(tf.distribute.get_strategy(), 0.0)
    model.set_weights(reference.get_weights())
    rows = 16 * 24
    data = kh.data.shard(helpers.examples(rows=rows), 16, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=3, tolerance=0.0
    )
    with kh.testing.emulated_fleet(small_gpu(model, 10)):
        with caplog.at_level(logging.WARNING, logger="keras_hetero"):
            model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])
    assert rebalancer.row_caps == [10, 10]
    assert rebalancer.changes
    # Its speed would give replica 1 about 13 of 16 rows; no move gives it
    # more than 10.
    assert all(r[1] <= 10 for r in _rows(rebalancer.changes, 16))
    assert list(data.rows) == [6, 10]
    held = [m for m in caplog.messages if "is held at 10 rows" in m]
    assert len(held) == 1 and "replica 1 (Tesla T4" in held[0], held
    reference.fit(helpers.examples(rows=rows).batch(16), epochs=2, verbose=0)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_shares_over_the_cap_at_the_start_move_down_at_the_first_decision(
    caplog,
):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _slow_model(strategy, [0.001, 0.001])
    data = kh.data.shard(
        helpers.examples(rows=16 * 12), 16, strategy=strategy, shares=[0.1, 0.9]
    )
    # A tolerance no speed gain passes: only the cap moves the shares.
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=2, tolerance=100.0
    )
    with kh.testing.emulated_fleet(small_gpu(model, 10)):
        with caplog.at_level(logging.WARNING, logger="keras_hetero"):
            model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    assert len(rebalancer.changes) == 1
    assert rebalancer.changes[0][0] == 3  # the first decision
    assert data.rows[1] <= 10
    assert any(
        "replica 1 (Tesla T4" in m and "has 14 rows" in m
        for m in caplog.messages
    ), caplog.messages


def test_caps_that_cannot_hold_the_batch_warn_and_cap_nothing(caplog):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _slow_model(strategy, [0.002, 0.0005])
    data = kh.data.shard(helpers.examples(rows=16 * 12), 16, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=3, tolerance=0.0
    )
    with kh.testing.emulated_fleet(small_gpu(model, 6)):  # 12 < 16 rows
        with caplog.at_level(logging.WARNING, logger="keras_hetero"):
            model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    assert rebalancer.row_caps == [None, None]
    assert any("less than the global batch of 16" in m for m in caplog.messages)
    assert data.rows[1] > 10  # balanced to speed, uncapped


def test_a_host_cpu_caps_nothing_a_small_model_needs():
    strategy = helpers.mirrored(DEVICES[:2])
    model = _slow_model(strategy, [0.002, 0.0005])
    data = kh.data.shard(helpers.examples(rows=16 * 12), 16, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    # Two logical CPUs share the host's memory: each holds millions of rows.
    assert all(cap > 10**6 for cap in rebalancer.row_caps)
    assert data.rows[1] >= 12


def test_max_rows_given_by_hand():
    strategy = helpers.mirrored(DEVICES[:2])
    model = _slow_model(strategy, [0.002, 0.0005])
    data = kh.data.shard(helpers.examples(rows=16 * 12), 16, strategy=strategy)
    for max_rows in (None, 9, [16, 9], np.array([16, 9])):
        data.shares = [0.5, 0.5]
        rebalancer = kh.callbacks.ShardRebalancer(
            data,
            every_n_steps=2,
            warmup_steps=1,
            window=3,
            tolerance=0.0,
            max_rows=max_rows,
        )
        model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
        if max_rows is None:
            assert rebalancer.row_caps is None and data.rows[1] >= 12
        else:
            assert rebalancer.row_caps[1] == 9 and data.rows[1] == 9
    for max_rows, match in (
        ([16, 9, 9], "3 value\\(s\\) for 2 replicas"),
        ([7, 8], "15 rows together, but each global batch has 16"),
    ):
        rebalancer = kh.callbacks.ShardRebalancer(data, max_rows=max_rows)
        with pytest.raises(ValueError, match=match):
            model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])


@pytest.mark.parametrize(
    "max_rows", [0, -4, 2.5, "big", True, [3, 0], [[3, 4]]]
)
def test_bad_max_rows_is_named(max_rows):
    with pytest.raises(ValueError, match="max_rows="):
        kh.callbacks.ShardRebalancer(max_rows=max_rows)


@pytest.mark.slow
@pytest.mark.both_flavours
def test_an_emulated_a100_and_small_t4_agree_on_caps_and_hold_the_t4():
    rows = 24 * 20 + 5
    reference = helpers.id_model([], 0.0)
    reference.optimizer.build(reference.trainable_variables)
    t4 = small_gpu(reference, 15)
    with kh.testing.emulated_fleet(["A100", t4]):
        results = kh.testing.run_workers(
            training_workers.rebalance_mwms, 2, timeout=240, args=(rows,)
        )
    first, second = (r.value for r in results)
    # Both workers computed the same caps from the exchanged devices: the
    # A100's 80 GiB holds any batch, the T4 15 rows.
    assert first["caps"] == second["caps"]
    assert first["caps"][1] == 15 and first["caps"][0] > 10**6
    assert first["changes"] == second["changes"] and first["changes"]
    # The T4's replica is 8x faster (simulated): about 21 of 24 rows at
    # its speed, never more than 15.
    assert all(r[1] <= 15 for r in _rows(first["changes"], 24))
    assert rows_from(first["shares"], 24) == [9, 15]
    assert first["held"] == second["held"] == 1
    counts = np.bincount(first["seen"] + second["seen"], minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)
    reference.set_weights(first["initial"])
    reference.fit(helpers.id_examples(rows).batch(24), epochs=2, verbose=0)
    helpers.assert_weights_close(first["weights"], reference.get_weights())


@pytest.mark.parametrize("built", [True, False], ids=["input", "lazy"])
def test_a_sequential_model_on_arrays_is_capped_too(built, caplog):
    # fit shards the arrays itself; a Sequential model built at its first
    # step has its layers' output shapes by the first decision.
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        layers = [kh.testing.SimulatedSpeed([0.002, 0.0005])]
        layers += helpers.seeded_layers()
        if built:
            layers.insert(0, keras.Input((helpers.FEATURES,)))
        model = kh.HeteroSequential(layers)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y, _, _ = helpers.arrays(16 * 12)
    reference = kh.HeteroSequential(
        [
            keras.Input((helpers.FEATURES,)),
            kh.testing.SimulatedSpeed(0.0),
            *helpers.seeded_layers(),
        ]
    )
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    reference.optimizer.build(reference.trainable_variables)
    rebalancer = kh.callbacks.ShardRebalancer(
        every_n_steps=2, warmup_steps=1, window=3, tolerance=0.0
    )
    with kh.testing.emulated_fleet(small_gpu(reference, 10)):
        with caplog.at_level(logging.WARNING, logger="keras_hetero"):
            model.fit(
                x,
                y,
                batch_size=16,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[rebalancer],
            )
    assert rebalancer.row_caps == [10, 10]
    assert list(rebalancer.dataset.rows) == [6, 10]
    assert any("replica 1 (Tesla T4" in m for m in caplog.messages)
