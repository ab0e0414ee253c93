"""HeteroModel vs stock keras.Model step time under MirroredStrategy.

Two logical CPUs, equal shares, the same model and data. The two models run
alternately in one process (several rounds), and we report the median step
time of each and their ratio. Target: ratio <= 1.03.

Run: `make bench` (or `python benchmarks/overhead.py`).
"""

import argparse
import datetime
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(2)
GLOBAL_BATCH = 256
STEPS = 40


def build(model_class, strategy, width):
    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = model_class(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[256, 1024],
        help="hidden widths W of the MLP to measure",
    )
    args = parser.parse_args()
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 64)).astype("float32")
    y = rng.integers(0, 10, size=(GLOBAL_BATCH * STEPS,)).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    print(
        f"overhead benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on 2 logical CPUs, equal shares, "
        f"global batch {GLOBAL_BATCH}, {args.rounds} alternating rounds of "
        f"{STEPS} steps, MLP 64-W-W-10"
    )
    print()
    print(
        "| W | stock step (ms) | HeteroModel step (ms) | extra (ms) | ratio |"
    )
    print("|---:|---:|---:|---:|---:|")
    for width in args.widths:
        stock, hetero = measure(strategy, examples, width, args.rounds)
        print(
            f"| {width} | {1000 * stock:.2f} | {1000 * hetero:.2f} | "
            f"{1000 * (hetero - stock):.2f} | {hetero / stock:.3f} |"
        )


def measure(strategy, examples, width, rounds):
    """Median step seconds of (stock, HeteroModel), alternating fits."""
    runs = {
        "stock": (
            build(keras.Model, strategy, width),
            examples.batch(GLOBAL_BATCH),
        ),
        "hetero": (
            build(kh.HeteroModel, strategy, width),
            kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy),
        ),
    }
    seconds = {name: [] for name in runs}
    for model, data in runs.values():  # warm-up: tracing
        model.fit(data, epochs=1, verbose=0)
    for _ in range(rounds):
        for name, (model, data) in runs.items():
            timer = kh.testing.StepTimer()
            model.fit(data, epochs=1, verbose=0, callbacks=[timer])
            seconds[name].extend(timer.seconds)
    return (
        float(np.median(seconds["stock"])),
        float(np.median(seconds["hetero"])),
    )


if __name__ == "__main__":
    main()
