"""The readings check themselves: ClockCheck, and the rebalancer and the
straggler detector holding still when a replica's clock is blind."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero.training import telemetry
from keras_hetero.training import trust_check
from keras_hetero.training.clock_check import ClockCheck
from tests.conftest import DEVICES
from tests.support import helpers

GPUS = ["/gpu:0", "/gpu:1"]


def _feed(check, readings):
    found = []
    for rows, seconds in readings:
        found += check.add(rows, seconds)
    return found


def test_a_constant_clock_is_found_by_the_floor():
    check = ClockCheck(GPUS, patience=3)
    found = _feed(check, [([8, 8], [0.01, 0.0])] * 3)
    assert [(f.replica, f.device, f.sign) for f in found] == [
        (1, "/gpu:1", "floor")
    ]
    assert "/gpu:1" in found[0].message("Held.")
    assert check.usable().tolist() == [True, False]
    np.testing.assert_equal(check.masked([0.01, 0.0]), [0.01, np.nan])
    # Reported once.
    assert _feed(check, [([8, 8], [0.01, 0.0])] * 5) == []


def test_seconds_that_ignore_the_rows_are_found_when_shares_move():
    """What a clock reading kernel ENQUEUE time shows: the same seconds
    whatever the rows; replica 0's seconds follow its rows."""
    check = ClockCheck(GPUS)
    before = [([16, 16], [0.016, 0.002])] * 5
    after = [([4, 28], [0.004, 0.002])] * 5
    found = _feed(check, before + after)
    assert [(f.replica, f.sign) for f in found] == [(1, "rows")]
    assert "from 16 to 28" in found[0].detail, found[0].detail
    # Smaller moves of the rows are not tested (noise would decide).
    check = ClockCheck(GPUS)
    assert _feed(check, before + [([12, 20], [0.012, 0.002])] * 5) == []


def test_no_finding_when_a_slowdown_moves_the_shares():
    """A device slows 5x, then the rebalancer takes most of its rows: its
    seconds move (against the rows), so its clock is seen to work."""
    check = ClockCheck(GPUS)
    fast = [([16, 16], [0.016, 0.016])] * 8
    slow = [([16, 16], [0.016, 0.080])] * 6
    moved = [([27, 5], [0.027, 0.025])] * 6
    assert _feed(check, fast + slow + moved) == []


def test_no_finding_for_real_readings_with_jitter_and_fixed_cost():
    rng = np.random.default_rng(0)
    check = ClockCheck(GPUS + ["/cpu:0"])
    found = []
    for step in range(2000):
        rows = np.array([16, 16, 16]) if step < 1000 else np.array([8, 12, 28])
        # A fixed cost per step, a cost per row, 10% jitter, a rare stall.
        seconds = (0.001 + rows * np.array([2e-4, 1e-4, 5e-5])) * (
            1 + 0.1 * rng.standard_normal(3)
        )
        if step % 97 == 0:
            seconds[step % 3] *= 5
        found += check.add(rows, seconds)
    assert found == []
    assert check.usable().all()


def test_readings_that_jump_every_step_are_reported_once_and_stay_usable():
    rng = np.random.default_rng(1)
    check = ClockCheck(GPUS, window=10)
    # Readings unrelated to the work: anything from 1e-5 to 1 s.
    noisy = [([8, 8], [0.01, s]) for s in 10 ** rng.uniform(-5, 0, 30)]
    found = _feed(check, noisy)
    assert [(f.replica, f.sign, f.blind) for f in found] == [
        (1, "noise", False)
    ]
    assert check.usable().all()


def test_noise_is_the_median_of_steps_at_equal_rows_whatever_changes():
    """Replicas' rows change now and then (steps across a change do not
    count; too little to test the rows sign) and some readings are
    missing: each replica is noise exactly when the median factor of its
    counted steps exceeds `max_jitter`."""
    rng = np.random.default_rng(4)
    replicas, window = 300, 20
    check = ClockCheck([f"/gpu:{i}" for i in range(replicas)], window=window)
    # Per replica a typical factor between readings, 1.5x to 30x.
    spread = np.log(10 ** rng.uniform(0.2, 1.5, replicas))
    rows = np.full((window, replicas), 16.0)
    seconds = np.empty((window, replicas))
    for reading in range(window):
        if reading:
            rows[reading] = np.where(
                rng.random(replicas) < 0.15, 20.0, rows[reading - 1]
            )
        seconds[reading] = (
            rows[reading]
            * 1e-3
            * np.exp(spread * rng.choice([-0.5, 0.5], replicas))
        )
    seconds[rng.random(seconds.shape) < 0.05] = np.nan
    found = []
    for reading in range(window):
        found += check.add(rows[reading], seconds[reading])
    expected = []
    for replica in range(replicas):
        cost = seconds[:, replica] / rows[:, replica]
        steps = [
            abs(np.log(cost[i + 1] / cost[i]))
            for i in range(window - 1)
            if rows[i + 1, replica] == rows[i, replica]
            and cost[i] > 0
            and cost[i + 1] > 0
        ]
        if len(steps) >= window // 2:
            ordered = sorted(steps)
            if np.exp(ordered[(len(steps) - 1) // 2]) > 8.0:
                expected.append(replica)
    assert 30 < len(expected) < 270  # both kinds, many of each
    assert sorted(f.replica for f in found) == expected
    assert {f.sign for f in found} == {"noise"}


def test_a_throttled_host_is_not_noise():
    """Under a CFS quota a replica's step is sometimes held to the next
    period: bimodal seconds, all of them real (measured: 2.5e-5 to 4e-5
    and 1e-4 to 1.8e-4 s per row), in any mix."""
    rng = np.random.default_rng(2)
    check = ClockCheck(GPUS)
    slow = rng.random(200) < np.linspace(0.1, 0.9, 200)
    seconds = np.where(slow, 1.5e-4, 3e-5) * rng.uniform(0.9, 1.2, 200) * 64
    assert _feed(check, [([64, 64], [0.002, s]) for s in seconds]) == []


def test_steps_and_unmeasured_readings():
    check = ClockCheck(GPUS, patience=2)
    # Two steps per call: per-step seconds 5e-6, below the floor.
    assert check.add([16, 16], [0.02, 1e-5], steps=2) == []
    found = check.add([16, 16], [0.02, 1e-5], steps=2)
    assert [f.replica for f in found] == [1]
    # NaN (an XLA step: not measured) and no rows never count.
    check = ClockCheck(GPUS, patience=1)
    assert check.add([8, 0], [np.nan, 0.0]) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 3}, "window=3"),
        ({"patience": 0}, "patience=0"),
        ({"floor_seconds": -1}, "floor_seconds=-1"),
        ({"max_jitter": "x"}, "max_jitter='x'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClockCheck(GPUS, **kwargs)


def _blind_clock_on(device, monkeypatch):
    """The in-step clock of the replica on `device` reads a constant."""
    original = telemetry.clock

    def clock(dependencies, enabled=True):
        first = telemetry._tensors(dependencies)[0]
        replica = tf.DeviceSpec.from_string(first.device)
        blind = tf.DeviceSpec.from_string(device)
        if (replica.device_type, replica.device_index) == (
            blind.device_type,
            blind.device_index,
        ):
            return tf.constant(1.0, tf.float64)
        return original(dependencies, enabled)

    monkeypatch.setattr(telemetry, "clock", clock)


def test_rebalancer_holds_a_blind_replica_and_balances_the_others(
    monkeypatch, caplog
):
    _blind_clock_on(DEVICES[1], monkeypatch)
    strategy = helpers.mirrored(DEVICES[:3])
    # SIMULATED speeds 1 : (blind) : 4.
    model = helpers.slow_model(strategy, [0.004, 0.001, 0.001])
    data = kh.data.shard(helpers.examples(rows=30 * 30), 30, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=4, window=4)
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    assert model.step_stats.compute_seconds[1] == 0.0
    assert rebalancer.changes
    assert data.shares[1] == pytest.approx(1 / 3)
    np.testing.assert_allclose(data.shares, [2 / 15, 1 / 3, 8 / 15], atol=0.05)
    warnings = [r.getMessage() for r in caplog.records]
    named = [w for w in warnings if DEVICES[1] in w and "ShardRebalancer" in w]
    assert len(named) == 1, warnings
    assert [f.replica for f in rebalancer.clock_findings] == [1]


def test_detector_raises_no_false_alarm_from_a_blind_replica(
    monkeypatch, caplog
):
    _blind_clock_on(DEVICES[0], monkeypatch)
    strategy = helpers.mirrored(DEVICES[:3])
    model = helpers.slow_model(strategy, 0.001)
    data = kh.data.shard(helpers.examples(rows=30 * 30), 30, strategy=strategy)
    detector = kh.callbacks.StragglerDetector(patience=2, window=3)
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        model.fit(data, epochs=1, verbose=0, callbacks=[detector])
    # Without the check, replica 0 reading 0 s made the others infinitely
    # slower than the best: both flagged.
    assert detector.events == []
    assert [(f.replica, f.sign) for f in detector.clock_findings] == [
        (0, "floor")
    ]
    named = [
        r.getMessage() for r in caplog.records if DEVICES[0] in r.getMessage()
    ]
    assert len(named) == 1


def test_the_rebalancer_and_the_detector_share_one_check(monkeypatch):
    # One set of readings and findings per fit: each train-function call
    # is one reading, however many callbacks feed it.
    _blind_clock_on(DEVICES[1], monkeypatch)
    strategy = helpers.mirrored(DEVICES[:2])
    model = helpers.slow_model(strategy, 0.001)
    data = kh.data.shard(helpers.examples(rows=30 * 20), 30, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=4, window=4, warmup_steps=0
    )
    detector = kh.callbacks.StragglerDetector(patience=2, window=3)
    added = []
    original = ClockCheck._add

    def counting(check, *args):
        added.append(id(check))
        return original(check, *args)

    monkeypatch.setattr(ClockCheck, "_add", counting)
    model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer, detector])
    assert rebalancer._clock is detector._clock
    assert len(set(added)) == 1
    assert len(added) == 20  # one reading per step, not two
    assert [(f.replica, f.sign) for f in rebalancer.clock_findings] == [
        (1, "floor")
    ]
    assert detector.clock_findings == rebalancer.clock_findings
    # The next fit starts a check of its own.
    model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer, detector])
    assert rebalancer._clock is detector._clock
    assert len(set(added)) == 2


def test_add_counts_a_keyed_reading_once():
    check = ClockCheck(GPUS, patience=2)
    first = check.add([8, 8], [0.01, 0.0], at=1)
    again = check.add([8, 8], [0.01, 0.0], at=1)
    assert first == again == []
    found = check.add([8, 8], [0.01, 0.0], at=2)
    assert [f.replica for f in found] == [1]
    assert [f.replica for f in check.add([8, 8], [0.01, 0.0], at=2)] == [1]
    assert check.add([8, 8], [0.01, 0.0], at=3) == []  # reported once


def test_at_1024_replicas_the_blind_half_is_found_and_no_other():
    """The vectorised check names exactly the replicas whose seconds stay
    flat when the shares move (half of 1,024), and no healthy one."""
    replicas = 1024
    check = ClockCheck([f"/gpu:{i}" for i in range(replicas)])
    blind = np.arange(replicas) < 512
    found = []
    for step in range(40):
        rows = np.full(replicas, 16.0)
        if step >= 20:
            rows = np.where(np.arange(replicas) % 2, 8.0, 24.0)
        seconds = np.where(blind, 0.002, 0.001 + rows * 1e-4)
        found += check.add(rows, seconds)
    assert sorted(f.replica for f in found) == list(range(512))
    assert {f.sign for f in found} == {"rows"}
    np.testing.assert_array_equal(check.usable(), ~blind)


def test_the_trust_check_finds_a_clock_under_half_the_host_time():
    check = ClockCheck(GPUS)
    _feed(check, [([16, 16], [0.002, 0.030])] * 4)
    assert check.recent_seconds(0) == (16.0, 0.002)
    # Replica 1 reads what the host timed; replica 0 a tenth of it.
    assert check.compare(1, 0.030, 0.032) == []
    (finding,) = check.compare(0, 0.002, 0.020)
    assert (finding.replica, finding.sign, finding.blind) == (0, "host", True)
    assert "10% of the 20.00 ms" in finding.detail, finding.detail
    assert check.usable().tolist() == [False, True]
    # Reported once; nothing judged on a NaN reading or a host time too
    # short to tell the device from the timer.
    assert check.compare(0, 0.002, 0.020) == []
    assert check.compare(1, np.nan, 0.020) == []
    assert check.compare(1, 0.0001, 0.0009) == []
    assert check.usable().tolist() == [False, True]


def _equally_blind_clocks(monkeypatch, seconds=0.002):
    """Every replica's clock reads `seconds` per step whatever its work:
    plausible, equal readings that never move (two GPUs whose clocks see
    only the queueing of their kernels)."""
    original = telemetry.stats_vector

    def stats_vector(num_replicas, rows, measured):
        return original(num_replicas, rows, tf.constant(seconds, tf.float64))

    monkeypatch.setattr(telemetry, "stats_vector", stats_vector)


def _fit_unequal_pair(trust_every_n_steps):
    """Two replicas, SIMULATED speeds 3 : 1, with a rebalancer."""
    devices = DEVICES[:2]
    strategy = helpers.mirrored(devices)
    model = helpers.slow_model(strategy, {devices[0]: 0.001, devices[1]: 0.003})
    data = kh.data.shard(helpers.examples(rows=32 * 16), 32, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data,
        every_n_steps=4,
        window=4,
        trust_every_n_steps=trust_every_n_steps,
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    return rebalancer, data


def test_the_trust_check_finds_equally_blind_clocks_and_holds(
    monkeypatch, caplog
):
    """No sign of the readings alone sees two equally blind clocks; the
    trust check (every 3 steps here) names both, and their shares stay."""
    _equally_blind_clocks(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        rebalancer, data = _fit_unequal_pair(trust_every_n_steps=3)
    assert [(f.replica, f.sign) for f in rebalancer.clock_findings] == [
        (0, "host"),
        (1, "host"),
    ]
    assert rebalancer.changes == []
    np.testing.assert_allclose(data.shares, [0.5, 0.5])
    warnings = [r.getMessage() for r in caplog.records]
    for device in DEVICES[:2]:
        named = [w for w in warnings if device in w and "held" in w]
        assert len(named) == 1, warnings


def test_the_trust_check_passes_working_clocks():
    """With the clocks as they are, the host's timing agrees: no "host"
    finding, and the shares follow the speeds. (Only the trust check's
    sign is asserted: on a loaded host a burst can fool the rows sign.)"""
    rebalancer, data = _fit_unequal_pair(trust_every_n_steps=3)
    assert [f for f in rebalancer.clock_findings if f.sign == "host"] == []
    assert rebalancer.changes
    assert data.shares[0] > 0.6


def test_the_online_trust_check_leaves_the_model_as_it_is():
    """During `fit` the trust check times the model being trained: no
    weight, statistic or metric may move."""
    strategy = helpers.mirrored(DEVICES[:2])
    model = helpers.slow_model(strategy, 0.0)
    x, y, _, _ = helpers.arrays()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)

    def state():
        metrics = [v for m in model.metrics for v in m.variables]
        return [np.array(v.numpy()) for v in [*model.variables, *metrics]]

    before = state()
    with strategy.scope():
        seconds = trust_check.host_seconds(
            model, trust_check.random_batch(model, 8), DEVICES[1]
        )
    assert seconds >= 0.0
    for old, new in zip(before, state()):
        np.testing.assert_array_equal(old, new)
