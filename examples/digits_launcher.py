"""Multi-worker training on scikit-learn's handwritten digits, started by
`keras-hetero run`.

    keras-hetero run --workers 2 examples/digits_launcher.py --simulate-speeds
    python -m keras_hetero.run --workers 2 examples/digits_launcher.py

The launcher starts two processes with a `TF_CONFIG` for a cluster on
127.0.0.1; each builds a `MultiWorkerMirroredStrategy` from it (stock
Keras 3 cannot `fit` there; `kh.HeteroModel` can). `ShardRebalancer` gives
each worker rows in proportion to its measured speed; every worker computes
the same shares from the same all-reduced timings. The workers of one
machine are equally fast, so `--simulate-speeds` makes worker 1 SIMULATED
four times slower per row (`kh.testing.SimulatedSpeed`) to give the
rebalancer something to do; on really unequal devices leave it out. With
`--checkpoint DIR` an `ElasticCheckpoint` saves there, and a restarted job
(the launcher restarts the group when a worker dies) continues at the next
global batch.

The same script runs on a cluster: on several hosts under `keras-hetero run
--nnodes` (on Kubernetes: examples/k8s/), under Slurm with `--cluster
slurm` (see docs/multi-machine.md). Run directly, without `TF_CONFIG`, it
trains as a single worker.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _digits import compile_for_digits  # noqa: E402
from _digits import examples  # noqa: E402
from _digits import layers  # noqa: E402
from _digits import load  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

GLOBAL_BATCH = 64
# --simulate-speeds: seconds per row of worker 1 and of every other worker.
SLOW_SECONDS_PER_ROW = 0.002
FAST_SECONDS_PER_ROW = 0.0005


def make_strategy(cluster):
    if cluster == "slurm":
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver()
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver
        )
    return tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG


def simulated_seconds_per_row(replicas):
    """Replica 1 SIMULATED 4x slower per row than the others."""
    return [
        SLOW_SECONDS_PER_ROW if replica == 1 else FAST_SECONDS_PER_ROW
        for replica in range(replicas)
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default=None, help="a shared dir")
    parser.add_argument("--cluster", choices=["tf_config", "slurm"])
    parser.add_argument(
        "--simulate-speeds",
        action="store_true",
        help="make worker 1 SIMULATED 4x slower (it sleeps)",
    )
    args = parser.parse_args(argv)

    strategy = make_strategy(args.cluster)
    worker = strategy.cluster_resolver.task_id or 0
    workers = strategy.num_replicas_in_sync

    x_train, y_train, x_test, y_test = load()
    with strategy.scope():
        inputs = keras.Input((64,))
        hidden = inputs
        if args.simulate_speeds:
            speeds = simulated_seconds_per_row(workers)
            hidden = kh.testing.SimulatedSpeed(speeds)(inputs)
        model = compile_for_digits(kh.HeteroModel(inputs, layers(hidden)))
    data = kh.data.shard(
        examples(x_train, y_train), GLOBAL_BATCH, strategy=strategy
    )
    callbacks = [kh.callbacks.ShardRebalancer(data, every_n_steps=4)]
    if args.checkpoint:
        callbacks.append(kh.callbacks.ElasticCheckpoint(args.checkpoint))
    model.fit(data, epochs=args.epochs, verbose=0, callbacks=callbacks)

    held_out = kh.data.shard(
        examples(x_test, y_test), GLOBAL_BATCH, strategy=strategy
    )
    _, accuracy = model.evaluate(held_out, verbose=0)
    speeds = (
        "SIMULATED: worker 1 4x slower"
        if args.simulate_speeds
        else "measured speeds"
    )
    print(
        f"worker {worker} of {workers}: shares {np.round(data.shares, 2)} "
        f"({speeds}), held-out accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()
