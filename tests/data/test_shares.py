"""Share validation, largest-remainder rounding and the share schedule."""

import numpy as np
import pytest

from keras_hetero.data import shares as shares_lib


@pytest.mark.parametrize(
    "shares, match",
    [
        ([0.5, -0.1, 0.6], "non-negative"),
        ([0.5, float("nan"), 0.5], "non-negative"),
        ([0.5, float("inf"), 0.5], "non-negative"),
        ([0.5, 0.5], "length 2"),
        ([0.0, 0.0, 0.0], "sum to 0"),
        ("abc", "Received: shares='abc'"),
        ([[0.5], [0.5], [0.0]], "length 3"),
    ],
)
def test_bad_shares_name_the_value(shares, match):
    with pytest.raises(ValueError, match=match) as error:
        shares_lib.validate_shares(shares, 3)
    assert "shares" in str(error.value)


def test_shares_are_normalised():
    np.testing.assert_allclose(
        shares_lib.validate_shares([3, 1], 2), [0.75, 0.25]
    )


@pytest.mark.parametrize(
    "shares, total, expected",
    [
        ([0.75, 0.25], 16, [12, 4]),
        ([1.0, 0.0], 16, [16, 0]),
        ([1 / 3, 1 / 3, 1 / 3], 16, [6, 5, 5]),
        ([0.5, 0.25, 0.25], 7, [3, 2, 2]),
        ([0.1, 0.1, 0.8], 3, [0, 0, 3]),
    ],
)
def test_largest_remainder(shares, total, expected):
    rows = shares_lib.rows_from_shares(np.array(shares), total)
    assert rows.tolist() == expected


def test_largest_remainder_sums_exactly_and_stays_within_one_row():
    rng = np.random.default_rng(0)
    for _ in range(500):
        replicas = int(rng.integers(1, 9))
        raw = rng.uniform(0, 1, size=replicas) * (
            rng.uniform(size=replicas) > 0.2
        )
        if raw.sum() == 0:
            raw[0] = 1.0
        shares = shares_lib.validate_shares(raw, replicas)
        total = int(rng.integers(replicas, 1000))
        rows = shares_lib.rows_from_shares(shares, total)
        assert rows.sum() == total
        assert np.all(rows >= 0)
        assert np.all(np.abs(rows - shares * total) < 1.0)


def _split(schedule, indices, rows=8):
    return [schedule.next_bounds(i, rows).tolist() for i in indices]


def test_schedule_applies_changes_from_the_named_batch():
    schedule = shares_lib.ShareSchedule(np.array([0.5, 0.5]))
    schedule.set_shares(np.array([0.75, 0.25]), at=(0, 2))
    assert _split(schedule, range(4)) == [
        [0, 4, 8],
        [0, 4, 8],
        [0, 6, 8],
        [0, 6, 8],
    ]
    assert schedule.position == (0, 4)


def test_passes_restart_the_index_and_changes_carry_over():
    schedule = shares_lib.ShareSchedule(np.array([0.5, 0.5]))
    _split(schedule, range(3))
    schedule.set_shares(np.array([1.0, 0.0]), at=(0, 5))  # past pass 0's end
    assert _split(schedule, range(2)) == [[0, 8, 8], [0, 8, 8]]
    assert schedule.passes_started == 2
    assert schedule.position == (1, 2)


def test_default_change_applies_to_next_unsplit_batch_never_back():
    schedule = shares_lib.ShareSchedule(np.array([0.5, 0.5]))
    _split(schedule, range(2))
    assert schedule.set_shares(np.array([1.0, 0.0])) == (0, 2)
    # An index already split is moved forward, not applied retroactively.
    assert schedule.set_shares(np.array([0.0, 1.0]), at=(0, 1)) == (0, 2)
    assert _split(schedule, [2]) == [[0, 0, 8]]
    np.testing.assert_allclose(schedule.shares_at((0, 1)), [0.5, 0.5])


def test_later_change_replaces_pending_ones_and_state_round_trips():
    schedule = shares_lib.ShareSchedule(np.array([0.5, 0.5]))
    schedule.set_shares(np.array([1.0, 0.0]), at=(0, 5))
    schedule.set_shares(np.array([0.0, 1.0]), at=(0, 3))
    np.testing.assert_allclose(schedule.shares_at((0, 6)), [0.0, 1.0])
    np.testing.assert_allclose(schedule.latest(), [0.0, 1.0])
    restored = shares_lib.ShareSchedule(np.array([0.5, 0.5]))
    restored.set_state(schedule.get_state())
    np.testing.assert_allclose(restored.shares_at((0, 4)), [0.0, 1.0])
    np.testing.assert_allclose(restored.shares_at((0, 2)), [0.5, 0.5])
