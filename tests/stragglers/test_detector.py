"""StragglerDetector inside fit: simulated slow replicas, plain models, the
hang watchdog, bad input."""

import logging
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.balancing import core as rebalance
from tests.conftest import DEVICES
from tests.support import helpers
from tests.support import training_workers


class _SlowDownAt(keras.callbacks.Callback):
    def __init__(self, layer, step, seconds):
        super().__init__()
        self.layer, self.step, self.seconds, self.seen = layer, step, seconds, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            self.layer.seconds_per_row = self.seconds


def _model(strategy, seconds):
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed(seconds)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(slow(inputs)))
        model.compile(optimizer="sgd", loss="mse")
    return model, slow


def test_slowed_replica_is_flagged_with_hook_logs_and_tensorboard(
    tmp_path, caplog
):
    strategy = helpers.mirrored(DEVICES[:2])
    model, slow = _model(strategy, [0.002, 0.002])
    hooked = []
    detector = kh.callbacks.StragglerDetector(
        window=5, on_straggler=hooked.append, log_dir=str(tmp_path)
    )
    data = kh.data.shard(helpers.examples(rows=16 * 40), 16, strategy=strategy)
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        history = model.fit(
            data,
            epochs=1,
            verbose=0,
            callbacks=[_SlowDownAt(slow, 15, [0.002, 0.004]), detector],
        )
    stragglers = [e for e in detector.events if e.kind == "straggler"]
    assert [e.replica for e in stragglers] == [1]
    event = stragglers[0]
    assert 15 < event.step <= 15 + 10
    assert event.device.endswith("CPU:1") and event.worker == 0
    assert event.relative_score < 0.7
    assert hooked == detector.events
    assert "replica 1 (worker 0" in caplog.text
    # A slower device is not a slower link: the time outside compute did
    # not grow.
    assert detector.communication_events == []
    stats = model.step_stats
    assert stats.call_seconds >= np.nanmax(stats.compute_seconds) > 0
    assert history.history["straggler/communication"] == [0]
    assert history.history["straggler/flagged"] == [1]
    assert history.history["straggler/relative_1"][0] < 0.7
    # The epoch's scores in TensorBoard, as in the logs.
    written = {}
    for path in tmp_path.iterdir():
        for record in tf.compat.v1.train.summary_iterator(str(path)):
            for value in record.summary.value:
                written[value.tag] = float(tf.make_ndarray(value.tensor))
    assert written["straggler/flagged"] == 1.0
    np.testing.assert_allclose(
        written["straggler/relative_1"],
        history.history["straggler/relative_1"][0],
        rtol=1e-6,
    )


def test_equal_replicas_raise_no_false_alarm():
    # Two equal logical CPUs, ~3 ms steps of an MLP and no simulated
    # slowness: the steps' own scheduling jitter (on a shared 2-core
    # machine) is all there is. Three epochs, 450 steps.
    strategy = helpers.mirrored(DEVICES[:2])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128 * 150, 32)).astype("float32")
    examples = tf.data.Dataset.from_tensor_slices((x, x[:, :1]))
    with strategy.scope():
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(512, activation="relu")(inputs)
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
    detector = kh.callbacks.StragglerDetector()
    data = kh.data.shard(examples, 128, strategy=strategy)
    model.fit(data, epochs=3, verbose=0, callbacks=[detector])
    assert int(model.optimizer.iterations.numpy()) == 450
    assert detector.events == []


def test_a_1_5x_slowdown_is_flagged_within_10_steps():
    strategy = helpers.mirrored(DEVICES[:2])
    # 128 ms steps: a 1.5x slowdown's relative score (ideally 0.667) stays
    # below the 0.7 threshold despite a loaded machine's few ms of jitter.
    model, slow = _model(strategy, [0.016, 0.016])
    detector = kh.callbacks.StragglerDetector()
    data = kh.data.shard(helpers.examples(rows=16 * 45), 16, strategy=strategy)
    model.fit(
        data,
        epochs=1,
        verbose=0,
        callbacks=[_SlowDownAt(slow, 20, [0.016, 0.024]), detector],
    )
    events = [(e.replica, e.kind) for e in detector.events]
    assert events[0] == (1, "straggler"), events
    assert 20 < detector.events[0].step <= 20 + 10
    assert detector.events[0].relative_score < 0.7
    # Replica 0 is never flagged. (Replica 1's score sits near the
    # threshold, 0.667 against 0.7, so on a loaded machine it may recover
    # and be flagged again: no hysteresis yet.)
    assert {replica for replica, _ in events} == {1}, events


def test_stop_action_stops_training_and_rebalance_action_moves_shares():
    # Replica 1 becomes 4x slower than itself at step 5. (A device slower
    # from the start is no event with a rebalancer in the job.)
    strategy = helpers.mirrored(DEVICES[:2])
    model, slow = _model(strategy, [0.001, 0.001])
    data = kh.data.shard(helpers.examples(rows=16 * 40), 16, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=1000, window=3
    )
    saved = []

    class Saver:
        def save_now(self):
            saved.append(True)

    detector = kh.callbacks.StragglerDetector(
        window=3,
        action=["rebalance", "stop"],
        rebalancer=rebalancer,
        checkpoint=Saver(),
    )
    model.fit(
        data,
        epochs=1,
        verbose=0,
        callbacks=[rebalancer, _SlowDownAt(slow, 5, [0.001, 0.004]), detector],
    )
    assert detector.events and detector.events[0].replica == 1
    assert saved == [True]
    assert model.optimizer.iterations.numpy() < 40  # stopped early
    assert data.shares[0] > 0.6  # the rebalancer acted at once


def test_restored_detector_names_the_device_of_its_events():
    # ElasticCheckpoint restores the scores with `set_state`; the next event
    # still names its worker and device.
    strategy = helpers.mirrored(DEVICES[:2])
    model, _ = _model(strategy, [0.001, 0.001])
    data = kh.data.shard(helpers.examples(rows=16 * 6), 16, strategy=strategy)
    first = kh.callbacks.StragglerDetector(window=3, patience=1)
    model.fit(data, epochs=1, verbose=0, callbacks=[first])
    state = first.get_state()
    assert state["scores"] is not None

    model, _ = _model(strategy, [0.001, 0.004])
    restored = kh.callbacks.StragglerDetector(window=3, patience=1)

    class Restore(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            restored.set_state(state)

    model.fit(data, epochs=1, verbose=0, callbacks=[restored, Restore()])
    stragglers = [e for e in restored.events if e.kind == "straggler"]
    assert [e.replica for e in stragglers] == [1]
    assert stragglers[0].device.endswith("CPU:1")


def test_plain_keras_model_per_worker_individual_score():
    model = helpers.compile_model(keras.Model(*helpers.layers()))

    class Stall(keras.callbacks.Callback):
        # A steady 10 ms per batch, so that this machine's jitter on a
        # ~2 ms step is small next to it; batches 20-34 take 60 ms.
        def on_train_batch_begin(self, batch, logs=None):
            time.sleep(0.06 if 20 <= batch < 35 else 0.01)

    detector = kh.callbacks.StragglerDetector(window=5)
    model.fit(
        helpers.examples(rows=16 * 50).batch(16),
        epochs=1,
        verbose=0,
        callbacks=[detector, Stall()],
    )
    kinds = [e.kind for e in detector.events]
    assert kinds[:2] == ["straggler", "recovered"]
    assert detector.events[0].individual_score < 0.7


def test_relative_threshold_spares_a_device_slower_by_design():
    # Replica 1 is 4x slower per row throughout: flagged with the default
    # threshold, not with relative_threshold=0.2.
    strategy = helpers.mirrored(DEVICES[:2])
    model, _ = _model(strategy, [0.0005, 0.002])
    data = kh.data.shard(helpers.examples(rows=16 * 30), 16, strategy=strategy)
    default = kh.callbacks.StragglerDetector(window=5)
    spared = kh.callbacks.StragglerDetector(window=5, relative_threshold=0.2)
    model.fit(data, epochs=1, verbose=0, callbacks=[default, spared])
    assert [(e.replica, e.kind) for e in default.events] == [(1, "straggler")]
    assert spared.events == []
    assert spared.scalars()["straggler/relative_1"] < 0.5


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"threshold": 0.0}, ValueError, "threshold=0.0"),
        ({"threshold": 1.5}, ValueError, "threshold"),
        ({"relative_threshold": 0}, ValueError, "relative_threshold=0"),
        ({"relative_threshold": "low"}, ValueError, "relative_threshold"),
        ({"patience": 0}, ValueError, "patience=0"),
        ({"min_excess_seconds": -1}, ValueError, "min_excess_seconds=-1"),
        ({"min_excess_seconds": "3ms"}, ValueError, "min_excess_seconds"),
        ({"action": "explode"}, ValueError, "explode"),
        ({"action": "rebalance"}, ValueError, "rebalancer"),
        ({"on_straggler": "print"}, TypeError, "on_straggler"),
        ({"hang_timeout": 0}, ValueError, "hang_timeout"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        kh.callbacks.StragglerDetector(**kwargs)


@pytest.mark.slow
def test_hang_watchdog_names_the_missing_worker():
    results = kh.testing.run_workers(training_workers.hang_mwms, 2, timeout=240)
    hangs = {r.index: r.value["hangs"] for r in results}
    # Worker 1 stalls before step 6; worker 0 waits in the collective and
    # names it. Training then completes on both.
    assert hangs[0] and hangs[0][0] == (6, [1])
    assert "worker(s) [1] have not reached it" in results[0].output
    assert all(r.value["steps"] == 10 for r in results)


class _FakeStore:
    """Heartbeat counters in place of the coordination service: `beating`
    workers move theirs on every read."""

    def __init__(self, beating):
        self.beating, self.values, self.reads = set(beating), {}, 0

    def get(self, key, timeout_ms):
        self.reads += 1
        task = int(key.rsplit("/", 1)[1])
        if task in self.beating or task not in self.values:
            self.values[task] = self.values.get(task, 0) + 1
        return str(self.values[task])


def test_watchdog_knows_a_silent_worker_at_once_when_it_watched_it_stop(
    monkeypatch,
):
    from keras_hetero.stragglers import detector as module

    store = _FakeStore(beating={1})
    monkeypatch.setattr(module._compat, "get_coordination_value", store.get)
    heartbeats = module._Heartbeats(period=0.2)
    heartbeats.read([1, 2])
    # Worker 2's counter last moved (for this reader) `window` seconds ago.
    value, _ = heartbeats._seen[2]
    heartbeats._seen[2] = (value, time.monotonic() - heartbeats.window)
    reads = store.reads
    assert heartbeats.silent([1, 2]) == [2]
    # One read of each, then worker 1 moved and worker 2 was already
    # silent long enough: no second round of reads, no wait.
    assert store.reads - reads == 2
    # Not read before: decided after one window of silence, not sooner.
    heartbeats.forget()
    started = time.monotonic()
    assert heartbeats.silent([1, 2]) == [2]
    assert time.monotonic() - started >= heartbeats.window - 0.05
    store.beating.add(2)
    heartbeats.forget()
    assert heartbeats.silent([1, 2]) == []


def test_timeouts_keep_tf_heartbeat_behind_the_watchdog():
    assert kh.Timeouts(watchdog=60).heartbeat == 120.0
    # A short watchdog still leaves its report 10 s before TF's error.
    assert kh.Timeouts(watchdog=6).heartbeat == 16.0
    assert kh.Timeouts(watchdog=6, heartbeat=7).heartbeat == 7.0
    with pytest.raises(ValueError, match="heartbeat=0"):
        kh.Timeouts(heartbeat=0)
    with pytest.raises(ValueError, match="watchdog=None"):
        kh.Timeouts(watchdog=None)


def test_communication_tracker_flags_time_outside_compute_not_compute():
    from keras_hetero.stragglers import communication

    tracker = communication.CommunicationTracker(
        window=3, patience=2, min_excess_seconds=0.003
    )
    events = []

    def run(steps, call, compute):
        for _ in range(steps):
            run.step += 1
            event = tracker.step(run.step, call, compute, 1)
            if event is not None:
                events.append((run.step, event))

    run.step = 0
    run(1, 5.0, 0.02)  # the trace: skipped
    run(10, 0.030, 0.020)  # baseline: 10 ms outside compute
    assert tracker.baseline == pytest.approx(0.010)
    run(10, 0.060, 0.040)  # a slower device: compute grows, not the rest
    assert events == []
    run(6, 0.060, 0.020)  # a slow link: 40 ms outside compute
    assert [e.kind for _, e in events] == ["communication"]
    step, event = events[0]
    # Two of the three readings slow for the median, then `patience`.
    assert step == 21 + 3
    assert event.outside_seconds == pytest.approx(0.040)
    assert event.baseline_seconds == pytest.approx(0.010)
    assert event.compute_seconds == pytest.approx(0.020)
    run(6, 0.030, 0.020)
    assert [e.kind for _, e in events] == [
        "communication",
        "communication_recovered",
    ]
    # A resumed run keeps the healthy baseline (the first reading after a
    # restart traces again and is skipped).
    resumed = communication.CommunicationTracker(3, 2, 0.003)
    resumed.set_state(tracker.state())
    assert resumed.step(1, 5.0, 0.02, 1) is None
    later = [resumed.step(i, 0.060, 0.020, 1) for i in range(2, 5)]
    assert [e.kind for e in later if e is not None] == ["communication"]


class _FedModel:
    """A stand-in model whose `step_stats` a test feeds, step by step, to
    the detectors it attaches."""

    def __init__(self):
        self.stats = []

    @property
    def step_stats(self):
        return self.stats[-1]

    def attach(self, detector):
        detector.set_model(self)
        detector.on_train_begin()
        return detector

    def feed(self, detector, count, compute, replicas=2, call=None):
        for _ in range(count):
            self.stats.append(
                kh.StepStats(
                    step=len(self.stats) + 1,
                    steps=1,
                    rows=np.full(replicas, 4),
                    compute_seconds=np.full(replicas, compute),
                    devices=[f"/CPU:{i}" for i in range(replicas)],
                    call_seconds=call,
                )
            )
            detector.on_train_batch_begin(0)
            detector.on_train_batch_end(0)

    def feed_steps(self, detector, steps):
        """Feeds `(rows, compute_seconds)` per step, one array each."""
        for rows, compute in steps:
            self.stats.append(
                kh.StepStats(
                    step=len(self.stats) + 1,
                    steps=1,
                    rows=rows,
                    compute_seconds=compute,
                    devices=[f"/CPU:{i}" for i in range(len(rows))],
                )
            )
            detector.on_train_batch_begin(0)
            detector.on_train_batch_end(0)


def test_detector_reports_a_slow_link_and_leaves_stragglers_alone(caplog):
    model = _FedModel()
    detector = model.attach(
        kh.callbacks.StragglerDetector(window=3, patience=2)
    )
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        model.feed(detector, 8, 0.020, call=0.030)
        model.feed(detector, 6, 0.020, call=0.080)
    assert [e.kind for e in detector.communication_events] == ["communication"]
    assert detector.events == []  # no replica is a straggler
    assert "slowed by communication at step" in caplog.text
    assert detector.scalars()["straggler/communication"] == 1
    state = detector.get_state()
    assert state["communication"]["baseline"] == pytest.approx(0.010)
    fresh = kh.callbacks.StragglerDetector(window=3, patience=2)
    fresh.set_state(state)
    model.attach(fresh)
    assert fresh._communication.baseline == pytest.approx(0.010)


def test_scores_restored_for_another_replica_count_start_afresh():
    # A job resumed with fewer or more replicas: the restored scores are
    # of other replicas and are not used.
    model = _FedModel()
    first = model.attach(kh.callbacks.StragglerDetector(window=3, patience=1))
    model.feed(first, 5, 0.02, replicas=2)
    resumed = model.attach(kh.callbacks.StragglerDetector(window=3, patience=1))
    resumed.set_state(first.get_state())
    model.feed(resumed, 5, 0.02, replicas=3)
    assert resumed.events == []
    assert resumed.get_state()["scores"]["seen"] == 5


def _converging_fleet(steps, drop_at=None, seed=0):
    """Rows and compute seconds of two replicas, replica 1 a device 3.3x
    slower per row from the start (0.3 of a core), 2x slower again from
    step `drop_at` on, with shares that a rebalancer sets every 10 steps
    from the last 10 readings (applied 4 steps later, as `ShardRebalancer`
    does by default). Simulated: 5% jitter on every step, and 3-6 ms
    delays on 5% of them."""
    rng = np.random.default_rng(seed)
    shares, pending = np.array([0.5, 0.5]), None
    speeds = rebalance.SpeedWindow.empty(2, 10)
    fed = []
    for step in range(1, steps + 1):
        if pending is not None and step == pending[0]:
            shares, pending = pending[1], None
        rows = np.round(shares * 512)
        seconds_per_row = np.array([0.0001, 0.00033])
        if drop_at is not None and step > drop_at:
            seconds_per_row[1] *= 2
        compute = rows * seconds_per_row * rng.lognormal(0.0, 0.05, 2)
        compute += (rng.random(2) < 0.05) * rng.uniform(0.003, 0.006, 2)
        fed.append((rows, compute))
        speeds = speeds.add(rows, compute)
        if step % 10 == 0 and step > 2:
            decided = rebalance.decide(speeds, shares, 512)
            if decided is not None:
                pending = (step + 4, decided)
    return fed


def _rebalanced_detector(model, rebalanced=True):
    detector = kh.callbacks.StragglerDetector()
    callbacks = [detector]
    if rebalanced:
        callbacks.insert(0, kh.callbacks.ShardRebalancer())
    detector.prepare_fit(kh.callbacks.FitContext(model, None, callbacks, {}))
    return model.attach(detector)


def test_a_slower_device_is_the_rebalancers_and_its_own_slowdown_an_event():
    # The real quota test's scenario (tests/balancing/test_real_devices.py)
    # with simulated readings, on the detector's defaults.
    steady = _FedModel()
    detector = _rebalanced_detector(steady)
    steady.feed_steps(detector, _converging_fleet(300))
    assert detector.events == []
    # The rebalancer sized the shares to the devices' 1 : 3.3 speeds, and
    # replica 1 scores low against the fastest: a slower device, not a
    # straggler.
    assert steady.stats[-1].rows[1] < 140
    assert detector.scalars()["straggler/relative_1"] < 0.5

    dropped = _FedModel()
    detector = _rebalanced_detector(dropped)
    dropped.feed_steps(detector, _converging_fleet(300, drop_at=100))
    stragglers = [e for e in detector.events if e.kind == "straggler"]
    assert [e.replica for e in stragglers] == [1]
    assert 100 < stragglers[0].step <= 100 + 10
    assert stragglers[0].individual_score < 0.7

    # Without a rebalancer the shares stay as they are, so a device slower
    # than the fastest costs every step: the relative score flags it.
    alone = _FedModel()
    detector = _rebalanced_detector(alone, rebalanced=False)
    alone.feed_steps(detector, _converging_fleet(30))
    assert [(e.replica, e.kind) for e in detector.events] == [(1, "straggler")]
