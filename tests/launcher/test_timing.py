"""The launcher's restart timing (`launcher.timing`, the workers' side in
`keras_hetero._phases`) and how long the others of a group get to stop
(`policy.stop_grace`); the timing of real restarts is asserted in
tests/checkpointing/test_elastic_processes.py and tests/launcher/
test_hosts.py."""

import os
import time

import pytest

from keras_hetero import _phases
from keras_hetero._environment import HANG_EXIT_CODE
from keras_hetero._environment import PHASES_ENV
from keras_hetero.launcher import policy
from keras_hetero.launcher import timing


@pytest.mark.parametrize(
    "codes, grace",
    [
        ([-9], policy.PEER_STOP_SECONDS),  # killed
        ([1], policy.PEER_STOP_SECONDS),  # crashed
        ([None], policy.PEER_STOP_SECONDS),  # a lost host
        ([-9, 1], policy.PEER_STOP_SECONDS),
        ([HANG_EXIT_CODE], 30.0),  # the others write hang reports
        ([-9, HANG_EXIT_CODE], 30.0),
        ([], 30.0),  # stopped for another reason
    ],
)
def test_the_others_stop_at_once_unless_a_hang_report_was_written(codes, grace):
    assert policy.stop_grace(codes, 30.0) == grace
    # Never longer than the grace the user gave.
    assert policy.stop_grace(codes, 0.1) == min(grace, 0.1)


def _write(path, **phases):
    with open(path, "a") as f:
        for name, seconds in phases.items():
            f.write(f"{name.replace('_', ' ')}\t{seconds:.6f}\n")


def test_an_attempt_is_logged_once_when_every_worker_trained_a_step():
    origin = time.time() - 10.0
    attempt = timing.AttemptTiming(
        1, origin, "worker(s) [1] failed", origin + 0.4, [0, 1]
    )
    try:
        lines = []
        _write(attempt.paths[0], imported=origin + 3, in_fit=origin + 4)
        _write(attempt.paths[1], imported=origin + 3.5)
        _write(attempt.paths[0], first_step=origin + 6)
        attempt.check(lines.append)
        assert lines == []  # worker 1 has not trained a step yet
        _write(attempt.paths[1], in_fit=origin + 4.2, first_step=origin + 6.5)
        attempt._next_read = 0.0
        attempt.check(lines.append)
        attempt._next_read = 0.0
        attempt.check(lines.append)
        attempt.log(lines.append, ended=True)
        assert len(lines) == 1, lines  # once
        parsed = timing.parse(lines[0])
        assert parsed is not None, lines
        number, phases = parsed
        assert number == 1
        assert "seconds since worker(s) [1] failed" in lines[0]
        # The slowest worker's time of each phase; `restored` was reached
        # by no worker (no ElasticCheckpoint): left out.
        assert list(phases) == [
            "peers stopped",
            "started",
            "imported",
            "in fit",
            "first step",
        ]
        assert phases["peers stopped"] == pytest.approx(0.4, abs=0.01)
        assert phases["started"] == pytest.approx(10.0, abs=1.0)
        assert phases["imported"] == pytest.approx(3.5, abs=0.01)
        assert phases["in fit"] == pytest.approx(4.2, abs=0.01)
        assert phases["first step"] == pytest.approx(6.5, abs=0.01)
    finally:
        attempt.close()
    assert not os.path.exists(attempt.directory)


def test_an_attempt_that_ends_early_logs_the_phases_it_reached():
    origin = time.time()
    attempt = timing.AttemptTiming(0, origin, "the launch", None, [3])
    try:
        _write(attempt.paths[3], imported=origin + 2)
        lines = []
        attempt.log(lines.append, ended=True)
        assert lines[0].startswith(
            "[launcher] attempt 0 ended before every worker trained a step"
        )
        assert list(timing.parse(lines[0])[1]) == ["started", "imported"]
    finally:
        attempt.close()


def test_a_worker_marks_each_phase_once_and_only_under_the_launcher(
    tmp_path, monkeypatch
):
    path = tmp_path / "worker0"
    monkeypatch.setattr(_phases, "_marked", set())
    monkeypatch.delenv(PHASES_ENV, raising=False)
    _phases.mark(_phases.IMPORTED)  # no launcher: no file
    assert not path.exists()
    monkeypatch.setattr(_phases, "_marked", set())
    monkeypatch.setenv(PHASES_ENV, str(path))
    before = time.time()
    for name in (_phases.IMPORTED, _phases.FIRST_STEP, _phases.FIRST_STEP):
        _phases.mark(name)
    times = _phases.read(str(path))
    assert list(times) == [_phases.IMPORTED, _phases.FIRST_STEP]
    assert before <= times[_phases.IMPORTED] <= time.time()
    assert path.read_text().count(_phases.FIRST_STEP) == 1
    # A half-written last line is skipped, not an error.
    with open(path, "a") as f:
        f.write("in fit\t12")
    path.write_text(path.read_text()[:-1] + "x")
    assert _phases.IN_FIT not in _phases.read(str(path))
    assert _phases.read(str(tmp_path / "none")) == {}


def test_parse_ignores_other_lines():
    assert (
        timing.parse("[launcher] attempt 1: 2 worker(s) on ports [1, 2]")
        is None
    )
    assert timing.parse("[worker 0] attempt 1 up, seconds since x: y z") is None
