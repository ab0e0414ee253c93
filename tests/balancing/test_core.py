"""The rebalancing decision core, without TensorFlow."""

import numpy as np
import pytest

from keras_hetero.balancing import core as rebalance
from keras_hetero.data.shares import rows_from_shares


def test_window_median_ignores_outliers_and_zero_row_replicas():
    window = rebalance.SpeedWindow.empty(2, 5)
    for seconds in (0.010, 0.011, 0.5, 0.009, 0.010):  # one 50x outlier
        window = window.add([10, 0], [seconds, 0.0])
    spr = window.seconds_per_row()
    assert spr[0] == pytest.approx(0.0010)
    assert np.isnan(spr[1])


def test_window_forgets_an_old_speed():
    window = rebalance.SpeedWindow.empty(1, 4)
    for _ in range(4):
        window = window.add([10], [0.01])
    for _ in range(3):
        window = window.add([10], [0.04])
    assert window.seconds_per_row()[0] == pytest.approx(0.004)


def test_shares_proportional_to_speed():
    shares = rebalance.balanced_shares(
        np.array([0.004, 0.002, 0.001]), np.ones(3) / 3, 70
    )
    np.testing.assert_allclose(shares, [1 / 7, 2 / 7, 4 / 7])


def test_bounds_min_share_and_max_rows():
    spr = np.array([0.1, 0.001, 0.001])
    shares = rebalance.balanced_shares(spr, np.ones(3) / 3, 100, min_share=0.1)
    assert shares[0] == pytest.approx(0.1)
    assert shares.sum() == pytest.approx(1.0)
    capped = rebalance.balanced_shares(
        np.array([0.001, 0.004]), np.array([0.5, 0.5]), 100, max_rows=60
    )
    np.testing.assert_allclose(capped, [0.6, 0.4])


def test_unknown_replica_keeps_its_share():
    shares = rebalance.balanced_shares(
        np.array([np.nan, 0.001, 0.003]), np.array([0.2, 0.4, 0.4]), 100
    )
    assert shares[0] == pytest.approx(0.2)
    np.testing.assert_allclose(shares[1:], [0.6, 0.2])


def test_hysteresis_keeps_shares_when_the_gain_is_small():
    window = rebalance.SpeedWindow.empty(2, 3)
    for _ in range(3):
        window = window.add([50, 50], [0.050, 0.052])
    assert rebalance.decide(window, [0.5, 0.5], 100, tolerance=0.05) is None
    assert rebalance.decide(window, [0.5, 0.5], 100, tolerance=0.0) is not None
    window = window.add([50, 50], [0.05, 0.2])
    window = window.add([50, 50], [0.05, 0.2])
    new = rebalance.decide(window, [0.5, 0.5], 100)
    np.testing.assert_allclose(new, [0.8, 0.2])


def test_medians_are_numpy_medians_of_the_known_readings():
    rng = np.random.default_rng(0)
    for size in (1, 2, 9, 10):
        readings = rng.random((size, 300))
        readings[rng.random(readings.shape) < 0.3] = np.nan
        readings[:, :5] = np.nan  # columns with no reading
        expected = [
            np.median(column[~np.isnan(column)])
            if (~np.isnan(column)).any()
            else np.nan
            for column in readings.T
        ]
        np.testing.assert_array_equal(rebalance.medians(readings), expected)
        full = rng.random((size, 300))
        np.testing.assert_array_equal(
            rebalance.medians(full), np.median(full, axis=0)
        )


def test_decisions_at_4096_replicas_converge_to_capacity():
    # Workers of 8 replicas of GPU generations 1 : 1.5 : 3, 3% jitter,
    # equal shares at first: the first decision puts the shares within 2%
    # of capacity (half the L1 distance: the fraction of the rows on the
    # wrong replicas), and they stay there.
    rng = np.random.default_rng(1)
    replicas, global_batch_size = 4096, 64 * 4096
    speed = np.repeat([1.0, 1.5, 3.0] * (replicas // 24 + 1), 8)[:replicas]
    capacity = speed / speed.sum()
    shares = np.full(replicas, 1.0 / replicas)
    window = rebalance.SpeedWindow.empty(replicas, 10)
    distances = []
    for step in range(1, 61):
        rows = rows_from_shares(shares, global_batch_size)
        jitter = np.exp(0.03 * rng.standard_normal(replicas))
        window = window.add(rows, rows * 0.004 / speed * jitter)
        if step % 10 == 0:
            new = rebalance.decide(window, shares, global_batch_size)
            shares = shares if new is None else new
            distances.append(0.5 * np.abs(shares - capacity).sum())
    assert distances[0] < 0.02
    assert max(distances) < 0.02
