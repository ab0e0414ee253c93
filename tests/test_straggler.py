"""Straggler scoring core, without TensorFlow."""

import numpy as np

from keras_hetero import straggler


def _run(
    costs,
    rows=None,
    threshold=0.7,
    patience=3,
    window=9,
    relative_threshold=None,
):
    """Feeds per-step costs (seconds per row, [steps, replicas])."""
    costs = np.asarray(costs, np.float64)
    rows = np.full(costs.shape, 10.0) if rows is None else np.asarray(rows)
    state = straggler.ScoreState.empty(costs.shape[1], window)
    events = []
    for step in range(costs.shape[0]):
        state = straggler.add_reading(
            state, rows[step], costs[step] * rows[step]
        )
        state, changes = straggler.evaluate(
            state,
            threshold=threshold,
            patience=patience,
            relative_threshold=relative_threshold,
        )
        events += [(step, *change) for change in changes]
    return state, events


def test_a_device_slower_by_design_and_relative_threshold():
    # Replica 1 is 4x slower per row from the start (a CPU next to a GPU):
    # with one threshold it is a straggler for what it is; with
    # relative_threshold below 0.25 it is not, yet its own slowdown (2x
    # against its baseline, step 40) is still caught by the individual
    # score.
    costs = np.full((80, 2), 0.01)
    costs[:, 1] = 0.04
    _, events = _run(costs[:40])
    assert [(e[1], e[2]) for e in events] == [(1, "straggler")]
    assert events[0][3] == 0.25  # relative score
    costs[40:, 1] *= 2.0
    _, events = _run(costs, relative_threshold=0.2)
    assert [(e[1], e[2]) for e in events] == [(1, "straggler")]
    step, _, _, relative, individual = events[0]
    assert 40 <= step < 50
    assert relative == 0.125 and individual < 0.7


def test_a_replica_slowed_1_5x_is_flagged_within_10_steps():
    costs = np.full((60, 4), 0.01)
    costs[30:, 2] *= 1.5
    _, events = _run(costs)
    assert [(e[1], e[2]) for e in events] == [(2, "straggler")]
    assert events[0][0] - 30 < 10
    assert events[0][3] < 0.7  # relative score


def test_no_false_flags_with_20_percent_jitter_over_2000_steps():
    rng = np.random.default_rng(0)
    costs = 0.01 * rng.uniform(0.8, 1.2, size=(2000, 4))
    _, events = _run(costs)
    assert events == []


def test_more_rows_is_not_slowness():
    costs = np.full((40, 2), 0.01)
    rows = np.full((40, 2), 10.0)
    rows[20:, 1] = 30.0  # rebalanced: 3x the rows, same seconds per row
    _, events = _run(costs, rows)
    assert events == []


def test_recovery_event_and_individual_score():
    costs = np.full((80, 1), 0.01)  # one replica: only its own history
    costs[20:45, 0] = 0.02
    state, events = _run(costs)
    kinds = [e[2] for e in events]
    assert kinds == ["straggler", "recovered"]
    assert events[0][4] < 0.7  # individual score caught it
    assert not state.flagged[0]


def test_zero_row_replica_is_not_scored_and_state_round_trips():
    costs = np.full((20, 2), 0.01)
    rows = np.full((20, 2), 10.0)
    rows[:, 1] = 0.0
    state, events = _run(costs, rows)
    assert events == []
    relative, _ = straggler.scores(state)
    assert np.isnan(relative[1])
    again = straggler.ScoreState.from_dict(state.to_dict())
    np.testing.assert_array_equal(again.baseline, state.baseline)
    assert again.seen == state.seen


def test_fast_scorer_matches_the_numpy_core_exactly():
    # The detector runs `Scorer` (plain floats) every step; it must take
    # exactly the numpy core's decisions: same changes, same state, on
    # noisy costs with slowdowns, recoveries, zero-row replicas and a zero
    # compute time.
    rng = np.random.default_rng(7)
    for replicas, window, patience, relative_threshold in (
        (2, 9, 3, None),
        (4, 5, 1, 0.5),
        (3, 4, 2, None),
    ):
        state = straggler.ScoreState.empty(replicas, window)
        scorer = straggler.Scorer(replicas, window)
        flagged = 0
        for step in range(3000):
            rows = rng.integers(0, 20, size=replicas)
            rows[rng.random(replicas) < 0.05] = 0
            speed = np.where(
                (step // 150) % 3 == 1, [1.0] + [2.5] * (replicas - 1), 1.0
            )
            seconds = rows * 0.001 * speed * rng.uniform(0.8, 1.2, replicas)
            if step == 500:
                seconds[0] = 0.0
            state = straggler.add_reading(state, rows, seconds)
            state, expected = straggler.evaluate(
                state,
                threshold=0.7,
                patience=patience,
                relative_threshold=relative_threshold,
            )
            got = scorer.step(
                rows,
                seconds,
                threshold=0.7,
                patience=patience,
                relative_threshold=relative_threshold,
            )
            assert got == expected, (step, got, expected)
            flagged += len(got)
        mine = scorer.state()
        np.testing.assert_array_equal(mine.readings, state.readings)
        np.testing.assert_array_equal(mine.baseline, state.baseline)
        np.testing.assert_array_equal(mine.below, state.below)
        np.testing.assert_array_equal(mine.flagged, state.flagged)
        assert mine.seen == state.seen
        assert flagged > 4  # the slowdowns really flagged and recovered
        again = straggler.Scorer.from_state(mine).state()
        np.testing.assert_array_equal(again.readings, mine.readings)
        np.testing.assert_array_equal(again.baseline, mine.baseline)
