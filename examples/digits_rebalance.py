"""Shares that follow measured speed: HeteroModel + kh.data.shard +
ShardRebalancer on scikit-learn's handwritten digits.

Three logical CPUs stand in for three devices, made SIMULATED-slow by
`kh.testing.SimulatedSpeed` (relative speeds 1 : 2 : 4). The first epoch
splits every global batch equally; then `ShardRebalancer` measures each
replica's seconds per row and moves the shares towards speed, so a step
stops waiting for the slowest replica. The training math stays that of one
device.

Run: `python examples/digits_rebalance.py` (about 30 s on 2 CPU cores).
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
SECONDS_PER_ROW = [0.003, 0.0015, 0.00075]  # simulated: speeds 1 : 2 : 4
GLOBAL_BATCH = 60


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    x_train, y_train, x_test, y_test = load()
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    with strategy.scope():
        inputs = keras.Input((64,))
        slow = kh.testing.SimulatedSpeed(SECONDS_PER_ROW)(inputs)
        model = compile_for_digits(kh.HeteroModel(inputs, layers(slow)))
    data = kh.data.shard(
        examples(x_train, y_train), GLOBAL_BATCH, strategy=strategy
    )

    # Epoch 1: equal shares, as stock Keras would split.
    equal = kh.testing.StepTimer()
    model.fit(data, epochs=1, verbose=0, callbacks=[equal])
    equal_shares = data.shares

    # Then let the shares follow the measured speed.
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=4, window=4)
    balanced = kh.testing.StepTimer()
    for epoch in range(1, args.epochs):
        model.fit(
            data,
            initial_epoch=epoch,
            epochs=epoch + 1,
            verbose=0,
            callbacks=[rebalancer, balanced],
        )

    print("digits, 3 replicas with SIMULATED speeds 1 : 2 : 4")
    print(f"{'':<24}{'shares':<22}{'ms/step (simulated)':>20}")
    for name, shares, timer in (
        ("equal split", equal_shares, equal),
        ("ShardRebalancer", data.shares, balanced),
    ):
        print(
            f"{name:<24}{str(np.round(shares, 2)):<22}"
            f"{1000 * timer.median():>20.0f}"
        )
    print(f"rows per replica now: {data.rows} of {GLOBAL_BATCH}")
    print(f"held-out accuracy: {accuracy(model, x_test, y_test):.3f}")


if __name__ == "__main__":
    main()
