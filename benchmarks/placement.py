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

Sleeps are in the forward pass only; the backward pass is the Dense layers'
real (small) work. Each blocked sleep holds a TensorFlow inter-op thread
(a real accelerator would not hold a host thread), so the pool is enlarged.

Run: `python benchmarks/placement.py` (about 3 minutes on 2 cores).
"""

import argparse
import datetime
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

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


def step_seconds(model, steps):
    x = np.random.default_rng(0).normal(size=(BATCH * steps, FEATURES))
    x = x.astype("float32")
    timer = kh.testing.StepTimer()
    model.fit(x, x, batch_size=BATCH, epochs=1, verbose=0, callbacks=[timer])
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


def bench_plan_time():
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
    for _ in range(3):
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
        "plan time (median of 3) |"
    )
    print("|---|---:|---:|---|---:|")
    print(
        f"| exact DP | 200 | 8 | yes | {np.median(times):.3f} s "
        f"(bottleneck stage {plan.bottleneck}) |"
    )


def bench_pipeline(steps, stage_time):
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
    for stages in (2, 3, 4):
        devices = DEVICES[:stages]
        for microbatches in (1, 2, 4, 8):
            model = stage_model([stage_time] * stages, devices, microbatches)
            seconds = step_seconds(model, steps)
            fraction = stage_time / seconds
            bound = microbatches / (microbatches + stages - 1)
            print(
                f"| {stages} | {microbatches} | {seconds * 1e3:.1f} ms | "
                f"{fraction:.3f} | {bound:.3f} | {fraction / bound:.3f} |"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage-ms", type=float, default=100.0)
    args = parser.parse_args()
    print(
        f"# placement benchmark, {datetime.date.today()}, Keras "
        f"{keras.__version__}, TF {tf.__version__} (SIMULATED speeds)"
    )
    bench_splits(args.steps)
    bench_plan_time()
    bench_pipeline(args.steps, args.stage_ms / 1e3)


if __name__ == "__main__":
    main()
