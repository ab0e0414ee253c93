"""`kh.HeteroSequential`, the one-line swap for `keras.Sequential`: each
way of building and saving one, checked against the same code with
`keras.Sequential` (both flavours), and its training under a strategy with
unequal shares against single-device training."""

import os
import pickle

import numpy as np
import pytest

import keras_hetero as kh
from tests.conftest import DEVICES
from tests.support import helpers

keras = kh.keras
X, Y, _, _ = helpers.arrays()


def _make(cls, with_input=False, **kwargs):
    first = [keras.Input((helpers.FEATURES,))] if with_input else []
    return helpers.compile_model(cls(first + helpers.seeded_layers(), **kwargs))


def _fit(model, epochs=2):
    return model.fit(
        X,
        Y,
        batch_size=helpers.GLOBAL_BATCH,
        shuffle=False,
        epochs=epochs,
        verbose=0,
    ).history


def _close(model, reference):
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize("with_input", [False, True], ids=["lazy", "input"])
def test_fits_like_keras_sequential(with_input):
    reference = _make(keras.Sequential, with_input)
    model = _make(kh.HeteroSequential, with_input)
    assert isinstance(model, kh.HeteroModel)
    assert isinstance(model, keras.Sequential)
    assert model.built is with_input
    want, got = _fit(reference), _fit(model)
    _close(model, reference)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["mae"], want["mae"], rtol=1e-5)
    assert model.step_stats.rows.tolist() == [X.shape[0] % 16]


@pytest.mark.parametrize("with_input", [False, True], ids=["lazy", "input"])
def test_uneven_shares_under_mirrored_equal_one_device(with_input):
    reference = _make(keras.Sequential, with_input)
    reference.fit(
        helpers.examples().batch(helpers.GLOBAL_BATCH), epochs=2, verbose=0
    )
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = _make(kh.HeteroSequential, with_input)
    model.fit(
        kh.data.shard(
            helpers.examples(),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=[0.75, 0.25],
        ),
        epochs=2,
        verbose=0,
    )
    _close(model, reference)
    assert model.step_stats.rows.tolist() == [6, 2]  # the last, 8-row batch


def test_add_and_pop_like_keras_sequential():
    def build(cls):
        model = cls(name="stack")
        model.add(keras.Input((helpers.FEATURES,)))
        for layer in helpers.seeded_layers():
            model.add(layer)
        model.add(keras.layers.Dense(3, name="extra"))
        model.pop()
        return helpers.compile_model(model)

    reference, model = build(keras.Sequential), build(kh.HeteroSequential)
    assert [layer.units for layer in model.layers] == [4, 1]
    assert "extra" not in [layer.name for layer in model.layers]
    assert model.output_shape == (None, 1)
    _fit(reference)
    _fit(model)
    _close(model, reference)


def test_settings_reach_the_step():
    # Two micro-steps per update: the same as one functional HeteroModel
    # with the same setting, unlike one update per batch.
    def fit(model):
        helpers.compile_model(model)
        _fit(model, epochs=1)
        return model

    inputs = keras.Input((helpers.FEATURES,))
    hidden, out = helpers.seeded_layers()
    two = {"accumulation_steps": 2}
    functional = fit(kh.HeteroModel(inputs, out(hidden(inputs)), **two))
    model = fit(kh.HeteroSequential(helpers.seeded_layers(), **two))
    _close(model, functional)
    assert int(model.optimizer.iterations) == 2  # 5 batches, 2 updates
    every_batch = fit(kh.HeteroSequential(helpers.seeded_layers()))
    assert not np.allclose(every_batch.get_weights()[0], model.get_weights()[0])


def test_precision_setting(mixed_float16):
    model = kh.HeteroSequential(
        helpers.seeded_layers(), precision="mixed_float16"
    )
    model.compile(optimizer="sgd", loss="mse")
    assert model.loss_scale is not None
    assert model.get_config()["precision"] == "mixed_float16"
    _fit(model, epochs=1)
    assert np.isfinite(model.get_weights()[0]).all()


def test_config_round_trip_keeps_layers_and_settings():
    model = kh.HeteroSequential(
        [keras.Input((helpers.FEATURES,)), *helpers.seeded_layers()],
        name="stack",
        gradient_compression="fp16",
        global_clipnorm=1.0,
    )
    config = model.get_config()
    clone = kh.HeteroSequential.from_config(config)
    assert type(clone) is kh.HeteroSequential
    assert clone.name == "stack" and clone.built
    assert clone.get_config() == config
    assert clone.get_config()["gradient_compression"] == "fp16"
    assert clone.get_config()["global_clipnorm"] == 1.0
    with pytest.raises(ValueError, match="gradient_compression='int8'"):
        kh.HeteroSequential.from_config(
            {**config, "gradient_compression": "int8"}
        )


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="precision='fp8'"):
        kh.HeteroSequential(helpers.seeded_layers(), precision="fp8")
    with pytest.raises(TypeError, match="no_such_argument"):
        kh.HeteroSequential(helpers.seeded_layers(), no_such_argument=1)


def test_positional_arguments_as_in_keras_sequential():
    # Keras 3: (layers, trainable, name); tf-keras: (layers, name).
    rest = ("stack",) if kh.FLAVOUR == "tf-keras" else (True, "stack")
    stock = keras.Sequential(helpers.seeded_layers(), *rest)
    model = kh.HeteroSequential(helpers.seeded_layers(), *rest)
    assert model.name == stock.name == "stack"
    assert isinstance(model, kh.HeteroSequential)


def _compiled_settings(model):
    return (
        type(model.optimizer).__name__,
        float(np.asarray(model.optimizer.learning_rate)),
    )


@pytest.mark.parametrize("with_input", [False, True], ids=["lazy", "input"])
@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_load_model_returns_a_compiled_hetero_sequential(
    tmp_path, suffix, with_input
):
    first = [keras.Input((helpers.FEATURES,))] if with_input else []
    model = kh.HeteroSequential(
        first + helpers.seeded_layers(), gradient_compression="bf16"
    )
    # Keras 3 cannot load a compiled `.h5` with loss="mse", stock or not.
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.MeanSquaredError(),
    )
    _fit(model, epochs=1)
    path = os.path.join(tmp_path, "model" + suffix)
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    assert type(loaded) is kh.HeteroSequential
    assert loaded.get_config()["gradient_compression"] == "bf16"
    assert _compiled_settings(loaded) == _compiled_settings(model)
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-6
    )
    if suffix == ".h5" and kh.FLAVOUR == "keras3":
        # Keras 3.15's `.h5` loader builds the optimizer for other variables
        # ("Unknown variable ..."), keras.Sequential as well.
        return
    # Training goes on from the saved optimizer state.
    _fit(model, epochs=1)
    _fit(loaded, epochs=1)
    _close(loaded, model)


def test_pickle_round_trip():
    model = _make(kh.HeteroSequential, accumulation_steps=2)
    _fit(model, epochs=1)
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is kh.HeteroSequential
    assert loaded.get_config()["accumulation_steps"] == 2
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-6
    )


def test_from_model_of_hetero_sequential_and_of_sequential():
    base = _make(keras.Sequential, with_input=True)
    wrapped = kh.HeteroModel.from_model(base)
    assert isinstance(wrapped, kh.HeteroModel)
    assert wrapped.optimizer is base.optimizer
    again = kh.HeteroModel.from_model(_make(kh.HeteroSequential))
    reference = _make(keras.Sequential)
    _fit(again)
    _fit(reference)
    _close(again, reference)
