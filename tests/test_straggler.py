"""Straggler scoring core, without TensorFlow."""

import numpy as np

from keras_hetero import straggler


def _run(costs, rows=None, threshold=0.7, patience=3, window=9):
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
            state, threshold=threshold, patience=patience
        )
        events += [(step, *change) for change in changes]
    return state, events


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
