"""Mixed precision: loss scaling that skips a step when ANY replica
overflows, the "auto" rule, and clear errors."""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import precision
from keras_hetero._compat import keras
from keras_hetero.training import state
from tests.conftest import DEVICES
from tests.support import helpers


@pytest.mark.parametrize(
    "bucket_bytes", [None, 4], ids=["one_collective", "buckets"]
)
def test_inf_on_one_replica_skips_the_step_everywhere(
    mixed_float16, bucket_bytes
):
    # With 4-byte buckets the first layer's gradient (inf on replica 1)
    # and the others travel in different collectives.
    strategy = helpers.mirrored(DEVICES[:2])
    armed = [False]
    with strategy.scope():
        model = helpers.poisoned_model(armed, bucket_bytes=bucket_bytes)
    probe = {"snapshot": lambda: helpers.replica_state(strategy, model)}
    data = kh.data.shard(
        helpers.examples(), 16, strategy=strategy, shares=[0.25, 0.75]
    )
    model.fit(
        data, epochs=1, verbose=0, callbacks=[helpers.Arm(armed, 3, probe)]
    )
    assert probe["scale_after"] == probe["scale_before"] / 2
    for before, after in zip(probe["before"], probe["after"]):
        np.testing.assert_array_equal(before, after)  # nothing moved
    moved = [
        not np.array_equal(a, b) for a, b in zip(probe["after"], probe["next"])
    ]
    assert any(moved)  # the next, finite step trains
    assert all(np.all(np.isfinite(v)) for v in probe["next"])
    # 5 batches; skipped ones (ours, and any natural overflow while the
    # scale finds its level) did not count as optimizer steps.
    skipped = int(state.run_state(model).loss_scale.skipped.numpy())
    assert skipped >= 1
    assert int(model.optimizer.iterations.numpy()) == 5 - skipped


def test_float16_training_matches_float32_closely(mixed_float16):
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = kh.HeteroModel(*helpers.layers(), precision="mixed_float16")
        helpers.compile_model(model)
        model.set_weights(helpers.initial_weights())
    data = kh.data.shard(
        helpers.examples(), 16, strategy=strategy, shares=[0.75, 0.25]
    )
    history = model.fit(data, epochs=2, verbose=0)
    _, reference = helpers.reference_fit()
    skipped = int(state.run_state(model).loss_scale.skipped.numpy())
    # Each overflow (the first steps, while the scale finds its level)
    # halved the scale and skipped that step everywhere.
    assert model.loss_scale == 2.0**15 / 2**skipped
    assert skipped <= 3
    # Two skipped steps of ten in epoch 0; by the end of epoch 1 float16
    # training is within 5% of the float32 single-device loss.
    assert history.history["loss"][-1] == pytest.approx(
        reference["loss"][-1], rel=0.05
    )


def test_float32_model_has_no_loss_scale():
    with tf.distribute.get_strategy().scope():
        model = helpers.hetero_model()
    assert model.loss_scale is None


def test_named_mixed_policy_must_match_the_layers():
    model = kh.HeteroModel(*helpers.layers(), precision="mixed_float16")
    with pytest.raises(ValueError, match="no layer of the model computes"):
        model.compile(optimizer="sgd", loss="mse")


def test_loss_scale_optimizer_is_replaced_by_our_scaling(mixed_float16):
    model = kh.HeteroModel(*helpers.layers(), precision="mixed_float16")
    inner = keras.optimizers.SGD()
    if kh.FLAVOUR == "tf-keras":
        wrapped = keras.mixed_precision.LossScaleOptimizer(inner)
    else:
        wrapped = keras.optimizers.LossScaleOptimizer(inner)
    model.compile(optimizer=wrapped, loss="mse")
    assert model.optimizer is inner
    assert model.loss_scale == 2.0**15


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="precision='half'"):
        kh.HeteroModel(*helpers.layers(), precision="half")


@pytest.mark.parametrize(
    "devices, expected",
    [
        ([("GPU", (8, 0)), ("GPU", (9, 0))], "mixed_bfloat16"),
        ([("GPU", (8, 6)), ("GPU", (7, 5))], "mixed_float16"),
        ([("GPU", (8, 6)), ("CPU", None)], "float32"),
        ([("GPU", (6, 1)), ("GPU", (8, 0))], "float32"),
        ([("TPU", None)], "mixed_bfloat16"),
        ([], "float32"),
    ],
)
def test_auto_rule(devices, expected):
    assert precision.auto_precision(devices) == expected


def test_auto_on_this_machine_is_float32():
    strategy = helpers.mirrored(DEVICES[:2])
    try:
        assert kh.set_precision("auto", strategy) == "float32"
        assert keras.mixed_precision.global_policy().name == "float32"
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
@pytest.mark.both_flavours
def test_inf_on_one_worker_skips_the_step_on_every_worker():
    from tests.support import training_workers

    results = kh.testing.run_workers(
        training_workers.poisoned_mwms, 2, timeout=240
    )
    for result in results:
        value = result.value
        assert value["unchanged"], result.index
        assert value["moved_next"] and value["finite"], result.index
        before, after = value["scales"]
        assert after == before / 2
        assert value["iterations"] == 5 - value["skipped"]
    assert results[0].value["scales"] == results[1].value["scales"]
