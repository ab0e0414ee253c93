"""kh.data.from_arrow: Parquet / Arrow IPC / tables as examples for shard."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.data import arrow as arrow_lib
from keras_hetero.data import blocks as blocks_lib
from tests.conftest import DEVICES
from tests.support import arrow_workers
from tests.support import helpers


def _table(rows, seed=0):
    """helpers.arrays as columns: id, x (fixed-size list), y, w."""
    x, y, weights, ids = helpers.arrays(rows, seed)
    return pa.table(
        {
            "id": ids,
            "x": pa.FixedSizeListArray.from_arrays(
                pa.array(x.ravel()), helpers.FEATURES
            ),
            "y": y[:, 0],
            "w": weights,
        }
    )


def _write_parquet(directory, table, files=3, row_group_rows=10):
    """`table` as consecutive Parquet files, as Spark writes them."""
    directory.mkdir(exist_ok=True)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    paths = []
    for index in range(files):
        path = directory / f"part-{index:05d}.parquet"
        part = table.slice(bounds[index], bounds[index + 1] - bounds[index])
        pq.write_table(part, path, row_group_size=row_group_rows)
        paths.append(path)
    (directory / "_SUCCESS").write_bytes(b"")
    (directory / ".part-00000.parquet.crc").write_bytes(b"not data")
    return paths


def _ids(examples):
    ids = [
        batch[0]["id"] if isinstance(batch, tuple) else batch["id"]
        for batch in examples.batch(64).as_numpy_iterator()
    ]
    return np.concatenate(ids).tolist() if ids else []


def _id_examples(directory, **kwargs):
    return kh.data.from_arrow(
        directory, ["x", "id"], label="y", shapes={"y": (1,)}, **kwargs
    )


def test_parquet_trains_like_one_device_under_mirrored(tmp_path):
    # helpers.reference_fit trains on helpers.arrays(): the same rows.
    _write_parquet(tmp_path / "data", _table(helpers.ROWS))
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    strategy = helpers.mirrored(DEVICES[:3])
    with strategy.scope():
        model = helpers.hetero_model(regularizer=True)
    examples = kh.data.from_arrow(
        tmp_path / "data",
        "x",
        label="y",
        sample_weight="w",
        shapes={"y": (1,)},
        batch_rows=7,  # record batches straddle global batches
    )
    data = kh.data.shard(
        examples, helpers.GLOBAL_BATCH, strategy=strategy, shares=[6, 3, 1]
    )
    assert data.num_batches == 5  # from the Parquet footers
    history = model.fit(data, epochs=2, verbose=0)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert history.history["loss"] == pytest.approx(
        reference_history["loss"], rel=1e-5
    )


class _MoveShares(keras.callbacks.Callback):
    """Sets the next split in `plan` after every train batch."""

    def __init__(self, data, plan):
        super().__init__()
        self.data, self.plan, self.calls = data, plan, 0

    def on_train_batch_end(self, batch, logs=None):
        self.data.shares = self.plan[self.calls % len(self.plan)]
        self.calls += 1


def test_each_id_trains_once_per_epoch_while_shares_move(tmp_path):
    rows = 30 * 8 + 7
    _write_parquet(tmp_path / "data", _table(rows), row_group_rows=25)
    strategy = helpers.mirrored(DEVICES[:3])
    seen = []
    with strategy.scope():
        model = helpers.id_model(seen, 0.0)
    data = kh.data.shard(
        _id_examples(tmp_path / "data", batch_rows=13), 30, strategy=strategy
    )
    plan = [[1, 1, 1], [0.7, 0.2, 0.1], [0, 0, 1], [0.1, 0.5, 0.4]]
    mover = _MoveShares(data, plan)
    model.fit(data, epochs=2, verbose=0, callbacks=[mover])
    assert mover.calls == 18
    splits = {
        tuple(data.shares_for_batch((pass_index, index)))
        for pass_index in range(data.passes_started)
        for index in range(18)
    }
    assert len(splits) >= 2  # the shares really moved while training
    counts = np.bincount(seen, minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)


def _corrupt_first_row_group(path):
    """Overwrites row group 0's column chunks; its footer stays readable."""
    group = pq.ParquetFile(path).metadata.row_group(0)
    with open(path, "r+b") as file:
        for index in range(group.num_columns):
            chunk = group.column(index)
            file.seek(chunk.dictionary_page_offset or chunk.data_page_offset)
            file.write(b"\xff" * chunk.total_compressed_size)


def test_resume_skips_whole_files_and_row_groups_without_reading(tmp_path):
    paths = _write_parquet(tmp_path / "data", _table(90), row_group_rows=10)
    examples = _id_examples(tmp_path / "data")
    # Resuming after 43 examples: file 0 (30 rows) and row group 0 of
    # file 1 (10 rows) must not be read at all; make reading them fail.
    os.remove(paths[0])
    listed = os.stat(paths[1])
    _corrupt_first_row_group(paths[1])
    # The same size and time: past the check for files changed under a
    # running job, to show that the row group is never read.
    os.utime(paths[1], ns=(listed.st_atime_ns, listed.st_mtime_ns))
    with pytest.raises(tf.errors.OpError):
        _ids(examples)
    strategy = helpers.mirrored(DEVICES[:2])
    data = kh.data.shard(examples, 8, strategy=strategy, shares=[3, 1])
    data.resume_after(43)
    seen = []
    for batch in data.as_distributed_dataset():
        for features, _ in strategy.experimental_local_results(batch):
            seen.extend(features["id"].numpy().tolist())
    assert seen == list(range(43, 90))
    with pytest.raises(tf.errors.OpError):  # inside the broken row group
        _ids(examples.skip(35))
    assert examples.skip(40).cardinality() == 50


def _pass_ids(strategy, data):
    return [
        i
        for batch in data.as_distributed_dataset()
        for features, _ in strategy.experimental_local_results(batch)
        for i in features["id"].numpy().tolist()
    ]


def test_shuffled_passes_are_seeded_permutations_resumed_in_order(tmp_path):
    # shard(shuffle=True) over from_arrow: each pass a permutation of
    # (seed, pass), converted whole once; a resumed pass skips indices.
    _write_parquet(tmp_path / "data", _table(90), row_group_rows=10)
    strategy = helpers.mirrored(DEVICES[:2])

    def shuffled(seed):
        return kh.data.shard(
            _id_examples(tmp_path / "data"),
            8,
            strategy=strategy,
            shares=[3, 1],
            shuffle=True,
            seed=seed,
        )

    data = shuffled(5)
    passes = [_pass_ids(strategy, data) for _ in range(3)]
    for ids in passes:
        assert sorted(ids) == list(range(90))
    assert passes[0] != list(range(90))
    assert passes[0] != passes[1] != passes[2] != passes[0]
    resumed = shuffled(99)  # a new process: the checkpoint's seed wins
    resumed.resume_after(43, pass_number=1, seed=5)
    assert _pass_ids(strategy, resumed) == passes[1][43:]
    assert _pass_ids(strategy, resumed) == passes[2]
    # Skipped or shuffled before shard: tf.data's shuffle of what is left.
    skipped = kh.data.shard(
        _id_examples(tmp_path / "data").skip(10), 8, shuffle=True, seed=5
    )
    left = [
        i
        for features, _ in skipped.as_distributed_dataset()
        for i in features["id"].numpy().tolist()
    ]
    assert sorted(left) == list(range(10, 90)) and left != sorted(left)


def test_tables_readers_directories_globs_lists_and_ipc_agree(tmp_path):
    table = _table(50)
    paths = _write_parquet(tmp_path / "data", table, files=2)
    everything = list(range(50))
    ipc = tmp_path / "table.arrow"
    feather.write_feather(table, ipc, chunksize=16)
    for source in (
        table,
        tmp_path / "data",
        str(tmp_path / "data" / "part-*.parquet"),
        [str(p) for p in paths],
        ipc,
        [ipc],
    ):
        examples = kh.data.from_arrow(source, ["id", "x"])
        assert _ids(examples) == everything, source
        assert examples.cardinality() == 50, source
        assert _ids(examples.skip(21)) == everything[21:], source
    # Skips add up; a negative one skips everything, as in tf.data.
    examples = kh.data.from_arrow(paths, ["id"])
    assert _ids(examples.skip(10).skip(5)) == everything[15:]
    assert _ids(examples.skip(tf.constant(-1, tf.int64)).skip(3)) == []
    assert examples.skip(-1).cardinality() == 0
    # Order is the order given.
    assert _ids(kh.data.from_arrow([paths[1], paths[0]], ["id"])) == (
        everything[25:] + everything[:25]
    )
    mixed = kh.data.from_arrow([ipc, tmp_path / "data"], ["id"])
    assert _ids(mixed) == everything + everything
    # A reader: length unknown, read once.
    examples = kh.data.from_arrow(table.to_reader(max_chunksize=7), ["id"])
    assert examples.cardinality() == tf.data.UNKNOWN_CARDINALITY
    assert _ids(examples) == everything
    with pytest.raises(tf.errors.OpError, match="read only once"):
        _ids(examples)


def test_column_types_become_tensors(tmp_path):
    image = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    table = pa.table(
        {
            "i8": pa.array([-1, 2], pa.int8()),
            "u16": pa.array([1, 60000], pa.uint16()),
            "f16": pa.array([0.5, 1.5], pa.float16()),
            "f64": [0.25, 1e300],
            "flag": [True, False],
            "text": ["a", "bé"],
            "big_text": pa.array(["x", "y"], pa.large_string()),
            "blob": pa.array([b"\x00\x01", b""], pa.binary()),
            "category": pa.array(["p", "q"]).dictionary_encode(),
            "image": pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(pa.array(image.ravel()), 4),
                3,
            ),
            "ragged_type": pa.array([[1.0, 2.0], [3.0, 4.0]]),
            "flat": pa.FixedSizeListArray.from_arrays(pa.array(range(12)), 6),
        }
    )
    pq.write_table(table, tmp_path / "types.parquet")
    examples = kh.data.from_arrow(
        tmp_path / "types.parquet",
        shapes={"ragged_type": (2,), "flat": (2, 3)},
    )
    spec = examples.element_spec
    expected = {
        "i8": (tf.int8, ()),
        "u16": (tf.uint16, ()),
        "f16": (tf.float16, ()),
        "f64": (tf.float64, ()),
        "flag": (tf.bool, ()),
        "text": (tf.string, ()),
        "big_text": (tf.string, ()),
        "blob": (tf.string, ()),
        "category": (tf.string, ()),
        "image": (tf.uint8, (3, 4)),
        "ragged_type": (tf.float64, (2,)),
        "flat": (tf.int64, (2, 3)),
    }
    assert {k: (s.dtype, tuple(s.shape)) for k, s in spec.items()} == expected
    values = next(iter(examples.batch(2).as_numpy_iterator()))
    np.testing.assert_array_equal(values["image"], image)
    np.testing.assert_array_equal(values["u16"], [1, 60000])
    np.testing.assert_array_equal(values["f64"], [0.25, 1e300])
    assert values["text"].tolist() == ["a".encode(), "bé".encode()]
    assert values["blob"].tolist() == [b"\x00\x01", b""]
    assert values["category"].tolist() == [b"p", b"q"]
    np.testing.assert_array_equal(values["ragged_type"], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(
        values["flat"], np.arange(12).reshape(2, 2, 3)
    )


def test_nulls_fail_with_their_count_unless_filled(tmp_path):
    table = pa.table(
        {
            "a": pa.array([1.0, None, None, 4.0, None], pa.float32()),
            "v": pa.array(
                [[1, 2], None, [3, None], [5, 6], [7, 8]],
                pa.list_(pa.int32(), 2),
            ),
            "s": ["p", None, "q", "r", "s"],
        }
    )
    pq.write_table(table, tmp_path / "nulls.parquet")
    # From the Parquet statistics and the table: before any reading.
    for source in (tmp_path / "nulls.parquet", table):
        with pytest.raises(ValueError, match="'a' has 3 null value"):
            kh.data.from_arrow(source, ["a"])
    # Found while reading (no statistics): the iteration fails.
    examples = kh.data.from_arrow(table.to_reader(), ["v"])
    with pytest.raises(tf.errors.OpError, match="'v' has 1 null row"):
        _ids_or_values(examples)
    # pyarrow < 26 (the newest for Python 3.10 is 25.0.1) cannot read a
    # null row of a fixed-size list back from Parquet itself
    # (`pq.read_table` fails: "Expected all lists to be of size=2 but index
    # 2 had size=0"); the in-memory table shows the same filling there.
    filled = tmp_path / "nulls.parquet"
    if int(pa.__version__.split(".")[0]) < 26:
        filled = table
    examples = kh.data.from_arrow(
        filled, fill_null={"a": -1.0, "v": 0, "s": "?"}
    )
    values = _ids_or_values(examples)
    np.testing.assert_array_equal(values["a"], [1, -1, -1, 4, -1])
    # A null list fills the whole example, a null inside a list its place.
    np.testing.assert_array_equal(
        values["v"], [[1, 2], [0, 0], [3, 0], [5, 6], [7, 8]]
    )
    assert values["s"].tolist() == [b"p", b"?", b"q", b"r", b"s"]
    everywhere = kh.data.from_arrow(table, ["a", "v"], fill_null=7)
    np.testing.assert_array_equal(
        _ids_or_values(everywhere)["v"][1:3], [[7, 7], [3, 7]]
    )


def _ids_or_values(examples):
    return next(iter(examples.batch(1000).as_numpy_iterator()))


def test_bad_columns_are_named(tmp_path):
    table = pa.table(
        {
            "id": [1, 2],
            "when": pa.array([0, 1], pa.timestamp("s")),
            "tags": pa.array([[1.0], [2.0, 3.0]]),
            "pair": pa.array(
                [[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float64(), 2)
            ),
        }
    )
    with pytest.raises(
        ValueError,
        match=re.escape("['nope'] not found")
        + ".*"
        + re.escape("Available columns: ['id', 'when', 'tags', 'pair']"),
    ):
        kh.data.from_arrow(table, ["id", "nope"])
    with pytest.raises(TypeError, match=r"'when' has type timestamp\[s\]"):
        kh.data.from_arrow(table, ["when"])
    with pytest.raises(TypeError, match="'tags' has type list<.*variable-len"):
        kh.data.from_arrow(table, ["tags"])
    with pytest.raises(tf.errors.OpError, match="'tags': row 1 holds 2 val"):
        _ids_or_values(kh.data.from_arrow(table, ["tags"], shapes={"tags": 1}))
    with pytest.raises(ValueError, match=r"shapes\['pair'\]=\(3,\)"):
        kh.data.from_arrow(table, ["pair"], shapes={"pair": (3,)})
    with pytest.raises(ValueError, match="fill_null.*'abc' for column 'id'"):
        kh.data.from_arrow(table, ["id"], fill_null={"id": "abc"})
    with pytest.raises(ValueError, match=r"keys \['other'\]"):
        kh.data.from_arrow(table, ["id"], fill_null={"other": 0})
    with pytest.raises(ValueError, match=r"\['id'\] are used more than once"):
        kh.data.from_arrow(table, ["id"], label="id")
    with pytest.raises(ValueError, match="sample_weight='id' without a `lab"):
        kh.data.from_arrow(table, ["pair"], sample_weight="id")
    with pytest.raises(ValueError, match="batch_rows=0"):
        kh.data.from_arrow(table, ["id"], batch_rows=0)
    with pytest.raises(TypeError, match="Received: 3 of type int"):
        kh.data.from_arrow(3)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        kh.data.from_arrow(tmp_path / "missing.parquet")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt' is neither a Parquet"):
        kh.data.from_arrow(tmp_path / "notes.txt")
    pq.write_table(table.select(["id"]), tmp_path / "a.parquet")
    ints = pa.table({"id": pa.array([1, 2], pa.int32())})
    pq.write_table(ints, tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="'id' has type int32 in .*b.parquet"):
        kh.data.from_arrow(str(tmp_path / "*.parquet"))


def test_without_pyarrow_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(
        ImportError, match=re.escape('pip install "pyarrow>=15"')
    ):
        kh.data.from_arrow("data.parquet")


def test_ipc_row_count_without_count_rows():
    batches = [pa.record_batch({"id": list(range(n))}) for n in (3, 0, 4)]

    class OlderReader:  # a pyarrow without RecordBatchFileReader.count_rows
        num_record_batches = len(batches)

        def get_batch(self, index):
            return batches[index]

    assert arrow_lib._ipc_rows(OlderReader()) == 7


def _run(code, *args):
    """Runs `code` in a fresh interpreter; its last line of output as JSON."""
    result = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_keras_hetero_works_without_pyarrow():
    # pyarrow is imported only by from_arrow. (Whether it is loaded after
    # `import keras_hetero` depends on the environment: Keras imports pandas
    # when installed, and pandas imports pyarrow.) With pyarrow made
    # unimportable, the rest of keras_hetero still imports and works.
    message = _run(
        "import json, sys\n"
        "sys.modules['pyarrow'] = None\n"
        "import keras_hetero as kh\n"
        "import tensorflow as tf\n"
        "kh.data.shard(tf.data.Dataset.range(8), 4)\n"
        "try:\n"
        "    kh.data.from_arrow('missing.parquet')\n"
        "except ImportError as error:\n"
        "    print(json.dumps(str(error)))\n"
    )
    assert 'pip install "pyarrow>=15"' in message


_MEMORY_PROBE = """
import json, os, resource, sys
import keras_hetero as kh

def peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

path, batch_rows = sys.argv[1], int(sys.argv[2])
examples = kh.data.from_arrow(path, "x", label="id", batch_rows=batch_rows)
batches = iter(examples.batch(batch_rows))
rows = sum(len(next(batches)[1]) for _ in range(8))  # warm up TF, pyarrow
before = peak_bytes()
rows += sum(len(ids) for _, ids in batches)
print(json.dumps({"rows": rows, "growth": peak_bytes() - before}))
"""


@pytest.mark.slow
def test_peak_memory_stays_bounded_on_a_file_far_larger_than_the_buffer(
    tmp_path,
):
    path = tmp_path / "big.parquet"
    width, chunk_rows, chunks = 64, 100_000, 8
    schema = pa.schema(
        [("id", pa.int64()), ("x", pa.list_(pa.float32(), width))]
    )
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for chunk in range(chunks):
            x = rng.random((chunk_rows, width), dtype=np.float32)
            ids = np.arange(chunk * chunk_rows, (chunk + 1) * chunk_rows)
            values = pa.FixedSizeListArray.from_arrays(
                pa.array(x.ravel()), width
            )
            writer.write_table(
                pa.table({"id": ids, "x": values}, schema=schema),
                row_group_size=chunk_rows,
            )
    size = path.stat().st_size
    batch_rows = 2048
    buffer = batch_rows * (width * 4 + 8)  # one record batch: ~0.5 MB
    assert size > 300 * buffer
    measured = _run(_MEMORY_PROBE, path, batch_rows)
    assert measured["rows"] == chunk_rows * chunks
    # Measured here: no growth at all after the warm-up. Pre-buffering
    # pyarrow's way (whole row groups ahead) grows it by a third of the file.
    assert measured["growth"] < size / 10, (measured, size)


@pytest.mark.slow
def test_two_workers_see_every_parquet_row_once_per_epoch(tmp_path):
    rows, global_batch = 24 * 16 + 5, 24
    table = _table(rows)
    _write_parquet(tmp_path / "data", table, row_group_rows=20)
    results = kh.testing.run_workers(
        arrow_workers.fit_parquet_ids_mwms,
        2,
        timeout=240,
        args=(str(tmp_path / "data"), global_batch),
    )
    first, second = (r.value for r in results)
    assert first["changes"] == second["changes"]
    assert len(first["changes"]) >= 1  # the shares moved
    counts = np.bincount(first["seen"] + second["seen"], minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)
    # And the math is one device's on the same global batches.
    reference = helpers.id_model([], 0.0)
    reference.set_weights(first["initial"])
    x, y, _, ids = helpers.arrays(rows)
    reference.fit(
        tf.data.Dataset.from_tensor_slices(({"x": x, "id": ids}, y)).batch(
            global_batch
        ),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(first["weights"], reference.get_weights())


@pytest.mark.slow
@pytest.mark.both_flavours
def test_two_workers_each_read_their_own_row_groups(tmp_path):
    # reads="own": each worker reads only the row groups dealt to it, the
    # shares move (ShardRebalancer), every row trains once per epoch, and
    # the weights are one device's on the global batches the queue made.
    rows, global_batch, group = 24 * 16 + 5, 24, 8
    table = _table(rows)
    paths = _write_parquet(tmp_path / "data", table, row_group_rows=group)
    results = kh.testing.run_workers(
        arrow_workers.fit_parquet_ids_mwms,
        2,
        timeout=240,
        args=(str(tmp_path / "data"), global_batch, "own"),
    )
    first, second = (r.value for r in results)
    assert first["changes"] == second["changes"]
    assert len(first["changes"]) >= 1  # the shares moved
    assert first["steps"][:2] == second["steps"][:2]
    counts = np.bincount(first["seen"] + second["seen"], minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)

    # Read about once between them: row groups, bytes (the footers'
    # compressed sizes of the columns read), for the two epochs' passes
    # (under tf-keras each worker also reads ahead into a third).
    def read(what, worker=None):
        workers = [first, second] if worker is None else [worker]
        return sum(
            w["read"]["passes"][number][what]
            for w in workers
            for number in (0, 1)
        )

    assert 2 * rows <= read("rows") <= 1.10 * 2 * rows, read("rows")
    assert read("rows", first) < 1.5 * rows
    footers = [pq.ParquetFile(path).metadata for path in paths]
    groups = [f.row_group(g) for f in footers for g in range(f.num_row_groups)]
    column_bytes = sum(
        group.column(c).total_compressed_size
        for group in groups
        for c in range(group.num_columns)
        if group.column(c).path_in_schema.split(".")[0] in ("x", "id", "y")
    )
    assert 2 * column_bytes <= read("bytes") <= 1.10 * 2 * column_bytes
    # One device on the global batches the block queue composed.
    block_rows = [group.num_rows for group in groups]
    starts = np.concatenate([[0], np.cumsum(block_rows)])
    order = []
    for epoch in first["steps"][:2]:  # tf-keras: a third read ahead
        batches = blocks_lib.compose(
            block_rows, range(len(block_rows)), epoch, 1
        )
        order.extend(starts[b] + r for batch in batches for b, r in batch)
    order = np.asarray(order)
    assert sorted(order[:rows]) == list(range(rows))
    assert not np.array_equal(order[:rows], np.arange(rows))  # composed
    reference = helpers.id_model([], 0.0)
    reference.set_weights(first["initial"])
    x, y, _, ids = helpers.arrays(rows)
    epoch_order = [order[:rows], order[rows : 2 * rows]]
    for part in epoch_order:
        reference.fit(
            tf.data.Dataset.from_tensor_slices(
                ({"x": x[part], "id": ids[part]}, y[part])
            ).batch(global_batch),
            epochs=1,
            verbose=0,
        )
    helpers.assert_weights_close(first["weights"], reference.get_weights())


@pytest.mark.parametrize("reads", ["all", "own"])
def test_a_file_changed_under_a_running_job_is_named(tmp_path, reads):
    paths = _write_parquet(tmp_path / "data", _table(60), row_group_rows=10)
    data = kh.data.shard(
        _id_examples(tmp_path / "data", batch_rows=10), 20, reads=reads
    )
    assert len(list(data.as_distributed_dataset())) == 3
    # Rewritten in place (another size, a newer time): refused on reading.
    pq.write_table(_table(70).slice(0, 25), paths[1], row_group_size=10)
    with pytest.raises(Exception, match=r"part-00001.parquet' changed while"):
        list(data.as_distributed_dataset())
