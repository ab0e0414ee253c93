"""The input split alone: host time per global batch, stock vs kh.data.shard.

Each run iterates a distributed dataset under MirroredStrategy on
`--replicas` logical CPUs with a trivial step (one sum per replica), so the
time per global batch is the input pipeline's: stock
`experimental_distribute_dataset` of the batched examples (Keras' own
split, even), a second stock run (A/A), `kh.data.shard` (bounds in-graph
from the schedule's copy, data/bounds.py; its own small map functions run
inline, `_compat.inline_map`), `kh.data.shard` with those maps on TF's
thread pool (before 2026-12-03) and with the bounds from a Python callback
per global batch (before 2026-12-02). Runs
alternate within each round; we report the median wall and process CPU
time per global batch and the median of the rounds' ratios to stock.

A second table times one small map function per element (two slices, the
size of the split's `_unpad`) run by `Dataset.map` on TF's thread pool and
by `_compat.inline_map` on the calling thread, in one thread
(`Dataset.reduce`), next to no map at all.

Run: `python benchmarks/split_pipeline.py` (2 replicas), `--replicas 4`.
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import equal_split_batch  # noqa: E402
from _harness import examples as examples_of  # noqa: E402
from _harness import header  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import round_order  # noqa: E402
from _harness import smoke_parser  # noqa: E402
from _step_variants import pooled_maps  # noqa: E402
from _step_variants import python_bounds  # noqa: E402

import keras_hetero as kh  # noqa: E402


def measure(strategy, rounds, batches):
    import tensorflow as tf

    batch = equal_split_batch(strategy.num_replicas_in_sync)
    examples = tf.data.Dataset.from_tensor_slices(
        examples_of("mlp", batch * batches)
    )

    def stock():
        return strategy.experimental_distribute_dataset(examples.batch(batch))

    def sharded():
        return kh.data.shard(
            examples, batch, strategy=strategy
        ).as_distributed_dataset()

    def sharded_python_bounds():
        with python_bounds():
            return sharded()

    def sharded_pooled_maps():
        with pooled_maps():
            return sharded()

    runs = {
        "stock": stock,
        "stock (A/A)": stock,
        "kh.data.shard": sharded,
        "kh.data.shard, split maps on the thread pool (before)": (
            sharded_pooled_maps
        ),
        "kh.data.shard, bounds by a Python callback (before)": (
            sharded_python_bounds
        ),
    }

    def make_step():
        @tf.function
        def step(iterator):
            return strategy.run(
                lambda part: tf.reduce_sum(tf.nest.flatten(part)[0]),
                args=(next(iterator),),
            )

        return step

    steps = {name: make_step() for name in runs}
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for number in range(rounds):
        for name in round_order(runs, number):
            iterator = iter(runs[name]())
            step = steps[name]
            step(iterator)  # tracing, the pipeline's first batch
            timed = batches - 2
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(timed):
                step(iterator)
            wall[name].append((time.perf_counter() - start_wall) / timed)
            cpu[name].append((time.process_time() - start_cpu) / timed)
    rows = []
    for name in runs:
        wall_ratio = np.median(np.divide(wall[name], wall["stock"]))
        cpu_ratio = np.median(np.divide(cpu[name], cpu["stock"]))
        rows.append(
            f"| {name} | {1000 * np.median(wall[name]):.3f} | "
            f"{wall_ratio:.3f} | {1000 * np.median(cpu[name]):.3f} | "
            f"{cpu_ratio:.3f} |"
        )
    return rows


def map_call_cost(rounds, calls=2000):
    """Rows: wall and CPU time per call of one small map function, on TF's
    thread pool (`Dataset.map`) and inline (`_compat.inline_map`), in one
    thread (`Dataset.reduce`), with no map as the baseline."""
    import tensorflow as tf

    from keras_hetero import _compat
    from keras_hetero.data.split import pipeline_options

    element = (tf.zeros([128, 64]), tf.zeros([128], tf.int32))
    source = tf.data.Dataset.from_tensors(element).repeat()

    def slice_both(x, y):  # the size of `_unpad`: two slices
        rows = tf.shape(y, out_type=tf.int64)[0] - 1
        return x[:rows], y[:rows]

    # The split's own options: no autotuning, no parallel rewrite of
    # sequential maps, no injected prefetch.
    source = source.with_options(pipeline_options())
    runs = {
        "no map": lambda: source,
        "Dataset.map (thread pool)": lambda: source.map(slice_both),
        "_compat.inline_map": lambda: _compat.inline_map(source, slice_both),
    }
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(rounds):
        for name, make in runs.items():
            dataset = make().take(calls)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            dataset.reduce(np.int64(0), lambda count, *_: count + 1)
            wall[name].append((time.perf_counter() - start_wall) / calls)
            cpu[name].append((time.process_time() - start_cpu) / calls)
    return [
        f"| {name} | {1e6 * np.median(wall[name]):.1f} | "
        f"{1e6 * np.median(cpu[name]):.1f} |"
        for name in runs
    ]


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--batches", type=int, default=300, help="global batches per run"
    )
    parser.add_argument(
        "--map-calls",
        type=int,
        default=2000,
        help="elements per run of the map function table",
    )
    args = parse_args(parser, rounds=1, batches=10, map_calls=100)
    devices = kh.testing.logical_cpus(args.replicas)
    strategy = kh.testing.mirrored(devices)
    print(
        header(
            "split pipeline benchmark",
            f"MirroredStrategy on {args.replicas} logical CPUs, global batch "
            f"{equal_split_batch(args.replicas)}, {args.rounds} alternating "
            f"rounds of {args.batches} global batches",
        )
    )
    print()
    print(
        "| input | wall per global batch (ms) | wall ratio to stock | "
        "CPU per global batch (ms) | CPU ratio to stock |"
    )
    print("|---|---:|---:|---:|---:|")
    print("\n".join(measure(strategy, args.rounds, args.batches)))
    print()
    print("One small map function per element (two slices), one thread:")
    print()
    print("| map | wall per element (us) | CPU per element (us) |")
    print("|---|---:|---:|")
    print("\n".join(map_call_cost(args.rounds, args.map_calls)))
    print()
    print(load_at_end())


if __name__ == "__main__":
    main()
