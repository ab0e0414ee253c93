"""kh.data.shard on one worker: contiguous, exactly-once slices by shares."""

import helpers
import numpy as np
import pytest
import tensorflow as tf
from conftest import DEVICES

import keras_hetero as kh


def _ids_dataset(strategy, shares, rows=helpers.ROWS):
    ids = tf.data.Dataset.from_tensor_slices(np.arange(rows, dtype="int64"))
    return kh.data.shard(
        ids, helpers.GLOBAL_BATCH, strategy=strategy, shares=shares
    )


def _slices(strategy, distributed):
    for batch in distributed:
        yield [
            np.asarray(part).tolist()
            for part in strategy.experimental_local_results(batch)
        ]


@pytest.mark.parametrize(
    "shares", [[1, 1, 1], [0.6, 0.3, 0.1], [0, 1, 0]], ids=str
)
def test_each_global_batch_is_split_contiguously_in_replica_order(shares):
    strategy = helpers.mirrored(DEVICES[:3])
    dataset = _ids_dataset(strategy, shares)
    seen = []
    for parts in _slices(strategy, dataset.as_distributed_dataset()):
        batch = [row for part in parts for row in part]
        total = len(batch)
        expected = kh.data.rows_from_shares(
            kh.data.validate_shares(shares, 3), total
        )
        assert [len(p) for p in parts] == expected.tolist()
        assert batch == list(range(batch[0], batch[0] + total))
        seen.extend(batch)
    assert seen == list(range(helpers.ROWS))


def test_share_changes_mid_epoch_keep_every_example_exactly_once():
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = _ids_dataset(strategy, [0.5, 0.5], rows=160)
    seen, rows, starts = [], [], {}
    plan = {2: [0.9, 0.1], 5: [0.0, 1.0], 7: [0.3, 0.7]}
    distributed = dataset.as_distributed_dataset()
    for step, parts in enumerate(_slices(strategy, distributed)):
        if step in plan:
            starts[step] = dataset.set_shares(plan[step])
        seen.extend(row for part in parts for row in part)
        rows.append([len(p) for p in parts])
    assert sorted(seen) == list(range(160))
    assert len(seen) == 160
    # A change applies from the next batch the pipeline has not split yet:
    # never to a batch already handed out.
    for step, start in starts.items():
        assert start[1] > step
    for index, split in enumerate(rows):
        shares = dataset.shares_for_batch((0, index))
        assert split == kh.data.rows_from_shares(shares, 16).tolist()


def test_from_batch_pins_the_change_to_a_global_batch_index():
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = _ids_dataset(strategy, [0.5, 0.5], rows=96)
    start = dataset.set_shares([0.75, 0.25], from_batch=3)
    assert start == (0, 3)
    rows = [
        [len(p) for p in parts]
        for parts in _slices(strategy, dataset.as_distributed_dataset())
    ]
    assert rows == [[8, 8]] * 3 + [[12, 4]] * 3
    assert dataset.position == (0, 6)
    # A second pass starts again at index 0 and keeps the latest split.
    again = [
        [len(p) for p in parts]
        for parts in _slices(strategy, dataset.as_distributed_dataset())
    ]
    assert again == [[12, 4]] * 6
    assert dataset.passes_started == 2


def test_sample_weighted_and_dict_examples_are_split_alike():
    strategy = helpers.mirrored(DEVICES[:2])
    x, y, weights, _ = helpers.arrays()
    examples = tf.data.Dataset.from_tensor_slices(({"features": x}, y, weights))
    dataset = kh.data.shard(examples, 16, strategy=strategy, shares=[3, 1])
    first = next(iter(dataset.as_distributed_dataset()))
    features, labels, sample_weight = (
        strategy.experimental_local_results(first[i]) for i in range(3)
    )
    assert [int(tf.shape(f["features"])[0]) for f in features] == [12, 4]
    np.testing.assert_array_equal(features[1]["features"], x[12:16])
    np.testing.assert_array_equal(labels[0], y[:12])
    np.testing.assert_array_equal(sample_weight[1], weights[12:16])
    assert dataset.rows.tolist() == [12, 4]
    assert dataset.num_batches == 5


def test_map_fn_runs_after_the_split_on_each_slice():
    strategy = helpers.mirrored(DEVICES[:2])
    x, y, _, _ = helpers.arrays()
    calls = []

    def scale(features, labels):
        calls.append(1)  # traced once; the map runs per slice
        return features * 2.0, labels

    examples = tf.data.Dataset.from_tensor_slices((x, y))
    dataset = kh.data.shard(
        examples, 16, strategy=strategy, shares=[3, 1], map_fn=scale
    )
    first = next(iter(dataset.as_distributed_dataset()))
    features = strategy.experimental_local_results(first[0])
    np.testing.assert_allclose(features[0], x[:12] * 2.0)
    np.testing.assert_allclose(features[1], x[12:16] * 2.0)
    with pytest.raises(TypeError, match="map_fn"):
        kh.data.shard(examples, 16, map_fn="decode")
