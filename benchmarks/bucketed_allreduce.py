"""Bucketed all-reduce (`HeteroModel(bucket_bytes=...)`) against one
collective per step, on REAL workers.

Two MultiWorkerMirroredStrategy worker processes on 127.0.0.1, each pinned
to its own core (`kh.testing.run_workers(cores="auto")`), one logical CPU
each, train with Adam on an in-memory input split equally
(`kh.data.shard`). Two conditions: both workers unthrottled, and worker 1
capped at `--quota` of its core by a cgroup CPU quota (the whole process: a
slow host; root). Two models: a deep MLP of about 1M weights (64, seven
Dense 400, 10: 4 MB of gradients, the backward pass spread over eight
layers) and the conv net of benchmarks/_harness.py (a small ResNet, 80 KB
of gradients).

For each model and condition a round runs every variant once, in turn
(every other round reversed): `one collective` (the default) twice, the
second the A/A row, and the bucket sizes of `BUCKETS`. A run's figure is
worker 0's median step time over the last `--steps` steps of one fit
(`kh.testing.StepTimer`: steady state, the first `WARMUP` steps left out);
the table gives, per variant, the median over rounds of its step time
divided by the same round's first `one collective` run, and the spread
(25th-75th percentile) of those ratios. A ratio below 1 is faster; a
difference within the A/A row's spread is not resolved by the run.
`collectives` is the number of buckets `aggregation.buckets` makes of the
model's gradients: the all-reduce ops one step runs (the tests check the
graph).

Run as root: `python benchmarks/bucketed_allreduce.py` (Keras 3), then with
`TF_USE_LEGACY_KERAS=1`; `--models mlp`, `--rounds 3`, `--steps 40`;
`--smoke` runs one tiny round.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import build_model  # noqa: E402
from _harness import compile_model  # noqa: E402
from _harness import examples  # noqa: E402
from _harness import header  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import markdown_table  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import quartiles  # noqa: E402
from _harness import round_order  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

WARMUP = 5
DISTINCT_BATCHES = 4
GLOBAL_BATCH = {"mlp": 256, "resnet": 64}
# Per model: the variants' bucket sizes in bytes (None: one collective).
BUCKETS = {
    "mlp": {
        "one collective": None,
        "one collective (A/A)": None,
        "buckets of 1 MiB": 1 << 20,
        "buckets of 256 KiB": 1 << 18,
    },
    "resnet": {
        "one collective": None,
        "one collective (A/A)": None,
        "buckets of 32 KiB": 1 << 15,
        "buckets of 8 KiB": 1 << 13,
    },
}
MODEL_NAMES = {
    "mlp": "MLP 64-7x400-10",
    "resnet": "ResNet (2 stages, 32x32x3)",
}


def _build(kind, model_class):
    from keras_hetero import keras

    if kind == "resnet":
        return build_model(kind, model_class)
    inputs = keras.Input((64,))
    hidden = inputs
    for _ in range(7):
        hidden = keras.layers.Dense(400, activation="relu")(hidden)
    return model_class(inputs, keras.layers.Dense(10)(hidden))


def _worker(kind, bucket_bytes, steps):
    import functools

    import tensorflow as tf

    from keras_hetero.training import aggregation

    kh.testing.logical_cpus(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    batch = GLOBAL_BATCH[kind]
    x, y = examples(kind, batch * DISTINCT_BATCHES)
    total = steps + WARMUP
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat(
        -(-total // DISTINCT_BATCHES)
    )
    model_class = functools.partial(kh.HeteroModel, bucket_bytes=bucket_bytes)
    with strategy.scope():
        model = compile_model(_build(kind, model_class))
    timer = kh.testing.StepTimer()
    model.fit(
        kh.data.shard(dataset, batch, strategy=strategy),
        epochs=1,
        steps_per_epoch=total,
        verbose=0,
        callbacks=[timer],
    )
    grads = [tf.zeros(w.shape) for w in model.trainable_weights]
    collectives = (
        1
        if bucket_bytes is None
        else len(aggregation.buckets(grads, bucket_bytes))
    )
    return {
        "seconds": float(np.median(timer.seconds[-steps:])),
        "weights": int(sum(np.prod(w.shape) for w in model.get_weights())),
        "collectives": collectives,
    }


def _run(kind, bucket_bytes, quotas, steps, timeout):
    return kh.testing.run_workers(
        _worker,
        2,
        timeout=timeout,
        args=(kind, bucket_bytes, steps),
        cpu_quotas=quotas,
        cores="auto",
    )[0].value


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(BUCKETS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quota", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=300)
    args = parse_args(parser, models=["resnet"], rounds=1, steps=3)
    conditions = {
        "unthrottled": None,
        f"worker 1 at {args.quota:g} core": [None, args.quota],
    }
    if args.smoke:
        conditions = {"unthrottled": None}
    print(
        header(
            "bucketed all-reduce benchmark",
            "MultiWorkerMirroredStrategy, 2 worker processes pinned to a "
            f"core each, Adam, median step of the last {args.steps} steps, "
            f"{args.rounds} rounds",
        )
    )
    rows = []
    for kind in args.models:
        variants = BUCKETS[kind]
        for condition, quotas in conditions.items():
            ratios = {name: [] for name in variants}
            seconds = {name: [] for name in variants}
            result = None
            for number in range(args.rounds):
                figures = {}
                for name in round_order(variants, number):
                    result = _run(
                        kind, variants[name], quotas, args.steps, args.timeout
                    )
                    figures[name] = result
                baseline = figures["one collective"]["seconds"]
                for name, figure in figures.items():
                    seconds[name].append(figure["seconds"])
                    ratios[name].append(figure["seconds"] / baseline)
            for name in variants:
                low, high = quartiles(ratios[name])
                rows.append(
                    (
                        f"{MODEL_NAMES[kind]}, {result['weights']:,} weights",
                        condition,
                        name,
                        str(figures[name]["collectives"]),
                        f"{np.median(seconds[name]) * 1e3:.1f}",
                        f"{np.median(ratios[name]):.3f}",
                        f"{low:.3f}-{high:.3f}",
                    )
                )
    print()
    print(
        markdown_table(
            [
                "model",
                "workers",
                "run",
                "collectives per step",
                "step ms",
                "step / one collective",
                "spread (rounds)",
            ],
            rows,
        )
    )
    print()
    print(load_at_end())


if __name__ == "__main__":
    main()
