"""Low-communication training (`kh.LowCommunication`) vs synchronous.

One fixed task with generated data: 10-class classification of 32 features
labelled by a fixed random teacher network; an MLP of 76,810 weights
(32-256-256-10), Adam(1e-3) inside, global batch 64, the same examples in
the same order for every run. Workers are real processes
(MultiWorkerMirroredStrategy under `kh.launcher.launch`).

Tables (all in one run, side by side):

1. Bytes on the wire per trained example (each worker's collective
   payload, from the tensors' sizes; the rows and telemetry vectors
   included), synchronous vs `sync_every` = H.
2. Final loss / accuracy on held-out examples after the same examples,
   synchronous vs H (and the relative difference), 2 and 4 workers.
3. Throughput (examples/s) with worker 1 behind a slowed link: every other
   worker reaches it through `kh.testing.NetworkHosts`' shaping relay
   (`--latency-ms`, `--mbit`, default 20 ms and 50 Mbit/s); needs root and
   network namespaces (skipped otherwise). An A/A row (synchronous twice)
   gives the noise.
4. SIMULATED speeds 1 : 3 (`kh.testing.SimulatedSpeed`): H with equal
   shares vs H with a `ShardRebalancer` (each worker's rows per inner step
   follow its speed), held-out loss at equal wall time.

Run: `python benchmarks/low_communication.py` (about 10 minutes on 2 cores;
`--only loss` for the first two tables). `--worker` is the per-process entry
point.
"""

import datetime
import io
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

FEATURES, CLASSES, HIDDEN = 32, 10, 256
GLOBAL_BATCH = 64


def _data(rows, seed):
    rng = np.random.default_rng(1234)  # the teacher: fixed for every split
    w1 = rng.normal(size=(FEATURES, 64)) / np.sqrt(FEATURES)
    w2 = rng.normal(size=(64, CLASSES)) / 8.0
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES))
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    return x.astype("float32"), y.astype("int64")


def worker(args):
    """One worker of a run; worker 0 writes the results to `args.out`."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    keras.utils.set_random_seed(0)
    mode = None
    if args.sync_every:
        outer = None
        if args.outer:
            rate, momentum = (float(v) for v in args.outer.split(","))
            outer = keras.optimizers.SGD(rate, momentum=momentum, nesterov=True)
        mode = kh.LowCommunication(
            args.sync_every, outer_optimizer=outer, compression=args.compression
        )
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        features = inputs
        if args.speeds:
            speeds = [float(s) for s in args.speeds.split(",")]
            features = kh.testing.SimulatedSpeed(speeds)(inputs)
        hidden = keras.layers.Dense(HIDDEN, activation="relu")(features)
        hidden = keras.layers.Dense(HIDDEN, activation="relu")(hidden)
        outputs = keras.layers.Dense(CLASSES)(hidden)
        model = kh.HeteroModel(inputs, outputs, low_communication=mode)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = _data(args.steps * GLOBAL_BATCH, seed=1)
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices((x, y)),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    times, waits = [], []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())
            stats = self.model.step_stats
            if stats.measured_steps and stats.wait_seconds is not None:
                waits.append(stats.wait_seconds / stats.measured_steps)

    callbacks = [Clock()]
    if args.rebalance:
        callbacks.append(
            kh.callbacks.ShardRebalancer(
                data, every_n_steps=args.sync_every, warmup_steps=2, window=4
            )
        )
    seconds = float(args.seconds) if args.seconds else None
    if seconds:
        # Equal wall time: stop after `seconds` of training.
        class Deadline(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                # At round ends only (a collective anyway): every worker
                # stops at the same step once any worker is past the time.
                if (batch + 1) % args.sync_every:
                    return
                late = time.perf_counter() - self.start > seconds
                flag = strategy.reduce(
                    "SUM",
                    strategy.run(lambda: tf.constant(float(late))),
                    axis=None,
                )
                if float(flag) > 0:
                    self.model.stop_training = True

        callbacks.append(Deadline())
    started = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    wall = time.perf_counter() - started
    hx, hy = _data(4096, seed=2)
    held_out = kh.data.shard(
        tf.data.Dataset.from_tensor_slices((hx, hy)),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    evaluation = model.evaluate(held_out, return_dict=True, verbose=0)
    steps = len(times)
    tail = np.diff(times[steps // 5 :]) if steps > 10 else np.diff(times)
    result = {
        "steps": steps,
        "wall": wall,
        "examples_per_second": GLOBAL_BATCH / float(np.mean(tail)),
        "loss": float(evaluation["loss"]),
        "accuracy": float(evaluation["accuracy"]),
        "weights": int(
            sum(np.prod(v.shape) for v in model.trainable_variables)
        ),
        "shares": [float(s) for s in data.shares],
        # Each worker's wait at the synchronisations per step (second half).
        "wait_per_step": (
            np.mean(waits[len(waits) // 2 :], axis=0).tolist()
            if waits
            else None
        ),
    }
    if task == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


def wire_bytes_per_example(weights, workers, sync_every, compression=None):
    """Each worker's collective payload per trained example (bytes)."""
    replicas_stats = 4 * (2 * workers)  # rows + seconds, float32
    if not sync_every:
        per_step = 4 * weights + replicas_stats
        return per_step / GLOBAL_BATCH
    itemsize = {None: 4, "fp16": 2, "bf16": 2, "int8": 1}[compression]
    per_sync = itemsize * weights + 4 * (2 + 2 * workers)
    return per_sync / (GLOBAL_BATCH * sync_every)


def run(workers, options, hosts=None, **kwargs):
    """A launcher job of `workers` processes; worker 0's results."""
    from keras_hetero import launcher

    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker"]
        command += ["--out", out] + options
        log = io.StringIO()
        result = launcher.launch(
            command,
            workers,
            max_restarts=0,
            grace_seconds=5,
            output=log,
            hosts=hosts,
            **kwargs,
        )
        if result.exit_code != 0:
            raise RuntimeError(log.getvalue()[-3000:])
        with open(out) as f:
            return json.load(f)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--sync-every", type=int, default=0)
    parser.add_argument("--compression", default=None)
    parser.add_argument(
        "--outer",
        default="",
        help="outer Nesterov SGD 'learning_rate,momentum' (default DiLoCo's)",
    )
    parser.add_argument("--speeds", default="")
    parser.add_argument("--rebalance", action="store_true")
    parser.add_argument("--seconds", default="")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--h", type=int, default=100)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--mbit", type=float, default=50.0)
    parser.add_argument("--slow-steps", type=int, default=300)
    parser.add_argument(
        "--speeds-seconds",
        type=float,
        default=30.0,
        help="training time of each run of the speeds table",
    )
    parser.add_argument(
        "--only",
        default="loss,link,speeds",
        help="tables to measure: loss (with the bytes), link, speeds",
    )
    # The smoke run: the first two tables (4 jobs); `--smoke --only
    # link,speeds` for the others (6 jobs).
    args = parse_args(
        parser,
        steps=16,
        workers="2",
        h=4,
        slow_steps=8,
        speeds_seconds=2.0,
        only="loss",
    )
    if args.worker:
        worker(args)
        return
    import keras_hetero as kh

    H = args.h
    steps = ["--steps", str(args.steps)]
    print(
        f"# low-communication benchmark, {datetime.date.today()}, "
        f"flavour {kh.FLAVOUR}, H = {H}, global batch {GLOBAL_BATCH}, "
        f"{args.steps} steps ({args.steps * GLOBAL_BATCH} examples)\n"
    )
    only = set(args.only.split(","))
    if "loss" in only:
        _loss_tables(args, steps, H)
    if "link" in only:
        _link_table(args, H)
    if "speeds" in only:
        _speeds_table(args, H)


def _loss_tables(args, steps, H):
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        sync = run(workers, steps)
        low = run(workers, steps + ["--sync-every", str(H)])
        low_bf16 = run(
            workers, steps + ["--sync-every", str(H), "--compression", "bf16"]
        )
        low_tuned = run(
            workers, steps + ["--sync-every", str(H), "--outer", "0.5,0.9"]
        )
        rows.append((workers, sync, low, low_bf16, low_tuned))
    weights = rows[0][1]["weights"]
    print("## Bytes on the wire per trained example (per worker)\n")
    print("| workers | synchronous | H | H, bf16 | fewer (H) | fewer (bf16) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for workers, *_ in rows:
        s = wire_bytes_per_example(weights, workers, 0)
        low = wire_bytes_per_example(weights, workers, H)
        bf = wire_bytes_per_example(weights, workers, H, "bf16")
        print(
            f"| {workers} | {s:.0f} | {low:.1f} | {bf:.1f} | "
            f"{s / low:.0f}x | {s / bf:.0f}x |"
        )
    print("\n## Held-out loss / accuracy after the same examples\n")
    print(
        "H: DiLoCo's outer SGD(0.7, momentum 0.9, Nesterov); H, outer 0.5: "
        "outer learning rate 0.5. Relative differences against synchronous.\n"
    )
    print(
        "| workers | sync loss | H loss | H bf16 loss | H, outer 0.5 loss | "
        "sync acc | H acc | H bf16 acc | H, outer 0.5 acc |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workers, sync, *lows in rows:

        def loss(value, sync=sync):
            rel = (value["loss"] - sync["loss"]) / sync["loss"]
            return f"{value['loss']:.4f} ({rel:+.1%})"

        print(
            f"| {workers} | {sync['loss']:.4f} | "
            + " | ".join(loss(v) for v in lows)
            + f" | {sync['accuracy']:.3f} | "
            + " | ".join(f"{v['accuracy']:.3f}" for v in lows)
            + " |"
        )


def _link_table(args, H):
    import keras_hetero as kh

    print("\n## Throughput with worker 1 behind a slowed link\n")
    available, reason = kh.testing.network_available()
    if not available:
        print(f"skipped: {reason}")
    else:
        slow_steps = ["--steps", str(args.slow_steps)]
        with kh.testing.NetworkHosts(2, relayed=(1,)) as net:
            net.slow(
                1, latency=args.latency_ms / 1000, bandwidth=args.mbit * 1e6 / 8
            )
            measured = []
            for options in (
                [],
                [],
                ["--sync-every", str(H)],
                ["--sync-every", str(H), "--compression", "bf16"],
            ):
                before = net.relayed_bytes(1)
                value = run(2, slow_steps + options, hosts=net)
                value["relayed"] = net.relayed_bytes(1) - before
                measured.append(value)
        print(
            f"{args.latency_ms:g} ms latency, {args.mbit:g} Mbit/s per "
            f"direction, 2 workers, {args.slow_steps} steps. Relayed bytes: "
            "all traffic to and from worker 1 through the relay over the "
            "whole job (start-up, variable broadcast and evaluation "
            "included), per trained example.\n"
        )
        print(
            "| run | examples/s | vs synchronous | relayed bytes / example "
            "| fewer |"
        )
        print("|---|---:|---:|---:|---:|")
        base = measured[0]["examples_per_second"]
        examples = args.slow_steps * GLOBAL_BATCH
        base_bytes = measured[0]["relayed"] / examples
        names = [
            "synchronous",
            "synchronous (A/A)",
            f"H = {H}",
            f"H = {H}, bf16",
        ]
        for name, value in zip(names, measured):
            rate = value["examples_per_second"]
            per_example = value["relayed"] / examples
            print(
                f"| {name} | {rate:.0f} | {rate / base:.2f}x | "
                f"{per_example:.0f} | {base_bytes / per_example:.0f}x |"
            )


def _speeds_table(args, H):
    print("\n## SIMULATED speeds 1 : 3, held-out loss at equal wall time\n")
    seconds = f"{args.speeds_seconds:g}"
    per_row = "0.001,0.003"
    speeds = ["--speeds", per_row, "--seconds", seconds]
    long_steps = ["--steps", str(args.steps * 4)]
    h = ["--sync-every", str(min(H, 20))]
    fixed = run(2, long_steps + h + speeds)
    balanced = run(2, long_steps + h + speeds + ["--rebalance"])
    print(
        f"2 workers, sync_every {min(H, 20)}, {seconds} s of training each "
        f"(simulated seconds per row {per_row})\n"
    )
    print(
        "| inner work | steps | held-out loss | accuracy | final shares | "
        "wait per step, worker 0 / 1 (ms) |"
    )
    print("|---|---:|---:|---:|---|---|")
    for name, value in (("equal shares", fixed), ("by speed", balanced)):
        shares = ", ".join(f"{s:.2f}" for s in value["shares"])
        waits = " / ".join(f"{1000 * w:.1f}" for w in value["wait_per_step"])
        print(
            f"| {name} | {value['steps']} | {value['loss']:.4f} | "
            f"{value['accuracy']:.3f} | {shares} | {waits} |"
        )


if __name__ == "__main__":
    main()
