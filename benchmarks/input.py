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

`--mode shuffle` (about 3 minutes) measures what shuffling and resuming in
the middle of an epoch cost, per source, with `--shuffle-rows` (10^6)
examples of 8 float32 features (the first is the example's id) + 1 label and
global batch `--batch`, under the default strategy (one replica), no model:

- tf.data: `kh.data.shard(from_tensor_slices(...))` with `shuffle=None`,
  `True` (random access: tf.data's global shuffle), `True` through a
  shuffle buffer of the whole pass (what examples without random access
  get, and what every `shuffle=True` got before) and `10_000` (a buffer);
- arrays: the `HeteroDataset` `fit` makes from numpy arrays, `shuffle=None`
  and `True` (a numpy permutation per epoch, one gather per batch);
- Arrow: `kh.data.from_arrow` over Parquet (`--files` files, row groups of
  10,000 rows) through `kh.data.shard`, `shuffle=None`, `True` (the pass
  converted whole, then permuted), `True` through tf.data's buffer of the
  pass (what it did before) and `10_000`.

For each: examples/s of one whole pass (`Dataset.reduce` over
`as_distributed_dataset()`), and the time from "start the pass resumed
after k examples" (`resume_after(k)` on a new dataset, then the first
batch) for k = 0 and k = `--shuffle-rows` / 2, as ElasticCheckpoint
resumes. Variants alternate within each round after one warm-up round,
which also checks that the resumed pass's first batch is the normal pass's
examples k, k+1, ...; medians over `--rounds` rounds.
"""

import datetime
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

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


SHUFFLE_SEED = 3
SHUFFLE_FEATURES = 8


def shuffle_variants(x, y, parquet_directory):
    """{name: (make a HeteroDataset for batch B, shuffle)}; the A/A row
    repeats the first."""
    import tensorflow as tf

    from keras_hetero.data.arrays import from_arrays

    def tf_data(shuffle, buffered=False):
        def make(batch):
            examples = tf.data.Dataset.from_tensor_slices((x, y))
            data = kh.data.shard(
                examples, batch, shuffle=shuffle, seed=SHUFFLE_SEED
            )
            if buffered:
                # What examples without random access get (and what all
                # `shuffle=True` got before): a shuffle buffer of the pass.
                data._source._random_access = False
            return data

        return make

    def arrays(shuffle):
        def make(batch):
            return from_arrays(
                x,
                y,
                batch_size=batch,
                strategy=tf.distribute.get_strategy(),
                shuffle=shuffle,
                seed=SHUFFLE_SEED,
            )

        return make

    def arrow(shuffle, buffered=False):
        def make(batch):
            examples = kh.data.from_arrow(
                parquet_directory, "x", label="y", shapes={"y": (1,)}
            )
            if buffered:
                # A plain tf.data.Dataset (`take` keeps every example):
                # `shuffle=True` then takes tf.data's buffer of the pass, as
                # it did before from_arrow shuffled a pass itself.
                examples = examples.take(len(x))
            return kh.data.shard(
                examples, batch, shuffle=shuffle, seed=SHUFFLE_SEED
            )

        return make

    return {
        "tf.data, shuffle=None": tf_data(None),
        "tf.data, shuffle=None again (A/A)": tf_data(None),
        "tf.data, shuffle=True (global shuffle, random access)": tf_data(True),
        "tf.data, shuffle=True (buffer of the pass, no random access)": (
            tf_data(True, buffered=True)
        ),
        "tf.data, shuffle=10_000 (buffer)": tf_data(10_000),
        "arrays (fit), shuffle=None": arrays(None),
        "arrays (fit), shuffle=True": arrays(True),
        "Arrow (Parquet), shuffle=None": arrow(None),
        "Arrow (Parquet), shuffle=True (whole pass converted, permuted)": (
            arrow(True)
        ),
        "Arrow (Parquet), shuffle=True (tf.data buffer of the pass)": arrow(
            True, buffered=True
        ),
        "Arrow (Parquet), shuffle=10_000 (buffer)": arrow(10_000),
    }


def pass_seconds(make, batch):
    dataset = make(batch).as_distributed_dataset()
    start = time.perf_counter()
    dataset.reduce(np.int64(0), lambda count, _: count + 1)
    return time.perf_counter() - start


def resumed(make, batch, skip):
    data = make(batch)
    data.resume_after(skip, pass_number=0, seed=SHUFFLE_SEED)
    return data.as_distributed_dataset()


def first_batch_seconds(make, batch, skip):
    """From "resume pass 0 after `skip` examples" to its first batch."""
    start = time.perf_counter()
    next(iter(resumed(make, batch, skip)))
    return time.perf_counter() - start


def check_resumed_order(name, make, batch, skip):
    """The resumed pass starts with examples `skip, skip + 1, ...` of the
    normal pass (ids in feature 0)."""
    ids = np.concatenate(
        [features[:, 0] for features, _ in make(batch).as_distributed_dataset()]
    )
    features, _ = next(iter(resumed(make, batch, skip)))
    got = np.asarray(features)[:, 0]
    if not np.array_equal(got, ids[skip : skip + len(got)]):
        raise RuntimeError(f"{name}: the resumed pass has another order.")
    if np.array_equal(np.sort(ids), ids) != ("None" in name):
        raise RuntimeError(f"{name}: shuffled {'None' not in name}?")


def shuffle_main(args):
    rounds = args.rounds or 3
    rows = args.shuffle_rows
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, SHUFFLE_FEATURES)).astype("float32")
    x[:, 0] = np.arange(rows)  # ids, exact in float32 below 2**24
    y = x[:, 1:2].copy()
    skip = rows // 2
    directory = tempfile.mkdtemp(prefix="kh-input-bench-")
    try:
        parquet_directory = write_parquet(directory, x, y, args.files)
        variants = shuffle_variants(x, y, parquet_directory)
        for name, make in variants.items():
            check_resumed_order(name, make, args.batch, skip)
        measures = ("pass", "first", "first resumed")
        seconds = {name: {m: [] for m in measures} for name in variants}
        for round_index in range(rounds + 1):  # round 0: warm-up
            for name, make in variants.items():
                times = {
                    "pass": pass_seconds(make, args.batch),
                    "first": first_batch_seconds(make, args.batch, 0),
                    "first resumed": first_batch_seconds(
                        make, args.batch, skip
                    ),
                }
                if round_index:
                    for measure, value in times.items():
                        seconds[name][measure].append(value)
    finally:
        shutil.rmtree(directory)

    median = {
        name: {m: float(np.median(runs[m])) for m in measures}
        for name, runs in seconds.items()
    }
    print(
        f"shuffle and resume benchmark, {datetime.date.today()}, Keras "
        f"flavour {kh.FLAVOUR}, {rows} examples of {SHUFFLE_FEATURES} float32 "
        f"features + 1 label (Parquet: {args.files} files, row groups of "
        f"{GROUP_ROWS}), global batch {args.batch}, default strategy (one "
        f"replica), no model, medians of {rounds} alternating rounds "
        "(2 CPU cores)"
    )
    print()
    print(
        "| source, shuffle | one pass, examples/s | vs same source unshuffled "
        "| first batch, skip 0 | first batch, resumed after "
        f"{skip:,} | resumed / skip 0 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, value in median.items():
        unshuffled = median[name.split(", ")[0] + ", shuffle=None"]
        print(
            f"| {name} | {rows / value['pass']:,.0f} | "
            f"{unshuffled['pass'] / value['pass']:.2f} | "
            f"{value['first']:.3f} s | {value['first resumed']:.3f} s | "
            f"{value['first resumed'] / value['first']:.1f} |"
        )


def sources_main(args):
    rounds = args.rounds or 7
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
        for round_index in range(rounds + 1):  # round 0: warm-up
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
        f"medians of {rounds} alternating rounds"
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


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument(
        "--mode",
        choices=("sources", "shuffle", "both"),
        default="sources",
        help="sources: throughput per source; shuffle: shuffled vs "
        "unshuffled throughput and the cost of resuming mid-epoch; both: "
        "one, then the other (--smoke's default)",
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--shuffle-rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=None)
    args = parse_args(
        parser,
        mode="both",
        rows=4096,
        shuffle_rows=4096,
        features=8,
        files=2,
        batch=256,
        rounds=1,
    )
    if args.mode in ("sources", "both"):
        sources_main(args)
    if args.mode == "both":
        print()
    if args.mode in ("shuffle", "both"):
        shuffle_main(args)


if __name__ == "__main__":
    main()
