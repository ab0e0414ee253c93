"""TensorFlow's and keras-io's tutorials with only the model class swapped.

Each test follows one tutorial's code path ("Distributed training with
Keras", "Save and load models", the mixed precision guide) on generated data
of the tutorial's shapes, once with stock Keras and once with
`kh.HeteroModel`, and checks that the numbers agree. Multi-worker and
parameter-server tutorials run in tests/training/test_keras_callbacks.py and
tests/training/test_parameter_server.py (real processes).
"""

import contextlib
import os

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from tests.conftest import DEVICES

keras = kh.keras
IMAGES = 256
# The tutorial's checkpoints: TensorFlow format on tf-keras (restored with
# `tf.train.latest_checkpoint`), `.weights.h5` on Keras 3, which needs it.
_WEIGHTS = ".weights.h5" if kh.FLAVOUR == "keras3" else ""
GLOBAL_BATCH = 64  # the tutorial's 64 per replica, scaled down


def _mnist_like():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(IMAGES, 12, 12, 1)).astype("uint8")
    labels = rng.integers(0, 10, size=(IMAGES,)).astype("int64")
    return images, labels


def _scale(image, label):
    return tf.cast(image, tf.float32) / 255.0, label


def _train_dataset():
    images, labels = _mnist_like()
    # The tutorial shuffles with a buffer; a seed makes both runs see the
    # same order.
    return (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .map(_scale)
        .cache()
        .shuffle(1000, seed=3)
        .batch(GLOBAL_BATCH)
    )


def _tutorial_model(hetero):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    if hetero:  # the one-line swap
        model = kh.HeteroModel.from_model(model)
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(),
        metrics=["accuracy"],
    )
    return model


def _decay(epoch):
    return 1e-3 if epoch < 1 else 1e-4


class _PrintLR(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


def _distributed_tutorial(hetero, tmp_path, strategy=None):
    directory = os.path.join(tmp_path, "hetero" if hetero else "stock")
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _tutorial_model(hetero)
    printer = _PrintLR()
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            filepath=os.path.join(directory, "ckpt_{epoch}" + _WEIGHTS),
            save_weights_only=True,
        ),
        keras.callbacks.LearningRateScheduler(_decay),
        printer,
    ]
    history = model.fit(
        _train_dataset(), epochs=2, callbacks=callbacks, verbose=0
    )
    return model, history.history, printer.rates, directory


def test_distributed_training_with_keras(tmp_path):
    # The reference is the tutorial's code on one device without a strategy.
    # (Stock Keras 3 under a strategy reads one extra batch from a fresh
    # iterator to build the model, so a reshuffling dataset's epochs come in
    # another order: same math, other batches. HeteroModel reads none.)
    stock, stock_history, stock_rates, _ = _distributed_tutorial(
        False, tmp_path
    )
    strategy = kh.testing.mirrored(DEVICES[:2])
    model, history, rates, directory = _distributed_tutorial(
        True, tmp_path, strategy
    )
    assert rates == stock_rates
    np.testing.assert_allclose(rates, [1e-3, 1e-4], rtol=1e-6)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(
            history[name], stock_history[name], rtol=1e-5
        )
    for got, want in zip(model.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # The tutorial's restore, evaluate, save and reload, in and out of scope.
    if kh.FLAVOUR == "keras3":
        assert sorted(os.listdir(directory)) == [
            "ckpt_1.weights.h5",
            "ckpt_2.weights.h5",
        ]
        model.load_weights(os.path.join(directory, "ckpt_2.weights.h5"))
    else:
        model.load_weights(tf.train.latest_checkpoint(directory))
    eval_dataset = _train_dataset()
    want = stock.evaluate(eval_dataset, return_dict=True, verbose=0)
    got = model.evaluate(eval_dataset, return_dict=True, verbose=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    path = os.path.join(tmp_path, "saved.keras")
    model.save(path)
    unreplicated = keras.models.load_model(path)
    assert isinstance(unreplicated, kh.HeteroModel)
    got = unreplicated.evaluate(eval_dataset, return_dict=True, verbose=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    with strategy.scope():
        replicated = keras.models.load_model(path)
    got = replicated.evaluate(eval_dataset, return_dict=True, verbose=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(want["accuracy"], rel=1e-5)


def _save_and_load_model(hetero):
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ]
    )
    if hetero:
        model = kh.HeteroModel.from_model(model)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def test_save_and_load_models(tmp_path):
    rng = np.random.default_rng(1)
    train_images = rng.uniform(size=(200, 784)).astype("float32")
    train_labels = rng.integers(0, 10, size=(200,))
    results = {}
    for hetero in (False, True):
        directory = os.path.join(tmp_path, str(hetero))
        model = _save_and_load_model(hetero)
        checkpoint = os.path.join(directory, "cp.weights.h5")
        model.fit(
            train_images,
            train_labels,
            epochs=2,
            shuffle=False,
            validation_data=(train_images[:50], train_labels[:50]),
            callbacks=[
                keras.callbacks.ModelCheckpoint(
                    filepath=checkpoint, save_weights_only=True
                )
            ],
            verbose=0,
        )
        fresh = _save_and_load_model(hetero)
        fresh.load_weights(checkpoint)
        loss, accuracy = fresh.evaluate(train_images, train_labels, verbose=0)
        path = os.path.join(directory, "my_model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        predictions = loaded.predict(train_images, verbose=0)
        np.testing.assert_allclose(
            predictions, model.predict(train_images, verbose=0), rtol=1e-6
        )
        results[hetero] = (loss, accuracy, predictions)
        if hetero:
            assert isinstance(loaded, kh.HeteroModel)
            # load_model gives a model that trains on, as in the tutorial.
            loaded.fit(train_images, train_labels, epochs=1, verbose=0)
    stock, hetero = results[False], results[True]
    assert hetero[0] == pytest.approx(stock[0], rel=1e-5)
    assert hetero[1] == pytest.approx(stock[1], rel=1e-5)
    np.testing.assert_allclose(hetero[2], stock[2], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    kh.FLAVOUR != "keras3", reason="Keras 3's `Model.export` (SavedModel)"
)
def test_saved_model_export(tmp_path):
    model = _save_and_load_model(True)
    images = np.random.default_rng(2).uniform(size=(8, 784)).astype("float32")
    model.fit(images, np.arange(8) % 10, verbose=0)
    path = os.path.join(tmp_path, "exported")
    model.export(path)
    reloaded = tf.saved_model.load(path)
    np.testing.assert_allclose(
        reloaded.serve(tf.constant(images)).numpy(),
        model.predict(images, verbose=0),
        rtol=1e-5,
    )


def _mixed_precision_guide(hetero):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(5)
        inputs = keras.Input(shape=(784,), name="digits")
        x = keras.layers.Dense(64, activation="relu", name="dense_1")(inputs)
        x = keras.layers.Dense(64, activation="relu", name="dense_2")(x)
        x = keras.layers.Dense(10, name="dense_logits")(x)
        outputs = keras.layers.Activation(
            "softmax", dtype="float32", name="predictions"
        )(x)
        model = (kh.HeteroModel if hetero else keras.Model)(
            inputs=inputs, outputs=outputs
        )
        model.compile(
            loss="sparse_categorical_crossentropy",
            optimizer=keras.optimizers.RMSprop(),
            metrics=["accuracy"],
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rng = np.random.default_rng(3)
    x_train = rng.uniform(size=(512, 784)).astype("float32")
    y_train = rng.integers(0, 10, size=(512,))
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=2,
        validation_split=0.2,
        shuffle=False,
        verbose=0,
    )
    return model, history.history


def test_mixed_precision_guide():
    stock, stock_history = _mixed_precision_guide(False)
    model, history = _mixed_precision_guide(True)
    assert model.loss_scale is not None
    assert model.layers[1].compute_dtype == "float16"
    # float16 arithmetic: the same steps, rounded alike.
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(
            history[name], stock_history[name], rtol=2e-3
        )
