"""`bucket_bytes`: the gradient all-reduce in buckets, last layers first,
each bucket's collective waiting only for its own gradients."""

import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.testing.devices import local_collective
from keras_hetero.training import aggregation
from tests.conftest import DEVICES
from tests.support import helpers

# helpers' model: kernel 5x4, bias 4, kernel 4x1, bias 1 (float32): 80, 16,
# 16 and 4 bytes. At 16 bytes a bucket: [bias 1 + kernel 4x1], [bias 4],
# [kernel 5x4]; at 1 byte one bucket per variable.
SMALL_BUCKETS = {16: 3, 1: 4}


def test_buckets_go_last_gradient_first_and_close_at_the_size():
    grads = [tf.ones([20]), tf.ones([4]), None, tf.ones([4]), tf.ones([1])]
    assert aggregation.buckets(grads, 16) == [[4, 3], [1], [0]]
    assert aggregation.buckets(grads, 1) == [[4], [3], [1], [0]]
    # A model of at most `bucket_bytes` is one bucket.
    assert aggregation.buckets(grads, 116) == [[4, 3, 1, 0]]
    assert aggregation.buckets(grads, 10**9) == [[4, 3, 1, 0]]
    # Sizes on the wire: fp16 halves them.
    assert aggregation.buckets(grads, 16, "fp16") == [[4, 3, 1], [0]]
    assert aggregation.buckets([None, None], 16) == []
    sparse = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([0, 1, 2]), [9, 2])
    assert aggregation.buckets([tf.ones([4]), sparse], 24) == [[1], [0]]


@pytest.mark.parametrize("bucket_bytes", sorted(SMALL_BUCKETS))
@pytest.mark.parametrize(
    "shares", [[0.75, 0.25], [0.0, 1.0]], ids=["75_25", "0_100"]
)
def test_bucketed_fit_equals_one_device(bucket_bytes, shares):
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(
            regularizer=True, bucket_bytes=bucket_bytes
        )
    data = kh.data.shard(
        helpers.examples(sample_weights=True),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    history = model.fit(data, epochs=2, verbose=0)
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    for key in ("loss", "mae"):
        assert history.history[key] == pytest.approx(
            reference_history[key], rel=1e-5
        )
    expected_rows = kh.data.rows_from_shares(shares, 8)
    assert model.step_stats.rows.tolist() == expected_rows.tolist()


@pytest.mark.parametrize(
    "settings",
    [{"accumulation_steps": 2}, {"gradient_compression": "fp16"}],
    ids=["accumulation", "fp16_wire"],
)
def test_buckets_train_like_one_collective_with_other_settings(settings):
    weights = []
    for bucket_bytes in (None, 16):
        strategy = helpers.mirrored(DEVICES[:2])
        with strategy.scope():
            model = helpers.hetero_model(bucket_bytes=bucket_bytes, **settings)
        data = kh.data.shard(
            helpers.examples(),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=[0.75, 0.25],
        )
        model.fit(data, epochs=2, verbose=0)
        weights.append(model.get_weights())
    helpers.assert_weights_close(weights[1], weights[0])


def test_bucketed_fit_on_real_collectives_equals_one_device():
    # The collectives of MultiWorkerMirroredStrategy (CollectiveReduceV2,
    # ordering token), between two logical CPUs of this process.
    strategy = local_collective(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(bucket_bytes=16)
    data = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.25, 0.75],
    )
    history = model.fit(data, epochs=2, verbose=0)
    reference, reference_history = helpers.reference_fit()
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert history.history["loss"] == pytest.approx(
        reference_history["loss"], rel=1e-5
    )


def _ancestors(op, control=True):
    """The ops `op` waits for, transitively: by data and (with `control`)
    control edges."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        parents = [t.op for t in current.inputs]
        if control:
            parents += current.control_inputs
        for parent in parents:
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


def _collectives(graph, device):
    """The all-reduce ops on `device`, in the order they were made (the
    order their ordering token chains them in)."""
    return [
        op
        for op in graph.get_operations()
        if op.type.startswith("CollectiveReduce") and op.device.endswith(device)
    ]


def test_each_bucket_collective_waits_only_for_its_own_gradients():
    strategy = local_collective(DEVICES[:2])
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4, activation="tanh"),
                keras.layers.Dense(3, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
    traced = []

    def replica(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        stats = tf.stack([tf.add_n([tf.reduce_sum(g) for g in grads])])
        traced.append(([g.op.name for g in grads], stats.op.name))
        summed, _ = aggregation.aggregate(
            grads, stats, bucket_bytes=40, divisor=lambda s: s[0]
        )
        return summed

    function = tf.function(lambda x: strategy.run(replica, args=(x,)))
    graph = function.get_concrete_function(tf.TensorSpec([8, 5])).graph
    # Biases 1 and 3 and kernel 3x1 (4 + 4 + 12 bytes), then kernel 4x3
    # (48): the first bucket; bias 4 and kernel 5x4 the second.
    groups = [[5, 4, 3, 2], [1, 0]]
    shapes = [tf.zeros(v.shape) for v in model.trainable_variables]
    assert aggregation.buckets(shapes, 40) == groups
    for (grad_names, stats_name), device in zip(traced, ("CPU:0", "CPU:1")):
        collectives = _collectives(graph, device)
        assert len(collectives) == len(groups)
        issued = []
        for collective, positions in zip(collectives, groups):
            issued += positions
            by_data = _ancestors(collective, control=False)
            waits_for = _ancestors(collective)
            # Its data: its own bucket's gradients, none of the others'
            # (the last also carries the telemetry, read after all).
            assert {
                p for p, name in enumerate(grad_names) if name in by_data
            } == (set(issued) if positions == groups[-1] else set(positions))
            # In all (the ordering token's control edges): the buckets
            # issued before it too, never a later one's.
            assert {
                p for p, name in enumerate(grad_names) if name in waits_for
            } == set(issued)
        # The telemetry rides in the last bucket only.
        assert [stats_name in _ancestors(c) for c in collectives] == [
            False,
            True,
        ]


def _train_step_graph(bucket_bytes):
    """The graph of HeteroModel's train step on two replicas that
    all-reduce with the collective ops workers use, after one fit step."""
    strategy = local_collective(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(bucket_bytes=bucket_bytes)
    batches = strategy.experimental_distribute_dataset(
        helpers.examples().batch(helpers.GLOBAL_BATCH)
    )
    model.fit(batches, epochs=1, steps_per_epoch=1, verbose=0)
    function = tf.function(
        lambda data: strategy.run(model.train_step, args=(data,))
    )
    return function.get_concrete_function(next(iter(batches))).graph


def test_train_step_buckets_wait_for_part_of_the_backward_pass():
    graph = _train_step_graph(16)
    for device in ("CPU:0", "CPU:1"):
        collectives = _collectives(graph, device)
        assert len(collectives) == SMALL_BUCKETS[16]
        backward = [
            {n for n in _ancestors(c) if "gradient_tape" in n}
            for c in collectives
        ]
        # Each bucket waits for more of the backward pass than the one
        # before it: the first (the last layer) for part of it, the last
        # (the first layer, the telemetry) for all of it.
        for earlier, later in zip(backward, backward[1:]):
            assert earlier < later


def test_a_model_within_bucket_bytes_runs_one_collective():
    graph = _train_step_graph(116)
    assert len(_collectives(graph, "CPU:0")) == 1


@pytest.mark.parametrize("value", [0, -5, 1.5, "1MB", True])
def test_bucket_bytes_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="bucket_bytes"):
        kh.HeteroModel(*helpers.layers(), bucket_bytes=value)


def test_bucket_bytes_does_not_combine_with_other_splits():
    with pytest.raises(ValueError, match="low_communication"):
        kh.HeteroModel(
            *helpers.layers(),
            bucket_bytes=1024,
            low_communication=kh.LowCommunication(sync_every=4),
        )
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=1024
    )
    with pytest.raises(ValueError, match="bytes_per_pack=1024"):
        kh.HeteroModel(
            *helpers.layers(), bucket_bytes=1024, communication=options
        )


def test_bucket_bytes_round_trips_through_the_config():
    model = kh.HeteroModel(*helpers.layers(), bucket_bytes=4096)
    assert model.get_config()["bucket_bytes"] == 4096
    clone = kh.HeteroModel.from_config(model.get_config())
    assert clone.hetero_settings.bucket_bytes == 4096
