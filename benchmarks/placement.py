"""Model parallelism on unequal devices: the planner and the pipeline
(SIMULATED device speeds).

Devices are logical CPUs; each stage's work is a `kh.testing.SimulatedSpeed`
sleep (forward pass) of its layers' cost divided by its device's simulated
speed, and a device does one thing at a time. Real compute (small Dense
layers) is negligible next to the sleeps. All step times are simulated.

(a) Splits of a 24-layer chain over 4 devices of simulated speeds 1, 1, 2, 4:
    the planner (`kh.placement.plan` with the layers' costs), "uniform by
    layer count" and "by parameter count" (DeepSpeed's two methods). For
    each: the slowest stage's time from the cost model, and the measured
    step time with `pipeline_microbatches` 1 and 8. Then the planner's own
    time for 200 layers x 8 devices (target < 1 s).
(b) The pipeline: K = 2, 3, 4 stages of equal simulated time T per batch
    (stage work proportional to its device's speed, as the planner splits),
    M = 1, 2, 4, 8 micro-batches. Ideal throughput is all K devices busy
    (step time T); GPipe's bound is M / (M + K - 1) of that. We print the
    measured fraction of ideal and its ratio to the bound (target >= 0.9).

(c) Choosing a layout (`kh.placement.plan_layout`) on 3 simulated clusters,
    one where each of data parallel, one pipeline and replicated pipelines
    should win: the predicted step time of every layout against the measured
    one, and whether the chooser picked the measured best. Each layout runs
    in this process on logical CPUs standing in for the clusters' devices
    (a worker = a group of them): the replicas as parallel branches of one
    model, each taking its share of the batch's rows, each stage a sleep of
    its predicted seconds (compute / speed + receiving its input) on its
    device. The gradient all-reduce is not run: its predicted seconds
    (simulated network) are added to the measured step. A pipeline across
    workers is predicted but not run (TensorFlow cannot run one replica
    across workers under tf.distribute).
(d) The planner's local search (used beyond 4096 device states) against
    the exact search: the bottleneck's gap on random profiles.

Sleeps are in the forward pass only; the backward pass is the Dense layers'
real (small) work. Each blocked sleep holds a TensorFlow inter-op thread
(a real accelerator would not hold a host thread), so the pool is enlarged.

Run: `python benchmarks/placement.py` (about 4 minutes on 2 cores;
`--only layouts` for (c) and (d)).
"""

import datetime
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

DEVICES = kh.testing.logical_cpus(8)

import tensorflow as tf  # noqa: E402

from keras_hetero import keras  # noqa: E402
from keras_hetero import placement  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(64)

BATCH = 64
FEATURES = 8


def chain_profile(layers=24, seed=0):
    """Per-layer (cost in seconds per batch on a speed-1 device, params).

    Costs and parameter counts are only loosely related, as in real
    models: convolution-like layers cost much and hold few weights,
    embedding/dense-like layers the reverse.
    """
    rng = np.random.default_rng(seed)
    costs, params = [], []
    for index in range(layers):
        if index % 3 == 0:  # convolution-like
            costs.append(rng.uniform(8e-3, 14e-3))
            params.append(int(rng.uniform(2e4, 6e4)))
        else:  # dense-like
            costs.append(rng.uniform(1e-3, 4e-3))
            params.append(int(rng.uniform(2e5, 8e5)))
    return costs, params


def split_evenly(weights, parts):
    """Contiguous split into `parts` with about equal sums of `weights`."""
    total, bounds, start, acc = sum(weights), [], 0, 0.0
    for index, weight in enumerate(weights):
        acc += weight
        left = parts - len(bounds) - 1
        remaining = len(weights) - index - 1
        if (
            left
            and (acc >= total * (len(bounds) + 1) / parts)
            and (remaining >= left)
        ):
            bounds.append((start, index + 1))
            start = index + 1
        elif remaining == left and left:
            bounds.append((start, index + 1))
            start = index + 1
    bounds.append((start, len(weights)))
    return bounds


def stage_model(stage_seconds, devices, microbatches):
    """One stage per device: a simulated sleep of `stage_seconds[k]` per
    batch of BATCH rows, then a small Dense layer, both placed there."""
    inputs = keras.Input((FEATURES,))
    hidden = inputs
    for seconds, device in zip(stage_seconds, devices):
        slow = kh.testing.SimulatedSpeed({device: seconds / BATCH})
        hidden = kh.layers.Placed(slow, device=device)(hidden)
        hidden = kh.layers.Placed(
            keras.layers.Dense(FEATURES, activation="tanh"), device=device
        )(hidden)
    model = kh.HeteroModel(inputs, hidden, pipeline_microbatches=microbatches)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def step_seconds(model, steps, batch=BATCH):
    x = np.random.default_rng(0).normal(size=(batch * steps, FEATURES))
    x = x.astype("float32")
    timer = kh.testing.StepTimer()
    model.fit(x, x, batch_size=batch, epochs=1, verbose=0, callbacks=[timer])
    return timer.median()


def splits(costs, params, speeds, devices):
    names = [f"layer_{i}" for i in range(len(costs))]
    model = keras.Sequential(
        [keras.Input((FEATURES,))]
        + [keras.layers.Dense(FEATURES, name=name) for name in names]
    )
    plan = placement.plan(
        model,
        devices,
        device_speeds=speeds,
        layer_costs=dict(zip(names, costs)),
        batch_size=BATCH,
    )
    planned, start = [], 0
    for stage in plan.stages:
        planned.append((start, start + len(stage.layers)))
        start += len(stage.layers)
    return {
        "planner (kh.placement.plan)": planned,
        "uniform by layer count": split_evenly([1] * len(costs), len(speeds)),
        "by parameter count": split_evenly(params, len(speeds)),
    }


def bench_splits(steps):
    costs, params = chain_profile()
    speeds = [1.0, 1.0, 2.0, 4.0]
    devices = DEVICES[: len(speeds)]
    rows = []
    for name, bounds in splits(costs, params, speeds, devices).items():
        stage_seconds = [
            sum(costs[s:e]) / speeds[d] for d, (s, e) in enumerate(bounds)
        ]
        measured = {
            m: step_seconds(stage_model(stage_seconds, devices, m), steps)
            for m in (1, 8)
        }
        rows.append(
            (
                name,
                [e - s for s, e in bounds],
                max(stage_seconds),
                sum(stage_seconds),
                measured[1],
                measured[8],
            )
        )
    best = rows[0][5]
    print(
        "\n(a) 24 layers on 4 devices, simulated speeds 1 : 1 : 2 : 4, "
        f"batch {BATCH}\n"
    )
    print(
        "| split | layers per stage | slowest stage (model) | sum of stages "
        "(model) | step, M=1 (simulated) | step, M=8 (simulated) | "
        "M=8 vs planner |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, sizes, worst, total, one, eight in rows:
        print(
            f"| {name} | {sizes} | {worst * 1e3:.1f} ms | "
            f"{total * 1e3:.1f} ms | {one * 1e3:.1f} ms | "
            f"{eight * 1e3:.1f} ms | {eight / best:.2f}x |"
        )


def bench_plan_time(repeats=3):
    rng = np.random.default_rng(1)
    names = [f"layer_{i}" for i in range(200)]
    model = keras.Sequential(
        [keras.Input((4,))]
        + [keras.layers.Dense(4, name=name) for name in names]
    )
    costs = dict(zip(names, rng.uniform(1e-4, 1e-2, size=200).tolist()))
    speeds = rng.choice([1.0, 1.5, 2.0, 4.0], size=8).tolist()
    memory = [int(m) for m in rng.uniform(2e4, 6e4, size=8)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = placement.plan(
            model,
            DEVICES[:8],
            device_speeds=speeds,
            device_memory=memory,
            layer_costs=costs,
        )
        times.append(time.perf_counter() - start)
    print(
        "\n| plan | layers | devices | memory limits | "
        f"plan time (median of {repeats}) |"
    )
    print("|---|---:|---:|---|---:|")
    print(
        f"| exact DP | 200 | 8 | yes | {np.median(times):.3f} s "
        f"(bottleneck stage {plan.bottleneck}) |"
    )


def bench_pipeline(
    steps, stage_time, stage_counts=(2, 3, 4), microbatch_counts=(1, 2, 4, 8)
):
    speeds = [1.0, 2.0, 4.0, 2.0]
    print(
        f"\n(b) pipeline: K stages of {stage_time * 1e3:.0f} ms each per "
        f"batch of {BATCH} rows (simulated; devices of speeds "
        f"{speeds[:4]}, work proportional to speed)\n"
    )
    print(
        "| K | M | step (simulated) | fraction of ideal | GPipe bound "
        "M/(M+K-1) | vs bound |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for stages in stage_counts:
        devices = DEVICES[:stages]
        for microbatches in microbatch_counts:
            model = stage_model([stage_time] * stages, devices, microbatches)
            seconds = step_seconds(model, steps)
            fraction = stage_time / seconds
            bound = microbatches / (microbatches + stages - 1)
            print(
                f"| {stages} | {microbatches} | {seconds * 1e3:.1f} ms | "
                f"{fraction:.3f} | {bound:.3f} | {fraction / bound:.3f} |"
            )


class RowSlice(keras.layers.Layer):
    """The rows `[lo * rows, hi * rows)` of the batch (one replica's share)."""

    def __init__(self, lo, hi, **kwargs):
        super().__init__(**kwargs)
        self.lo, self.hi = lo, hi

    def call(self, inputs):
        rows = tf.cast(tf.shape(inputs)[0], tf.float32)
        start = tf.cast(tf.round(self.lo * rows), tf.int32)
        end = tf.cast(tf.round(self.hi * rows), tf.int32)
        return inputs[start:end]


class Rows(keras.layers.Layer):
    """Concatenates the replicas' rows back into the batch."""

    def call(self, inputs):
        return tf.concat(inputs, axis=0)


# Rows per global batch in (c): micro-batches of 64 rows keep the rounding
# of each replica's share of them small.
LAYOUT_BATCH = 512


def replicas_model(replicas, microbatches):
    """`replicas`: `[(share, [(device, seconds per batch), ...])]`, each a
    branch over its share of the rows, its stages in turn."""
    inputs = keras.Input((FEATURES,))
    outputs, lo = [], 0.0
    for share, stages in replicas:
        hidden = RowSlice(lo, lo + share)(inputs)
        lo += share
        for device, seconds in stages:
            slow = kh.testing.SimulatedSpeed({device: seconds / LAYOUT_BATCH})
            hidden = kh.layers.Placed(slow, device=device)(hidden)
            hidden = kh.layers.Placed(
                keras.layers.Dense(FEATURES, activation="tanh"), device=device
            )(hidden)
        outputs.append(hidden)
    model = kh.HeteroModel(
        inputs, Rows()(outputs), pipeline_microbatches=microbatches
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def layout_replicas(layout, choice, costs):
    """The branches that simulate `layout`."""
    if layout.kind == placement.DATA_PARALLEL:
        devices = [d for worker in choice.cluster for d in worker]
        return [
            (share, [(device.name, sum(costs) / device.speed)])
            for share, device in zip(layout.shares, devices)
        ]
    return [
        (share, list(zip([s.device for s in p.stages], p.stage_seconds)))
        for share, p in zip(layout.shares, layout.plans)
    ]


def layout_clusters():
    weights_model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(64, name=f"layer_{i}") for i in range(8)]
    )
    d = DEVICES
    return weights_model, [
        (
            "1 worker, speeds 1/2/1/0.5, 10 GB/s",
            [[(d[0], 1.0), (d[1], 2.0), (d[2], 1.0), (d[3], 0.5)]],
            dict(bandwidth=1e10),
        ),
        (
            "1 worker, speeds 1/2/1, 1 MB/s links",
            [[(d[0], 1.0), (d[1], 2.0), (d[2], 1.0)]],
            dict(bandwidth=1e6),
        ),
        (
            "2 workers (speeds 1/2 and 1/1), 1 MB/s between them",
            [[(d[0], 1.0), (d[1], 2.0)], [(d[2], 1.0), (d[3], 1.0)]],
            dict(network_bandwidth=1e6),
        ),
    ]


def bench_layouts(steps, microbatches=8, cluster_count=None):
    model, clusters = layout_clusters()
    clusters = clusters[:cluster_count]
    names = [layer.name for layer in model.layers]
    costs = np.random.default_rng(4).uniform(0.03, 0.07, size=8).tolist()
    print(
        f"\n(c) layouts of an 8-layer chain (Dense 64, {sum(costs):.3f} s "
        f"per batch of {LAYOUT_BATCH} rows at speed 1), M = {microbatches} "
        "(SIMULATED devices and network)\n"
    )
    print(
        "| cluster | layout | predicted step | measured step (simulated) | "
        "measured / predicted | chosen |"
    )
    print("|---|---|---:|---:|---:|---|")
    for title, cluster, links in clusters:
        choice = placement.plan_layout(
            model,
            cluster,
            batch_size=LAYOUT_BATCH,
            microbatches=microbatches,
            layer_costs=dict(zip(names, costs)),
            **links,
        )

        def measure(layout, choice=choice):
            seconds = step_seconds(
                replicas_model(
                    layout_replicas(layout, choice, costs),
                    layout.microbatches,
                ),
                steps,
                LAYOUT_BATCH,
            )
            return seconds + layout.communication_seconds

        measured = {}
        one_worker = len(choice.cluster) == 1
        for kind, layout in choice.layouts.items():
            if layout.reason is None and not (
                one_worker and kind == placement.REPLICATED_PIPELINES
            ):
                measured[kind] = measure(layout)
        fastest = min(measured, key=measured.get)
        for kind, layout in choice.layouts.items():
            mark = "**chosen**" if layout is choice.best else ""
            if one_worker and kind == placement.REPLICATED_PIPELINES:
                print(
                    f"| {title} | {kind} | {layout.step_seconds * 1e3:.1f} "
                    "ms | = pipeline (one worker) | - | |"
                )
                continue
            if kind not in measured:
                print(
                    f"| {title} | {kind} | "
                    + (
                        f"{layout.step_seconds * 1e3:.1f} ms"
                        if layout.step_seconds < float("inf")
                        else "-"
                    )
                    + f" | not run ({layout.reason}) | - | {mark} |"
                )
                continue
            print(
                f"| {title} | {kind} | {layout.step_seconds * 1e3:.1f} ms | "
                f"{measured[kind] * 1e3:.1f} ms | "
                f"{measured[kind] / layout.step_seconds:.3f} | {mark} |"
            )
        again = measure(choice.best)
        print(
            f"| {title} | A/A: {choice.best.kind} measured again | | "
            f"{again * 1e3:.1f} ms | {again / measured[choice.best.kind]:.3f}"
            " of the first | |"
        )
        print(
            f"| {title} | measured best: {fastest} | | | | picked best: "
            f"{'yes' if choice.best.kind == fastest else 'NO'} |"
        )


def bench_local_search_gap(cases=40):
    from keras_hetero.placement import search as _placement_search

    rng = np.random.default_rng(3)
    gaps, exact_times, local_times = [], [], []
    for _ in range(cases):
        layers = 60
        costs = rng.uniform(1e-3, 1e-2, size=layers).tolist()
        memory = rng.integers(1, 10, size=layers).tolist()
        inputs = [0.0] + rng.uniform(0, 2e-3, size=layers - 1).tolist()
        speeds = rng.choice([0.6, 1.0, 1.5, 2.0, 2.5, 4.0], size=8).tolist()
        capacity = [
            None if rng.random() < 0.5 else int(rng.integers(40, 120))
            for _ in range(8)
        ]
        found = {}
        for method, times in (("exact", exact_times), ("local", local_times)):
            start = time.perf_counter()
            stages, _ = _placement_search.search(
                costs, memory, inputs, speeds, capacity, method=method
            )
            times.append(time.perf_counter() - start)
            found[method] = stages
        if found["exact"] is None or found["local"] is None:
            continue
        exact, _ = _placement_search.bottleneck_and_total(
            found["exact"], costs, inputs, speeds
        )
        local, _ = _placement_search.bottleneck_and_total(
            found["local"], costs, inputs, speeds
        )
        gaps.append(local / exact - 1)
    print(
        f"\n(d) local search vs exact, {len(gaps)} random profiles of 60 "
        "layers on 8 devices (6 speeds, half with memory limits)\n"
    )
    print(
        "| search | median time | bottleneck gap: median | mean | max | "
        "cases exact |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| exact | {np.median(exact_times):.3f} s | 0 | 0 | 0 | - |")
    print(
        f"| local | {np.median(local_times):.3f} s | "
        f"{np.median(gaps):.2%} | {np.mean(gaps):.2%} | {np.max(gaps):.2%} "
        f"| {sum(g <= 1e-9 for g in gaps)}/{len(gaps)} |"
    )


def main():
    parser = smoke_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage-ms", type=float, default=100.0)
    parser.add_argument("--only", choices=["layouts"], default=None)
    args = parse_args(parser, steps=2, stage_ms=5.0)
    print(
        f"# placement benchmark, {datetime.date.today()}, Keras "
        f"{keras.__version__}, TF {tf.__version__} (SIMULATED speeds)"
    )
    # The smoke run: each table with its fewest rows (one pipeline depth,
    # one cluster, a few search cases).
    if args.only != "layouts":
        bench_splits(args.steps)
        bench_plan_time(repeats=1 if args.smoke else 3)
        if args.smoke:
            bench_pipeline(args.steps, args.stage_ms / 1e3, (2,), (1, 4))
        else:
            bench_pipeline(args.steps, args.stage_ms / 1e3)
    bench_layouts(args.steps, cluster_count=1 if args.smoke else None)
    bench_local_search_gap(cases=4 if args.smoke else 40)


if __name__ == "__main__":
    main()
