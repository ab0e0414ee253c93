"""kh.data.shard on one worker: contiguous, exactly-once slices by shares."""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from tests.conftest import DEVICES
from tests.support import helpers


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


def _pass_ids(strategy, dataset):
    """The ids of one pass over `dataset`, in global batch order."""
    return [
        row
        for parts in _slices(strategy, dataset.as_distributed_dataset())
        for part in parts
        for row in part
    ]


def _shuffled(strategy, shuffle, seed, rows=helpers.ROWS, source=None):
    ids = tf.data.Dataset.from_tensor_slices(np.arange(rows, dtype="int64"))
    if source == "buffer":
        ids = helpers.without_random_access(ids)
    return kh.data.shard(
        ids,
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.6, 0.4],
        shuffle=shuffle,
        seed=seed,
    )


@pytest.mark.parametrize("shuffle", [True, 20], ids=["whole-pass", "buffer"])
def test_shuffle_gives_each_pass_its_own_seeded_order(shuffle):
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = _shuffled(strategy, shuffle, seed=7)
    passes = [_pass_ids(strategy, dataset) for _ in range(3)]
    for ids in passes:
        assert sorted(ids) == list(range(helpers.ROWS))  # exactly once
    assert passes[0] != list(range(helpers.ROWS))
    assert passes[0] != passes[1] != passes[2] != passes[0]
    # The order of pass p is a function of (seed, p) alone: not of the
    # process's global TensorFlow seed, nor of the dataset object.
    tf.random.set_seed(12345)
    again = _shuffled(strategy, shuffle, seed=7)
    assert [_pass_ids(strategy, again) for _ in range(3)] == passes
    other = _shuffled(strategy, shuffle, seed=8)
    assert _pass_ids(strategy, other) != passes[0]
    if shuffle == 20:  # output k is one of the first k + 20 examples
        assert all(row < k + 20 for k, row in enumerate(passes[0]))


@pytest.mark.parametrize("source", ["random-access", "buffer"])
def test_resume_after_repeats_the_interrupted_pass_order(source):
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = _shuffled(strategy, True, seed=3, source=source)
    passes = [_pass_ids(strategy, dataset) for _ in range(3)]
    for ids in passes:
        assert sorted(ids) == list(range(helpers.ROWS))
    assert passes[0] != passes[1] != list(range(helpers.ROWS))
    # A new process resumes pass 2 after 20 of its examples, with the
    # checkpoint's seed (its own would differ).
    resumed = _shuffled(strategy, True, seed=99, source=source)
    resumed.resume_after(20, pass_number=2, seed=3)
    assert _pass_ids(strategy, resumed) == passes[2][20:]
    assert resumed.next_pass == 3
    # It then counts on: its pass 3 is pass 3 of seed 3 everywhere.
    check = _shuffled(strategy, True, seed=3, source=source)
    check.resume_after(0, pass_number=3)
    assert _pass_ids(strategy, resumed) == _pass_ids(strategy, check)


@pytest.mark.parametrize("source", ["random-access", "buffer"])
def test_resumed_whole_pass_shuffle_reads_only_what_it_skips(source):
    # shuffle=True over random-access examples (tf.data's global shuffle)
    # starts a resumed pass after fetching the skipped examples only; a
    # shuffle buffer reads the whole pass first.
    rows, skip = 1000, 100
    reads = []

    def read(i):
        reads.append(int(i))
        return i

    ids = tf.data.Dataset.from_tensor_slices(np.arange(rows, dtype="int64"))
    ids = ids.map(lambda i: tf.numpy_function(read, [i], tf.int64))
    if source == "buffer":
        ids = helpers.without_random_access(ids)
    data = kh.data.shard(ids, helpers.GLOBAL_BATCH, shuffle=True, seed=4)
    data.resume_after(skip, pass_number=0)
    iterator = iter(data.as_distributed_dataset())
    first = np.asarray(next(iterator)).tolist()
    read_before_first = len(reads)
    rest = [i for batch in iterator for i in np.asarray(batch).tolist()]
    normal = kh.data.shard(ids, helpers.GLOBAL_BATCH, shuffle=True, seed=4)
    order = [
        i
        for batch in normal.as_distributed_dataset()
        for i in np.asarray(batch).tolist()
    ]
    assert sorted(order) == list(range(rows))
    assert first + rest == order[skip:]
    if source == "buffer":
        assert read_before_first >= rows
    else:  # the skipped examples, the first batch, a few ahead, the probe
        assert read_before_first <= skip + 4 * helpers.GLOBAL_BATCH + 1


def test_without_seed_one_is_drawn_from_numpy_when_iterated():
    strategy = helpers.mirrored(DEVICES[:2])
    first, second = (_shuffled(strategy, True, None) for _ in range(2))
    assert first.seed is None
    np.random.seed(11)
    order = _pass_ids(strategy, first)
    np.random.seed(11)
    assert _pass_ids(strategy, second) == order
    assert first.seed == second.seed is not None
    assert _shuffled(strategy, None, None).shuffling is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shuffle": 0}, "shuffle=0"),
        ({"shuffle": -5}, "buffer size"),
        ({"shuffle": "yes"}, "shuffle='yes'"),
        ({"shuffle": 2.5}, "shuffle=2.5"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 1.5}, "seed=1.5"),
    ],
)
def test_bad_shuffle_and_seed_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kh.data.shard(helpers.examples(), 16, **kwargs)


def test_whole_pass_shuffle_needs_a_known_number_of_examples():
    unknown = helpers.examples().filter(lambda x, y: True)
    with pytest.raises(ValueError, match="unknown or infinite"):
        kh.data.shard(unknown, 16, shuffle=True)
    assert kh.data.shard(unknown, 16, shuffle=100).shuffling == 100


def test_with_options_prefetch_and_cache_keep_the_split():
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = _ids_dataset(strategy, [0.7, 0.3])
    expected = list(_slices(strategy, dataset.as_distributed_dataset()))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    options.threading.private_threadpool_size = 2
    view = dataset.with_options(options).prefetch(2).cache()
    assert list(_slices(strategy, view.as_distributed_dataset())) == expected
    pipeline = view._pipeline(tf.distribute.InputContext(), repeat=False)
    assert pipeline.options().threading.private_threadpool_size == 2
    # A view shares the shares: a ShardRebalancer of either moves both.
    dataset.shares = [0.25, 0.75]
    np.testing.assert_allclose(view.shares, [0.25, 0.75])


@pytest.mark.parametrize("buffer_size", [None, 0, 3, tf.data.AUTOTUNE])
def test_prefetch_before_the_split_keeps_elements_and_share_changes(
    buffer_size,
):
    # `prefetch(n)` reads global batches ahead BEFORE the split (none by
    # default, 0 too). The bounds are read at the split, so a change of
    # shares made while iterating still splits every batch not yet split
    # by the new shares, and every example comes once, in order.
    strategy = helpers.mirrored(DEVICES[:2])
    dataset = _ids_dataset(strategy, [0.7, 0.3], rows=6 * helpers.GLOBAL_BATCH)
    if buffer_size is not None:
        dataset = dataset.prefetch(buffer_size)
    slices = _slices(strategy, dataset.as_distributed_dataset())
    parts = []
    for index in range(6):
        if index == 1:
            start = dataset.set_shares([0.25, 0.75], from_batch=4)
            assert start == (0, 4)
        parts.append(next(slices))
    rows = [[len(part) for part in batch] for batch in parts]
    big = helpers.GLOBAL_BATCH
    before = kh.data.rows_from_shares([0.7, 0.3], big).tolist()
    after = kh.data.rows_from_shares([0.25, 0.75], big).tolist()
    assert rows == [before] * 4 + [after] * 2
    flat = [row for batch in parts for part in batch for row in part]
    assert flat == list(range(6 * big))


@pytest.mark.parametrize(
    "bad", [-2, 1.5, "2", True, np.array([1, 2])], ids=repr
)
def test_prefetch_refuses_a_bad_buffer_size(bad):
    dataset = kh.data.shard(helpers.examples(), 16)
    with pytest.raises(ValueError, match="buffer_size=") as caught:
        dataset.prefetch(bad)
    assert repr(bad) in str(caught.value)
    assert "tf.data.AUTOTUNE" in str(caught.value)


def test_pipeline_runs_without_the_autotuning_thread():
    # With tf.data's autotuning thread, destroying the iterator of a fit
    # stopped mid-epoch blocked for as long as the fit had run (up to 60 s):
    # docs/benchmarks.md, "Input iterator teardown".
    dataset = _ids_dataset(helpers.mirrored(DEVICES[:2]), [0.5, 0.5])
    options = tf.data.Options()
    options.autotune.enabled = True
    for view in (dataset, dataset.with_options(options)):
        pipeline = view._pipeline(tf.distribute.InputContext(), repeat=False)
        assert pipeline.options().autotune.enabled is False


def test_with_options_refuses_what_breaks_exactly_once():
    dataset = kh.data.shard(helpers.examples(), 16)
    data_policy = tf.data.Options()
    data_policy.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    with pytest.raises(ValueError, match="auto_shard_policy"):
        dataset.with_options(data_policy)
    unordered = tf.data.Options()
    unordered.deterministic = False
    with pytest.raises(ValueError, match="deterministic=False"):
        dataset.with_options(unordered)
    with pytest.raises(TypeError, match="tf.data.Options"):
        dataset.with_options({"deterministic": True})


@pytest.mark.parametrize(
    "method, advice",
    [
        ("map", "map_fn="),
        ("batch", "global_batch_size="),
        ("shuffle", "shuffle="),
        ("repeat", "as_distributed_dataset"),
        ("filter", "before `kh.data.shard`"),
        ("cardinality", "num_batches"),
    ],
)
def test_other_tf_data_methods_say_what_to_use_instead(method, advice):
    dataset = kh.data.shard(helpers.examples(), 16)
    with pytest.raises(AttributeError, match=advice):
        getattr(dataset, method)
    assert not hasattr(dataset, method)
    with pytest.raises(AttributeError, match="no attribute 'spam'"):
        dataset.spam  # noqa: B018


def _batches(dataset, count):
    return [np.asarray(x) for x, _ in dataset.take(count).as_numpy_iterator()]


@pytest.mark.parametrize(
    "shuffle", [None, True, "buffer"], ids=["none", "whole-pass", "buffer"]
)
def test_parameter_server_dataset_is_the_one_device_batch_stream(shuffle):
    # 72 examples in global batches of 16: 5 per pass (the last of 8 rows).
    examples = helpers.examples()
    if shuffle == "buffer":  # shuffle=True without random access
        examples, shuffle = helpers.without_random_access(examples), True
    seed = 5 if shuffle else None
    one_device = kh.data.shard(
        examples, 16, shuffle=shuffle, seed=seed
    ).as_distributed_dataset()
    expected = _batches(one_device, 5) + _batches(one_device, 5)
    stream = kh.data.shard(
        examples, 16, shuffle=shuffle, seed=seed
    ).parameter_server_dataset()
    got = _batches(stream, 10)
    for g, w in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, w)
    if shuffle:
        assert not np.array_equal(expected[0], expected[5])
