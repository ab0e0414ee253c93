"""kh.data.index_tfrecords / from_tfrecords: TFRecords read by offsets,
each worker its own records under kh.data.shard(reads="own")."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from tests.conftest import DEVICES
from tests.support import arrow_workers
from tests.support import helpers


def _records(tmp_path, rows=40, files=2):
    directory = tmp_path / "records"
    paths = arrow_workers.write_id_tfrecords(str(directory), rows, files)
    return directory, paths


def _ids(batches):
    return [int(i) for x, _ in batches for i in x["id"].numpy()]


def test_records_are_tfrecorddatasets_in_file_order(tmp_path):
    directory, paths = _records(tmp_path)
    indexes = kh.data.index_tfrecords(directory)
    assert indexes == [path + ".idx" for path in paths]
    records = kh.data.from_tfrecords(directory, records_per_block=6)
    assert int(records.cardinality()) == 40
    assert records.element_spec == tf.TensorSpec((), tf.string)
    expected = list(tf.data.TFRecordDataset(paths).as_numpy_iterator())
    assert list(records.as_numpy_iterator()) == expected
    # Resuming seeks: `skip` reads no record before the first it yields.
    assert list(records.skip(13).as_numpy_iterator()) == expected[13:]


@pytest.mark.parametrize("shuffle", [None, True])
def test_reads_own_on_one_worker_reads_every_record_once(tmp_path, shuffle):
    directory, _ = _records(tmp_path)
    kh.data.index_tfrecords(directory)
    strategy = helpers.mirrored(DEVICES[:2])
    data = kh.data.shard(
        kh.data.from_tfrecords(directory, records_per_block=6),
        16,
        strategy=strategy,
        shares=[3, 1],
        reads="own",
        shuffle=shuffle,
        seed=4,
        map_fn=arrow_workers.parse_id_records,
    )
    ids = []
    for x, _ in data.as_distributed_dataset():
        for part in strategy.experimental_local_results(x["id"]):
            ids.extend(int(i) for i in part.numpy())
    assert sorted(ids) == list(range(40))
    assert (ids == list(range(40))) == (shuffle is None)
    assert data.reads_done["rows"] == 40


def test_an_index_that_does_not_match_its_file_is_named(tmp_path):
    directory, paths = _records(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"index_tfrecords\("):
        kh.data.from_tfrecords(directory)
    kh.data.index_tfrecords(directory)
    index = paths[0] + ".idx"
    lines = open(index).read().splitlines()
    # The file grew after it was indexed.
    size = os.path.getsize(paths[0])
    with open(paths[0], "ab") as file, open(paths[1], "rb") as other:
        file.write(other.read(100))
    with pytest.raises(ValueError, match=r"does not match .* changed after"):
        kh.data.from_tfrecords(directory)
    os.truncate(paths[0], size)
    # Sizes that cover the file but split it elsewhere: found on reading.
    first, second = (line.split() for line in lines[:2])
    lines[0] = f"0 {int(first[1]) + 8}"
    lines[1] = f"{int(first[1]) + 8} {int(second[1]) - 8}"
    open(index, "w").write("\n".join(lines) + "\n")
    records = kh.data.from_tfrecords(directory)
    with pytest.raises(Exception, match=r"record 0 .* the index says"):
        list(records.as_numpy_iterator())
    with pytest.raises(ValueError, match=r"records_per_block"):
        kh.data.from_tfrecords(directory, records_per_block=0)


def test_compressed_and_missing_files_are_refused(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    with tf.io.TFRecordWriter(path, options="GZIP") as writer:
        for _ in range(3):
            writer.write(b"x" * 50)
    with pytest.raises(ValueError, match=r"not an uncompressed TFRecord"):
        kh.data.index_tfrecords(path)
    with pytest.raises(FileNotFoundError, match=r"matching any file"):
        kh.data.index_tfrecords(str(tmp_path / "none-*.tfrecord"))
    with pytest.raises(TypeError, match=r"Expected a TFRecord file path"):
        kh.data.from_tfrecords(3)


@pytest.mark.slow
@pytest.mark.both_flavours
def test_two_workers_each_read_their_own_records(tmp_path):
    # Indexed TFRecords, reads="own", parsed in map_fn, shares moved by a
    # ShardRebalancer: every record once per epoch, read about once
    # between the two workers (bytes: the records' framed sizes).
    rows, global_batch = 24 * 10 + 5, 24
    directory, paths = _records(tmp_path, rows, files=3)
    kh.data.index_tfrecords(directory)
    results = kh.testing.run_workers(
        arrow_workers.fit_tfrecord_ids_mwms,
        2,
        timeout=240,
        args=(str(directory), global_batch, 8),
    )
    first, second = (r.value for r in results)
    assert first["changes"] >= 1  # the shares moved
    counts = np.bincount(first["seen"] + second["seen"], minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)
    size = sum(os.path.getsize(path) for path in paths)
    for what, whole in (("rows", rows), ("bytes", size)):
        read = sum(
            w["read"]["passes"][number][what]
            for w in (first, second)
            for number in (0, 1)
        )
        assert 2 * whole <= read <= 1.10 * 2 * whole, (what, read, whole)


def test_a_file_changed_under_a_running_job_is_named(tmp_path):
    directory, paths = _records(tmp_path)
    kh.data.index_tfrecords(directory)
    data = kh.data.shard(
        kh.data.from_tfrecords(directory, records_per_block=6),
        16,
        reads="own",
        map_fn=arrow_workers.parse_id_records,
    )
    assert len(list(data.as_distributed_dataset())) == 3
    os.utime(paths[0], ns=(1, 1))  # the same bytes, another time
    with pytest.raises(Exception, match=r"00000.tfrecord' changed while"):
        list(data.as_distributed_dataset())
