"""Epoch boundaries: samples/s over whole epochs against within them, stock
Keras beside HeteroModel, both Keras flavours.

The issue's case: an MLP 64-W-W-10 (W = 1024: 1.1M weights) on an
in-memory `tf.data` input (24,576 rows of 64 floats, 6 MB) in global
batches of 2,048: 12 steps per epoch. Each run fits `--epochs` epochs.
"Within" is the rate over each epoch's steps after its first, from
`on_train_batch_end` stamps; "whole" is the rate from one `on_epoch_end` to
the next (epoch 0, which traces, left out); a boundary is the time from an
epoch's last `on_train_batch_end` to the next epoch's first, less one
median step (from epoch 1's end on). Runs alternate in order round by
round (`_harness.round_order`); the table shows medians over rounds (the
boundary columns: over every boundary of every round), and the A/A row the
noise. Rows: stock `keras.Model` (not under MultiWorkerMirroredStrategy
with Keras 3, where it cannot fit; there the A/A row is "HeteroModel
before"'s), "HeteroModel before" (Keras' own epoch iterators, as before
`keras_hetero.training.epochs`), HeteroModel on the same `tf.data` input, and
HeteroModel on `kh.data.shard` of its rows.

Run: `python benchmarks/epoch_boundary.py` (both flavours, each in a
process of its own; `--flavour` picks one; `--where one mirrored workers`:
one process without a strategy, MirroredStrategy on 2 logical CPUs, a pair
of MultiWorkerMirroredStrategy worker processes on 127.0.0.1).

`--input` picks the input: `tf.data` (the default above, autotuned as
tf.data is by default), or one of the inputs that read a new iterator
each epoch (docs/drop-in.md, "Epoch boundaries"): `arrays` (`fit(x, y,
batch_size=, shuffle=True)`), `generator` (an endless Python generator
with `steps_per_epoch`), `pydataset` (a `keras.utils.PyDataset`; Keras 3,
tf-keras has its `Sequence`). Those have no `kh.data.shard` row.
"""

import os
import subprocess
import sys
import time
from contextlib import nullcontext

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import header  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import markdown_table  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import round_order  # noqa: E402
from _harness import smoke_parser  # noqa: E402

FLAVOURS = {"keras3": "0", "tf-keras": "1"}
PLACES = ("one", "mirrored", "workers")
INPUTS = ("tf.data", "arrays", "generator", "pydataset")


def _stamps_callback():
    from keras_hetero import keras

    class Stamps(keras.callbacks.Callback):
        """`on_train_batch_end` and `on_epoch_end` times of one fit."""

        def on_train_begin(self, logs=None):
            self.batch_ends, self.epoch_ends = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.batch_ends.append([])

        def on_train_batch_end(self, batch, logs=None):
            self.batch_ends[-1].append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_ends.append(time.perf_counter())

    return Stamps()


def _rates(stamps, batch):
    """`(within, whole, boundary seconds per epoch)` of one fit.

    A boundary is the time from an epoch's last `on_train_batch_end` to the
    next epoch's first, less one step at the median step time: what the
    boundary adds, measured where it happens (noise elsewhere in the epoch
    stays out of it)."""
    steps = np.concatenate([np.diff(ends) for ends in stamps.batch_ends[1:]])
    step = float(np.median(steps))
    walls = np.diff(stamps.epoch_ends)
    per_epoch = len(stamps.batch_ends[1])
    within = batch / step
    whole = per_epoch * batch / float(np.median(walls))
    boundaries = [
        after[0] - before[-1] - step
        for before, after in zip(stamps.batch_ends[1:], stamps.batch_ends[2:])
    ]
    return within, whole, np.array(boundaries)


def _runs(stock_fits, kind):
    """Run names; `before`: HeteroModel with Keras' own epoch iterators
    (`keras_hetero.training.epochs.keras_own_epoch_iterators`)."""
    if stock_fits:
        names = ["stock", "stock (A/A)", "HeteroModel before"]
    else:
        names = ["HeteroModel before", "HeteroModel before (A/A)"]
    names.append("HeteroModel")
    if kind == "tf.data":
        names.append("HeteroModel, kh.data.shard")
    return names


def _fit_input(kind, x, y, batch):
    """`fit`'s keyword arguments for input `kind` over `(x, y)`."""
    import tensorflow as tf

    from keras_hetero import keras

    steps = len(x) // batch
    if kind == "tf.data":
        examples = tf.data.Dataset.from_tensor_slices((x, y))
        return {"x": examples.batch(batch)}
    if kind == "arrays":
        return {"x": x, "y": y, "batch_size": batch, "shuffle": True}
    if kind == "generator":

        def batches():
            while True:
                for step in range(steps):
                    part = slice(step * batch, (step + 1) * batch)
                    yield x[part], y[part]

        return {"x": batches(), "steps_per_epoch": steps, "shuffle": False}
    base = getattr(keras.utils, "PyDataset", None) or keras.utils.Sequence

    class Batches(base):
        def __len__(self):
            return steps

        def __getitem__(self, step):
            part = slice(step * batch, (step + 1) * batch)
            return x[part], y[part]

    return {"x": Batches()}


def table(strategy, args):
    """The markdown table of `args`' runs under `strategy`."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import keras
    from keras_hetero.training import epochs

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 64)).astype("float32")
    y = rng.integers(0, 10, size=args.rows).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    multi_worker = isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    )
    stock_fits = kh.FLAVOUR == "tf-keras" or not multi_worker
    names = _runs(stock_fits, args.input)
    models, inputs = {}, {}
    for name in names:
        keras.utils.set_random_seed(0)
        stock = name.startswith("stock")
        model_class = keras.Model if stock else kh.HeteroModel
        with strategy.scope():
            features = keras.Input((64,))
            hidden = keras.layers.Dense(args.width, activation="relu")(features)
            hidden = keras.layers.Dense(args.width, activation="relu")(hidden)
            models[name] = model_class(features, keras.layers.Dense(10)(hidden))
            models[name].compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True
                ),
            )
        if name.endswith("kh.data.shard"):
            inputs[name] = {
                "x": kh.data.shard(examples, args.batch, strategy=strategy)
            }
        else:
            inputs[name] = _fit_input(args.input, x, y, args.batch)
    results = {name: [] for name in names}
    for number in range(args.rounds):
        for name in round_order(names, number):
            stamps = _stamps_callback()
            before = name.startswith("HeteroModel before")
            with (
                epochs.keras_own_epoch_iterators() if before else nullcontext()
            ):
                models[name].fit(
                    **inputs[name],
                    epochs=args.epochs,
                    callbacks=[stamps],
                    verbose=0,
                )
            results[name].append(_rates(stamps, args.batch))
    rows = []
    for name in names:
        within = np.median([result[0] for result in results[name]])
        whole = np.median([result[1] for result in results[name]])
        boundaries = np.concatenate([result[2] for result in results[name]])
        rows.append(
            [
                name,
                f"{within:.0f}",
                f"{whole:.0f}",
                f"{whole / within:.3f}",
                f"{1000 * np.median(boundaries):.0f}",
                f"{1000 * np.mean(boundaries):.0f}",
                f"{1000 * np.max(boundaries):.0f}",
            ]
        )
    columns = [
        "run",
        "within epochs (samples/s)",
        "whole epochs (samples/s)",
        "whole / within",
        "boundary median (ms)",
        "mean (ms)",
        "max (ms)",
    ]
    return markdown_table(columns, rows)


def _worker_table(args):
    from _harness import mwms_strategy

    return table(mwms_strategy(), args)


def _place_title(place):
    return {
        "one": "one process, no strategy",
        "mirrored": "MirroredStrategy on 2 logical CPUs (one process)",
        "workers": "MultiWorkerMirroredStrategy, 2 worker processes "
        "(1 logical CPU each, 127.0.0.1)",
    }[place]


def run_flavour(args):
    """This process's flavour: one table per place."""
    import keras_hetero as kh

    if "mirrored" in args.where:
        devices = kh.testing.logical_cpus(2)
    print(
        header(
            "epoch boundary benchmark",
            f"MLP 64-{args.width}-{args.width}-10, {args.rows} rows, global "
            f"batch {args.batch} ({args.rows // args.batch} steps per "
            f"epoch), {args.epochs} epochs per fit, {args.rounds} "
            f"alternating rounds, input {args.input}",
        )
    )
    for place in args.where:
        print()
        print(f"{kh.FLAVOUR}, {_place_title(place)}:")
        print()
        if place == "workers":
            results = kh.testing.run_workers(
                _worker_table, 2, timeout=args.timeout, args=(args,)
            )
            print(results[0].value)
        elif place == "mirrored":
            print(table(kh.testing.mirrored(devices), args))
        else:
            import tensorflow as tf

            print(table(tf.distribute.get_strategy(), args))
    print()
    print(load_at_end())


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument(
        "--flavour", choices=["both", *FLAVOURS], default="both"
    )
    parser.add_argument(
        "--where", nargs="+", choices=PLACES, default=list(PLACES)
    )
    parser.add_argument("--input", choices=INPUTS, default="tf.data")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--rows", type=int, default=24576)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument(
        "--timeout", type=int, default=1800, help="seconds per worker pair"
    )
    args = parse_args(
        parser,
        rounds=1,
        epochs=3,
        rows=1024,
        batch=256,
        width=32,
        where=["one"],
    )
    if args.flavour != "both":
        run_flavour(args)
        return
    for flavour, legacy in FLAVOURS.items():
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        command += ["--flavour", flavour]
        env = {**os.environ, "TF_USE_LEGACY_KERAS": legacy}
        subprocess.run(command, env=env, check=True)
        print()


if __name__ == "__main__":
    main()
