"""HeteroModel's user-facing surface: construction styles, saving, input and
argument errors, telemetry, evaluate / predict."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import helpers


def test_from_model_shares_layers_and_trains_like_reference():
    reference, _ = helpers.reference_fit()
    base = keras.Sequential(
        [
            keras.Input((helpers.FEATURES,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model = helpers.compile_model(kh.HeteroModel.from_model(base))
    model.set_weights(helpers.initial_weights())
    model.fit(
        kh.data.shard(helpers.examples(), helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    # Layers (and so weights) are shared with the wrapped model.
    helpers.assert_weights_close(base.get_weights(), model.get_weights())


class SubclassedModel(kh.HeteroModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def test_subclassing_works_after_functional_use_under_mirrored():
    # A functional HeteroModel must not turn HeteroModel itself functional.
    kh.HeteroModel(*helpers.layers())
    reference, _ = helpers.reference_fit()
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.compile_model(SubclassedModel())
        model(np.zeros((1, helpers.FEATURES), "float32"))
        model.set_weights(helpers.initial_weights())
    model.fit(
        kh.data.shard(
            helpers.examples(),
            helpers.GLOBAL_BATCH,
            shares=[0.25, 0.75],
            strategy=strategy,
        ),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_keras_file_round_trip(tmp_path):
    model = helpers.hetero_model(
        gradient_compression="bf16", global_clipnorm=2.0
    )
    model.fit(
        kh.data.shard(helpers.examples(), helpers.GLOBAL_BATCH),
        epochs=1,
        verbose=0,
    )
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kh.HeteroModel)
    assert type(loaded).__name__ == "HeteroModel"
    config = loaded.get_config()
    assert config["gradient_compression"] == "bf16"
    assert config["global_clipnorm"] == 2.0
    helpers.assert_weights_close(loaded.get_weights(), model.get_weights())
    x, _, _, _ = helpers.arrays()
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6
    )


def test_evaluate_and_predict_on_uneven_shards_match_reference():
    reference, _ = helpers.reference_fit(epochs=1)
    strategy = helpers.mirrored(DEVICES[:3])
    with strategy.scope():
        model = helpers.hetero_model()
    model.set_weights(reference.get_weights())
    dataset = kh.data.shard(
        helpers.examples(sample_weights=True),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.5, 0.0, 0.5],
    )
    got = model.evaluate(dataset, return_dict=True, verbose=0)
    want = reference.evaluate(
        helpers.examples(sample_weights=True).batch(helpers.GLOBAL_BATCH),
        return_dict=True,
        verbose=0,
    )
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["mae"] == pytest.approx(want["mae"], rel=1e-5)
    x, _, _, _ = helpers.arrays()
    np.testing.assert_allclose(
        model.predict(dataset, verbose=0),
        reference.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def _record_stats(model, dataset):
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.step_stats)

    model.fit(dataset, epochs=1, verbose=0, callbacks=[Record()])
    return seen


def test_step_stats_cover_every_replica():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = kh.HeteroModel(*helpers.layers())
        model.compile(optimizer="sgd", loss="mse")
    assert model.step_stats is None
    dataset = kh.data.shard(
        helpers.examples(rows=64), 16, strategy=strategy, shares=[0.75, 0.25]
    )
    seen = _record_stats(model, dataset)
    assert [s.step for s in seen] == [1, 2, 3, 4]
    for stats in seen:
        assert stats.steps == 1
        assert stats.rows.tolist() == [12, 4]
        assert np.all(stats.compute_seconds > 0)
        assert len(stats.devices) == 2
        assert stats.devices[1].endswith("CPU:1")


def test_step_stats_sum_over_steps_per_execution():
    model = kh.HeteroModel(*helpers.layers())
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    dataset = kh.data.shard(helpers.examples(rows=80), 16)
    seen = _record_stats(model, dataset)
    assert [s.steps for s in seen] == [2, 2, 1]
    assert [s.step for s in seen] == [2, 4, 5]
    assert [s.rows.tolist() for s in seen] == [[32], [32], [16]]


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_train_function_reads_the_telemetry_itself(
    monkeypatch, steps_per_execution
):
    # Keras 3: the totals come out of the train function's own call (no
    # eager read after it), leave the logs Keras sees, and give the same
    # step_stats. tf-keras' train function is its own: one read per call.
    from keras_hetero.training import telemetry

    given = []
    snapshot = telemetry.Telemetry.snapshot

    def spy(self, call_seconds=None, totals=None):
        given.append(totals)
        return snapshot(self, call_seconds, totals)

    monkeypatch.setattr(telemetry.Telemetry, "snapshot", spy)
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = kh.HeteroModel(*helpers.layers())
        model.compile(
            optimizer="sgd",
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    dataset = kh.data.shard(
        helpers.examples(rows=64), 16, strategy=strategy, shares=[0.75, 0.25]
    )
    logs_seen = []

    class Logs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            logs_seen.append(sorted(logs))
            stats = self.model.step_stats
            assert stats.rows.tolist() == [12 * stats.steps, 4 * stats.steps]

    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[Logs()])
    calls = 4 // steps_per_execution
    assert model.step_stats.step == 4
    assert sorted(history.history) == ["loss", "mae"]
    assert logs_seen == [["loss", "mae"]] * calls
    x, y, _, _ = helpers.arrays(rows=16)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert sorted(logs) == ["loss", "mae"]
    assert model.step_stats.step == 5 and model.step_stats.steps == 1
    calls += 1
    read_in_call = [totals is not None for totals in given]
    assert read_in_call == [kh.FLAVOUR == "keras3"] * calls


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_on_batch_methods_take_one_step_whatever_steps_per_execution(
    steps_per_execution,
):
    # tf-keras' own *_on_batch fail with steps_per_execution > 1 (their loop
    # asks the one batch for a second): each call is one exact step here,
    # and fit afterwards still runs steps_per_execution steps per call.
    # (Keras 3's own predict_on_batch returns each row once per replica.)
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(steps_per_execution=steps_per_execution)
    reference = helpers.compile_model(keras.Model(*helpers.layers()))
    reference.set_weights(helpers.initial_weights())
    x, y, _, _ = helpers.arrays(rows=32)
    for rows in (slice(0, 16), slice(16, 32)):
        logs = model.train_on_batch(x[rows], y[rows], return_dict=True)
        want = reference.train_on_batch(x[rows], y[rows], return_dict=True)
        np.testing.assert_allclose(logs["loss"], want["loss"], rtol=1e-5)
        assert model.step_stats.steps == 1
        # Keras 3's *_on_batch give each replica the whole batch (stock
        # too); tf-keras splits it.
        split = [16, 16] if kh.FLAVOUR == "keras3" else [8, 8]
        assert model.step_stats.rows.tolist() == split
    assert model.step_stats.step == 2
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    logs = model.test_on_batch(x, y, return_dict=True)
    want = reference.test_on_batch(x, y, return_dict=True)
    np.testing.assert_allclose(logs["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        model.predict_on_batch(x),
        reference.predict_on_batch(x),
        rtol=1e-5,
        atol=1e-6,
    )
    dataset = kh.data.shard(helpers.examples(rows=96), 16, strategy=strategy)
    seen = _record_stats(model, dataset)
    assert [s.steps for s in seen] == [steps_per_execution] * (
        6 // steps_per_execution
    )
    assert model.step_stats.step == 8


def test_steps_per_execution_with_replicas():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = kh.HeteroModel(*helpers.layers())
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    dataset = kh.data.shard(
        helpers.examples(rows=64), 16, strategy=strategy, shares=[0.75, 0.25]
    )
    seen = _record_stats(model, dataset)
    assert [s.steps for s in seen] == [2, 2]
    assert [s.rows.tolist() for s in seen] == [[24, 8], [24, 8]]


def test_compute_seconds_reflect_simulated_speed():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed([0.0, 0.01])(inputs)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(slow))
        model.compile(optimizer="sgd", loss="mse")
    dataset = kh.data.shard(helpers.examples(rows=32), 16, strategy=strategy)
    model.fit(dataset, epochs=1, verbose=0)
    stats = model.step_stats
    # Replica 1 sleeps 8 rows * 0.01 s inside its step; replica 0 does not.
    assert stats.compute_seconds[1] >= 0.08
    assert stats.compute_seconds[0] < stats.compute_seconds[1]


_FIT_AFTER_CONTEXT_RESET = """
import numpy as np
from tensorflow.python.eager import context
import keras_hetero as kh
from keras_hetero._compat import keras

def fit():
    inputs = keras.Input((3,))
    model = kh.HeteroModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    return model.step_stats.compute_seconds

fit()
context._reset_context()  # as Keras' and TF's distribute tests do
print("seconds", fit().tolist())
"""


def test_clocks_work_after_the_eager_context_is_reset():
    # The clock function is registered in the context it was traced in; a
    # cached one called in a new context gave "Can't find a function".
    result = subprocess.run(
        [sys.executable, "-c", _FIT_AFTER_CONTEXT_RESET],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "seconds [" in result.stdout


def test_replica_clocks_do_not_wait_for_each_other():
    # A stateful clock op would be chained across the replicas' steps by
    # automatic control dependencies: replica 1's start after replica 0's end.
    import time

    from keras_hetero.training import telemetry

    strategy = helpers.mirrored(DEVICES[:2])

    def work(x):
        time.sleep(0.2)
        return x

    @tf.function
    def step(x):
        def replica(x):
            start = telemetry.clock(x)
            with tf.control_dependencies([start]):
                x = tf.identity(x)
            y = tf.numpy_function(work, [x], tf.float32, stateful=False)
            with tf.control_dependencies([y]):
                end = telemetry.clock(tf.shape(x)[0])
            return start, end, y

        return strategy.run(replica, (x,))

    starts, ends, _ = step(tf.ones([2]))
    starts = [float(s) for s in strategy.experimental_local_results(starts)]
    ends = [float(e) for e in strategy.experimental_local_results(ends)]
    assert all(e - s >= 0.2 for s, e in zip(starts, ends))
    # The two replicas' intervals overlap: each started before the other ended.
    assert max(starts) < min(ends)


def test_model_created_outside_scope_used_inside_is_an_error():
    model = kh.HeteroModel(*helpers.layers())
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        with pytest.raises(ValueError, match="outside any strategy scope"):
            model.compile(optimizer="sgd", loss="mse")


def test_dataset_for_another_strategy_is_an_error():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model()
    other = kh.data.shard(helpers.examples(), helpers.GLOBAL_BATCH)
    with pytest.raises(ValueError, match="sharded for"):
        model.fit(other, epochs=1, verbose=0)


def test_dataset_for_another_instance_of_the_same_strategy_type_says_so():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model()
    twin = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=helpers.mirrored(DEVICES[:2]),
    )
    with pytest.raises(ValueError, match="another MirroredStrategy instance"):
        model.fit(twin, epochs=1, verbose=0)


@pytest.mark.parametrize("labels", ["sparse", "one-hot"])
def test_class_weight_with_a_hetero_dataset_equals_stock_keras(labels):
    x, _, _, _ = helpers.arrays()
    classes = np.argmax(x[:, :3], axis=1)
    y = classes if labels == "sparse" else np.eye(3, dtype="float32")[classes]
    loss = (
        "sparse_categorical_crossentropy"
        if labels == "sparse"
        else "categorical_crossentropy"
    )
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}

    def classifier(cls):
        keras.utils.set_random_seed(2)
        inputs = keras.Input((helpers.FEATURES,))
        outputs = keras.layers.Dense(3, activation="softmax")(inputs)
        model = cls(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    reference = classifier(keras.Model)
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = classifier(kh.HeteroModel)
    model.set_weights(reference.get_weights())
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    data = kh.data.shard(
        examples, helpers.GLOBAL_BATCH, strategy=strategy, shares=[0.7, 0.3]
    )
    history = model.fit(data, class_weight=class_weight, epochs=2, verbose=0)
    expected = reference.fit(
        examples.batch(helpers.GLOBAL_BATCH),
        class_weight=class_weight,
        epochs=2,
        verbose=0,
    )
    assert history.history["loss"] == pytest.approx(
        expected.history["loss"], rel=1e-5
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"precision": "float8"}, ValueError, "precision='float8'"),
        ({"gradient_compression": "int4"}, ValueError, "int4"),
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps=0"),
        ({"pipeline_microbatches": -1}, ValueError, "pipeline_microbatches"),
        ({"global_clipnorm": 0.0}, ValueError, "global_clipnorm=0.0"),
        ({"communication": "ring"}, TypeError, "CommunicationOptions"),
        ({"pipeline_microbatches": 2.0}, ValueError, "microbatches=2.0"),
        ({"accumulation_steps": 1.5}, ValueError, "accumulation_steps=1.5"),
    ],
)
def test_bad_model_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kh.HeteroModel(*helpers.layers(), **kwargs)


def test_settings_are_one_immutable_definition():
    """`HeteroModel`'s keyword arguments, `HeteroSequential`'s, the
    settings object and the docstring name the same settings; the object
    is read-only and rides along in the config."""
    import dataclasses
    import inspect

    from keras_hetero.training import options

    keyword_only = [
        name
        for name, parameter in inspect.signature(
            kh.HeteroModel.__init__
        ).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert tuple(keyword_only) == options.NAMES
    # cleandoc: Python 3.13 strips a docstring's indentation when compiling.
    docstring = inspect.cleandoc(kh.HeteroModel.__doc__)
    for name in options.NAMES:
        assert f"\n    {name}:" in docstring, name
        default = inspect.signature(kh.HeteroModel.__init__).parameters[name]
        assert default.default == getattr(options.Settings(), name)
    model = kh.HeteroModel(*helpers.layers(), accumulation_steps=3)
    settings = model.hetero_settings
    assert settings.accumulation_steps == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.accumulation_steps = 1
    config = model.get_config()
    assert {name: config[name] for name in options.SERIALISED} == (
        settings.config()
    )
    assert "communication" not in config
    clone = kh.HeteroModel.from_config(config)
    assert clone.hetero_settings == settings
    sequential = kh.HeteroSequential(
        [keras.layers.Dense(1)], accumulation_steps=2
    )
    assert sequential.hetero_settings.accumulation_steps == 2


@pytest.mark.parametrize("global_batch_size", [1, 0, 2.5, "16", True], ids=str)
def test_global_batch_smaller_than_replicas_or_not_an_int(global_batch_size):
    strategy = helpers.mirrored(DEVICES[:2])
    with pytest.raises(ValueError, match="global_batch_size"):
        kh.data.shard(helpers.examples(), global_batch_size, strategy=strategy)


def test_bad_shares_and_examples():
    strategy = helpers.mirrored(DEVICES[:2])
    with pytest.raises(ValueError, match="shares"):
        kh.data.shard(helpers.examples(), 16, strategy=strategy, shares=[1.0])
    dataset = kh.data.shard(helpers.examples(), 16, strategy=strategy)
    for bad in ([-1.0, 2.0], [float("nan"), 1.0], [0.0, 0.0], [1, 1, 1]):
        with pytest.raises(ValueError, match="shares"):
            dataset.shares = bad
    np.testing.assert_allclose(dataset.shares, [0.5, 0.5])  # unchanged
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        kh.data.shard(np.zeros((4, 2)), 2)


def test_gradient_compression_and_clipping_after_aggregation():
    strategy = helpers.mirrored(DEVICES[:2])
    clip = 0.05
    reference = helpers.compile_model(keras.Model(*helpers.layers()))
    reference.optimizer.global_clipnorm = clip
    reference.set_weights(helpers.initial_weights())
    reference.fit(
        helpers.examples().batch(helpers.GLOBAL_BATCH), epochs=1, verbose=0
    )
    with strategy.scope():
        model = helpers.hetero_model(global_clipnorm=clip)
    model.fit(
        kh.data.shard(
            helpers.examples(),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=[0.8, 0.2],
        ),
        epochs=1,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())

    with strategy.scope():
        compressed = helpers.hetero_model(gradient_compression="bf16")
    compressed.fit(
        kh.data.shard(
            helpers.examples(), helpers.GLOBAL_BATCH, strategy=strategy
        ),
        epochs=1,
        verbose=0,
    )
    plain, _ = helpers.reference_fit(epochs=1)
    # bf16 keeps 8 bits of mantissa: close, not equal.
    helpers.assert_weights_close(
        compressed.get_weights(), plain.get_weights(), rtol=0.05, atol=0.02
    )


def test_zero_row_replica_gets_no_nan():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(regularizer=True)
    model.fit(
        kh.data.shard(
            helpers.examples(), 16, strategy=strategy, shares=[0.0, 1.0]
        ),
        epochs=1,
        verbose=0,
    )
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert model.step_stats.rows[0] == 0


def test_as_distributed_dataset_for_custom_loops():
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.25, 0.75],
    )
    distributed = dataset.as_distributed_dataset()
    assert isinstance(distributed, tf.distribute.DistributedDataset)
    rows = [
        [
            int(tf.shape(part)[0])
            for part in strategy.experimental_local_results(x)
        ]
        for x, _ in distributed
    ]
    assert rows == [[4, 12]] * 4 + [[2, 6]]
