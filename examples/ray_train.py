"""Scaling out with Ray: keras-hetero training under Ray Train.

The training function is an ordinary keras-hetero one (HeteroModel,
`kh.data.shard`, ShardRebalancer, StragglerDetector) with one Ray-specific
callback, `kh.ray.ElasticCheckpoint`, which reports Keras logs and
checkpoints to Ray and resumes from Ray's latest checkpoint when Ray
restarts or resizes the worker group. Ray's `TensorflowTrainer` starts one
worker per `ScalingConfig` worker and writes `TF_CONFIG`, so
`MultiWorkerMirroredStrategy()` joins them.

With `--simulate-slow`, worker 1's replica is made SIMULATED 4x slower
(`kh.testing.SimulatedSpeed`), and the shares move rows to worker 0.

Run (needs the `ray` extra, `pip install ".[ray]"` here):

    python examples/ray_train.py                     # local Ray, 2 workers
    python examples/ray_train.py --workers 1-4       # elastic: 1 to 4
    python examples/ray_train.py --address auto      # an existing cluster

On a cluster, `--storage` must be shared by all nodes (NFS path, s3://...).
About two minutes on 2 CPU cores.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROWS, FEATURES = 2048, 8


def make_examples():
    """The same unbatched examples on every worker (kh.data.shard splits)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y))


def train_fn(config):
    """Runs on every Ray Train worker."""
    import tensorflow as tf

    import keras_hetero as kh
    import keras_hetero.ray
    from keras_hetero import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # Ray's TF_CONFIG
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        hidden = inputs
        if config["simulate_slow"]:  # SIMULATED: replica 1 is 4x slower
            hidden = kh.testing.SimulatedSpeed([0.0002, 0.0008])(hidden)
        hidden = keras.layers.Dense(32, activation="relu")(hidden)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    data = kh.data.shard(make_examples(), 128, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=4)
    model.fit(
        data,
        epochs=config["epochs"],
        verbose=0,
        callbacks=[
            rebalancer,
            kh.callbacks.StragglerDetector(),
            keras_hetero.ray.ElasticCheckpoint(save_every=8),
        ],
    )
    if strategy.cluster_resolver.task_id == 0:
        print(f"final shares: {data.shares.round(3)}, rows: {data.rows}")


def _workers(text):
    """`--workers`: "2" -> 2, "1-4" -> (1, 4) (elastic)."""
    low, _, high = text.partition("-")
    return (int(low), int(high)) if high else int(low)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_workers, default=2)
    parser.add_argument("--address", default="local")
    parser.add_argument("--storage", default="/tmp/keras_hetero-ray")
    parser.add_argument(
        "--name", default=None, help="the same name resumes a stopped run"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--simulate-slow", action="store_true")
    args = parser.parse_args()

    import ray
    import ray.train
    from ray.train.tensorflow import TensorflowTrainer

    import keras_hetero.ray

    ray.init(address=args.address)
    trainer = TensorflowTrainer(
        train_fn,
        train_loop_config={
            "epochs": args.epochs,
            "simulate_slow": args.simulate_slow,
        },
        tensorflow_config=keras_hetero.ray.TensorflowConfig(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=args.workers, resources_per_worker={"CPU": 1}
        ),
        run_config=ray.train.RunConfig(
            name=args.name,
            storage_path=os.path.abspath(args.storage)
            if "://" not in args.storage
            else args.storage,
            failure_config=ray.train.FailureConfig(
                max_failures=args.max_failures
            ),
        ),
    )
    result = trainer.fit()
    print(f"metrics: {result.metrics}")
    print(f"checkpoint: {result.checkpoint}")


if __name__ == "__main__":
    main()
