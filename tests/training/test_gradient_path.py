"""The gradient path after the backward pass: accumulation over micro-steps
with uneven rows, wire compression and communication options reaching the
collective, per-replica (ON_READ) state under uneven shares, and XLA."""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _distribute
from keras_hetero._compat import keras
from keras_hetero.training import aggregation
from keras_hetero.training import state
from tests.conftest import DEVICES
from tests.support import helpers

ROWS = 64  # 4 micro-steps of 16 per epoch: 2 updates of 32 rows at k = 2.


class RecordRows(keras.callbacks.Callback):
    """Records the rows each replica got per step."""

    def on_train_begin(self, logs=None):
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append(tuple(self.model.step_stats.rows.tolist()))


def alternate_shares(dataset, options):
    """Plans a different split for consecutive global batches of both
    epochs (a pass is an epoch under Keras 3, the whole fit under tf-keras)."""
    for batch in [(0, i) for i in range(8)] + [(1, i) for i in range(4)]:
        dataset.set_shares(options[batch[1] % len(options)], from_batch=batch)


@pytest.mark.parametrize("replicas", [1, 2])
def test_accumulation_with_uneven_shares_equals_one_big_step(replicas):
    reference = helpers.compile_model(keras.Model(*helpers.layers()))
    reference.set_weights(helpers.initial_weights())
    reference.fit(
        helpers.examples(rows=ROWS).batch(2 * helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    strategy = (
        helpers.mirrored(DEVICES[:2])
        if replicas == 2
        else tf.distribute.get_strategy()
    )
    with strategy.scope():
        model = helpers.hetero_model(accumulation_steps=2)
    options = [[0.75, 0.25], [0.125, 0.875]] if replicas == 2 else [[1.0]]
    data = kh.data.shard(
        helpers.examples(rows=ROWS),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=options[0],
    )
    alternate_shares(data, options)
    shares = RecordRows()
    model.fit(data, epochs=2, verbose=0, callbacks=[shares])

    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 4  # updates, not steps
    if replicas == 2:
        # The micro-steps of one update really had different splits.
        assert len(set(shares.rows)) >= 2, shares.rows


def test_accumulation_applies_only_on_the_kth_micro_step():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(accumulation_steps=3)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(
                (
                    int(model.optimizer.iterations.numpy()),
                    float(state.run_state(model).accumulator.rows.numpy()),
                )
            )

    data = kh.data.shard(
        helpers.examples(rows=ROWS), 16, strategy=strategy, shares=[0.5, 0.5]
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[Record()])
    # Micro-steps 1, 2 add up rows; the 3rd applies and clears; the 4th
    # starts the next sum (carried past the epoch end, not applied).
    assert seen == [(0, 16.0), (0, 32.0), (1, 0.0), (1, 16.0)]
    names, _ = kh._compat.checkpoint_variables(model)
    assert any("accumulated_rows" in name for name in names)


def test_overflow_in_one_micro_step_skips_the_whole_update(mixed_float16):
    strategy = helpers.mirrored(DEVICES[:2])
    armed = [False]
    with strategy.scope():
        model = helpers.poisoned_model(armed, accumulation_steps=2)
    history = []

    class Watch(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_batch_begin(self, batch, logs=None):
            self.step += 1
            armed[0] = self.step == 3  # first micro-step of update 2

        def on_train_batch_end(self, batch, logs=None):
            history.append(
                (
                    int(model.optimizer.iterations.numpy()),
                    int(state.run_state(model).loss_scale.skipped.numpy()),
                    model.loss_scale,
                    [w.copy() for w in model.get_weights()],
                )
            )

    data = kh.data.shard(
        helpers.examples(rows=96), 16, strategy=strategy, shares=[0.25, 0.75]
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[Watch()])
    iterations = [h[0] for h in history]
    skipped = [h[1] for h in history]
    scale = [h[2] for h in history]
    # Updates happen on micro-steps 2, 4, 6; the one on 4 holds the inf
    # of micro-step 3 and is skipped everywhere; the scale only changes
    # on update micro-steps.
    assert skipped[2] == skipped[1] and skipped[3] == skipped[1] + 1
    assert scale[3] == scale[2] / 2 and scale[2] == scale[1]
    assert iterations[3] == iterations[1]
    for before, after in zip(history[1][3], history[3][3]):
        np.testing.assert_array_equal(before, after)
    assert iterations[5] == iterations[3] + 1  # the next update trains
    assert all(np.all(np.isfinite(w)) for w in history[5][3])


def _collectives(timeout):
    """`(dtype, communication_hint)` of every all-reduce op traced so far
    whose timeout is `timeout` (a value unique to the calling test)."""
    from tensorflow.python.eager import context

    found = []
    ctx = context.context()
    for name in ctx.list_function_names():
        try:
            function = ctx.get_function_def(name)
        except tf.errors.NotFoundError:
            # Removed meanwhile: an input iterator's functions, the iterator
            # destroyed off the training thread after `fit`.
            continue
        for node in function.node_def:
            if not node.op.startswith("CollectiveReduce"):
                continue
            if node.attr["timeout_seconds"].f != pytest.approx(timeout):
                continue
            found.append(
                (
                    tf.as_dtype(node.attr["T"].type),
                    node.attr["communication_hint"].s.decode(),
                )
            )
    return found


@pytest.mark.parametrize(
    "compression, timeout", [("fp16", 17.0), ("bf16", 19.0), (None, 23.0)]
)
def test_collective_gets_the_wire_dtype_and_the_options(compression, timeout):
    # The train step's collective ops (MirroredStrategy on CPUs all-reduces
    # with CollectiveReduceV2) carry the wire dtype, the timeout and the
    # implementation hint given to HeteroModel.
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=1024,
        timeout_seconds=timeout,
        implementation=(
            tf.distribute.experimental.CommunicationImplementation.RING
        ),
    )
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model(
            gradient_compression=compression, communication=options
        )
    data = kh.data.shard(
        helpers.examples(), 16, strategy=strategy, shares=[0.75, 0.25]
    )
    model.fit(data, epochs=1, verbose=0)
    found = _collectives(timeout)
    wire = aggregation.WIRE_DTYPES.get(compression, tf.float32)
    dtypes = {dtype for dtype, _ in found}
    # Gradients in the wire dtype; the float32 telemetry travels with them
    # (in their collective when they are float32 too).
    assert dtypes == {wire, tf.float32}
    assert {hint for _, hint in found} == {"ring"}


def test_one_collective_per_step_for_gradients_telemetry_and_metrics():
    # The metric variables' replica sums travel in the gradients' collective
    # (a cross-replica read would reduce each variable on its own).
    from tensorflow.python.eager import context

    before = set(context.context().list_function_names())
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model()  # loss and "mae": 4 metric variables
    data = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.75, 0.25],
    )
    history = model.fit(data, epochs=1, verbose=0)
    # Per traced step function (Keras 3's `one_step_on_data`, tf-keras'
    # `train_function`, traced again for the epoch's last, smaller batch).
    reduces = [
        sum(
            node.op.startswith("CollectiveReduce")
            for node in context.context().get_function_def(name).node_def
        )
        for name in set(context.context().list_function_names()) - before
        if "train_function" in name or "one_step_on_data" in name
    ]
    # One per replica (tf-keras' metric results would add two per variable
    # in `merge_call`s).
    assert reduces and set(reduces) == {strategy.num_replicas_in_sync}
    reference, reference_history = helpers.reference_fit(epochs=1)
    for key in ("loss", "mae"):
        assert history.history[key] == pytest.approx(
            reference_history[key], rel=1e-5
        )


def test_first_local_replica_is_known_while_tracing():
    strategy = helpers.mirrored(DEVICES[:3])
    outputs = tf.function(
        lambda: strategy.run(
            lambda: tf.constant(_distribute.is_first_local_replica())
        )
    )()
    assert [bool(v) for v in strategy.experimental_local_results(outputs)] == [
        True,
        False,
        False,
    ]
    assert _distribute.is_first_local_replica() is True  # no replica context


def test_telemetry_added_once_per_step_and_exact_with_three_replicas():
    # Only the first replica adds the gathered stats to its copy of the
    # totals (a read takes that copy), and only its global rows order the
    # update: step_stats, the optimizer's steps and the weights are those
    # of every replica doing both.
    strategy = helpers.mirrored(DEVICES[:3])
    with strategy.scope():
        model = helpers.hetero_model()
    shares = [0.5, 0.25, 0.25]
    data = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    record = RecordRows()
    model.fit(data, epochs=2, verbose=0, callbacks=[record])
    reference, _ = helpers.reference_fit(epochs=2)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    steps = 2 * -(-helpers.ROWS // helpers.GLOBAL_BATCH)
    assert int(model.optimizer.iterations.numpy()) == steps
    full = kh.data.rows_from_shares(shares, helpers.GLOBAL_BATCH).tolist()
    last = kh.data.rows_from_shares(
        shares, helpers.ROWS % helpers.GLOBAL_BATCH
    ).tolist()
    assert record.rows == ([tuple(full)] * (steps // 2 - 1) + [tuple(last)]) * 2
    stats = model.step_stats
    assert stats.step == steps and stats.steps == 1
    assert np.all(stats.compute_seconds > 0)
    copies = state.run_state(model).telemetry.totals.values
    assert copies[0].numpy()[0] == steps
    assert not np.any(copies[1].numpy()) and not np.any(copies[2].numpy())


def _aggregate_on_replicas(grads_of, extra_of, path, **kwargs):
    """`aggregate` on 2 Mirrored replicas whose inputs differ by replica
    id: `path` is "packed" (must take the one-vector path) or "per tensor"
    (the per-gradient path, then `divide`)."""
    strategy = helpers.mirrored(DEVICES[:2])

    def replica():
        factor = tf.cast(_distribute.replica_id() + 1, tf.float32) / 3.0
        grads, extra = grads_of(factor), extra_of(factor)
        stats = tf.stack([factor * 7.0, 3.0 - factor, 0.25, factor])
        divisor = kwargs.get("divisor")
        if path == "packed":
            assert aggregation._packs_in_one(grads, stats, extra, None, None)
            return aggregation.aggregate(grads, stats, extra=extra, **kwargs)
        reduced = aggregation.all_reduce_sum(grads + [stats] + extra)
        summed_grads = reduced[: len(grads)]
        if divisor is not None:
            summed_grads = aggregation.divide(
                summed_grads, divisor(reduced[len(grads)])
            )
        return summed_grads, reduced[len(grads)], reduced[len(grads) + 1 :]

    outputs = tf.function(lambda: strategy.run(replica))()
    return tf.nest.map_structure(
        lambda v: None if v is None else strategy.experimental_local_results(v),
        outputs,
    )


@pytest.mark.parametrize("extra", ["scalars", "vectors", "none"])
@pytest.mark.parametrize("divided", [True, False])
def test_packed_collective_gives_the_same_bits_as_per_tensor_sums(
    extra, divided
):
    # One flat vector (gradients, stats, metric values) and one division:
    # the same elementwise arithmetic as a sum and a division per tensor.
    def grads_of(factor):
        return [
            tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]) * factor,
            None,  # a variable the loss does not reach
            tf.constant([1e-7, 3.0, -2.5]) / factor,
        ]

    def extra_of(factor):
        if extra == "scalars":
            return [factor * 11.0, tf.constant(2.0), factor]
        if extra == "vectors":
            return [tf.fill([2, 2], factor), tf.constant([5.0])]
        return []

    kwargs = {"divisor": lambda stats: stats[0] + stats[1]} if divided else {}
    packed = _aggregate_on_replicas(grads_of, extra_of, "packed", **kwargs)
    reference = _aggregate_on_replicas(
        grads_of, extra_of, "per tensor", **kwargs
    )
    if not extra:
        packed = (*packed, [])  # aggregate leaves out an empty extra
    flat_packed = tf.nest.flatten(packed)
    flat_reference = tf.nest.flatten(reference)
    assert len(flat_packed) == len(flat_reference)
    for got, want in zip(flat_packed, flat_reference):
        assert (got is None) == (want is None)
        if got is None:
            continue
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert packed[0][1] is None  # None gradients stay None


def _packing_decisions(grads_of, compression=None, options=None):
    """`_packs_in_one` of `grads_of()` on 2 Mirrored replicas (traced once
    per replica)."""
    strategy = helpers.mirrored(DEVICES[:2])
    decisions = []

    def replica():
        stats = tf.ones([4])
        decisions.append(
            aggregation._packs_in_one(
                grads_of(), stats, [], compression, options
            )
        )
        return stats

    tf.function(lambda: strategy.run(replica))()
    return decisions


@pytest.mark.parametrize(
    "why",
    ["compression", "sparse gradient", "float64 gradient", "packs", "large"],
)
def test_collective_packed_by_tensor_when_one_vector_cannot_carry_it(why):
    options = None
    if why == "packs":
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=1024
        )

    def grads_of():
        grads = [tf.ones([3])]
        if why == "sparse gradient":
            grads.append(
                tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), [4, 2])
            )
        if why == "float64 gradient":
            grads.append(tf.ones([2], tf.float64))
        if why == "large":
            # More elements than one copy into a vector is worth.
            grads.append(tf.ones([aggregation.PACK_LIMIT - 2]))
        return grads

    compression = "fp16" if why == "compression" else None
    decisions = _packing_decisions(grads_of, compression, options)
    assert decisions == [False, False]


def test_gradients_up_to_the_pack_limit_travel_in_one_vector():
    def grads_of():
        return [tf.ones([aggregation.PACK_LIMIT - 3]), None, tf.ones([3])]

    assert _packing_decisions(grads_of) == [True, True]


@pytest.mark.parametrize("path", ["packed", "per tensor"])
def test_either_side_of_the_pack_limit_trains_like_the_reference(
    path, monkeypatch
):
    # A model above `PACK_LIMIT` takes the per-tensor path: same weights.
    if path == "per tensor":
        monkeypatch.setattr(aggregation, "PACK_LIMIT", 0)
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = helpers.hetero_model()
    data = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=[0.75, 0.25],
    )
    history = model.fit(data, epochs=2, verbose=0)
    reference, reference_history = helpers.reference_fit(epochs=2)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert history.history["loss"] == pytest.approx(
        reference_history["loss"], rel=1e-5
    )


@pytest.mark.parametrize(
    "compression, tolerance", [("fp16", 1e-3), ("bf16", 1e-2)]
)
def test_compressed_training_loss_stays_close(compression, tolerance):
    strategy = helpers.mirrored(DEVICES[:2])
    losses = {}
    for setting in (None, compression):
        with strategy.scope():
            model = helpers.hetero_model(gradient_compression=setting)
        data = kh.data.shard(
            helpers.examples(), 16, strategy=strategy, shares=[0.6, 0.4]
        )
        losses[setting] = model.fit(data, epochs=3, verbose=0).history["loss"]
    # After 15 steps the final loss differs by at most `tolerance`
    # (relative): fp16 keeps 11 bits of mantissa, bf16 8.
    assert losses[compression][-1] == pytest.approx(
        losses[None][-1], rel=tolerance
    )


def _batch_norm_layers(synchronized):
    inputs = keras.Input((helpers.FEATURES,))
    hidden = keras.layers.Dense(4)(inputs)
    hidden = keras.layers.BatchNormalization(
        synchronized=synchronized, name="bn"
    )(hidden)
    hidden = keras.layers.Activation("tanh")(hidden)
    return inputs, keras.layers.Dense(1)(hidden)


def _compile(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.mark.parametrize("shares", [[0.75, 0.25], [1.0, 0.0]])
def test_synchronized_batch_norm_matches_one_device(shares):
    # Moving statistics are per-replica state; synchronized BN all-reduces
    # the batch statistics, so every replica updates them with the global
    # batch's values: weights AND moving statistics match one device, for
    # any split of rows, a replica with none included.
    keras.utils.set_random_seed(3)
    reference = _compile(keras.Model(*_batch_norm_layers(False)))
    initial = reference.get_weights()
    reference.fit(
        helpers.examples(rows=ROWS).batch(helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = _compile(kh.HeteroModel(*_batch_norm_layers(True)))
        model.set_weights(initial)
    data = kh.data.shard(
        helpers.examples(rows=ROWS),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    model.fit(data, epochs=2, verbose=0)
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    x, _, _, _ = helpers.arrays(rows=8)
    np.testing.assert_allclose(
        model.predict(x, verbose=0),
        reference.predict(x, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_per_replica_batch_norm_with_an_empty_replica_is_refused():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = _compile(kh.HeteroModel(*_batch_norm_layers(False)))
    before = model.get_weights()
    empty = kh.data.shard(
        helpers.examples(), 16, strategy=strategy, shares=[1.0, 0.0]
    )
    with pytest.raises(ValueError, match=r"\['bn'\].*replica\(s\) \[1\]"):
        model.fit(empty, epochs=1, verbose=0)
    helpers.assert_weights_close(model.get_weights(), before)
    uneven = kh.data.shard(
        helpers.examples(), 16, strategy=strategy, shares=[0.75, 0.25]
    )
    with pytest.warns(UserWarning, match="synchronized=True"):
        model.fit(uneven, epochs=1, verbose=0)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def _xla_model():
    model = kh.HeteroModel(*helpers.layers())
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="mse",
        metrics=["mae"],
        jit_compile=True,
    )
    model.set_weights(helpers.initial_weights())
    return model


@pytest.mark.parametrize("where", ["no_strategy", "one_device_cpu1"])
def test_xla_trains_like_the_reference_with_one_replica(where):
    reference, history = helpers.reference_fit()
    strategy = (
        tf.distribute.OneDeviceStrategy(DEVICES[1])
        if where == "one_device_cpu1"
        else tf.distribute.get_strategy()
    )
    with strategy.scope():
        model = _xla_model()
    assert kh._compat.jit_compiled(model)
    detector = kh.callbacks.StragglerDetector(window=2, patience=1)
    result = model.fit(
        kh.data.shard(helpers.examples(), 16, strategy=strategy),
        epochs=2,
        verbose=0,
        callbacks=[detector],
    )
    helpers.assert_weights_close(
        model.get_weights(), reference.get_weights(), rtol=1e-4, atol=1e-5
    )
    assert result.history["loss"] == pytest.approx(history["loss"], rel=1e-4)
    stats = model.step_stats
    # Rows are counted; XLA cannot call the host clock: seconds unmeasured.
    assert stats.rows.tolist() == [helpers.ROWS % 16]
    assert np.isnan(stats.compute_seconds).all()
    assert detector.events == []


def test_xla_with_several_cpu_replicas_is_a_clear_error():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        model = _xla_model()
    before = model.get_weights()
    data = kh.data.shard(helpers.examples(), 16, strategy=strategy)
    with pytest.raises(ValueError, match="jit_compile=True.*b/194942685"):
        model.fit(data, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.evaluate(data, verbose=0)
    helpers.assert_weights_close(model.get_weights(), before)


def test_wire_bytes_counts_the_gradients_sent():
    with tf.distribute.get_strategy().scope():
        model = helpers.hetero_model()
    variables = model.trainable_variables
    # 5x4 + 4 + 4x1 + 1 = 29 gradient elements; telemetry 2 x 2 floats.
    assert aggregation.wire_bytes(variables, None, 2) == 29 * 4 + 16
    assert aggregation.wire_bytes(variables, "fp16", 2) == 29 * 2 + 16
    assert aggregation.wire_bytes(variables, "bf16", 2) == 29 * 2 + 16
