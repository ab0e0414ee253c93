"""HeteroModel vs stock keras.Model step time, equal shares.

The same model and data under MirroredStrategy on `--replicas` logical CPUs
of this process, or under MultiWorkerMirroredStrategy with `--workers`
worker processes (one logical CPU each, TF_CONFIG on 127.0.0.1). The models
run alternately in one process (several rounds) and we report the median
step time of each and their ratio. An A/A row (a second stock model against
the first) shows the noise. Target: ratio <= 1.03 (W=256), <= 1.05 (W=64).

`--profile` adds HeteroModel variants with one piece of its step switched
off (benchmark-only patches applied while the step is traced), side by side
in the same run: what each piece costs per step. Step times are medians
over all rounds; the ratio is the median of the rounds' ratios (each round's
runs are close in time, so a change of load moves both).

Each row also has the process's CPU time per step (`StepTimer.cpu_seconds`:
every thread of the process, so the input pipeline's work too; mean per
fit, median over rounds) and its ratio to stock's, median of the rounds.
It is a second view of where the work goes, not a steadier measure: TF's
thread pools spin while they wait and that counts as CPU, so its A/A rows
moved as much as the wall time's on a shared machine (docs/benchmarks.md,
2026-12-03). Under `--workers` both are worker 0's.

Run: `python benchmarks/overhead.py` (Mirrored, 2 replicas),
`--replicas 4`, `--workers 2`, `--spe 1 8`, `--profile`, `--profile
before replayed` (only the variants whose names contain those words).
"""

import argparse
import contextlib
import datetime
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402

GLOBAL_BATCH = 256  # less 256 % replicas: stock Keras 3 needs equal splits
STEPS = 40  # per fit; --steps


def build(model_class, strategy, width, steps_per_execution):
    from keras_hetero import keras

    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = model_class(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
    return model


# --- profile variants: one piece of HeteroModel's step switched off -------


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _no_clocks():
    import tensorflow as tf

    from keras_hetero.training import telemetry

    return _patched(
        telemetry,
        "clock",
        lambda dependency, enabled=True: tf.constant(np.nan, tf.float64),
    )


def _control_edge_clock():
    # The clock as it was before it waited for the device: the reading
    # ordered after its dependencies by control edges only, on the
    # replica's device (on a GPU: the time to queue the work).
    from keras_hetero import _compat
    from keras_hetero.training import telemetry

    def clock(dependencies, enabled=True):
        import tensorflow as tf

        if not enabled:
            return tf.constant(np.nan, tf.float64)
        first, *rest = telemetry._tensors(dependencies)
        with tf.control_dependencies(rest):
            return _compat.unordered_timestamp(first)

    return _patched(telemetry, "clock", clock)


def _no_record():
    from keras_hetero.training import telemetry

    return _patched(telemetry.Telemetry, "record", lambda self, stats: None)


@contextlib.contextmanager
def _local_logs():
    with (
        _patched(
            kh.HeteroModel,
            "_global_logs",
            lambda self: self.get_metrics_result(),
        ),
        _patched(kh.HeteroModel, "_packs_metrics", lambda self: False),
    ):
        yield


def _no_divide():
    # Timing only: the gradients are then wrong by the factor of the rows.
    from keras_hetero.training import aggregation

    aggregate = aggregation.aggregate

    def undivided(*args, divisor=None, **kwargs):
        return aggregate(*args, **kwargs)

    return _patched(aggregation, "aggregate", undivided)


def _python_bounds():
    # The split's bounds from a Python callback per global batch, as before
    # the in-graph copy of the schedule (data/bounds.py): `numpy_function`
    # over the schedule's own rule, at the benchmark's equal shares.
    import tensorflow as tf

    from keras_hetero.data import bounds as bounds_lib
    from keras_hetero.data import shares as shares_lib

    def bounds(self, index, total_rows):
        schedule = shares_lib.ShareSchedule(
            np.full(self.num_replicas, 1.0 / self.num_replicas)
        )
        result = tf.numpy_function(
            schedule.next_bounds, [index, total_rows], tf.int64
        )
        result.set_shape([self.num_replicas + 1])
        return result

    return _patched(bounds_lib.PipelineSplit, "bounds", bounds)


def _pipeline_then(transform):
    # kh.data.shard's pipeline with `transform` applied to what it returns.
    from keras_hetero.data.shard import HeteroDataset

    pipeline = HeteroDataset._pipeline

    def patched(self, *args, **kwargs):
        return transform(pipeline(self, *args, **kwargs))

    return _patched(HeteroDataset, "_pipeline", patched)


def _autotuning_on():
    # kh.data.shard's pipeline as before 2026-12-03: tf.data's autotuning
    # thread on (docs/benchmarks.md, "Input iterator teardown").
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = True
    return _pipeline_then(lambda dataset: dataset.with_options(options))


def _pooled_maps():
    # The split's own map functions run on TF's inter-op thread pool, as
    # before 2026-12-03 (`Dataset.map`; now `_compat.inline_map`).
    from keras_hetero import _compat

    return _patched(
        _compat, "inline_map", lambda dataset, function: dataset.map(function)
    )


def _per_tensor_collective():
    # The gradient path before 2026-12-03: the collective packs each tensor
    # and each gradient is divided on its own (`aggregation.aggregate`).
    # Since then also the path of models above `aggregation.PACK_LIMIT`
    # gradient elements (W=256 here), where this row equals HeteroModel's.
    from keras_hetero.training import aggregation

    return _patched(aggregation, "_packs_in_one", lambda *args: False)


def _every_replica():
    # Every replica adds the gathered telemetry to its own copy and orders
    # the update after its own global rows, as before 2026-12-04 (now the
    # first local replica only: `_distribute.is_first_local_replica`).
    from keras_hetero import _distribute

    return _patched(_distribute, "is_first_local_replica", lambda: True)


def _replayed():
    # The split's output kept in memory after its first pass (warm-up) and
    # replayed: what is left is the step's own cost, without the input
    # pipeline's CPU time (which logical CPU devices share with the step).
    return _pipeline_then(lambda dataset: dataset.cache())


@contextlib.contextmanager
def _all_off():
    with _no_clocks(), _no_record(), _local_logs():
        yield


# name -> (patch made while tracing, input: "shared" (the HeteroModel
# run's kh.data.shard dataset), "own" (a kh.data.shard dataset of its own,
# built under the patch) or "keras" (Keras' own input split))
PROFILE = {
    "no clocks": (_no_clocks, "shared"),
    "clock by control edges (before)": (_control_edge_clock, "shared"),
    "no telemetry record": (_no_record, "shared"),
    "local metrics read": (_local_logs, "shared"),
    "Keras' input split": (contextlib.nullcontext, "keras"),
    "no gradient divide (wrong values)": (_no_divide, "shared"),
    "split bounds by a Python callback (before)": (_python_bounds, "own"),
    "tf.data autotuning on (before)": (_autotuning_on, "own"),
    "split maps on the thread pool (before)": (_pooled_maps, "own"),
    "collective and division per tensor (before)": (
        _per_tensor_collective,
        "shared",
    ),
    "telemetry and update order on every replica (before)": (
        _every_replica,
        "shared",
    ),
    "input replayed from memory": (_replayed, "own"),
    "all four off": (_all_off, "keras"),
}


def global_batch(replicas):
    """256, or the multiple of `replicas` below it (equal shares)."""
    return GLOBAL_BATCH - GLOBAL_BATCH % replicas


def stock_runs(strategy, steps_per_execution):
    """Whether stock `keras.Model.fit` works here (docs/strategies.md).

    Stock Keras 3 cannot fit under MultiWorkerMirroredStrategy, nor with
    `steps_per_execution > 1` under any strategy with several replicas.
    """
    import tensorflow as tf

    return kh.FLAVOUR == "tf-keras" or not (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        or steps_per_execution > 1
    )


def measure(strategy, width, rounds, steps_per_execution, profile):
    """Median seconds per step of each run, alternating fits."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    batch = global_batch(strategy.num_replicas_in_sync)
    x = rng.normal(size=(batch * STEPS, 64)).astype("float32")
    y = rng.integers(0, 10, size=(batch * STEPS,)).astype("int32")
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    batched = examples.batch(batch)
    sharded = kh.data.shard(examples, batch, strategy=strategy)
    k = steps_per_execution
    stock_class, bare = kh.keras.Model, None
    if not stock_runs(strategy, k):
        # The baseline is HeteroModel's bare step instead.
        stock_class, bare = kh.HeteroModel, _all_off
    runs = {
        "stock": (build(stock_class, strategy, width, k), batched, bare),
        "stock (A/A)": (
            build(stock_class, strategy, width, k),
            batched,
            bare,
        ),
        "HeteroModel": (
            build(kh.HeteroModel, strategy, width, k),
            sharded,
            None,
        ),
    }
    if profile is not None:
        for name, (patch, source) in PROFILE.items():
            if profile and not any(part in name for part in profile):
                continue
            data = {
                "shared": sharded,
                "own": kh.data.shard(examples, batch, strategy=strategy),
                "keras": batched,
            }[source]
            runs[f"HeteroModel, {name}"] = (
                build(kh.HeteroModel, strategy, width, k),
                data,
                patch,
            )
    if "HeteroModel, input replayed from memory" in runs:
        # Its baseline: stock with its batches replayed from memory too.
        runs["stock, input replayed from memory"] = (
            build(stock_class, strategy, width, k),
            batched.cache(),
            bare,
        )
    for model, data, patch in runs.values():  # warm-up: tracing
        with patch() if patch else contextlib.nullcontext():
            model.fit(data, epochs=1, verbose=0, shuffle=False)
    seconds = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    ratios = {name: [] for name in runs}
    cpu_ratios = {name: [] for name in runs}
    for number in range(rounds):
        medians, means = {}, {}
        order = list(runs) if number % 2 == 0 else list(runs)[::-1]
        for name in order:  # every other round reversed: no position bias
            model, data, _ = runs[name]
            timer = kh.testing.StepTimer()
            model.fit(
                data, epochs=1, verbose=0, shuffle=False, callbacks=[timer]
            )
            # One batch-end callback per execution of k steps.
            steps = np.asarray(timer.seconds) / k
            seconds[name].extend(steps)
            medians[name] = np.median(steps)
            # CPU: the mean, all the work (the input pipeline's comes in
            # bursts that a median would leave out).
            means[name] = np.sum(timer.cpu_seconds) / (k * len(steps))
            cpu[name].append(means[name])
        for name in runs:
            ratios[name].append(medians[name] / medians["stock"])
            cpu_ratios[name].append(means[name] / means["stock"])
    # The ratio is the median over rounds of each round's ratio: the runs of
    # one round are close in time, so a change of the machine's load (other
    # jobs) moves both.
    return {
        name: (
            float(np.median(seconds[name])),
            float(np.median(ratios[name])),
            float(np.median(cpu[name])),
            float(np.median(cpu_ratios[name])),
            # The spread of the rounds' ratios: a difference between two
            # rows smaller than this is not resolved by the run.
            tuple(float(q) for q in np.percentile(ratios[name], [25, 75])),
        )
        for name in runs
    }


def table(strategy, widths, rounds, spes, profile):
    """Markdown rows: one per (W, k, run), ratio to the stock run."""
    lines = [
        "| W | k | run | step (ms) | extra (ms) | "
        "ratio to stock (median of rounds) | rounds' ratios, quartiles | "
        "CPU per step (ms) | CPU ratio to stock |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for width in widths:
        for k in spes:
            medians = measure(strategy, width, rounds, k, profile)
            stock = medians["stock"][0]
            for name, (value, ratio, cpu, cpu_ratio, spread) in medians.items():
                if name == "stock":
                    continue
                lines.append(
                    f"| {width} | {k} | {name} | {1000 * value:.2f} | "
                    f"{1000 * (value - stock):.2f} | {ratio:.3f} | "
                    f"{spread[0]:.3f}-{spread[1]:.3f} | "
                    f"{1000 * cpu:.2f} | {cpu_ratio:.3f} |"
                )
    return lines


def where(workers, replicas):
    """The strategy, as the tables' titles name it."""
    if workers:
        return (
            f"MultiWorkerMirroredStrategy, {workers} worker processes "
            "(1 logical CPU each, 127.0.0.1)"
        )
    return f"MirroredStrategy on {replicas} logical CPUs"


def mwms_strategy():
    """In a worker process: one logical CPU, MultiWorkerMirroredStrategy."""
    kh.testing.logical_cpus(1)
    import tensorflow as tf

    return tf.distribute.MultiWorkerMirroredStrategy()


def lines_on(
    workers, replicas, table, args, worker, worker_args=None, timeout=590
):
    """`table(strategy, *args)`'s lines: with `workers`, worker 0's
    `worker(*worker_args)` (default `args`) in that many worker processes
    (which build their strategy with `mwms_strategy`, and are stopped after
    `timeout` seconds); else under MirroredStrategy on `replicas` logical
    CPUs of this process."""
    if workers:
        results = kh.testing.run_workers(
            worker,
            workers,
            timeout=timeout,
            args=args if worker_args is None else worker_args,
        )
        return results[0].value
    devices = kh.testing.logical_cpus(replicas)
    return table(kh.testing.mirrored(devices), *args)


def _mwms_worker(widths, rounds, spes, profile, steps):
    global STEPS
    STEPS = steps
    return table(mwms_strategy(), widths, rounds, spes, profile)


def main():
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="hidden widths W of the MLP to measure",
    )
    parser.add_argument(
        "--spe",
        type=int,
        nargs="+",
        default=[1],
        help="steps_per_execution values k to measure",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--replicas", type=int, default=2)
    group.add_argument("--workers", type=int, default=0)
    parser.add_argument(
        "--profile",
        nargs="*",
        metavar="PART",
        help="add the profile variants (those whose name contains a PART, "
        "if any are given)",
    )
    parser.add_argument(
        "--steps", type=int, default=STEPS, help="steps per fit"
    )
    args = parser.parse_args()
    STEPS = args.steps
    load = os.getloadavg()[0]
    print(
        f"overhead benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, {where(args.workers, args.replicas)}, equal shares, "
        "global batch "
        f"{global_batch(args.workers or args.replicas)}, "
        f"{args.rounds} alternating rounds of {STEPS} steps, MLP 64-W-W-10, "
        f"load average at start {load:.1f} on {os.cpu_count()} cores"
    )
    print()
    table_args = (args.widths, args.rounds, args.spe, args.profile)
    lines = lines_on(
        args.workers,
        args.replicas,
        table,
        table_args,
        _mwms_worker,
        worker_args=(*table_args, STEPS),
    )
    if kh.FLAVOUR != "tf-keras" and (args.workers or max(args.spe) > 1):
        print(
            "stock Keras 3 cannot fit under MultiWorkerMirroredStrategy, nor "
            "with steps_per_execution > 1 under MirroredStrategy: in those "
            'rows "stock" is HeteroModel with the four pieces of --profile '
            "switched off (no clocks, no telemetry record, local metrics "
            "read, Keras' input split)"
        )
        print()
    print("\n".join(lines))
    print()
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
