"""Shared pieces of the benchmarks: models, synthetic data, tables.

Three model kinds, each small enough for a 2-core machine and each a shape
users train: an MLP, a small ResNet on CIFAR-shaped images and a small
Transformer encoder on token sequences. The data is generated (no dataset
downloads); labels are 10 classes.
"""

import datetime
import os

import numpy as np

MODELS = ("mlp", "resnet", "transformer")
# Global batch per model: steps of tens of milliseconds on one core.
GLOBAL_BATCH = {"mlp": 1024, "resnet": 64, "transformer": 128}


def build_model(kind, model_class, *, width=256):
    """An uncompiled `kind` model made with `model_class(inputs, outputs)`
    (`kh.HeteroModel` or the flavour's `keras.Model`), under the caller's
    strategy scope."""
    from keras_hetero import keras

    layers = keras.layers
    if kind == "mlp":
        inputs = keras.Input((64,))
        hidden = layers.Dense(width, activation="relu")(inputs)
        hidden = layers.Dense(width, activation="relu")(hidden)
        outputs = layers.Dense(10)(hidden)
    elif kind == "resnet":
        # Two residual stages (16 and 32 filters), CIFAR-shaped input.
        inputs = keras.Input((32, 32, 3))
        hidden = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
        for filters, stride in ((16, 1), (32, 2)):
            shortcut = hidden
            hidden = layers.Conv2D(
                filters, 3, strides=stride, padding="same", activation="relu"
            )(hidden)
            hidden = layers.Conv2D(filters, 3, padding="same")(hidden)
            if stride != 1 or shortcut.shape[-1] != filters:
                shortcut = layers.Conv2D(filters, 1, strides=stride)(shortcut)
            hidden = layers.Activation("relu")(layers.Add()([hidden, shortcut]))
        hidden = layers.GlobalAveragePooling2D()(hidden)
        outputs = layers.Dense(10)(hidden)
    elif kind == "transformer":
        # One encoder block: 32 tokens, 64 dimensions, 4 heads.
        inputs = keras.Input((32,), dtype="int32")
        hidden = layers.Embedding(1000, 64)(inputs)
        attended = layers.MultiHeadAttention(num_heads=4, key_dim=16)(
            hidden, hidden
        )
        hidden = layers.LayerNormalization()(layers.Add()([hidden, attended]))
        forward = layers.Dense(128, activation="relu")(hidden)
        forward = layers.Dense(64)(forward)
        hidden = layers.LayerNormalization()(layers.Add()([hidden, forward]))
        hidden = layers.GlobalAveragePooling1D()(hidden)
        outputs = layers.Dense(10)(hidden)
    else:
        raise ValueError(
            f"Invalid value for argument `kind`. Received: kind={kind!r}. "
            f"Expected one of {MODELS}."
        )
    return model_class(inputs, outputs)


def compile_model(model, steps_per_execution=1, metrics=None):
    from keras_hetero import keras

    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
        steps_per_execution=steps_per_execution,
    )
    return model


def examples(kind, rows, seed=0):
    """`(x, y)` numpy arrays of `rows` synthetic examples for `kind`."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size=rows).astype("int32")
    if kind == "mlp":
        x = rng.normal(size=(rows, 64)).astype("float32")
    elif kind == "resnet":
        x = rng.random((rows, 32, 32, 3), dtype=np.float32)
    elif kind == "transformer":
        x = rng.integers(0, 1000, size=(rows, 32)).astype("int32")
    else:
        raise ValueError(f"Unknown model kind {kind!r}; expected {MODELS}.")
    return x, y


def header(title, details):
    """The first line every benchmark prints: what, when, on what."""
    import keras_hetero as kh

    load = os.getloadavg()[0]
    return (
        f"{title}, {datetime.date.today()}, Keras flavour {kh.FLAVOUR}, "
        f"{details}, load average at start {load:.1f} on "
        f"{os.cpu_count()} cores"
    )


def markdown_table(columns, rows):
    """A markdown table, numeric columns (by the first row) right-aligned."""
    aligns = ["---:" if _numeric(cell) else "---" for cell in rows[0]]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(aligns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def _numeric(cell):
    try:
        float(str(cell).rstrip("%x"))
    except ValueError:
        return False
    return True
