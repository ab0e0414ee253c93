"""Model parallelism on unequal devices: kh.placement.plan and Placed
layers on scikit-learn's handwritten digits.

Two logical CPUs stand in for two devices; the planner is told the second
is twice as fast (a SIMULATED speed: both are the same CPU here). It splits
the chain of layers into one stage per device so that the slowest stage is
as fast as possible, and `kh.layers.place` returns a copy of the model whose
layers are `kh.layers.Placed` on their stage's device (forward, backward and
weights). The placed model trains as a `kh.HeteroModel` with
`pipeline_microbatches=4`: each batch goes through the stages as 4
micro-batches, so both devices work at once (GPipe), and the update is the
one of the whole batch. `.keras` files keep the device hints.

Run: `python examples/digits_placement.py` (about 20 s on 2 CPU cores).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

from _digits import accuracy  # noqa: E402
from _digits import compile_for_digits  # noqa: E402
from _digits import load  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(2)
SPEEDS = [1.0, 2.0]  # simulated: the planner's view of the devices
MICROBATCHES = 4


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)

    x_train, y_train, x_test, y_test = load()
    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(128, activation="relu") for _ in range(5)]
        + [keras.layers.Dense(10, activation="softmax")]
    )
    plan = kh.placement.plan(
        model, DEVICES, device_speeds=SPEEDS, batch_size=48
    )
    print("plan for 2 devices, SIMULATED relative speeds 1 : 2")
    print(plan.summary())

    placed = compile_for_digits(
        kh.HeteroModel.from_model(
            kh.layers.place(model, plan.hints()),
            pipeline_microbatches=MICROBATCHES,
        )
    )
    placed.fit(x_train, y_train, batch_size=48, epochs=args.epochs, verbose=0)
    devices = {
        layer.get_config()["device"]
        for layer in placed.layers
        if isinstance(layer, kh.layers.Placed)
    }
    print(f"placed layers run on: {sorted(devices)}")
    print(
        f"pipeline: {MICROBATCHES} micro-batches of {48 // MICROBATCHES} "
        "rows per batch"
    )
    print(f"held-out accuracy: {accuracy(placed, x_test, y_test):.3f}")


if __name__ == "__main__":
    main()
