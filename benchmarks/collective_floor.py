"""The ceiling of two equal CPU workers: where the last 10-15% of the ideal go.

Two MultiWorkerMirroredStrategy worker processes on 127.0.0.1, each pinned
to its own core (no quota), train HeteroModel on `kh.data.shard` (one
collective per step: the gradients, the rows and seconds, the metrics).
The issue's ideal is the sum of each worker's rate alone; this script
splits the distance to it into its parts, all measured in one run:

- `alone, global batch`: one worker, its core, the whole global batch (the
  ideal is twice its rate);
- `alone, half batch`: one worker training its half of the batch, as each
  of the pair does: a smaller batch computes fewer samples per second;
- `pair` (twice, the second the A/A row): the two workers together;
- `alone, global batch, 3 inter-op threads`: as the first row with
  TensorFlow's inter-op pool raised to 3 threads (as
  `kh.testing.logical_cpus(1)` does for `SimulatedSpeed`'s sleeps, and the
  benchmarks that call it): on one core, more threads can be slower;
- the bare all-reduce between the same two workers, of one float (the
  collective's latency) and of the gradients' size (`bare_allreduce_seconds`);
- `ceiling`: the half-batch step plus the bare all-reduce of the gradients:
  what a pair that added nothing else would reach.

Columns: step ms (the median of the last `--tail` of `--steps` steps, the
median over `--rounds` alternating rounds), samples/s, and the rate as a
fraction of the ideal (twice `alone, global batch`) and of twice `alone,
half batch` (the communication's share alone).

Run: `python benchmarks/collective_floor.py` (Keras 3), then with
`TF_USE_LEGACY_KERAS=1`; `--models resnet mlp`, `--rounds 3`; `--smoke`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import bare_allreduce_seconds  # noqa: E402
from _harness import build_model  # noqa: E402
from _harness import compile_model  # noqa: E402
from _harness import examples  # noqa: E402
from _harness import header  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import markdown_table  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import round_order  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

# model -> (global batch, MLP width): the two shapes, a compute-bound
# conv net and an MLP of about a million weights.
SHAPES = {"resnet": (64, None), "mlp": (2048, 1024)}
# run -> (workers, batch per worker as a fraction of the global batch,
# TensorFlow's inter-op pool size: 0 is its default)
RUNS = {
    "alone, global batch": (1, 1.0, 0),
    "alone, half batch": (1, 0.5, 0),
    "pair": (2, 1.0, 0),
    "pair (A/A)": (2, 1.0, 0),
    "alone, global batch, 3 inter-op threads": (1, 1.0, 3),
}
DISTINCT_BATCHES = 8


def _train(kind, batch, width, steps, tail, inter_op):
    """One fit on this worker; its median step seconds over the tail, and
    the model's weight count. TensorFlow's own thread pools (one CPU device,
    its default inter-op pool) unless `inter_op`."""
    import tensorflow as tf

    if inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = examples(kind, batch * DISTINCT_BATCHES)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat(
        -(-steps // DISTINCT_BATCHES)
    )
    extra = {} if width is None else {"width": width}
    with strategy.scope():
        model = compile_model(build_model(kind, kh.HeteroModel, **extra))
    timer = kh.testing.StepTimer()
    model.fit(
        kh.data.shard(dataset, batch, strategy=strategy),
        epochs=1,
        steps_per_epoch=steps,
        verbose=0,
        callbacks=[timer],
    )
    weights = int(sum(np.prod(w.shape) for w in model.get_weights()))
    return float(np.median(timer.seconds[-tail:])), weights


def _run(name, kind, steps, tail, timeout):
    workers, fraction, inter_op = RUNS[name]
    global_batch, width = SHAPES[kind]
    results = kh.testing.run_workers(
        _train,
        workers,
        timeout=timeout,
        args=(kind, int(global_batch * fraction), width, steps, tail, inter_op),
        cores="auto" if workers > 1 else [0],
    )
    return results[0].value


def model_table(kind, args):
    global_batch, _ = SHAPES[kind]
    steps = {name: [] for name in RUNS}
    weights = None
    for number in range(args.rounds):
        for name in round_order(RUNS, number):
            seconds, weights = _run(
                name, kind, args.steps, args.tail, args.timeout
            )
            steps[name].append(seconds)
    bare = [
        kh.testing.run_workers(
            bare_allreduce_seconds,
            2,
            timeout=args.timeout,
            args=([1, weights], args.repeats),
            cores="auto",
        )[0].value
        for _ in range(args.rounds)
    ]
    latency, gradients = (float(np.median(b)) for b in zip(*bare))
    step = {name: float(np.median(s)) for name, s in steps.items()}
    rows_per_step = {
        name: global_batch * RUNS[name][1] for name in RUNS
    }  # a pair's step trains the global batch
    rate = {name: rows_per_step[name] / step[name] for name in RUNS}
    ideal = 2 * rate["alone, global batch"]
    halves = 2 * rate["alone, half batch"]
    ceiling = step["alone, half batch"] + gradients
    rows = []
    for name, seconds, samples in [
        *[(name, step[name], rate[name]) for name in RUNS],
        ("ceiling: half-batch step + bare all-reduce", ceiling, None),
    ]:
        pair = samples is None or RUNS[name][0] == 2
        if samples is None:
            samples = global_batch / ceiling
        rows.append(
            [
                name,
                f"{seconds * 1e3:.1f}",
                f"{samples:,.0f}",
                f"{samples / ideal:.0%}" if pair else "-",
                f"{samples / halves:.0%}" if pair else "-",
            ]
        )
    columns = [
        "run",
        "step ms",
        "samples/s",
        "of the ideal (twice alone)",
        "of twice alone at half batch",
    ]
    print()
    print(
        f"{kind}: {weights:,} weights ({weights * 4:,} bytes of gradients), "
        f"global batch {global_batch}"
    )
    print()
    print(markdown_table(columns, rows))
    print()
    print(
        f"bare all-reduce between the two workers: 1 float {latency * 1e3:.2f}"
        f" ms, {weights * 4:,} bytes {gradients * 1e3:.2f} ms (medians of "
        f"{args.repeats}, median of {args.rounds} rounds)"
    )


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument(
        "--models", nargs="+", choices=sorted(SHAPES), default=list(SHAPES)
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tail", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=600)
    args = parse_args(
        parser, models=["resnet"], steps=6, tail=3, rounds=1, repeats=5
    )
    print(
        header(
            "collective floor benchmark",
            "MultiWorkerMirroredStrategy, 2 worker processes pinned to a core "
            f"each (no quota), HeteroModel on kh.data.shard, {args.rounds} "
            "alternating rounds",
        )
    )
    for kind in args.models:
        model_table(kind, args)
    print()
    print(load_at_end())


if __name__ == "__main__":
    main()
