"""The data and model the digits examples share.

scikit-learn ships the UCI handwritten digits (1797 images of 8x8 pixels,
10 classes) inside the package, so the examples need no download:
`pip install ".[examples]"` in this checkout.
"""

import numpy as np
import tensorflow as tf

from keras_hetero import keras

HELD_OUT = 357  # the last 357 images; the first 1440 train


def load():
    """Returns `(x_train, y_train, x_test, y_test)`, pixels scaled to [0, 1].

    The order is fixed (shuffled once with a fixed seed), so every run and
    every worker of a multi-worker job sees the same examples in the same
    order, which an exact resume needs.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int64")
    return x[:-HELD_OUT], y[:-HELD_OUT], x[-HELD_OUT:], y[-HELD_OUT:]


def examples(x, y):
    """An unbatched `tf.data.Dataset` of `(x, y)`, ready for `kh.data.shard`."""
    return tf.data.Dataset.from_tensor_slices((x, y))


def layers(inputs, width=64):
    """A small classifier on `inputs`: 64 pixels -> `width` -> 10 classes."""
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    return keras.layers.Dense(10, activation="softmax")(hidden)


def compile_for_digits(model, learning_rate=0.01):
    """Adam and sparse categorical cross-entropy, with accuracy."""
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def accuracy(model, x, y):
    """Fraction of `x` the model classifies as `y`."""
    predicted = np.argmax(model.predict(x, batch_size=len(x), verbose=0), -1)
    return float(np.mean(predicted == y))
