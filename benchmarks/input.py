"""Input throughput: Parquet via `kh.data.from_arrow` vs TFRecords vs memory.

The same examples (`--features` float32 features and one float32 label per
row) come from three sources:

- Parquet: `--files` files written by pyarrow (row groups of 10,000 rows,
  features as a fixed-size list), read by `kh.data.from_arrow`;
- TFRecords: the same rows as `tf.train.Example`s in as many files, read by
  `tf.data.TFRecordDataset` and parsed per batch (`tf.io.parse_example`;
  under `kh.data.shard` as its `map_fn`, after the split);
- memory: numpy arrays through `tf.data.Dataset.from_tensor_slices`.

Two measurements per source, in examples/s: the input pipeline alone
(`examples.batch(B)` consumed by `Dataset.reduce`, no model, no Python per
batch; wall time of a whole pass) and `fit` of a one-Dense-layer
`kh.HeteroModel` for one epoch over `kh.data.shard(examples, B)` under
MirroredStrategy on 2 logical CPUs (`B` / the median step time of the epoch,
which includes waiting for input; robust to bursts of load on a shared
machine). Sources alternate within each round, after one warm-up round; we
print medians over `--rounds` rounds and ratios to memory.

Run: `python benchmarks/input.py` (about 2 minutes on 2 cores).
"""

import argparse
import datetime
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402

GROUP_ROWS = 10_000


def make_arrays(rows, features):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1))).astype("float32")
    return x, y


def write_parquet(directory, x, y, files):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for index, rows in enumerate(np.array_split(np.arange(len(x)), files)):
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(
                    pa.array(x[rows].ravel()), x.shape[1]
                ),
                "y": y[rows, 0],
            }
        )
        path = os.path.join(directory, f"part-{index:05d}.parquet")
        pq.write_table(table, path, row_group_size=GROUP_ROWS)
    return directory


def write_tfrecords(directory, x, y, files):
    import tensorflow as tf

    paths = []
    for index, rows in enumerate(np.array_split(np.arange(len(x)), files)):
        path = os.path.join(directory, f"part-{index:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in rows:
                feature = {
                    "x": tf.train.Feature(
                        float_list=tf.train.FloatList(value=x[row])
                    ),
                    "y": tf.train.Feature(
                        float_list=tf.train.FloatList(value=y[row])
                    ),
                }
                example = tf.train.Example(
                    features=tf.train.Features(feature=feature)
                )
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def sources(x, y, parquet_directory, tfrecord_paths):
    """{name: (unbatched examples, map_fn for shard, batch -> (x, y))}."""
    import tensorflow as tf

    spec = {
        "x": tf.io.FixedLenFeature([x.shape[1]], tf.float32),
        "y": tf.io.FixedLenFeature([1], tf.float32),
    }

    def parse(records):
        parsed = tf.io.parse_example(records, spec)
        return parsed["x"], parsed["y"]

    def parquet():
        return kh.data.from_arrow(
            parquet_directory, "x", label="y", shapes={"y": (1,)}
        )

    def tfrecords():
        records = tf.data.TFRecordDataset(tfrecord_paths)
        return records.apply(tf.data.experimental.assert_cardinality(len(x)))

    def memory():
        return tf.data.Dataset.from_tensor_slices((x, y))

    return {
        "Parquet, `kh.data.from_arrow`": (parquet, None),
        "TFRecords, `TFRecordDataset` + `parse_example`": (tfrecords, parse),
        "in memory, `from_tensor_slices`": (memory, None),
    }


def pipeline_seconds(make, parse, batch):
    batches = make().batch(batch)
    if parse is not None:
        batches = batches.map(parse)
    start = time.perf_counter()
    batches.reduce(np.int64(0), lambda count, _: count + 1)
    return time.perf_counter() - start


def fit_step_seconds(model, strategy, make, parse, batch):
    data = kh.data.shard(make(), batch, strategy=strategy, map_fn=parse)
    timer = kh.testing.StepTimer()
    model.fit(data, epochs=1, verbose=0, callbacks=[timer])
    return timer.median()


def build(strategy, features):
    from keras_hetero import keras

    with strategy.scope():
        inputs = keras.Input((features,))
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    strategy = kh.testing.mirrored(kh.testing.logical_cpus(2))

    x, y = make_arrays(args.rows, args.features)
    directory = tempfile.mkdtemp(prefix="kh-input-bench-")
    try:
        os.makedirs(os.path.join(directory, "parquet"))
        parquet_directory = write_parquet(
            os.path.join(directory, "parquet"), x, y, args.files
        )
        tfrecord_paths = write_tfrecords(directory, x, y, args.files)
        cases = sources(x, y, parquet_directory, tfrecord_paths)
        models = {name: build(strategy, args.features) for name in cases}
        seconds = {name: {"pipeline": [], "fit": []} for name in cases}
        for round_index in range(args.rounds + 1):  # round 0: warm-up
            for name, (make, parse) in cases.items():
                pipeline = pipeline_seconds(make, parse, args.batch)
                fit = fit_step_seconds(
                    models[name], strategy, make, parse, args.batch
                )
                if round_index:
                    seconds[name]["pipeline"].append(pipeline)
                    seconds[name]["fit"].append(fit)
    finally:
        shutil.rmtree(directory)

    rates = {
        name: {
            "pipeline": args.rows / float(np.median(runs["pipeline"])),
            "fit": args.batch / float(np.median(runs["fit"])),
        }
        for name, runs in seconds.items()
    }
    memory = rates["in memory, `from_tensor_slices`"]
    print(
        f"input benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, {args.rows} examples of {args.features} float32 "
        f"features + 1 label in {args.files} files, global batch "
        f"{args.batch}, MirroredStrategy on 2 logical CPUs (2 CPU cores), "
        f"medians of {args.rounds} alternating rounds"
    )
    print()
    print(
        "| source | pipeline alone, examples/s | vs memory | fit (1 Dense "
        "layer), examples/s | vs memory |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, rate in rates.items():
        print(
            f"| {name} | {rate['pipeline']:,.0f} | "
            f"{rate['pipeline'] / memory['pipeline']:.2f} | "
            f"{rate['fit']:,.0f} | {rate['fit'] / memory['fit']:.2f} |"
        )


if __name__ == "__main__":
    main()
