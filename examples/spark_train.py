"""Training from Spark: keras-hetero workers as one Spark barrier stage.

Spark writes the training data as Parquet part files; `kh.spark.run` starts
one worker per barrier task with a `TF_CONFIG` naming all of them, and every
worker reads all the files with `kh.data.from_arrow`. An ElasticCheckpoint
resumes a stage that `kh.spark.run` starts again after a failure
(`--max-restarts`); the workers' loss histories come back to the driver.

Run (needs the `spark` extra, `pip install ".[spark]"` here, and Java):

    python examples/spark_train.py                   # local Spark, 2 workers
    spark-submit --master yarn ... examples/spark_train.py --master "" \\
        --data /shared/train --checkpoints /shared/ckpt

On a cluster, `--data` and `--checkpoints` must be paths every executor
sees. About a minute on 2 CPU cores.
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Spark's Python tasks (and so the workers) run this interpreter.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

ROWS, FEATURES, BATCH = 2048, 8, 128


def train_fn(data_path, checkpoint_dir, epochs):
    """Runs once per worker, in a fresh process on a Spark executor."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # kh.spark's
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    examples = kh.data.from_arrow(
        data_path,
        "features",
        label="label",
        shapes={"features": (FEATURES,), "label": (1,)},
    )
    data = kh.data.shard(examples, BATCH, strategy=strategy)
    history = model.fit(
        data,
        epochs=epochs,
        verbose=0,
        callbacks=[
            kh.callbacks.ShardRebalancer(data),
            kh.callbacks.ElasticCheckpoint(checkpoint_dir, save_every=8),
        ],
    )
    return {
        "loss": history.history["loss"],
        "restart": int(os.environ["KERAS_HETERO_RESTART"]),
    }


def write_examples(spark, path):
    """y = x @ w + noise, written by Spark as Parquet part files."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = x @ rng.normal(size=FEATURES) + 0.1 * rng.normal(size=ROWS)
    rows = [(list(map(float, r)), float(t)) for r, t in zip(x, y)]
    frame = spark.createDataFrame(rows, "features array<float>, label float")
    frame.write.mode("overwrite").parquet(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--master",
        default="local[2]",
        help='Spark master; "" keeps spark-submit\'s',
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--data", help="Parquet directory (default: temp)")
    parser.add_argument("--checkpoints", help="checkpoint directory")
    options = parser.parse_args()

    from pyspark.sql import SparkSession

    import keras_hetero.spark

    builder = SparkSession.builder.appName("keras-hetero")
    if options.master:
        builder = builder.master(options.master).config(
            "spark.ui.enabled", "false"
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    scratch = tempfile.mkdtemp(prefix="keras_hetero-spark-")
    data = options.data or os.path.join(scratch, "train")
    checkpoints = options.checkpoints or os.path.join(scratch, "ckpt")
    write_examples(spark, data)
    result = keras_hetero.spark.run(
        train_fn,
        options.workers,
        args=(data, checkpoints, options.epochs),
        spark=spark,
        max_restarts=options.max_restarts,
    )
    print(f"attempts: {result.attempts}")
    for index, value in enumerate(result.values):
        losses = ", ".join(f"{loss:.4f}" for loss in value["loss"])
        print(f"worker {index}: loss per epoch {losses}")
    spark.stop()


if __name__ == "__main__":
    main()
