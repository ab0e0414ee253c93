"""Mixed precision and compressed gradients: HeteroModel(precision=...,
gradient_compression=...) on scikit-learn's handwritten digits.

Two logical CPUs, uneven shares. The same model is trained three ways:
float32; float16 compute with dynamic loss scaling and float16 gradients on
the wire (`"mixed_float16"` + `"fp16"`, as on Volta/Turing GPUs); bfloat16
compute and bfloat16 gradients on the wire (`"mixed_bfloat16"` + `"bf16"`,
as on Ampere GPUs and TPUs). `kh.set_precision("auto", strategy)` would pick
the fastest policy every device runs well: float32 on these CPUs, which do
not compute faster in 16 bits, so the timings here say nothing about
speed; the example shows that accuracy holds.

Run: `python examples/digits_precision.py` (about 30 s on 2 CPU cores).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

import tensorflow as tf  # noqa: E402
from _digits import accuracy  # noqa: E402
from _digits import compile_for_digits  # noqa: E402
from _digits import examples  # noqa: E402
from _digits import load  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(2)
GLOBAL_BATCH = 48
SETTINGS = [  # (precision, gradient_compression)
    ("float32", None),
    ("mixed_float16", "fp16"),
    ("mixed_bfloat16", "bf16"),
]


def train(strategy, data, precision, compression, epochs):
    # Layers take their dtype policy when created: set it, then build.
    kh.set_precision(precision)
    try:
        with strategy.scope():
            inputs = keras.Input((64,))
            hidden = keras.layers.Dense(64, activation="relu")(inputs)
            # Keep the output, and so the loss, in float32.
            outputs = keras.layers.Dense(
                10, activation="softmax", dtype="float32"
            )(hidden)
            model = kh.HeteroModel(
                inputs,
                outputs,
                precision=precision,
                gradient_compression=compression,
            )
            compile_for_digits(model)
    finally:
        kh.set_precision("float32")
    history = model.fit(data, epochs=epochs, verbose=0)
    return model, history.history["loss"][-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    x_train, y_train, x_test, y_test = load()
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    data = kh.data.shard(
        examples(x_train, y_train),
        GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.6, 0.4],
    )
    print(f'"auto" picks {kh.set_precision("auto", strategy)} on these CPUs')
    kh.set_precision("float32")

    print(f"{'precision':<16}{'on the wire':<13}{'loss':>7}{'accuracy':>10}")
    for precision, compression in SETTINGS:
        model, loss = train(strategy, data, precision, compression, args.epochs)
        held_out = accuracy(model, x_test, y_test)
        wire = compression or "float32"
        print(f"{precision:<16}{wire:<13}{loss:>7.3f}{held_out:>10.3f}")
        if model.loss_scale is not None:
            print(f"{'':<16}(final loss scale {model.loss_scale:g})")


if __name__ == "__main__":
    main()
