"""Main demo: uneven work for unequal devices, with exact training math.

Three replicas on logical CPUs are made SIMULATED-slow with
`kh.testing.SimulatedSpeed` (relative speeds 1 : 2 : 4). Stock Keras gives
each replica the same rows, so every step waits for the slowest. HeteroModel
measures each replica's seconds per row (`model.step_stats`), splits the global
batch in proportion to speed (`kh.data.shard(..., shares=...)`), and still
computes exactly the single-device update.

Run: `make demo` (or `python examples/quickstart.py`). About a minute on
2 CPU cores.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero._compat import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(3)
SECONDS_PER_ROW = [0.008, 0.004, 0.002]  # simulated: speeds 1 : 2 : 4
GLOBAL_BATCH = 42
ROWS = GLOBAL_BATCH * 30


def make_examples():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    return x, y, tf.data.Dataset.from_tensor_slices((x, y))


def build(model_class):
    inputs = keras.Input((8,))
    slow = kh.testing.SimulatedSpeed(SECONDS_PER_ROW)(inputs)
    hidden = keras.layers.Dense(16, activation="relu")(slow)
    model = model_class(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def samples_per_second(model, data):
    timer = kh.testing.StepTimer()
    model.fit(data, epochs=1, verbose=0, callbacks=[timer])
    return GLOBAL_BATCH / timer.median()


def main():
    x, y, examples = make_examples()
    ideal = sum(1.0 / s for s in SECONDS_PER_ROW)
    strategy = tf.distribute.MirroredStrategy(DEVICES)

    with strategy.scope():
        stock = build(keras.Model)
    stock_rate = samples_per_second(stock, examples.batch(GLOBAL_BATCH))

    with strategy.scope():
        model = build(kh.HeteroModel)
    data = kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)
    model.fit(data, epochs=1, verbose=0)
    seconds_per_row = model.step_stats.seconds_per_row
    data.shares = 1.0 / seconds_per_row  # proportional to measured speed
    hetero_rate = samples_per_second(model, data)

    print("keras-hetero demo: 3 replicas, SIMULATED speeds 1 : 2 : 4")
    print(f"measured seconds/row per replica: {np.round(seconds_per_row, 5)}")
    print(
        f"shares set from them: {np.round(data.shares, 3)}  rows: {data.rows}"
    )
    print()
    print(f"{'setup':<34}{'samples/s':>10}{'% of ideal':>12}")
    for name, rate in (
        ("stock keras.Model, equal split", stock_rate),
        ("kh.HeteroModel, shares by speed", hetero_rate),
    ):
        print(f"{name:<34}{rate:>10.0f}{100 * rate / ideal:>11.0f}%")
    print(f"(ideal = sum of replica speeds = {ideal:.0f} rows/s, simulated)")

    # Same math as one device on the concatenated global batches.
    reference = build(keras.Model)
    reference.set_weights(model.get_weights())
    with strategy.scope():
        check = build(kh.HeteroModel)
    check.set_weights(model.get_weights())
    check.fit(
        kh.data.shard(
            examples, GLOBAL_BATCH, strategy=strategy, shares=data.shares
        ),
        epochs=1,
        verbose=0,
    )
    reference.fit(examples.batch(GLOBAL_BATCH), epochs=1, verbose=0)
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(check.get_weights(), reference.get_weights())
    )
    print(f"max |weight difference| vs single-device training: {gap:.1e}")


if __name__ == "__main__":
    main()
