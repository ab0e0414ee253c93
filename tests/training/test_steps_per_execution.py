"""`steps_per_execution > 1` under MirroredStrategy and MultiWorkerMirrored.

Several steps per call train exactly like one step per call, i.e. like one
device on the same global batches: with uneven shares, the last partial
global batch, epochs whose length is not a multiple of the steps per call or
unknown, plain tf.data input, evaluate / predict, and while ShardRebalancer
moves shares. Telemetry covers each call's steps. (The 3-process
MultiWorkerMirrored case with fit / evaluate / predict is in
test_multi_worker.py.)
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _compat
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import helpers
from tests.support import training_workers

# 72 rows in global batches of 16: 5 batches per epoch, the last one of 8
# rows; 5 is a multiple of neither 2 nor 3.
BATCHES = 5
STRATEGIES = {
    "mirrored2-75_25": (lambda: helpers.mirrored(DEVICES[:2]), [0.75, 0.25]),
    "mirrored3-60_30_10": (
        lambda: helpers.mirrored(DEVICES[:3]),
        [0.6, 0.3, 0.1],
    ),
    "central_storage2-25_75": (
        lambda: tf.distribute.experimental.CentralStorageStrategy(
            DEVICES[:2], parameter_device=DEVICES[0]
        ),
        [0.25, 0.75],
    ),
    "one_device": (lambda: tf.distribute.OneDeviceStrategy(DEVICES[1]), None),
}


def _model(strategy, steps_per_execution, regularizer=True):
    with strategy.scope():
        return helpers.hetero_model(
            regularizer=regularizer, steps_per_execution=steps_per_execution
        )


class _RecordStats(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.step_stats)


@pytest.mark.parametrize("steps_per_execution", [2, 3])
@pytest.mark.parametrize("setting", STRATEGIES.values(), ids=STRATEGIES)
def test_fit_equals_single_device(setting, steps_per_execution):
    make_strategy, shares = setting
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    strategy = make_strategy()
    model = _model(strategy, steps_per_execution)
    data = kh.data.shard(
        helpers.examples(sample_weights=True),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    record = _RecordStats()
    history = model.fit(data, epochs=2, verbose=0, callbacks=[record])

    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 2 * BATCHES
    if not isinstance(
        strategy, tf.distribute.experimental.CentralStorageStrategy
    ):
        # Upstream: Keras does not aggregate metrics under
        # CentralStorageStrategy (docs/strategies.md).
        for key in ("loss", "mae"):
            assert history.history[key] == pytest.approx(
                reference_history[key], rel=1e-5
            )
    # One StepStats per call, summed over its steps; a call stops at the
    # epoch's end (5 = 2 + 2 + 1 = 3 + 2).
    per_epoch = [steps_per_execution] * (BATCHES // steps_per_execution)
    if BATCHES % steps_per_execution:
        per_epoch.append(BATCHES % steps_per_execution)
    assert [s.steps for s in record.seen] == per_epoch * 2
    assert [s.step for s in record.seen] == np.cumsum(per_epoch * 2).tolist()
    shares = data.shares
    full = kh.data.rows_from_shares(shares, helpers.GLOBAL_BATCH)
    last = kh.data.rows_from_shares(shares, helpers.ROWS % helpers.GLOBAL_BATCH)
    assert record.seen[0].rows.tolist() == (full * per_epoch[0]).tolist()
    assert (
        record.seen[-1].rows.tolist()
        == (full * (per_epoch[-1] - 1) + last).tolist()
    )


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_epochs_of_unknown_length_lose_and_repeat_no_step(steps_per_execution):
    # The data ends inside a call: its last fetch finds nothing, and the next
    # call finds nothing at once. Neither may leave a phantom optimizer step
    # behind (momentum would move the weights) nor skip a batch.
    reference, _ = helpers.reference_fit()
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, steps_per_execution, regularizer=False)
    examples = helpers.examples().filter(lambda x, y: True)  # length unknown
    data = kh.data.shard(
        examples, helpers.GLOBAL_BATCH, strategy=strategy, shares=[0.75, 0.25]
    )
    assert data.num_batches is None
    # tf-keras needs the epoch length of an unknown-length input.
    kwargs = {"steps_per_epoch": BATCHES} if _compat.IS_LEGACY else {}
    model.fit(data, epochs=2, verbose=0, **kwargs)
    assert int(model.optimizer.iterations.numpy()) == 2 * BATCHES
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_plain_tf_data_input(steps_per_execution):
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    strategy = helpers.mirrored(DEVICES[:3])
    model = _model(strategy, steps_per_execution)
    history = model.fit(
        helpers.examples(sample_weights=True).batch(helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    assert history.history["loss"] == pytest.approx(
        reference_history["loss"], rel=1e-5
    )
    assert int(model.optimizer.iterations.numpy()) == 2 * BATCHES


def test_evaluate_and_predict_match_reference():
    reference, _ = helpers.reference_fit(epochs=1)
    strategy = helpers.mirrored(DEVICES[:3])
    model = _model(strategy, 3, regularizer=False)
    model.set_weights(reference.get_weights())
    shares = [0.5, 0.0, 0.5]
    want = reference.evaluate(
        helpers.examples(sample_weights=True).batch(helpers.GLOBAL_BATCH),
        return_dict=True,
        verbose=0,
    )
    for data in (
        kh.data.shard(
            helpers.examples(sample_weights=True),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=shares,
        ),
        helpers.examples(sample_weights=True).batch(helpers.GLOBAL_BATCH),
    ):
        got = model.evaluate(data, return_dict=True, verbose=0)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["mae"] == pytest.approx(want["mae"], rel=1e-5)
    x, _, _, _ = helpers.arrays()
    expected = reference.predict(x, verbose=0)
    dataset = kh.data.shard(
        helpers.examples(), helpers.GLOBAL_BATCH, strategy=strategy
    )
    dataset.shares = shares
    for data, kwargs in (
        (dataset, {}),
        (x, {"batch_size": helpers.GLOBAL_BATCH}),
    ):
        np.testing.assert_allclose(
            model.predict(data, verbose=0, **kwargs),
            expected,
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_rebalancing_keeps_every_example_once_and_the_math(
    steps_per_execution,
):
    strategy = helpers.mirrored(DEVICES[:3])
    seen = []
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = helpers.id_model(seen, [0.003, 0.001, 0.0], steps_per_execution)
    initial = model.get_weights()
    global_batch, batches = 30, 25
    rows = global_batch * (batches - 1) + 7
    data = kh.data.shard(
        helpers.id_examples(rows), global_batch, strategy=strategy
    )
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])

    assert len(rebalancer.changes) >= 2
    for steps, (pass_index, first_batch), _ in rebalancer.changes:
        # Named `lag` batches after the last one trained, so no pipeline
        # had split it yet (else the schedule would have moved it later).
        # Passes are epochs under Keras 3, the whole fit under tf-keras.
        trained = steps - pass_index * batches
        assert first_batch == trained + rebalancer.lag
    counts = np.bincount(seen, minlength=rows)
    assert np.all(counts == 2), np.nonzero(counts != 2)
    reference = helpers.id_model([], 0.0)
    reference.set_weights(initial)
    reference.fit(
        helpers.id_examples(rows).batch(global_batch), epochs=2, verbose=0
    )
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())


def test_straggler_detector_counts_steps_of_each_call():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed([0.002, 0.002])
        outputs = keras.layers.Dense(1)(slow(inputs))
        model = kh.HeteroModel(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)

    class SlowDownAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.step_stats.step == 16:
                # 5x slower (64 ms more per step): clear of the step-time
                # noise the detector measures on a loaded 2-core machine
                # (2x, 16 ms, went unflagged at load 8).
                slow.seconds_per_row = [0.002, 0.010]

    detector = kh.callbacks.StragglerDetector(window=5)
    data = kh.data.shard(helpers.examples(rows=16 * 40), 16, strategy=strategy)
    model.fit(data, epochs=1, verbose=0, callbacks=[SlowDownAfter(), detector])
    stragglers = [e for e in detector.events if e.kind == "straggler"]
    assert [e.replica for e in stragglers] == [1]
    # Events name the model's step at the end of the call that found them.
    assert stragglers[0].step % 2 == 0
    assert 16 < stragglers[0].step <= 16 + 2 * 10


def test_hang_watchdog_keeps_one_progress_mark_per_worker(monkeypatch):
    # With 2 steps per call the watchdog publishes steps 1, 3, 5, ...; each
    # mark replaces the last one in the coordination service's store.
    from tensorflow.python.eager import context

    from keras_hetero.stragglers import detector as straggler_detector

    store = {}

    class Store:
        def set_config_key_value(self, key, value):
            store[key] = value

        def delete_config_key_value(self, key):
            del store[key]

    monkeypatch.setattr(context, "context", Store)
    watchdog = straggler_detector._Watchdog(None, timeout=60)
    for step in (1, 3, 5, 7):
        watchdog.step_started(step)
    assert list(store) == [straggler_detector._progress_key(0, 7)]


@pytest.mark.slow
@pytest.mark.both_flavours
def test_multi_worker_epochs_of_unknown_length():
    results = kh.testing.run_workers(
        training_workers.unknown_length_mwms,
        2,
        timeout=240,
        args=([0.7, 0.3], 3),
    )
    reference, _ = helpers.reference_fit()
    for result in results:
        assert result.value["iterations"] == 2 * BATCHES
        helpers.assert_weights_close(
            result.value["weights"], reference.get_weights()
        )
