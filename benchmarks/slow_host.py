"""A slow host against a slow accelerator: where a throttled worker's lost
time goes, and what gives it back (issue 44 item 4).

REAL unequal devices, no simulation: two MultiWorkerMirroredStrategy worker
processes on 127.0.0.1, each pinned to its own core
(`kh.testing.run_workers(cores="auto")`), worker 1 capped at `--cap` of its
core by a Linux cgroup CPU quota, either

- `compute`: only TensorFlow's kernel threads (`kh.testing.ThrottleCompute`;
  a slow accelerator on a normal host: its gRPC and collective threads run
  at full speed), or
- `process`: the whole worker (a slow host: it also answers the
  collectives within its quota's time slices, and the ring waits).

Both run the same rows with `ShardRebalancer(every_n_steps=5, window=5)`
unless the row says "equal shares". Per row, worker 0's steady-state step
(the median of the last `--tail` of `--steps` steps, the epoch boundary
excluded) and what `model.step_stats` says of it: each replica's compute
milliseconds per step (step start to gradients ready; medians) and the time
outside compute (the step less the slowest replica's compute: collectives,
waiting for a late peer, Keras' loop). "ideal" is the sum of each worker's rate
alone (its cap and core, one process, the whole global batch, the same
throttle). The `process - compute` difference at equal settings is the slow
host's communication: what moving rows cannot give back.

Rows beyond the plain rebalanced run try what may help a slow host:
`gradient_compression="bf16"` (half the bytes to send through the slow
host's quota), `bucket_bytes` where the installed keras-hetero has it (the
all-reduce in buckets, last layers first), and `kh.LowCommunication(
sync_every=4)` (one collective per 4 steps: fewer rounds for the slow host
to answer; a different algorithm, DiLoCo's, docs/low-communication.md).
`accumulation_steps` is not a row: it all-reduces every micro-step.

Run as root: `python benchmarks/slow_host.py` (Keras 3), then with
`TF_USE_LEGACY_KERAS=1`; `--models resnet`, `--cap 0.4`, `--steps 60`;
`--smoke` runs one tiny case in seconds.
"""

import inspect
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import GLOBAL_BATCH  # noqa: E402
from _harness import build_model  # noqa: E402
from _harness import compile_model  # noqa: E402
from _harness import examples  # noqa: E402
from _harness import header  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import markdown_table  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

DISTINCT_BATCHES = 8  # the input repeats this many distinct global batches
BUCKET_BYTES = 256 * 1024
# name -> (rebalanced, HeteroModel keyword arguments); made in the worker
# (a LowCommunication's outer optimizer would start TensorFlow's context
# before the strategy could configure its collectives).
VARIANTS = {
    "equal shares": (False, dict),
    "rebalanced": (True, dict),
    "rebalanced (A/A)": (True, dict),
    "rebalanced, bf16 gradients": (
        True,
        lambda: {"gradient_compression": "bf16"},
    ),
    "rebalanced, 256 KiB buckets": (
        True,
        lambda: {"bucket_bytes": BUCKET_BYTES},
    ),
    "rebalanced, LowCommunication(sync_every=4)": (
        True,
        lambda: {"low_communication": kh.LowCommunication(sync_every=4)},
    ),
}


def _has_buckets():
    return (
        "bucket_bytes" in inspect.signature(kh.HeteroModel.__init__).parameters
    )


class _Stats(kh.keras.callbacks.Callback):
    """Each step's per-replica compute seconds (worker 0's view)."""

    def on_train_begin(self, logs=None):
        self.compute = []

    def on_train_batch_end(self, batch, logs=None):
        stats = self.model.step_stats
        if stats is None or not stats.measured_steps:
            return
        self.compute.append(
            (np.asarray(stats.compute_seconds) / stats.measured_steps).tolist()
        )


def _worker(model_kind, variant, steps, throttle):
    import tensorflow as tf

    rebalanced, options = VARIANTS[variant]
    global_batch = GLOBAL_BATCH[model_kind]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    options = options()
    x, y = examples(model_kind, global_batch * DISTINCT_BATCHES)
    repeats = -(-steps // DISTINCT_BATCHES)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat(repeats)

    def model_class(inputs, outputs):
        return kh.HeteroModel(inputs, outputs, **options)

    with strategy.scope():
        model = compile_model(build_model(model_kind, model_class))
    timer, stats = kh.testing.StepTimer(), _Stats()
    callbacks = [timer, stats]
    if throttle == "compute":
        callbacks.append(kh.testing.ThrottleCompute())
    data = kh.data.shard(dataset, global_batch, strategy=strategy)
    if rebalanced:
        callbacks.append(
            kh.callbacks.ShardRebalancer(data, every_n_steps=5, window=5)
        )
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=steps,
        verbose=0,
        callbacks=callbacks,
    )
    return {
        "seconds": timer.seconds,
        "compute": stats.compute,
        "shares": np.asarray(data.shares).tolist(),
    }


def _alone(model_kind, steps, throttle):
    """Samples/s of one worker training the whole global batch."""
    import tensorflow as tf

    global_batch = GLOBAL_BATCH[model_kind]
    x, y = examples(model_kind, global_batch * DISTINCT_BATCHES)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat(
        -(-steps // DISTINCT_BATCHES)
    )
    model = compile_model(build_model(model_kind, kh.HeteroModel))
    timer = kh.testing.StepTimer()
    callbacks = [timer]
    if throttle == "compute":
        callbacks.append(kh.testing.ThrottleCompute())
    model.fit(
        dataset.batch(global_batch, drop_remainder=True),
        epochs=1,
        steps_per_epoch=steps,
        verbose=0,
        callbacks=callbacks,
    )
    return {"seconds": timer.seconds}


def _row(model_kind, throttle, variant, result, ideal, tail):
    global_batch = GLOBAL_BATCH[model_kind]
    seconds = float(np.median(result["seconds"][-tail:]))
    rate = global_batch / seconds
    compute = np.asarray(result["compute"][-tail:], dtype=float)
    compute_ms = np.median(compute, axis=0) * 1e3
    # The step's wall time less the slowest replica's compute: collectives,
    # waiting for a late peer, and Keras' loop.
    outside = seconds * 1e3 - compute_ms.max()
    return [
        model_kind,
        throttle,
        variant,
        f"{ideal:.0f}",
        f"{rate:.0f}",
        f"{rate / ideal:.0%}",
        f"{seconds * 1e3:.1f}",
        " / ".join(f"{c:.1f}" for c in compute_ms),
        f"{outside:.1f}",
        " ".join(f"{s:.3f}" for s in result["shares"]),
    ]


def table(models, cap, throttles, variants, steps, tail, timeout):
    columns = [
        "model",
        "throttle",
        "run",
        "ideal samples/s",
        "samples/s",
        "of ideal",
        "step ms",
        "compute ms (worker 0 / 1)",
        "outside compute ms",
        "final shares",
    ]
    rows = []
    for model_kind in models:
        global_batch = GLOBAL_BATCH[model_kind]
        for throttle in throttles:
            ideal = 0.0
            for quota, core in ((None, 0), (cap, 1 % os.cpu_count())):
                alone = kh.testing.run_workers(
                    _alone,
                    1,
                    timeout=timeout,
                    args=(model_kind, steps, throttle),
                    cpu_quotas=[quota],
                    cores=[core],
                    throttle=throttle,
                )[0].value
                ideal += global_batch / float(
                    np.median(alone["seconds"][-tail:])
                )
            for variant in variants:
                result = kh.testing.run_workers(
                    _worker,
                    2,
                    timeout=timeout,
                    args=(model_kind, variant, steps, throttle),
                    cpu_quotas=[None, cap],
                    cores="auto",
                    throttle=throttle,
                )[0].value
                rows.append(
                    _row(model_kind, throttle, variant, result, ideal, tail)
                )
                print(markdown_table(columns, rows[-1:]).splitlines()[-1])
                sys.stdout.flush()
    return markdown_table(columns, rows)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["resnet", "mlp"])
    parser.add_argument("--cap", type=float, default=0.4)
    parser.add_argument(
        "--throttles", nargs="+", default=["compute", "process"]
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tail", type=int, default=30)
    parser.add_argument("--timeout", type=int, default=900)
    args = parse_args(
        parser,
        models=["mlp"],
        throttles=["process"],
        variants=["rebalanced", "rebalanced, bf16 gradients"],
        steps=8,
        tail=4,
    )
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        print(f"slow_host.py needs CPU quotas: {reason}")
        return 0 if args.smoke else 1
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(
            f"unknown --variants {unknown}; expected some of {list(VARIANTS)}"
        )
    variants = [
        v for v in args.variants if _has_buckets() or "buckets" not in v
    ]
    print(
        header(
            "a slow host against a slow accelerator (CPU quotas)",
            f"2 MultiWorkerMirroredStrategy workers on 127.0.0.1 pinned to "
            f"cores, worker 1 capped at {args.cap} of its core",
        )
    )
    print(
        f"\nSteady state: medians of the last {args.tail} of {args.steps} "
        "steps; global batch "
        + ", ".join(f"{m} {GLOBAL_BATCH[m]}" for m in args.models)
        + "\n"
    )
    print(
        "\n"
        + table(
            args.models,
            args.cap,
            args.throttles,
            variants,
            args.steps,
            args.tail,
            args.timeout,
        )
    )
    print(load_at_end())
    return 0


if __name__ == "__main__":
    sys.exit(main())
