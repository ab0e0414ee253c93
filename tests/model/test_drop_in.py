"""HeteroModel as a drop-in `keras.Model`: every way of making a model,
saving round trips, optional inputs and Keras' own error types, each checked
against the same code with `keras.Model` (both flavours)."""

import os
import pickle
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _compat
from tests.conftest import DEVICES
from tests.support import helpers

keras = kh.keras
X, Y, WEIGHTS, _ = helpers.arrays()


def _subclass(base):
    class Lazy(base):
        """Layers made in `__init__`, built on the first call."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden, self.out = helpers.seeded_layers()

        def call(self, inputs):
            return self.out(self.hidden(inputs))

    return Lazy


def _fit_lazy(base, strategy=None, **fit_kwargs):
    """Fit of a lazily built subclass of `base`; initial weights seeded."""
    scope = strategy.scope() if strategy else _no_scope()
    with scope:
        keras.utils.set_random_seed(11)
        model = helpers.compile_model(_subclass(base)())
    history = model.fit(
        X,
        Y,
        batch_size=helpers.GLOBAL_BATCH,
        shuffle=False,
        verbose=0,
        epochs=2,
        **fit_kwargs,
    )
    return model, history.history


class _no_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_lazily_built_subclass_fits_like_keras_model():
    reference, want = _fit_lazy(keras.Model)
    model, got = _fit_lazy(kh.HeteroModel)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)


def test_lazily_built_subclass_fits_under_mirrored():
    reference, _ = _fit_lazy(keras.Model)
    strategy = helpers.mirrored(DEVICES[:2])
    model, _ = _fit_lazy(kh.HeteroModel, strategy)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_lazily_built_subclass_with_xla():
    reference, _ = _fit_lazy(keras.Model)
    with _no_scope():
        keras.utils.set_random_seed(11)
        model = _subclass(kh.HeteroModel)()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss="mse",
            jit_compile=True,
        )
    model.fit(
        X,
        Y,
        batch_size=helpers.GLOBAL_BATCH,
        shuffle=False,
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_model_without_trainable_weights_warns_and_evaluates():
    model = kh.HeteroModel(*helpers.layers())
    model.trainable = False
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    before = model.get_weights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(X, Y, batch_size=16, verbose=0)
    assert any("trainable weights" in str(w.message) for w in caught)
    helpers.assert_weights_close(model.get_weights(), before, rtol=0, atol=0)
    stock = keras.Model(*helpers.layers())
    stock.set_weights(before)
    stock.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    want = stock.evaluate(X, Y, batch_size=16, return_dict=True, verbose=0)
    assert history.history["loss"][0] == pytest.approx(want["loss"], rel=1e-5)


class FunctionalSubclass(kh.HeteroModel):
    """A subclass that builds its graph and calls the functional init."""

    def __init__(self, units=1, **kwargs):
        inputs = keras.Input((helpers.FEATURES,))
        hidden = keras.layers.Dense(4, activation="tanh")(inputs)
        super().__init__(inputs, keras.layers.Dense(units)(hidden), **kwargs)
        self.units = units


def test_subclass_calling_functional_init_trains_like_reference():
    reference, _ = helpers.reference_fit()
    model = helpers.compile_model(FunctionalSubclass(accumulation_steps=1))
    model.set_weights(helpers.initial_weights())
    assert model.units == 1
    model.fit(
        kh.data.shard(helpers.examples(), helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    # HeteroModel itself stays a subclassing base.
    assert not isinstance(_subclass(kh.HeteroModel)(), kh._compat.Functional)


def test_pickle_round_trip_of_functional_model():
    model = helpers.hetero_model(gradient_compression="fp16")
    model.fit(X, Y, batch_size=16, verbose=0)
    loaded = pickle.loads(pickle.dumps(model))
    assert isinstance(loaded, kh.HeteroModel)
    assert loaded.get_config()["gradient_compression"] == "fp16"
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-6
    )


def _compiled_settings(model):
    return (
        type(model.optimizer).__name__,
        float(np.asarray(model.optimizer.learning_rate)),
    )


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_load_model_returns_a_compiled_model(tmp_path, suffix):
    model = kh.HeteroModel(*helpers.layers(), gradient_compression="bf16")
    # Keras 3 cannot load a compiled `.h5` with loss="mse", stock or not
    # ("Could not deserialize 'keras.metrics.mse'"); a loss object it can.
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.MeanSquaredError(),
        metrics=["mae"] if suffix == ".keras" else None,
    )
    model.fit(X, Y, batch_size=16, verbose=0)
    path = os.path.join(tmp_path, "model" + suffix)
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    assert isinstance(loaded, kh.HeteroModel)
    assert loaded.get_config()["gradient_compression"] == "bf16"
    assert _compiled_settings(loaded) == _compiled_settings(model)
    want = model.evaluate(X, Y, return_dict=True, verbose=0)
    got = loaded.evaluate(X, Y, return_dict=True, verbose=0)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-6)
    if suffix == ".h5" and kh.FLAVOUR == "keras3":
        # Keras 3.15's `.h5` loader builds the optimizer for other variables
        # ("Unknown variable ... This optimizer can only be called for the
        # variables it was originally built with"), keras.Model as well.
        return
    # Training goes on from the saved optimizer state (same batch order).
    model.fit(X, Y, batch_size=16, shuffle=False, verbose=0)
    loaded.fit(X, Y, batch_size=16, shuffle=False, verbose=0)
    helpers.assert_weights_close(loaded.get_weights(), model.get_weights())


def test_from_model_keeps_compile_state():
    base = keras.Model(*helpers.layers())
    base.set_weights(helpers.initial_weights())
    helpers.compile_model(base)
    model = kh.HeteroModel.from_model(base)
    assert model.optimizer is base.optimizer
    reference, _ = helpers.reference_fit()
    model.fit(
        kh.data.shard(helpers.examples(), helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_from_model_of_sequential_without_input_builds_on_first_data(
    tmp_path,
):
    def make(wrap):
        keras.utils.set_random_seed(5)
        base = keras.Sequential(helpers.seeded_layers())
        model = kh.HeteroModel.from_model(base) if wrap else base
        return helpers.compile_model(model)

    reference, model = make(False), make(True)
    assert isinstance(model, kh.HeteroModel)
    for m in (reference, model):
        m.fit(X, Y, batch_size=16, shuffle=False, epochs=2, verbose=0)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    path = os.path.join(tmp_path, "wrapped.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), rtol=1e-6
    )


def test_from_model_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="Expected a `keras.Model`"):
        kh.HeteroModel.from_model(keras.layers.Dense(1))


@pytest.mark.skipif(
    not _compat.CONVERTS_OPTIONAL_INPUTS,
    reason="Keras 3.12+: optional inputs fed None (stock fit fails before)",
)
def test_optional_input_fed_none():
    def make(cls):
        a = keras.Input((3,), name="a")
        b = keras.Input((3,), name="b", optional=True)

        class AddIfPresent(keras.layers.Layer):
            def call(self, a, b=None):
                return a if b is None else a + b

        keras.utils.set_random_seed(2)
        model = cls(
            {"a": a, "b": b}, keras.layers.Dense(1)(AddIfPresent()(a, b))
        )
        model.compile(optimizer="sgd", loss="mse")
        return model

    data = {"a": X[:, :3], "b": None}
    stock, model = make(keras.Model), make(kh.HeteroModel)
    for m in (stock, model):
        m.fit(data, Y, batch_size=16, shuffle=False, verbose=0)
    helpers.assert_weights_close(model.get_weights(), stock.get_weights())
    with pytest.raises(ValueError, match="is not optional"):
        model.fit({"a": None, "b": None}, Y, verbose=0)


def test_compile_mistakes_keep_keras_error_types():
    for cls in (keras.Model, kh.HeteroModel):
        model = cls(*helpers.layers())
        model.compile(optimizer="sgd", loss={"no_such_output": "mse"})
        with pytest.raises((ValueError, KeyError)) as caught:
            model.fit(X, Y, verbose=0)
        if cls is keras.Model:
            stock = caught.type
    assert caught.type is stock
    assert "StagingError" not in type(caught.value).__name__


def test_auto_scale_loss_false_turns_loss_scaling_off(mixed_float16):
    if kh.FLAVOUR != "keras3":
        pytest.skip("`auto_scale_loss` is a Keras 3 compile argument")
    model = kh.HeteroModel(*helpers.layers())
    model.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    assert model.loss_scale is None
    model.compile(optimizer="sgd", loss="mse")
    assert model.loss_scale is not None


@pytest.mark.skipif(kh.FLAVOUR != "tf-keras", reason="tf.compat.v1 optimizers")
def test_tf_compat_v1_optimizer():
    def make(cls):
        model = cls(*helpers.layers())
        model.set_weights(helpers.initial_weights())
        model.compile(
            optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.05),
            loss="mse",
        )
        return model

    stock, model = make(keras.Model), make(kh.HeteroModel)
    for m in (stock, model):
        m.fit(X, Y, batch_size=16, shuffle=False, epochs=2, verbose=0)
    helpers.assert_weights_close(model.get_weights(), stock.get_weights())
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = kh.HeteroModel(*helpers.layers())
        with pytest.raises(ValueError, match="tf.compat.v1"):
            model.compile(
                optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.05),
                loss="mse",
            )


def test_public_keras_is_the_selected_flavour():
    expected = "tf_keras" if kh.FLAVOUR == "tf-keras" else "keras"
    assert kh.keras.__name__.split(".")[0] == expected
    assert kh.keras is kh._compat.keras


# --- tf-keras' training_test causes (issue 17), checked on both flavours ----


def _stock_and_hetero(make):
    """`make(cls)` for keras.Model and kh.HeteroModel, seeded alike."""
    models = []
    for cls in (keras.Model, kh.HeteroModel):
        keras.utils.set_random_seed(3)
        models.append(make(cls))
    return models


def _error_of(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - compared with Keras' own
        return error
    return None


def test_fit_without_targets_gives_keras_own_error():
    def make(cls):
        model = cls(*helpers.layers())
        model.compile(optimizer="sgd", loss="mse")
        return model

    stock, model = _stock_and_hetero(make)
    want = _error_of(lambda: stock.fit(X, verbose=0))
    got = _error_of(lambda: model.fit(X, verbose=0))
    assert want is not None
    assert type(got) is type(want)
    if kh.FLAVOUR == "tf-keras":
        assert "Target data is missing" in str(got)


class _ActivityLoss(keras.layers.Layer):
    """Identity that adds the mean square of its input as a loss."""

    def call(self, inputs):
        self.add_loss(tf.reduce_mean(tf.square(inputs)))
        return inputs


def test_model_with_only_add_loss_fits_without_targets():
    def make(cls, strategy=None):
        with strategy.scope() if strategy else _no_scope():
            inputs = keras.Input((helpers.FEATURES,))
            hidden = keras.layers.Dense(
                3, kernel_initializer=keras.initializers.GlorotUniform(seed=4)
            )(inputs)
            model = cls(inputs, _ActivityLoss()(hidden))
            model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    stock = make(keras.Model)
    stock.fit(X, batch_size=16, shuffle=False, epochs=2, verbose=0)
    for strategy in (None, helpers.mirrored(DEVICES[:2])):
        model = make(kh.HeteroModel, strategy)
        history = model.fit(
            X, batch_size=16, shuffle=False, epochs=2, verbose=0
        )
        helpers.assert_weights_close(model.get_weights(), stock.get_weights())
        assert np.isfinite(history.history["loss"]).all()


def _config_subclasses(base):
    class Default(base):
        def __init__(self, units):
            super().__init__()
            self.units = units

        def call(self, inputs):
            return inputs

    class Kwargs(base):
        def __init__(self, units, **kwargs):
            super().__init__()  # as tf-keras' test: `kwargs` kept unused
            self.units = units

        def call(self, inputs):
            return inputs

    class Override(base):
        def __init__(self, units):
            super().__init__()
            self.units = units

        def call(self, inputs):
            return inputs

        def get_config(self):
            return {"units": int(self.units), **super().get_config()}

    return {
        "default": Default(units=10),
        "kwargs": Kwargs(10, extra=1),
        "override": Override(units=np.int32(10)),
    }


def _config_or_error(model):
    """`get_config()` without the name (numbered per class), or the type of
    the error (Keras 3 refuses a subclass without `get_config` whose
    `__init__` has no `**kwargs`)."""
    error = _error_of(model.get_config)
    if error is not None:
        return type(error)
    config = dict(model.get_config())
    config.pop("name", None)
    return config


def _round_trip(model):
    """The config of `from_config(get_config())`, or the error's type."""
    config = _config_or_error(model)
    if not isinstance(config, dict):
        return config
    clone = _error_of(lambda: type(model).from_config(model.get_config()))
    if clone is not None:
        return type(clone)
    clone = type(model).from_config(model.get_config())
    assert isinstance(clone, type(model))
    return _config_or_error(clone)


def test_subclass_get_config_is_keras_own():
    stock = _config_subclasses(keras.Model)
    ours = _config_subclasses(kh.HeteroModel)
    for kind, model in ours.items():
        assert _config_or_error(model) == _config_or_error(stock[kind]), kind
        assert _round_trip(model) == _round_trip(stock[kind]), kind
    if kh.FLAVOUR == "tf-keras":  # Keras 3 revives none of them
        for model in ours.values():
            assert _round_trip(model) == _config_or_error(model)


@pytest.mark.skipif(
    kh.FLAVOUR != "tf-keras",
    reason="Keras 3 captures no `__init__` arguments of Model subclasses",
)
def test_subclass_passing_settings_on_keeps_them_in_config():
    class Passing(kh.HeteroModel):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def call(self, inputs):
            return inputs

    model = Passing(3, accumulation_steps=2)
    clone = Passing.from_config(model.get_config())
    assert clone.hetero_settings.accumulation_steps == 2
    assert Passing(3).get_config().get("accumulation_steps", 1) == 1


@pytest.mark.parametrize("through", ["HeteroModel", "its class"])
def test_functional_config_round_trip_keeps_the_settings(through):
    # tf-keras' `from_config` on the HeteroModel class rebuilt a functional
    # model from inputs and outputs alone and dropped the settings.
    model = kh.HeteroModel(*helpers.layers(), accumulation_steps=3)
    cls = kh.HeteroModel if through == "HeteroModel" else type(model)
    clone = cls.from_config(model.get_config())
    assert clone.hetero_settings.accumulation_steps == 3
    assert clone.get_config() == model.get_config() | {"name": clone.name}


def _loss_scale_optimizer(optimizer):
    if kh.FLAVOUR == "tf-keras":
        return keras.mixed_precision.LossScaleOptimizer(optimizer)
    return keras.optimizers.LossScaleOptimizer(optimizer)


@pytest.mark.parametrize(
    "extra_losses",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                kh.FLAVOUR != "tf-keras",
                # Keras 3.15 itself: "Cannot convert a list containing a
                # tensor of dtype float16 to float32" (its regularisers).
                reason="tf-keras sums regularisers of mixed dtypes",
            ),
        ),
    ],
)
def test_losses_of_float16_and_float32_outputs(extra_losses):
    """A float16 output's loss is summed with a float32 one (cast as Keras
    does; float16 gradients scaled by the loss scale and the rows).

    The reference is keras.Model with a LossScaleOptimizer, which scales
    the loss as HeteroModel does when a layer computes in float16 (same
    initial scale and growth); one row a step, so both skip the same steps.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 2)).astype("float32")
    y = rng.normal(size=(12, 2)).astype("float32")
    regularizer = "l2" if extra_losses else None

    def make(cls):
        inputs = keras.Input((2,))
        out_32 = keras.layers.Dense(
            2, dtype="float32", kernel_regularizer=regularizer
        )(inputs)
        out_16 = keras.layers.Dense(
            2, dtype="float16", kernel_regularizer=regularizer
        )(inputs)
        model = cls(inputs, [out_32, out_16])
        if extra_losses:  # tf-keras' test: a float64 loss as well
            model.add_loss(0.01 * tf.reduce_sum(tf.cast(out_16, "float64")))
        optimizer = _loss_scale_optimizer(keras.optimizers.SGD(0.05))
        model.compile(optimizer=optimizer, loss=["mse", "mse"])
        return model

    stock, model = _stock_and_hetero(make)
    assert model.loss_scale is not None
    before = model.get_weights()
    histories = [
        m.fit(x, [y, y], batch_size=1, epochs=2, shuffle=False, verbose=0)
        for m in (stock, model)
    ]
    weights = model.get_weights()
    assert [w.dtype for w in weights][-2:] == [np.float16, np.float16]
    helpers.assert_weights_close(weights, stock.get_weights())
    np.testing.assert_allclose(
        histories[1].history["loss"], histories[0].history["loss"], rtol=1e-5
    )
    assert not np.allclose(weights[-2], before[-2])  # float16 ones trained


# Devices this process does not have (conftest makes /cpu:0-3): TensorFlow
# places the replicas on an existing device, as in tf-keras' own
# `test_distribution_reduction_method_sum_*` (it names /cpu:1-4 of a host
# with one CPU device). A collective in replica context hangs there.
_MISSING = ["/cpu:4", "/cpu:5", "/cpu:6", "/cpu:7"]


def test_replicas_on_missing_devices_are_detected():
    assert kh._distribute.replicas_on_missing_devices(
        tf.distribute.MirroredStrategy(_MISSING[:2])
    )
    assert not kh._distribute.replicas_on_missing_devices(
        helpers.mirrored(DEVICES[:2])
    )


@pytest.mark.timeout(300)
def test_untrainable_model_on_four_missing_devices_fits():
    def make(cls):
        with tf.distribute.MirroredStrategy(_MISSING).scope():
            inputs = keras.Input((1,))
            outputs = keras.layers.Dense(
                1, kernel_initializer="zeros", bias_initializer="ones"
            )(inputs)
            model = cls(inputs, outputs)
        model.trainable = False
        model.compile(optimizer="sgd", loss="mean_absolute_error")
        return model

    # Outputs 1, targets 2: every loss is 1. Batches of 8 split evenly
    # (stock Keras 3 cannot build on uneven per-replica batches).
    x, y = 2 * np.ones((40, 1)), 2 * np.ones((40, 1))
    logs = []
    for model in (make(keras.Model), make(kh.HeteroModel)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no trainable weights"
            history = model.fit(x, y, batch_size=8, verbose=0)
        evaluated = model.evaluate(x, y, batch_size=8, verbose=0)
        logs.append([*history.history["loss"], evaluated])
    np.testing.assert_allclose(logs[1], logs[0], rtol=1e-6)
    np.testing.assert_allclose(logs[1], 1.0, rtol=1e-6)


@pytest.mark.timeout(300)
def test_training_on_missing_devices_matches_one_device():
    # Stock Keras hangs here (both flavours: its optimizer's all-reduce).
    reference, want = helpers.reference_fit()
    strategy = tf.distribute.MirroredStrategy(_MISSING[:2])
    with strategy.scope():
        model = helpers.hetero_model()
    history = model.fit(
        kh.data.shard(
            helpers.examples(),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=[3, 1],
        ),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(history.history["loss"], want["loss"], rtol=1e-5)
    assert model.step_stats.rows.tolist() == [6, 2]


def test_subclass_with_own_steps_keeps_keras_log_reduction():
    """A subclass's own `train_step` / `test_step` return what Keras' would
    reduce: here each replica's share of a global mean (tf-keras' test)."""
    batch_size = 8

    def make(base):
        class OwnSteps(base):
            def _share(self, data):
                ones = tf.ones_like(data[0][:, 0])
                return tf.nn.compute_average_loss(
                    ones, global_batch_size=batch_size
                )

            def train_step(self, data):
                return {"loss": self._share(data)}

            def test_step(self, data):
                return {"metric": self._share(data)}

        with helpers.mirrored(DEVICES[:4]).scope():
            inputs = keras.Input((1,))
            model = OwnSteps(inputs, keras.layers.Dense(1)(inputs))
            model.compile()
        return model

    x = np.ones((40, 1), "float32")
    logs = []
    for model in (make(keras.Model), make(kh.HeteroModel)):
        history = model.fit(x, x, batch_size=batch_size, epochs=2, verbose=0)
        evaluated = model.evaluate(x, x, batch_size=batch_size, verbose=0)
        logs.append([*history.history["loss"], evaluated])
    np.testing.assert_allclose(logs[1], logs[0], rtol=1e-6)
