"""The input kinds of the exact-resume tests.

For tests/checkpointing/test_elastic_processes.py; shared by the worker
script (tests/scripts/elastic_train.py) and the test's one-device reference,
so both build the same pipeline. Every example is `({"x": features, "id":
id}, y)` with ids 0..ROWS-1 (helpers.arrays). Also imported by worker
processes (keep it free of pytest).
"""

import os

import tensorflow as tf

import keras_hetero as kh
from tests.support import helpers

ROWS = 80
SEED = 1234  # the shuffle seed of the shuffled kinds
FILES = 4  # Parquet / TFRecord files of ROWS // FILES rows each

KINDS = (
    "plain",
    "shard",
    "arrays",
    "arrow",
    "arrow-own",
    "tfrecord",
    "augment",
    "service",
)


def write_files(kind, directory):
    """Writes the Parquet (2 row groups per file) or TFRecord files."""
    os.makedirs(directory, exist_ok=True)
    x, y, _, ids = helpers.arrays(ROWS)
    per_file = ROWS // FILES
    for number in range(FILES):
        rows = slice(number * per_file, (number + 1) * per_file)
        if kind.startswith("arrow"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table(
                {
                    "x": pa.FixedSizeListArray.from_arrays(
                        pa.array(x[rows].ravel()), helpers.FEATURES
                    ),
                    "id": pa.array(ids[rows]),
                    "y": pa.FixedSizeListArray.from_arrays(
                        pa.array(y[rows].ravel()), 1
                    ),
                }
            )
            pq.write_table(
                table,
                os.path.join(directory, f"part-{number}.parquet"),
                row_group_size=per_file // 2,
            )
        elif kind == "tfrecord":
            path = os.path.join(directory, f"part-{number}.tfrecord")
            with tf.io.TFRecordWriter(path) as writer:
                for row in range(rows.start, rows.stop):
                    feature = {
                        "x": _floats(x[row]),
                        "y": _floats(y[row]),
                        "id": tf.train.Feature(
                            int64_list=tf.train.Int64List(value=[ids[row]])
                        ),
                    }
                    example = tf.train.Example(
                        features=tf.train.Features(feature=feature)
                    )
                    writer.write(example.SerializeToString())


def _floats(values):
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def _parse(record):
    parsed = tf.io.parse_single_example(
        record,
        {
            "x": tf.io.FixedLenFeature([helpers.FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([1], tf.float32),
            "id": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    return {"x": parsed["x"], "id": parsed["id"]}, parsed["y"]


def dataset(kind, batch, strategy, data_dir=None):
    """The `kh.data.HeteroDataset` of an input kind (not for "arrays")."""
    if kind == "plain":
        return kh.data.shard(
            helpers.id_examples(ROWS), batch, strategy=strategy
        )
    if kind in ("shard", "augment"):
        # A buffer smaller than the pass: a partial shuffle, by (seed, pass).
        examples, shuffle = helpers.id_examples(ROWS), 32
    elif kind == "arrow":
        # Whole-pass shuffle of a lazily read Parquet directory.
        examples = kh.data.from_arrow(
            data_dir, ["x", "id"], label="y", batch_rows=16
        )
        shuffle = True
    elif kind == "arrow-own":
        # Each worker reads only the row groups dealt to it, worker 0's
        # replica taking 3 rows in 4; the block order and rows within
        # blocks shuffled per pass.
        examples = kh.data.from_arrow(data_dir, ["x", "id"], label="y")
        return kh.data.shard(
            examples,
            batch,
            strategy=strategy,
            shuffle=True,
            seed=SEED,
            shares=[3, 1],
            reads="own",
        )
    elif kind == "service":
        # Rows pulled from a tf.data service job per epoch; `data_dir` is
        # the dispatcher's address. Worker 0's replica takes 3 rows in 4.
        return kh.data.shard(
            helpers.id_examples(ROWS),
            batch,
            strategy=strategy,
            shares=[3, 1],
            service=data_dir,
        )
    elif kind == "tfrecord":
        # A shuffled file list, fixed across epochs and reproducible in a
        # fresh process: tf.data's seeded shuffle is a function of (global
        # seed, op seed), and every process sets the same global seed
        # (`keras.utils.set_random_seed`). Files are read interleaved, in
        # a deterministic order; `shard` then reshuffles every pass.
        files = sorted(tf.io.gfile.glob(os.path.join(data_dir, "*.tfrecord")))
        examples = (
            tf.data.Dataset.from_tensor_slices(files)
            .shuffle(len(files), seed=7, reshuffle_each_iteration=False)
            .interleave(
                tf.data.TFRecordDataset,
                cycle_length=2,
                num_parallel_calls=2,
                deterministic=True,
            )
            .map(_parse)
            .apply(tf.data.experimental.assert_cardinality(ROWS))
        )
        shuffle = 16
    else:
        raise ValueError(f"unknown input kind {kind!r}")
    return kh.data.shard(
        examples, batch, strategy=strategy, shuffle=shuffle, seed=SEED
    )


def arrays():
    """`(x, y)` of the "arrays" kind, for `fit(x, y, shuffle=True)`."""
    x, y, _, ids = helpers.arrays(ROWS)
    return {"x": x, "id": ids}, y


def augment_layers(keras):
    """Random augmentation for the "augment" kind."""
    return [keras.layers.GaussianNoise(0.3), keras.layers.Dropout(0.2)]
