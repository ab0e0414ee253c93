"""Uniform vs rebalanced shares on SIMULATED unequal devices.

MirroredStrategy over logical CPUs; each replica is slowed by
`kh.testing.SimulatedSpeed` (seconds per row; speed = 1 / that). For each case
we train the same model with equal shares and with `ShardRebalancer`, and
print samples/s (median step time over the second half of the run), % of the
ideal (the sum of the replicas' simulated speeds, rows/s) and, for the
slow-down case, the steps after the change until a 5-step median reaches 95%
of the new ideal. All figures are simulated.

Run: `python benchmarks/rebalance.py` (about 3 minutes on 2 cores).
"""

import argparse
import datetime
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero._compat import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(4)
BASE = 0.004  # simulated seconds per row of the slowest device
GLOBAL_BATCH = 48


class SlowDown(keras.callbacks.Callback):
    """Makes replica `replica` `factor` times slower after step `at`."""

    def __init__(self, layer, at, replica, factor):
        super().__init__()
        self.layer, self.at, self.replica, self.factor = (
            layer,
            at,
            replica,
            factor,
        )
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == self.at:
            seconds = list(self.layer.seconds_per_row)
            seconds[self.replica] *= self.factor
            self.layer.seconds_per_row = seconds


def run(speeds, steps, rebalance, slowdown=None):
    replicas = len(speeds)
    strategy = tf.distribute.MirroredStrategy(DEVICES[:replicas])
    seconds = [BASE / s for s in speeds]
    with strategy.scope():
        inputs = keras.Input((16,))
        slow = kh.testing.SimulatedSpeed(seconds)
        hidden = keras.layers.Dense(32, activation="relu")(slow(inputs))
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * steps, 16)).astype("float32")
    examples = tf.data.Dataset.from_tensor_slices((x, x[:, :1]))
    data = kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)
    timer = kh.testing.StepTimer()
    callbacks = [timer]
    if rebalance:
        callbacks.append(
            kh.callbacks.ShardRebalancer(data, every_n_steps=5, window=5)
        )
    if slowdown:
        callbacks.append(SlowDown(slow, *slowdown))
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return np.asarray(timer.seconds), seconds


def ideal(seconds):
    return float(np.sum(1.0 / np.asarray(seconds)))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    print(
        f"rebalance benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on logical CPUs, global batch "
        f"{GLOBAL_BATCH}, SIMULATED speeds (slowest {BASE} s/row)"
    )
    print()
    print(
        "| speeds | uniform samples/s | uniform % ideal | rebalanced "
        "samples/s | rebalanced % ideal | steps to 95% after change |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    cases = [
        ("1:2", [1, 2], None),
        ("1:4", [1, 4], None),
        ("1:1:2:4", [1, 1, 2, 4], None),
        ("1:1 -> replica 1 2x slower at step 100", [1, 1], (100, 1, 2.0)),
    ]
    for name, speeds, slowdown in cases:
        steps = 200 if slowdown else args.steps
        row = [name]
        for rebalance in (False, True):
            times, seconds = run(speeds, steps, rebalance, slowdown)
            if slowdown:
                at, replica, factor = slowdown
                seconds[replica] *= factor
                tail = times[at + (steps - at) // 2 :]
            else:
                tail = times[len(times) // 2 :]
            rate = GLOBAL_BATCH / float(np.median(tail))
            row += [f"{rate:.0f}", f"{100 * rate / ideal(seconds):.0f}%"]
            if rebalance and slowdown:
                target = 0.95 * ideal(seconds)
                after = times[slowdown[0] :]
                rolling = [
                    GLOBAL_BATCH / np.median(after[i : i + 5])
                    for i in range(len(after) - 4)
                ]
                hit = [i for i, r in enumerate(rolling) if r >= target]
                row.append(str(hit[0] + 5) if hit else "not reached")
        if not slowdown:
            row.append("-")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
