"""Input iterator teardown: the wait after a fit that was stopped mid-epoch.

Each run is a fresh process: MirroredStrategy on 2 logical CPUs, a one-layer
model, a fit that a callback stops after `--seconds` (as EarlyStopping,
ElasticCheckpoint's resume tests or a notebook's interrupted cell leave an
input iterator half read), then `del` of the model and the dataset and
`gc.collect()`, timed. Variants: stock Keras on
`experimental_distribute_dataset` (twice: A/A), HeteroModel on
`kh.data.shard` as it is, and the same with tf.data's autotuning put back
(the code before 2026-12-03). Runs alternate within each round; we report
the median teardown in seconds and its ratio to stock.

Run: `python benchmarks/teardown.py` (`--seconds 5 20 --rounds 2`).
"""

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402
from _step_variants import autotuning_on  # noqa: E402

VARIANTS = (
    "stock",
    "stock (A/A)",
    "kh.data.shard",
    "kh.data.shard, tf.data autotuning on (before)",
)


def child(variant, seconds, rows):
    import gc
    import time

    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import keras

    kh.testing.logical_cpus(2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    examples = tf.data.Dataset.from_tensor_slices((x, y))

    class StopAfter(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.started = time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            if time.monotonic() - self.started > seconds:
                self.model.stop_training = True

    stock = variant.startswith("stock")
    with strategy.scope():
        inputs = keras.Input((8,))
        model_class = keras.Model if stock else kh.HeteroModel
        model = model_class(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    if stock:
        data = examples.batch(64)
    else:
        data = kh.data.shard(examples, 64, strategy=strategy)
    before = "autotuning on" in variant
    with autotuning_on() if before else contextlib.nullcontext():
        model.fit(data, epochs=1, verbose=0, callbacks=[StopAfter()])
    started = time.monotonic()
    del model, data
    gc.collect()
    return time.monotonic() - started


def measure(variant, seconds, rows):
    output = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(seconds), str(rows)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = smoke_parser(__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, nargs="+", default=[5, 20])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--rows",
        type=int,
        default=64 * 200_000,
        help="examples in the input: more than a fit reads in --seconds",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parse_args(parser, seconds=[0.5], rounds=1, rows=64 * 1000)
    if args.child:
        variant, seconds, rows = args.child
        print(json.dumps(child(variant, float(seconds), int(rows))))
        return
    import numpy as np

    results = {(v, s): [] for v in VARIANTS for s in args.seconds}
    for _ in range(args.rounds):
        for seconds in args.seconds:
            for variant in VARIANTS:
                results[variant, seconds].append(
                    measure(variant, seconds, args.rows)
                )
    print(
        f"Teardown after a fit stopped mid-epoch ({datetime.date.today()}, "
        f"median of {args.rounds} rounds, MirroredStrategy on 2 logical "
        "CPUs; seconds / ratio to stock)\n"
    )
    columns = [f"stopped at {s:g} s" for s in args.seconds]
    print("| run | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for variant in VARIANTS:
        cells = []
        for seconds in args.seconds:
            median = float(np.median(results[variant, seconds]))
            stock = float(np.median(results["stock", seconds]))
            cells.append(f"{median:.2f} s / {median / stock:.2f}")
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
