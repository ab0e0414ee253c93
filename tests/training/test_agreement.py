"""One job, one set of decisions: the settings workers exchange at the
start of `fit` (and at `compile` / `set_precision` for precision "auto")."""

import numpy as np
import pytest

import keras_hetero as kh
from keras_hetero import _agreement
from keras_hetero import devices
from keras_hetero._compat import keras
from keras_hetero.training import agreement
from tests.support import agreement_workers
from tests.support import helpers


def test_mismatches_name_each_setting_and_every_workers_value():
    found = _agreement.mismatches(
        [
            {"global batch size": 32, "seed": 1, "spe": 1},
            {"global batch size": 64, "seed": 1},
            {"global batch size": 32, "seed": 1, "spe": 1},
        ]
    )
    assert found == [
        ("global batch size", [32, 64, 32]),
        ("spe", [1, None, 1]),
    ]
    message = _agreement.mismatch_message(found, "`fit`")
    assert "global batch size: worker 0: 32, worker 1: 64, worker 2: 32" in (
        message
    )
    assert "spe: worker 0: 1, worker 1: None, worker 2: 1" in message
    assert "before the first step of `fit`" in message
    assert _agreement.mismatches([{"a": [1, 2]}, {"a": [1, 2]}]) == []


def test_a_record_travels_in_a_fixed_number_of_words():
    record = {"worker": 1, "settings": {"precision": "auto", "é": [1.5]}}
    words = _agreement.encode(record)
    assert words.dtype == np.int32
    assert words.shape == (_agreement.RECORD_BYTES // 4 + 1,)
    assert _agreement.decode(words) == record
    huge = _agreement.encode({"worker": 2, "x": "y" * _agreement.RECORD_BYTES})
    assert huge.shape == words.shape
    assert _agreement.decode(huge)["oversize"] > _agreement.RECORD_BYTES


def test_no_exchange_without_several_workers():
    strategy = helpers.mirrored(["/device:CPU:0", "/device:CPU:1"])
    assert not _agreement.needs_exchange(strategy)
    assert _agreement.exchange(strategy, {"a": 1}) == [{"a": 1}]


def test_the_fingerprint_holds_what_must_match():
    model = helpers.hetero_model(steps_per_execution=2, bucket_bytes=64)
    dataset = kh.data.shard(
        helpers.examples(), 16, shuffle=True, seed=7, strategy=None
    )
    values = agreement.fingerprint(
        model, dataset, agreement.fit_arguments({"epochs": 3})
    )
    assert values["steps_per_execution"] == 2
    assert values["bucket_bytes"] == 64
    assert values["global batch size"] == 16
    assert values["shuffle seed"] == 7
    assert values["epochs"] == 3
    assert values["compute dtypes"] == ["float32"]
    assert values["loss scaling"] is False
    assert values["examples"] == ["float32(5,)", "float32(1,)"]
    assert values["weights"].startswith("4 weights, 29 parameters")
    assert values["keras"].startswith(kh.FLAVOUR)
    # The library's callbacks and what must match of them; Keras' own
    # callbacks are each worker's business.
    callbacks = [
        kh.callbacks.ElasticCheckpoint("unused", save_every=5),
        keras.callbacks.TerminateOnNaN(),
        kh.callbacks.ShardRebalancer(every_n_steps=7, max_rows=None),
    ]
    given = agreement.fit_arguments({"callbacks": callbacks})
    assert given["callbacks"] == ["ElasticCheckpoint", "ShardRebalancer"]
    assert given["ShardRebalancer.every_n_steps"] == 7
    assert given["ShardRebalancer.max_rows"] is None
    assert "steps=5" in given["ElasticCheckpoint.save_every"]
    assert given["ElasticCheckpoint.resize"] == "keep_global_batch"
    assert agreement.fit_arguments({})["callbacks"] == []
    other = helpers.hetero_model()
    other.optimizer.learning_rate = 0.5
    assert (
        agreement.fingerprint(other, dataset, {})["optimizer"]
        != values["optimizer"]
    )


@pytest.mark.slow
@pytest.mark.both_flavours
def test_an_emulated_a100_t4_cpu_fleet_resolves_one_precision_everywhere():
    # A100 + T4: float16 (with loss scaling) on every worker, where each
    # worker alone would pick bfloat16 / float16; with a CPU: float32.
    for fleet, policy, dtype in (
        (["A100", "T4"], "mixed_float16", "float16"),
        (["A100", "T4", "CPU"], "float32", "float32"),
    ):
        with kh.testing.emulated_fleet(fleet):
            results = kh.testing.run_workers(
                agreement_workers.resolve_auto_precision,
                len(fleet),
                timeout=180,
            )
        values = [result.value for result in results]
        assert [v["devices"][0] for v in values] == [
            devices.FLEET[entry]["model"] for entry in fleet
        ]
        for value in values:
            assert value["set_precision"] == policy
            # (tf-keras' input layer computes in float32 under any policy.)
            assert dtype in value["compute_dtypes"]
            assert ("float16" in value["compute_dtypes"]) is (
                dtype == "float16"
            )
            assert value["loss_scaling"] is (dtype == "float16")
            assert value["loss"] == values[0]["loss"]


@pytest.mark.slow
@pytest.mark.both_flavours
def test_settings_that_differ_raise_on_every_worker_before_step_one():
    results = kh.testing.run_workers(
        agreement_workers.mismatched_fits, 2, timeout=240
    )
    expected = {
        "steps_per_execution": "steps_per_execution: worker 0: 1, worker 1: 2",
        "global batch size": "global batch size: worker 0: 32, worker 1: 64",
        "shuffle seed": "shuffle seed: worker 0: 1, worker 1: 2",
        # A model built at its first step would take other weight shapes.
        "examples": "examples: worker 0: ['float32(5,)', 'float32(1,)'], "
        "worker 1: ['float32(4,)', 'float32(1,)']",
        "ShardRebalancer.every_n_steps": "ShardRebalancer.every_n_steps: "
        "worker 0: 5, worker 1: 10",
        "callbacks": "callbacks: worker 0: [], worker 1: ['StragglerDetector']",
    }
    if kh.FLAVOUR == "tf-keras":
        # tf-keras keeps `steps_per_execution` in a variable, whose initial
        # value MultiWorkerMirroredStrategy broadcasts from worker 0 at
        # `compile`: the workers agree by construction.
        assert [r.value["steps_per_execution"] for r in results] == [1, 1]
        del expected["steps_per_execution"]
    else:
        assert [r.value["steps_per_execution"] for r in results] == [1, 2]
    for result in results:
        errors = result.value["errors"]
        if kh.FLAVOUR == "tf-keras":
            assert errors.pop("steps_per_execution") is None
        assert set(errors) == set(expected)
        for setting, text in expected.items():
            assert errors[setting] is not None, setting
            assert text in errors[setting]
            assert "before the first step of `fit`" in errors[setting]
        assert not result.value["built"]  # no step ran
