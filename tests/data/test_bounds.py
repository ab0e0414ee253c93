"""The split's bounds in-graph (data/bounds.py): the same rows as the
schedule's Python rule, and a share change recorded where it took effect
even when the pipeline races past it."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero.data import bounds as bounds_lib
from keras_hetero.data import shares as shares_lib
from tests.conftest import DEVICES
from tests.support import helpers


def test_in_graph_rows_are_the_python_rows_bit_for_bit():
    rng = np.random.default_rng(0)
    cases = [
        ([1, 1, 1], 7),
        ([1, 1], 255),
        ([0, 1, 0], 16),
        ([0.6, 0.3, 0.1], 1),
        ([1e-9, 1, 1], 100),
        ([1, 2, 3, 4], 1000),
    ]
    for _ in range(300):
        replicas = int(rng.integers(1, 6))
        raw = rng.random(replicas) * (rng.random(replicas) > 0.2)
        if raw.sum() == 0:
            raw[0] = 1.0
        cases.append((raw, int(rng.integers(1, 600))))
    for raw, total in cases:
        shares = shares_lib.validate_shares(raw, len(raw))
        expected = shares_lib.rows_from_shares(shares, total)
        got = bounds_lib.rows_from_shares(
            tf.constant(shares, tf.float64), tf.constant(total, tf.int64)
        ).numpy()
        np.testing.assert_array_equal(got, expected, err_msg=f"{raw} {total}")


def test_keys_order_as_pass_and_index():
    positions = [(-1, 0), (0, 0), (0, 1), (0, 2**31), (1, 0), (7, 3)]
    keys = [bounds_lib.batch_key(p) for p in positions]
    assert keys == sorted(keys)
    assert [bounds_lib.batch_position(k) for k in keys] == positions


def _attached(shares=(0.5, 0.5)):
    schedule = shares_lib.ShareSchedule(np.asarray(shares, np.float64))
    split = bounds_lib.PipelineSplit(len(shares))
    schedule.attach(split)
    return schedule, split


def _claim(split, index, rows=16):
    return split.bounds(tf.constant(index, tf.int64), rows).numpy().tolist()


def test_pipeline_position_and_passes_come_from_the_graph():
    schedule, split = _attached()
    assert schedule.position == (0, 0) and schedule.passes_started == 0
    assert [_claim(split, i) for i in range(3)] == [[0, 8, 16]] * 3
    assert schedule.position == (0, 3) and schedule.passes_started == 1
    _claim(split, 0)  # index 0 starts the next pass
    assert schedule.position == (1, 1) and schedule.passes_started == 2


def test_a_change_ahead_of_the_pipeline_holds_from_its_batch():
    schedule, split = _attached()
    _claim(split, 0)
    assert schedule.set_shares(np.array([0.75, 0.25]), at=(0, 3)) == (0, 3)
    assert [_claim(split, i) for i in range(1, 5)] == [
        [0, 8, 16],
        [0, 8, 16],
        [0, 12, 16],
        [0, 12, 16],
    ]
    # The table copy keeps only what the pipeline can still reach; a
    # restored schedule replaces it.
    schedule.set_state({"changes": [((-1, 0), [0.25, 0.75])]})
    assert _claim(split, 5) == [0, 4, 16]


def _race(claim_before, claim_after):
    """A change meant from batch 2, written while the pipeline claims."""
    schedule, split = _attached()
    for index in range(claim_before):
        _claim(split, index)
    changes = schedule._replaced((0, 2), np.array([0.75, 0.25]))
    split._write(changes)
    split_rows = [
        _claim(split, index)
        for index in range(claim_before, claim_before + claim_after)
    ]
    return split._settle((0, 2), timeout=1.0), split_rows


def test_a_race_past_the_change_is_settled_where_the_new_split_began():
    # The pipeline had claimed batches 2 and 3 before the write: they kept
    # the old split; the change holds from batch 4.
    took, _ = _race(claim_before=4, claim_after=0)
    assert took == (0, 4)
    # Batch 2 before the write, 3 and 4 after it: from batch 3.
    took, rows = _race(claim_before=3, claim_after=2)
    assert took == (0, 3) and rows == [[0, 12, 16]] * 2
    # Nothing at or after batch 2 claimed before the write: as asked.
    took, rows = _race(claim_before=2, claim_after=2)
    assert took == (0, 2) and rows == [[0, 12, 16]] * 2


def test_settling_names_a_claimed_batch_that_never_read_its_split():
    schedule, split = _attached()
    # A claim with no record after it: what a pipeline stopped between its
    # two ops would leave.
    split._cursor.assign([0, 5])
    split._write(schedule._replaced((0, 2), np.array([1.0, 0.0])))
    with pytest.raises(RuntimeError, match=r"global batch \(0, 4\)"):
        split._settle((0, 2), timeout=0.05)


def test_changes_during_a_running_pipeline_are_recorded_as_applied():
    # Share changes "from the next batch" while the pipeline prefetches in
    # its own threads: wherever each lands, the record says which shares
    # split every batch, and each example comes once.
    strategy = helpers.mirrored(DEVICES[:2])
    rows = 16 * 120
    ids = tf.data.Dataset.from_tensor_slices(np.arange(rows, dtype="int64"))
    dataset = kh.data.shard(ids, 16, strategy=strategy, shares=[1, 1])
    rng = np.random.default_rng(1)
    stop = threading.Event()
    starts = []

    def change():
        while not stop.is_set():
            starts.append(dataset.set_shares(rng.random(2) + 0.01))

    seen, splits = [], []
    changer = threading.Thread(target=change)
    changer.start()
    try:
        for batch in dataset.as_distributed_dataset():
            parts = strategy.experimental_local_results(batch)
            splits.append([int(tf.shape(p)[0]) for p in parts])
            seen.extend(int(v) for p in parts for v in np.asarray(p))
    finally:
        stop.set()
        changer.join()
    assert sorted(seen) == list(range(rows)) and len(seen) == rows
    assert len(starts) > 10
    for index, split in enumerate(splits):
        shares = dataset.shares_for_batch((0, index))
        assert split == kh.data.rows_from_shares(shares, 16).tolist(), index


def test_the_state_is_a_plain_local_variable_inside_a_strategy_scope():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        split = bounds_lib.PipelineSplit(2)
    for variable in (split._cursor, split._table, split._seen):
        assert type(variable).__name__ == "ResourceVariable"
        assert not variable.trainable
