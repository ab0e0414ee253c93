"""kh.testing: SimulatedSpeed's replica mapping, run_workers' failure paths."""

import pytest

import keras_hetero as kh


def test_simulated_speed_per_replica_list_float_and_device_dict():
    assert kh.testing.SimulatedSpeed(0.002).seconds_for(3) == 0.002
    listed = kh.testing.SimulatedSpeed([0.0, 0.001])
    assert listed.seconds_for(1) == 0.001
    assert listed.seconds_for(5) == 0.0
    by_device = kh.testing.SimulatedSpeed({"CPU:1": 0.003})
    by_device._device_by_replica.update(
        {
            0: "/job:localhost/replica:0/task:0/device:CPU:0",
            1: "/job:localhost/replica:0/task:0/device:CPU:1",
        }
    )
    assert by_device.seconds_for(0) == 0.0
    assert by_device.seconds_for(1) == 0.003


def test_simulated_speed_is_assignable_and_serialisable():
    layer = kh.testing.SimulatedSpeed([0.0, 0.001])
    layer.seconds_per_row = [0.002, 0.0]
    assert layer.seconds_for(0) == 0.002
    clone = kh.testing.SimulatedSpeed.from_config(layer.get_config())
    assert clone.seconds_per_row == [0.002, 0.0]


@pytest.mark.parametrize("bad", [-0.1, "fast", [0.1, float("nan")]], ids=str)
def test_simulated_speed_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="seconds_per_row"):
        kh.testing.SimulatedSpeed(bad)


def _fail():
    raise RuntimeError("boom from a worker")


def _sleep_forever():
    import time

    time.sleep(600)


def _report():
    import json
    import os

    return json.loads(os.environ["TF_CONFIG"])


@pytest.mark.slow
def test_run_workers_sets_loopback_tf_config():
    results = kh.testing.run_workers(_report, 2, timeout=60)
    configs = [r.value for r in results]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    addresses = configs[0]["cluster"]["worker"]
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    assert len(set(addresses)) == 2


@pytest.mark.slow
def test_run_workers_reports_failure_with_output():
    with pytest.raises(kh.testing.WorkerError, match="boom from a worker"):
        kh.testing.run_workers(_fail, 2, timeout=60)


@pytest.mark.slow
def test_run_workers_kills_on_timeout():
    results = kh.testing.run_workers(_sleep_forever, 1, timeout=3, check=False)
    assert results[0].exit_code != 0


def _environment_and_flavour():
    import os

    from keras_hetero import _compat

    return {
        "marker": os.environ.get("KH_TEST_MARKER"),
        "legacy": _compat.IS_LEGACY,
        "pid": os.getpid(),
    }


@pytest.mark.slow
def test_run_workers_pass_the_callers_environment_now(monkeypatch):
    from keras_hetero import _compat

    kh.testing.run_workers(_report, 1, timeout=60)  # the forkserver starts
    marker = "set after the forkserver started"
    monkeypatch.setenv("KH_TEST_MARKER", marker)
    results = kh.testing.run_workers(_environment_and_flavour, 2, timeout=60)
    values = [r.value for r in results]
    assert [v["marker"] for v in values] == [marker] * 2
    assert [v["legacy"] for v in values] == [_compat.IS_LEGACY] * 2
    assert values[0]["pid"] != values[1]["pid"]


def test_run_workers_spawn_when_an_import_time_variable_changed(monkeypatch):
    from keras_hetero.testing import workers

    monkeypatch.setattr(workers, "_server", {})
    assert workers._context().get_start_method() == "forkserver"
    assert workers._context().get_start_method() == "forkserver"
    monkeypatch.setenv("KERAS_BACKEND", "jax-not-what-the-server-has")
    assert workers._context().get_start_method() == "spawn"


def test_run_workers_rejects_bad_counts():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_workers"):
            kh.testing.run_workers(_report, bad)


def test_step_timer_times_every_step_after_the_first():
    from tests.support import helpers

    model = helpers.hetero_model()
    timer = kh.testing.StepTimer()
    model.fit(
        kh.data.shard(helpers.examples(), helpers.GLOBAL_BATCH),
        epochs=2,
        verbose=0,
        callbacks=[timer],
    )
    assert len(timer.seconds) == 2 * 5 - 1
    assert all(seconds > 0 for seconds in timer.seconds)
    assert len(timer.cpu_seconds) == len(timer.seconds)
    assert all(seconds >= 0 for seconds in timer.cpu_seconds)
    # Each step's work is done on this process's threads.
    assert sum(timer.cpu_seconds) > 0
    assert timer.median() > 0
