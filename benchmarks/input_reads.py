"""Bytes read per epoch by all workers: `reads="all"` vs `reads="own"`.

A Parquet directory (`--files` files, row groups of `--group-rows` rows,
`--features` float32 features and a float32 label per row) is trained on
for one epoch by a one-Dense-layer `kh.HeteroModel` under
MultiWorkerMirroredStrategy, 2 and 4 worker processes (on 2 cores workers
share cores: bytes are counts, not timings), global batch `--batch`, with
shares equal, 0.75 / 0.25 (worker pairs), and moving every 10 steps
through four splits (`HeteroDataset.set_shares` at the same batch on
every worker, as `ShardRebalancer` does).

`reads="own"`: each worker's `HeteroDataset.reads_done` for the epoch's
pass (the column chunks' compressed sizes from the footers of the row
groups it read, and their rows), summed over workers, against the
dataset's bytes; per worker, the rows it read (parsed) against the rows it
trained. `reads="all"`: every
worker reads the whole stream (how it works: docs/arrow.md), so its bytes
are the workers' number times the dataset's and each worker parses every
row (rows / the rows it trained); the table states it so rather than
measuring it.

Run: `python benchmarks/input_reads.py` (about 4 minutes on 2 cores).
"""

import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

MODES = ("equal", "0.75/0.25", "moving every 10 steps")
# The four splits a "moving" run cycles through, per pair of workers.
_MOVES = ([1, 1], [3, 1], [1, 3], [0.9, 0.1])


def _shares(mode, workers, step=0):
    pair = [1, 1] if mode == "equal" else [3, 1]
    if mode.startswith("moving"):
        pair = _MOVES[(step // 10) % len(_MOVES)]
    return pair * (workers // 2)


def write(directory, rows, files, group_rows, features):
    """The Parquet files; returns the dataset's bytes (x and y chunks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    total = 0
    for number, part in enumerate(np.array_split(np.arange(rows), files)):
        x = rng.normal(size=(len(part), features)).astype("float32")
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(
                    pa.array(x.ravel()), features
                ),
                "y": rng.normal(size=len(part)).astype("float32"),
            }
        )
        path = os.path.join(directory, f"part-{number:05d}.parquet")
        pq.write_table(table, path, row_group_size=group_rows)
        footer = pq.ParquetFile(path).metadata
        total += sum(
            footer.row_group(g).column(c).total_compressed_size
            for g in range(footer.num_row_groups)
            for c in range(footer.num_columns)
        )
    return total


def _worker(directory, batch, mode):
    """One epoch with reads="own"; this worker's reads and rows trained."""
    import tensorflow as tf

    from keras_hetero import keras
    from keras_hetero.data import shares as shares_lib

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    examples = kh.data.from_arrow(directory, "x", label="y")
    data = kh.data.shard(
        examples,
        batch,
        strategy=strategy,
        shares=_shares(mode, workers),
        reads="own",
    )

    class Move(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            if mode.startswith("moving") and (step + 1) % 10 == 0:
                # A few batches ahead, named: the same batch everywhere.
                data.set_shares(
                    _shares(mode, workers, step + 1), from_batch=step + 5
                )

    with strategy.scope():
        inputs = keras.Input((examples.element_spec[0].shape[0],))
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    model.fit(data, epochs=1, verbose=0, callbacks=[Move()])
    worker = strategy.cluster_resolver.task_id
    trained = sum(
        int(
            shares_lib.rows_from_shares(
                data.shares_for_batch((0, index)),
                min(batch, data.num_examples - index * batch),
            )[worker]
        )
        for index in range(data.num_batches)
    )
    # The epoch's pass only: tf-keras' repeated pipeline reads a step or
    # two ahead into the next pass, which a longer fit would train.
    first = data.reads_done["passes"][min(data.reads_done["passes"])]
    return {**first, "trained": trained}


def measure(directory, dataset_bytes, rows, workers, mode, args):
    results = kh.testing.run_workers(
        _worker,
        workers,
        timeout=args.timeout,
        args=(directory, args.batch, mode),
    )
    reads = [r.value for r in results]
    read = sum(r["bytes"] for r in reads)
    parsed = max(r["rows"] / max(r["trained"], 1) for r in reads)
    # Under reads="all" each worker parses every row.
    parsed_all = max(rows / max(r["trained"], 1) for r in reads)
    assert sum(r["trained"] for r in reads) == rows, reads
    return read / dataset_bytes, parsed, parsed_all


def main():
    parser = smoke_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--group-rows", type=int, default=500)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--timeout", type=float, default=600)
    args = parse_args(
        parser, rows=2_000, files=2, group_rows=100, batch=64, workers="2"
    )
    directory = tempfile.mkdtemp(prefix="input_reads")
    try:
        size = write(
            directory, args.rows, args.files, args.group_rows, args.features
        )
        print(
            f"{kh.FLAVOUR}: {args.rows:,} rows, {args.files} Parquet files, "
            f"row groups of {args.group_rows} rows ({size:,} bytes), "
            f"global batch {args.batch}, one epoch"
        )
        print()
        print(
            "| workers | shares | bytes read, all workers / dataset: "
            'reads="all" | reads="own" | rows parsed / rows trained, '
            'worst worker: reads="all" | reads="own" |'
        )
        print("|---:|---|---:|---:|---:|---:|")
        for workers in [int(w) for w in args.workers.split(",")]:
            for mode in MODES:
                read, parsed, parsed_all = measure(
                    directory, size, args.rows, workers, mode, args
                )
                print(
                    f"| {workers} | {mode} | {workers}.00 (by design) | "
                    f"{read:.3f} | {parsed_all:.2f} (by design) | "
                    f"{parsed:.3f} |"
                )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
