"""Finding a replica that slows down mid-run: StragglerDetector on
scikit-learn's handwritten digits.

Three logical CPUs stand in for three equal devices
(`kh.testing.SimulatedSpeed`). Partway through training replica 2 is
SIMULATED to slow down fivefold, as a GPU that throttles or a spot machine
with a noisy neighbour would.
`kh.callbacks.StragglerDetector` scores every replica's seconds per row each
step, flags replica 2 within a few steps, and (`action="rebalance"`) asks the
`ShardRebalancer` to move rows away from it at once.

Run: `python examples/digits_stragglers.py` (about 30 s on 2 CPU cores).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _digits import accuracy  # noqa: E402
from _digits import compile_for_digits  # noqa: E402
from _digits import examples  # noqa: E402
from _digits import layers  # noqa: E402
from _digits import load  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(3)
NORMAL = 0.001  # simulated seconds per row of a healthy replica
GLOBAL_BATCH = 60


class SlowDown(keras.callbacks.Callback):
    """Makes replica 2 five times slower from train step `at_step` on."""

    def __init__(self, speed_layer, at_step):
        super().__init__()
        self.speed_layer = speed_layer
        self.at_step = at_step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.step_stats.step == self.at_step:
            self.speed_layer.seconds_per_row = [NORMAL, NORMAL, 5 * NORMAL]
            print(f"step {self.at_step}: replica 2 slows down 5x (simulated)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--slow-at-step", type=int, default=30)
    args = parser.parse_args(argv)

    x_train, y_train, x_test, y_test = load()
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    speed = kh.testing.SimulatedSpeed(NORMAL)
    with strategy.scope():
        inputs = keras.Input((64,))
        model = compile_for_digits(
            kh.HeteroModel(inputs, layers(speed(inputs)))
        )
    data = kh.data.shard(
        examples(x_train, y_train), GLOBAL_BATCH, strategy=strategy
    )

    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=1000)
    detector = kh.callbacks.StragglerDetector(
        threshold=0.7,
        patience=3,
        action="rebalance",
        rebalancer=rebalancer,
        window=5,
    )
    model.fit(
        data,
        epochs=args.epochs,
        verbose=0,
        callbacks=[SlowDown(speed, args.slow_at_step), rebalancer, detector],
    )

    flagged = [e for e in detector.events if e.kind == "straggler"]
    print(f"straggler events: {[(e.step, e.replica) for e in flagged]}")
    print(f"shares after the rebalance: {np.round(data.shares, 2)}")
    print(f"held-out accuracy: {accuracy(model, x_test, y_test):.3f}")


if __name__ == "__main__":
    main()
