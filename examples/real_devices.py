"""Demo on REAL unequal devices: two workers, one capped at a quarter core.

No simulation: two MultiWorkerMirroredStrategy worker processes on
127.0.0.1, each pinned to its own core; worker 1 runs under a Linux cgroup
CPU quota of `--cap` of its core (`kh.testing.run_workers(cpu_quotas=...)`,
root only). The same compute-bound model trains twice: with equal shares
(every step waits for the capped worker) and with `ShardRebalancer`, which
reads each replica's measured seconds per row and moves rows to the fast
worker; the update stays exactly one device's on the same global batches.

Where CPU quotas are not available (not Linux, not root, no cgroup `cpu`
controller) it says why and runs the SIMULATED demo, examples/quickstart.py.

Run: `make demo`, or `python examples/real_devices.py [--cap 0.25]` (about a
minute on 2 cores).
"""

import argparse
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402

GLOBAL_BATCH = 512
FEATURES = 256
WIDTH = 1024


def train(rebalance, steps):
    """One worker's fit; returns steady-state seconds per step and shares."""
    import tensorflow as tf

    keras = kh.keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
        hidden = keras.layers.Dense(WIDTH, activation="relu")(hidden)
        model = kh.HeteroModel(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * steps, FEATURES)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices((x, y)),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    timer = kh.testing.StepTimer()
    callbacks = [timer]
    if rebalance:
        callbacks.append(
            kh.callbacks.ShardRebalancer(data, every_n_steps=4, window=4)
        )
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    stats = model.step_stats
    return {
        "seconds": float(np.median(timer.seconds[-steps // 2 :])),
        "shares": np.asarray(data.shares).tolist(),
        "seconds_per_row": stats.seconds_per_row.tolist(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cap", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        print(f"CPU quotas are not available here ({reason}).")
        print("Running the SIMULATED demo instead: examples/quickstart.py\n")
        quickstart = os.path.join(os.path.dirname(__file__), "quickstart.py")
        return subprocess.call([sys.executable, quickstart])
    print(
        f"Real unequal devices (CPU quota, no simulation): 2 workers on "
        f"127.0.0.1, each pinned to a core; worker 1 capped at {args.cap:g} "
        f"of its core. Keras flavour {kh.FLAVOUR}, global batch "
        f"{GLOBAL_BATCH}, {args.steps} steps per run.\n"
    )
    rows = {}
    for name, rebalance in (("equal shares", False), ("rebalanced", True)):
        results = kh.testing.run_workers(
            train,
            2,
            timeout=600,
            args=(rebalance, args.steps),
            cpu_quotas=[None, args.cap],
            cores="auto",
        )
        rows[name] = results[0].value
    equal, balanced = rows["equal shares"], rows["rebalanced"]
    cost = np.array(balanced["seconds_per_row"])
    print("| run | samples/s | shares (worker 0, worker 1) |")
    print("|---|---:|---|")
    for name, value in rows.items():
        shares = ", ".join(f"{s:.2f}" for s in value["shares"])
        print(f"| {name} | {GLOBAL_BATCH / value['seconds']:.0f} | {shares} |")
    print(
        f"\nmeasured seconds per row, worker 1 / worker 0: "
        f"{cost[1] / cost[0]:.2f} (capacity {1 / args.cap:.2f})"
    )
    print(
        f"rebalanced / equal shares: "
        f"{equal['seconds'] / balanced['seconds']:.2f}x samples/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
