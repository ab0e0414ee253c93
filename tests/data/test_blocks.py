"""The block queue of kh.data.shard(reads="own") and its single-process
behaviour: exactly once whatever the shares, state, errors."""

import collections
import importlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import keras
from keras_hetero.data import blocks as blocks_lib
from keras_hetero.data import shares as shares_lib
from tests.conftest import DEVICES
from tests.support import helpers


def _random_pass(rng):
    """Blocks, an order, workers, replicas per worker and per-step rows
    per replica from random shares (some replicas at 0)."""
    block_rows = rng.integers(0, 40, rng.integers(1, 25))
    workers, local = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    batch = int(rng.integers(workers * local, 120))
    steps, left = [], int(block_rows.sum())
    while left > 0:
        shares = rng.random(workers * local) * (
            rng.random(workers * local) > 0.2
        )
        if shares.sum() == 0:
            shares[0] = 1
        rows = shares_lib.rows_from_shares(
            shares / shares.sum(), min(batch, left)
        )
        steps.append(rows.tolist())
        left -= min(batch, left)
    return block_rows, rng.permutation(len(block_rows)), workers, local, steps


def test_every_row_is_taken_once_whatever_the_shares():
    rng = np.random.default_rng(0)
    for trial in range(300):
        block_rows, order, _, local, steps = _random_pass(rng)
        batches = blocks_lib.compose(block_rows, order, steps, local)
        taken = collections.Counter(row for batch in batches for row in batch)
        expected = {(b, r) for b, n in enumerate(block_rows) for r in range(n)}
        assert set(taken) == expected, trial
        assert set(taken.values()) <= {1}, trial
        assert [len(b) for b in batches] == [sum(s) for s in steps], trial


def test_each_block_is_dealt_to_one_worker_but_at_a_pass_end():
    # Rows move between workers only when the pass has no block left to
    # deal: blocks read by two workers are few (bytes read ~1x).
    rng = np.random.default_rng(1)
    for _ in range(100):
        block_rows, order, workers, local, steps = _random_pass(rng)
        queue = blocks_lib.BlockQueue(block_rows, order, workers)
        readers = collections.defaultdict(set)
        for rows in steps:
            taken = queue.take(blocks_lib.worker_rows(rows, local))
            for worker, segments in enumerate(taken):
                for block, _, _ in segments:
                    readers[block].add(worker)
        shared = [b for b, w in readers.items() if len(w) > 1]
        assert len(shared) <= workers * (workers - 1), (shared, workers)


def test_one_worker_reads_the_blocks_in_order():
    queue = blocks_lib.BlockQueue([3, 5, 2], [0, 1, 2], 1)
    assert queue.take([4]) == [[(0, 0, 3), (1, 0, 1)]]
    assert queue.take([4]) == [[(1, 1, 5)]]
    assert queue.take([2]) == [[(2, 0, 2)]]
    assert queue.remaining_rows == 0


def test_a_pass_end_moves_rows_from_the_worker_with_most_to_spare():
    queue = blocks_lib.BlockQueue([10, 10], [0, 1], 2)
    # Worker 0 is dealt block 0, worker 1 block 1.
    assert queue.take([2, 2]) == [[(0, 0, 2)], [(1, 0, 2)]]
    # No block left: worker 0 needs 12 of its 8, takes 4 from the back
    # of worker 1's rows.
    assert queue.take([12, 4]) == [[(0, 2, 10), (1, 6, 10)], [(1, 2, 6)]]
    assert queue.remaining_rows == 0


class _CountingStream:
    """Blocks of `rows` rows (ids in values), counting the reads."""

    def __init__(self, block_rows):
        self.block_rows = list(block_rows)
        self.reads = collections.Counter()

    def blocks(self):
        return [(number, rows) for number, rows in enumerate(self.block_rows)]

    def read_block(self, block, first_row):
        self.reads[block[0]] += 1
        return {"id": np.arange(first_row, first_row + block[1])}, block[1]


def test_a_worker_keeps_a_block_a_step_after_its_rows_left_its_queue():
    # 4 workers, shares moving every 10 steps through 1:1, 3:1, 1:3, 9:1
    # per pair (benchmarks/input_reads.py): at the pass's end rows of a
    # block a worker just finished move to it again. Kept one step, it is
    # not read again: the worst worker reads 3% more rows than it trains
    # (11.6% when blocks were dropped at once).
    block_rows = [500] * 80
    moves = ([1, 1], [3, 1], [1, 3], [0.9, 0.1])
    streams = [_CountingStream(block_rows) for _ in range(4)]
    readers = [
        blocks_lib.BlockReader(stream, 1, worker, 4)
        for worker, stream in enumerate(streams)
    ]
    for reader in readers:
        reader.start_pass(0, None)
    left, step, trained, ids = 40_000, 0, np.zeros(4), []
    while left:
        pair = np.asarray(moves[0 if step < 14 else (step - 4) // 10 % 4])
        shares = np.tile(pair / pair.sum(), 2) / 2
        rows = shares_lib.rows_from_shares(shares, min(256, left))
        bounds = np.concatenate([[0], np.cumsum(rows)])
        for worker, reader in enumerate(readers):
            values = reader.step(bounds)
            if values is not None:
                ids.extend(values["id"].tolist())
                trained[worker] += len(values["id"])
        left -= min(256, left)
        step += 1
    assert sorted(ids) == list(range(40_000))
    read = np.array([reader.rows_read for reader in readers])
    assert read.sum() / 40_000 <= 1.03, read
    assert max(read / trained) <= 1.05, read / trained


def test_state_resumes_the_same_takes():
    rng = np.random.default_rng(2)
    block_rows, order, workers, local, steps = _random_pass(rng)
    whole = blocks_lib.BlockQueue(block_rows, order, workers)
    expected = [whole.take(blocks_lib.worker_rows(s, local)) for s in steps]
    for cut in range(len(steps) + 1):
        first = blocks_lib.BlockQueue(block_rows, order, workers)
        for rows in steps[:cut]:
            first.take(blocks_lib.worker_rows(rows, local))
        again = blocks_lib.BlockQueue(block_rows, order, workers)
        again.set_state(first.get_state())
        assert [
            again.take(blocks_lib.worker_rows(s, local)) for s in steps[cut:]
        ] == expected[cut:]


def test_bad_steps_and_states_are_named():
    queue = blocks_lib.BlockQueue([4], [0], 2)
    with pytest.raises(ValueError, match=r"expected 2 non-negative"):
        queue.take([1])
    with pytest.raises(ValueError, match=r"takes 5 rows .* has 4 left"):
        queue.take([3, 2])
    with pytest.raises(ValueError, match=r"3 worker\(s\) .* 2 worker\(s\)"):
        queue.set_state({"next": 0, "fifos": [[], [], []]})
    with pytest.raises(ValueError, match=r"each of the 2 blocks once"):
        blocks_lib.BlockQueue([4, 4], [0, 0], 1)


def _ids_table(rows):
    return pa.table(
        {
            "x": np.arange(rows, dtype="float32"),
            "id": np.arange(rows, dtype="int64"),
        }
    )


def _epoch_ids(data, strategy):
    ids = []
    for batch in data.as_distributed_dataset():
        ids.extend(
            int(i)
            for part in strategy.experimental_local_results(batch[1])
            for i in part.numpy()
        )
    return ids


@pytest.mark.parametrize("source", ["parquet", "ipc", "table"])
def test_one_worker_reads_its_blocks_once_and_in_order(tmp_path, source):
    # One worker: the queue deals every block to it in order, so the
    # global batches are `examples.batch(B)`'s; shuffled, a permutation.
    table, rows = _ids_table(50), 50
    if source == "parquet":
        pq.write_table(table, tmp_path / "a.parquet", row_group_size=7)
        given = tmp_path / "a.parquet"
    elif source == "ipc":
        feather.write_feather(table, tmp_path / "a.arrow", chunksize=7)
        given = tmp_path / "a.arrow"
    else:
        given = table
    strategy = helpers.mirrored(DEVICES[:2])
    examples = kh.data.from_arrow(given, "x", label="id", batch_rows=7)
    data = kh.data.shard(
        examples, 8, strategy=strategy, shares=[3, 1], reads="own"
    )
    assert data.reads == "own"
    assert _epoch_ids(data, strategy) == list(range(rows))
    assert data.reads_done["rows"] == rows
    assert data.reads_done["bytes"] > 0
    shuffled = kh.data.shard(
        examples, 8, strategy=strategy, reads="own", shuffle=True, seed=5
    )
    ids = _epoch_ids(shuffled, strategy)
    assert sorted(ids) == list(range(rows)) and ids != list(range(rows))
    assert shuffled.shuffle_mechanism == "block order and rows within blocks"


def test_what_reads_own_cannot_read_is_refused(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    table = _ids_table(20)
    examples = kh.data.from_arrow(table, "x", label="id")
    with pytest.raises(ValueError, match=r"reads='some'.*\"all\".*\"own\""):
        kh.data.shard(examples, 8, strategy=strategy, reads="some")
    with pytest.raises(ValueError, match=r"untransformed.*map_fn"):
        kh.data.shard(
            examples.map(lambda x, y: (x, y)), 8, strategy=strategy, reads="own"
        )
    with pytest.raises(ValueError, match=r"untransformed"):
        kh.data.shard(
            tf.data.Dataset.range(8), 8, strategy=strategy, reads="own"
        )
    with pytest.raises(ValueError, match=r"shuffle=16 with reads=\"own\""):
        kh.data.shard(examples, 8, strategy=strategy, reads="own", shuffle=16)
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches())
    with pytest.raises(ValueError, match=r"RecordBatchReader has no random"):
        kh.data.shard(
            kh.data.from_arrow(reader, "x", label="id"),
            8,
            strategy=strategy,
            reads="own",
        )
    data = kh.data.shard(examples, 8, strategy=strategy, reads="own")
    with pytest.raises(ValueError, match=r"`cache` has no use"):
        data.cache()


def test_several_workers_reading_all_of_files_are_told_once_how_not_to(
    tmp_path, monkeypatch, caplog
):
    # A one-time log line when each of several workers would read a
    # file-backed input whole (here: 2 workers, as `_distribute` says).
    shard_module = importlib.import_module("keras_hetero.data.shard")
    monkeypatch.setattr(shard_module._distribute, "num_workers", lambda s: 2)
    pq.write_table(_ids_table(20), tmp_path / "a.parquet", row_group_size=5)
    path = str(tmp_path / "a.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"record")
    kh.data.index_tfrecords(path)
    cases = [
        (tf.data.Dataset.range(8), "all", None),
        (kh.data.from_arrow(tmp_path / "a.parquet", "x"), "own", None),
        (
            kh.data.from_arrow(tmp_path / "a.parquet", "x"),
            "all",
            r"each of the 2 workers reads all 1 file\(s\) .*"
            r'reads="own"',
        ),
        (kh.data.from_tfrecords(path), "own", None),
        (
            kh.data.from_tfrecords(path),
            "all",
            r"reads all 1 file\(s\) of its .*from_tfrecords",
        ),
        (
            tf.data.TFRecordDataset([path]).map(lambda r: tf.strings.length(r)),
            "all",
            r"whole TFRecordDataset stream .* map_fn=",
        ),
    ]
    for examples, reads, expected in cases:
        monkeypatch.setattr(shard_module, "_ADVISED", [])
        caplog.clear()
        with caplog.at_level("WARNING", logger="keras_hetero"):
            kh.data.shard(examples, 4, reads=reads)
            kh.data.shard(examples, 4, reads=reads)
        said = [r.getMessage() for r in caplog.records]
        if expected is None:
            assert not said, said
        else:
            assert len(said) == 1, said  # once per process
            assert re.search(expected, said[0]), said


class SubclassedModel(kh.HeteroModel):
    """Built lazily, on the first batch."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def _model(kind):
    keras.utils.set_random_seed(1)
    if kind == "functional":
        inputs = keras.Input((helpers.FEATURES,))
        return kh.HeteroModel(inputs, keras.layers.Dense(1)(inputs))
    if kind == "sequential":
        return kh.HeteroSequential([keras.layers.Dense(1)])
    return SubclassedModel()


@pytest.mark.parametrize(
    "kind, steps_per_execution",
    [("functional", 1), ("sequential", 3), ("subclassed", 2)],
)
def test_one_worker_trains_evaluates_and_predicts_as_reads_all(
    tmp_path, kind, steps_per_execution
):
    # One worker is dealt every block in order: reads="own" must train,
    # evaluate and predict exactly as reads="all" (models built or not,
    # several steps per call).
    x, y, _, _ = helpers.arrays(70)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(
                pa.array(x.ravel()), helpers.FEATURES
            ),
            "y": y[:, 0],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=9)
    strategy = helpers.mirrored(DEVICES[:2])
    results = []
    for reads in ("all", "own"):
        examples = kh.data.from_arrow(
            tmp_path / "a.parquet", "x", label="y", shapes={"y": (1,)}
        )
        data = kh.data.shard(
            examples, 16, strategy=strategy, shares=[3, 1], reads=reads
        )
        with strategy.scope():
            model = _model(kind)
            model.compile(
                optimizer="sgd",
                loss="mse",
                steps_per_execution=steps_per_execution,
            )
        history = model.fit(data, epochs=2, verbose=0)
        results.append(
            (
                history.history["loss"],
                model.evaluate(data, verbose=0),
                model.predict(data, verbose=0),
                model.get_weights(),
            )
        )
    (loss, evaluated, predicted, weights), own = results
    assert own[0] == pytest.approx(loss, rel=1e-6)
    assert own[1] == pytest.approx(evaluated, rel=1e-6)
    np.testing.assert_allclose(own[2], predicted, rtol=1e-6)
    helpers.assert_weights_close(own[3], weights)


def test_a_mid_epoch_resume_needs_the_same_reads_and_workers(tmp_path):
    # ElasticCheckpoint's restore refuses, before the first step, what
    # would resume a reads="own" epoch on other global batches.
    from keras_hetero.checkpointing import resume

    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model()
    table = _ids_table(20)
    own = kh.data.shard(
        kh.data.from_arrow(table, "x", label="id"),
        8,
        strategy=strategy,
        reads="own",
    )
    every = kh.data.shard(
        kh.data.from_arrow(table, "x", label="id"), 8, strategy=strategy
    )
    queue = {"steps": 1, "queue": {"next": 1, "fifos": [[[0, 8, 20]]]}}
    saved = {"num_workers": 1, "input_state": queue}
    with pytest.raises(ValueError, match=r"read with reads='own'; this one"):
        resume._resume_reads("ckpt-1", saved, every, model)
    with pytest.raises(ValueError, match=r"read with reads='all'; this one"):
        resume._resume_reads("ckpt-1", {"num_workers": 1}, own, model)
    with pytest.raises(ValueError, match=r"by 2 worker\(s\) .* this job has 1"):
        resume._resume_reads("ckpt-1", {**saved, "num_workers": 2}, own, model)
    resume._resume_reads("ckpt-1", saved, own, model)  # as saved: fine
