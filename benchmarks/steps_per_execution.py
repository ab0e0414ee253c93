"""Time per train step with `steps_per_execution=k` under MirroredStrategy.

Two logical CPUs, a small MLP with uneven shares (0.75 / 0.25), so the
host's per-call cost (Python, callbacks, the function call) is a large part
of a step: the case `steps_per_execution` is for. The models (one per k, the
same weights and data) fit one epoch each in turn, several rounds; we report
the median seconds per step of each k (epoch time from `on_epoch_begin` to
`on_epoch_end` over the steps it ran) and the ratio to k = 1. The A/A row is
a second k = 1 model: the noise of the measurement.

Run: `python benchmarks/steps_per_execution.py`.
"""

import datetime
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(2)
GLOBAL_BATCH = 32


class EpochTimer(keras.callbacks.Callback):
    """Seconds per train step of each epoch."""

    def __init__(self):
        super().__init__()
        self.seconds_per_step = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._steps = int(self.model.optimizer.iterations.numpy())

    def on_epoch_end(self, epoch, logs=None):
        steps = int(self.model.optimizer.iterations.numpy()) - self._steps
        seconds = time.perf_counter() - self._start
        self.seconds_per_step.append(seconds / steps)


def build(strategy, steps_per_execution):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(
            optimizer="sgd",
            loss="mse",
            steps_per_execution=steps_per_execution,
        )
    return model


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--k", type=int, nargs="+", default=[4, 16], help="values of k"
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="steps per epoch"
    )
    args = parse_args(parser, rounds=1, steps=32)
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * args.steps, 16)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    runs = {"1 (A/A)": 1, "1": 1, **{str(k): k for k in args.k}}
    models = {name: build(strategy, k) for name, k in runs.items()}
    data = kh.data.shard(
        examples, GLOBAL_BATCH, strategy=strategy, shares=[0.75, 0.25]
    )
    timers = {name: EpochTimer() for name in runs}
    for model in models.values():  # warm-up: tracing
        model.fit(data, epochs=1, verbose=0)
    for _ in range(args.rounds):
        for name, model in models.items():
            model.fit(data, epochs=1, verbose=0, callbacks=[timers[name]])
    median = {
        name: float(np.median(timer.seconds_per_step))
        for name, timer in timers.items()
    }
    print(
        f"steps_per_execution benchmark, {datetime.date.today()}, Keras "
        f"flavour {kh.FLAVOUR}, MirroredStrategy on 2 logical CPUs, shares "
        f"0.75/0.25, global batch {GLOBAL_BATCH}, {args.steps} steps per "
        f"epoch, {args.rounds} alternating rounds, MLP 16-32-1"
    )
    print()
    print("| k | step (ms) | ratio to k = 1 |")
    print("|---:|---:|---:|")
    for name in runs:
        print(
            f"| {name} | {1000 * median[name]:.2f} | "
            f"{median[name] / median['1']:.3f} |"
        )


if __name__ == "__main__":
    main()
