"""ShardRebalancer and StragglerDetector on REAL unequal devices: worker
processes pinned to cores with CPU quotas (Linux cgroups, root), no sleeps.

Run alone (`serial`): a quota caps a worker exactly, but other load on the
uncapped worker's core would change the capacity ratio under test.
"""

import numpy as np
import pytest

import keras_hetero as kh

pytestmark = [pytest.mark.slow, pytest.mark.serial]

FEATURES = 256
WIDTH = 1024
GLOBAL_BATCH = 512
CAPS = [1.0, 0.25]
# Compute dominates a step (about 2 GFLOP per replica): a capped worker
# runs out of its quota within the step, every step.


@pytest.fixture(scope="module", autouse=True)
def cgroups():
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        pytest.skip(reason)


def _model(keras, model_class):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    hidden = keras.layers.Dense(WIDTH, activation="relu")(hidden)
    model = model_class(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    return model


def _data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, FEATURES)).astype("float32")
    return x, x[:, :1] * 0.5


def _rebalancing_worker(steps):
    import tensorflow as tf

    keras = kh.keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(keras, kh.HeteroModel)
    initial = model.get_weights()
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices(_data(steps)),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=4, window=4)
    seconds_per_row = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seconds_per_row.append(
                self.model.step_stats.seconds_per_row.tolist()
            )

    model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer, Record()])
    return {
        "initial": initial,
        "final": model.get_weights(),
        "shares": np.asarray(data.shares).tolist(),
        "changes": len(rebalancer.changes),
        "seconds_per_row": seconds_per_row,
        "findings": [(f.replica, f.sign) for f in rebalancer.clock_findings],
    }


def test_shares_converge_to_the_measured_capacity_and_training_is_exact():
    steps = 48
    for attempt in range(2):
        results = kh.testing.run_workers(
            _rebalancing_worker,
            2,
            timeout=300,
            args=(steps,),
            cpu_quotas=CAPS,
            cores="auto",
        )
        value = results[0].value
        # The capacity ratio as the clocks measured it at the end (cost per
        # row does not depend on the rows when compute dominates).
        cost = np.median(np.array(value["seconds_per_row"])[-12:], axis=0)
        capacity = cost[1] / cost[0]
        alarms = [sign for _, sign in value["findings"] if sign != "noise"]
        # One CI run of many (2026-12-07) found the capped worker's seconds
        # flat across a share change ("rows"), likely because its steps
        # are whole CFS periods of 100 ms and a small change of its rows
        # can land in the same number of periods. Once is run again; twice
        # in a row fails.
        if not alarms or attempt:
            break
        print(f"clock findings {alarms} (capacity {capacity:.2f}): again")
    assert value["changes"] >= 1
    assert alarms == []
    shares = np.array(value["shares"])
    print(f"cost per row ratio {capacity:.2f}, shares {shares}")
    assert capacity > 2.0  # a quarter of a core against a whole one
    assert shares[0] / shares[1] == pytest.approx(capacity, rel=0.3)
    # Both workers hold the same weights, equal to one device's training
    # on the concatenated global batches.
    keras = kh.keras
    reference = _model(keras, keras.Model)
    reference.set_weights(value["initial"])
    x, y = _data(steps)
    reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    for worker in results:
        for actual, expected in zip(
            worker.value["final"], reference.get_weights()
        ):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def _straggler_worker(steps, slow_at):
    import json
    import os

    import tensorflow as tf

    keras = kh.keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(keras, kh.HeteroModel)
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices(_data(steps)),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    detector = kh.callbacks.StragglerDetector()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.step_stats.compute_seconds.tolist())

    callbacks = [detector, Record()]
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if task == 1:
        callbacks.append(kh.testing.ThrottleAt(slow_at, 0.3))
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return {
        "events": [(e.step, e.replica, e.kind) for e in detector.events],
        "blind": [f.replica for f in detector.clock_findings if f.blind],
        "seen": seen,
    }


def test_a_real_quota_drop_is_flagged_within_10_steps_and_nothing_before():
    steps, slow_at = 90, 50
    results = kh.testing.run_workers(
        _straggler_worker,
        2,
        timeout=300,
        args=(steps, slow_at),
        cpu_quotas=[None, None],
        cores="auto",
    )
    events = results[0].value["events"]
    seconds = np.array(results[0].value["seen"])
    print(
        "events:",
        events,
        "slowed/steady seconds of replica 1:",
        np.median(seconds[slow_at + 1 :, 1])
        / np.median(seconds[10:slow_at, 1]),
    )
    assert results[0].value["blind"] == []
    # ThrottleAt acts before batch `slow_at` (0-based): step slow_at + 1 is
    # the first slow one.
    assert [e for e in events if e[0] <= slow_at] == []
    stragglers = [e for e in events if e[2] == "straggler"]
    assert stragglers and stragglers[0][1] == 1
    # Within the detector's defaults' bound, window + patience - 2 = 10
    # slow steps, however the throttled steps jitter (the sustained rule
    # of `kh.straggler`; 7 on a quiet machine, 17 on a busy one before it).
    assert stragglers[0][0] - slow_at <= 9 + 3 - 2
    assert results[1].value["events"] == events  # every worker alike


def _slower_device_worker(steps, slow_at):
    import json
    import os

    import tensorflow as tf

    keras = kh.keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(keras, kh.HeteroModel)
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices(_data(steps)),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    detector = kh.callbacks.StragglerDetector()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stats = self.model.step_stats
            seen.append((stats.rows.tolist(), stats.compute_seconds.tolist()))

    callbacks = [kh.callbacks.ShardRebalancer(data), detector, Record()]
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if task == 1 and slow_at is not None:
        callbacks.append(kh.testing.ThrottleAt(slow_at, 0.15))
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return {
        "events": [(e.step, e.replica, e.kind) for e in detector.events],
        "seen": seen,
    }


@pytest.mark.parametrize(
    # CI: the drop at step 100, which also asserts no event before it.
    "slow_at",
    [pytest.param(None, marks=pytest.mark.extended), 100],
)
def test_a_slower_device_is_no_straggler_and_its_own_slowdown_is(slow_at):
    # Worker 1 at 0.3 of its core from the start, the defaults of
    # ShardRebalancer and StragglerDetector: sizing its share is the
    # rebalancer's job, no event. Its quota halved at step 100 (slower
    # than itself): flagged within window + patience - 2 = 10 steps.
    steps = 300 if slow_at is None else 160
    for attempt in range(2):
        results = kh.testing.run_workers(
            _slower_device_worker,
            2,
            timeout=600,
            args=(steps, slow_at),
            cpu_quotas=[None, 0.3],
            cores="auto",
        )
        events = results[0].value["events"]
        rows, seconds = (np.array(a) for a in zip(*results[0].value["seen"]))
        cost = seconds / rows
        ratio = np.median(cost[20:100, 1]) / np.median(cost[20:100, 0])
        print(
            "events:",
            events,
            "rows of worker 1 at the end:",
            rows[-1, 1],
            "cost per row 1 / 0 (steps 20-100):",
            ratio,
        )
        early = [e for e in events if e[0] <= (slow_at or steps)]
        # A quota of 0.3 makes worker 1 about 3.3x slower per row. Far
        # from that, the host did not give the workers what the quotas
        # say (a loaded machine: a run measured 5.2x and a 3-step false
        # alarm): the test's premise did not hold, so it runs once more.
        if not early or 2.5 <= ratio <= 4.5 or attempt:
            break
        print(f"quota ratio {ratio:.2f} not ~3.3 (a loaded host): again")
    assert results[1].value["events"] == events  # every worker alike
    if slow_at is None:
        assert len(rows) == steps
        assert events == []
        return
    print(
        "worker 1 slowed/steady cost per row:",
        np.median(cost[slow_at + 1 :, 1]) / np.median(cost[20:slow_at, 1]),
    )
    assert [e for e in events if e[0] <= slow_at] == []
    stragglers = [e for e in events if e[2] == "straggler"]
    assert stragglers and stragglers[0][1] == 1
    assert stragglers[0][0] - slow_at <= 9 + 3 - 2
