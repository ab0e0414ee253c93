"""Numpy input: `HeteroModel.fit`'s array sharding vs Keras' array adapter.

`fit(x, y, batch_size=B, shuffle=True)` on `--rows` numpy rows of
`--features` float32 features (a small MLP, SGD, one epoch per
measurement: a worst case, whose ~1 ms steps make per-step input costs
visible). Rows:

- no strategy, stock `keras.Model`: Keras' own array adapter (twice: the
  A/A row shows the noise);
- no strategy, `kh.HeteroModel`: with one replica `fit` keeps Keras' own
  adapter (the numbers are stock Keras');
- no strategy, `kh.HeteroModel` on the same arrays sharded as under several
  replicas (`keras_hetero.data.arrays.from_arrays`): what one replica would
  cost on that path;
- MirroredStrategy on 2 logical CPUs: stock `keras.Model` (Keras' adapter,
  tf.distribute's equal split); `kh.HeteroModel` through Keras' adapter
  (`keras.Model.fit(model, ...)`, bypassing the sharding: equal split, no
  shares); `kh.HeteroModel.fit` (arrays sharded automatically).

Per row: the median step time of the epoch (`kh.testing.StepTimer`,
includes waiting for input) and the wall time of the whole `fit` call (set
up included: conversion, tracing), as medians over `--rounds` alternating
rounds after one warm-up round; ratios to the stock row of the same
strategy, and of the sharded rows to Keras' adapter with the same model
class (the input path's own cost).

Run: `python benchmarks/arrays.py` (about 3 minutes on 2 cores).
"""

import datetime
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402
from keras_hetero.data import arrays  # noqa: E402


def build(cls, strategy, features):
    with strategy.scope():
        inputs = keras.Input((features,))
        hidden = keras.layers.Dense(128, activation="relu")(inputs)
        model = cls(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def measure(model, x, y, batch, via):
    timer = kh.testing.StepTimer()
    kwargs = dict(epochs=1, verbose=0, callbacks=[timer])
    start = time.perf_counter()
    if via == "sharded":
        data = arrays.from_arrays(
            x,
            y,
            batch_size=batch,
            strategy=model.distribute_strategy,
            shuffle=True,
        )
        model.fit(data, **kwargs)
    elif via == "keras adapter":
        keras.Model.fit(model, x, y, batch_size=batch, **kwargs)
    else:
        model.fit(x, y, batch_size=batch, **kwargs)
    return timer.median(), time.perf_counter() - start


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--rows", type=int, default=32_768)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parse_args(parser, rows=2048, features=16, rounds=1)
    mirrored = kh.testing.mirrored(kh.testing.logical_cpus(2))
    import tensorflow as tf

    default = tf.distribute.get_strategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, args.features)).astype("float32")
    y = rng.integers(0, 10, size=(args.rows,)).astype("int64")

    # name: (model class, strategy, how fit gets the arrays, compared with)
    stock, mirrored_stock = (
        "no strategy, keras.Model (Keras' array adapter)",
        "Mirrored 2 CPUs, keras.Model (Keras' adapter, equal split)",
    )
    adapter = "no strategy, kh.HeteroModel (keeps Keras' adapter)"
    mirrored_adapter = (
        "Mirrored 2 CPUs, kh.HeteroModel via Keras' adapter (equal split)"
    )
    cases = {
        stock: (keras.Model, default, "fit", None),
        "no strategy, keras.Model again (A/A)": (
            keras.Model,
            default,
            "fit",
            None,
        ),
        adapter: (kh.HeteroModel, default, "fit", None),
        "no strategy, kh.HeteroModel, arrays sharded": (
            kh.HeteroModel,
            default,
            "sharded",
            adapter,
        ),
        mirrored_stock: (keras.Model, mirrored, "fit", None),
        mirrored_adapter: (kh.HeteroModel, mirrored, "keras adapter", None),
        "Mirrored 2 CPUs, kh.HeteroModel.fit (arrays sharded)": (
            kh.HeteroModel,
            mirrored,
            "fit",
            mirrored_adapter,
        ),
    }
    models = {
        name: build(cls, strategy, args.features)
        for name, (cls, strategy, _, _) in cases.items()
    }
    seconds = {name: {"step": [], "fit": []} for name in cases}
    for round_index in range(args.rounds + 1):  # round 0: warm-up
        for name, (_, _, via, _) in cases.items():
            step, fit = measure(models[name], x, y, args.batch, via)
            if round_index:
                seconds[name]["step"].append(step)
                seconds[name]["fit"].append(fit)

    medians = {
        name: {key: float(np.median(runs[key])) for key in runs}
        for name, runs in seconds.items()
    }
    print(
        f"array input benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, {args.rows} rows of {args.features} float32 features, "
        f"global batch {args.batch}, shuffle=True, one epoch per fit, "
        f"medians of {args.rounds} alternating rounds"
    )
    print()
    print(
        "| input path | step time | step vs stock | step vs Keras' adapter "
        "(same model) | whole fit | fit vs stock |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, (_, strategy, _, same_model) in cases.items():
        got = medians[name]
        base = medians[stock if strategy is default else mirrored_stock]
        own = (
            f"{got['step'] / medians[same_model]['step']:.3f}"
            if same_model
            else ""
        )
        print(
            f"| {name} | {got['step'] * 1e3:.2f} ms | "
            f"{got['step'] / base['step']:.3f} | {own} | {got['fit']:.2f} s | "
            f"{got['fit'] / base['fit']:.3f} |"
        )


if __name__ == "__main__":
    main()
