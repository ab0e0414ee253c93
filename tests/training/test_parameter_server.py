"""ParameterServerStrategy: worker and ps servers as processes on 127.0.0.1,
the coordinator in its own process (a coordinator in the pytest process would
connect the whole test session's eager context to the cluster). Both Keras
flavours run the same HeteroModel loop through a ClusterCoordinator."""

import contextlib
import multiprocessing
import socket
import time

import numpy as np
import pytest

import keras_hetero as kh
from tests.support import helpers
from tests.support import parameter_server_workers
from tests.support import training_workers

pytestmark = pytest.mark.slow

_SPAWN = multiprocessing.get_context("spawn")


class _Cluster:
    """2 workers + 1 ps as server processes; the coordinator's cluster."""

    def __init__(self):
        ports = kh.testing.free_ports(4)
        self.spec = {
            "worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
            "ps": [f"127.0.0.1:{ports[2]}"],
            "chief": [f"127.0.0.1:{ports[3]}"],
        }
        self.servers = {}
        for job, index in (("worker", 0), ("worker", 1), ("ps", 0)):
            self.start(job, index)

    def start(self, job, index):
        process = _SPAWN.Process(
            target=training_workers.pss_server,
            args=(self.spec, job, index),
            daemon=True,
        )
        process.start()
        self.servers[job, index] = process

    def kill(self, job, index):
        process = self.servers.pop((job, index))
        process.kill()
        process.join()

    def stop(self):
        for process in self.servers.values():
            if process.is_alive():
                process.kill()
            process.join()


@contextlib.contextmanager
def _coordinator(task, args=()):
    """Starts a cluster and a coordinator running
    `parameter_server_workers.<task>`."""
    cluster = _Cluster()
    queue, events = _SPAWN.Queue(), _SPAWN.Queue()
    process = _SPAWN.Process(
        target=parameter_server_workers.run,
        args=(task, cluster.spec, queue, events, args),
        daemon=True,
    )
    process.start()

    def result(timeout=240):
        status, value = queue.get(timeout=timeout)
        assert status == "ok", value
        return value

    try:
        yield cluster, events, result
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        cluster.stop()


def _wait_until_listening(address, timeout=120):
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {address} after {timeout}s")


@pytest.mark.both_flavours
def test_fit_evaluate_save_load_and_per_worker_telemetry(tmp_path):
    with _coordinator("fit_evaluate_save", (str(tmp_path),)) as (
        _,
        _,
        result,
    ):
        value = result()
    assert value["iterations"] == 20
    assert len(value["loss"]) == 2
    assert np.all(np.isfinite(value["loss"]))
    assert set(value["evaluation"]) == {"loss", "mae"}
    # evaluate before and after (the 72 examples, through the workers):
    # 20 asynchronous SGD steps learn.
    assert value["evaluation"]["loss"] < 0.7 * value["before"]["loss"], value
    assert len(value["as_list"]) == 2  # [loss, mae] without return_dict
    # Every step ran on one worker; both workers took part.
    assert sum(value["steps_per_worker"]) == 20
    assert value["devices"] == [
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
    ]
    np.testing.assert_allclose(
        value["loaded_predictions"], value["model_predictions"], rtol=1e-6
    )
    assert value["loaded_type"].endswith("HeteroModel")
    np.testing.assert_allclose(
        value["predict"], value["model_predictions"], rtol=1e-5, atol=1e-6
    )
    # steps_per_execution=2: 6 steps in 3 closures, every step applied.
    assert value["twice_iterations"] == 6


def test_kh_data_shard_input():
    with _coordinator("sharded_input") as (_, _, result):
        value = result()
    # 72 examples in global batches of 16: 5 steps an epoch by default.
    assert value["iterations"] == 15, value
    assert sum(value["steps_per_worker"]) == 15
    assert min(value["steps_per_worker"]) > 0, value
    assert len(value["loss"]) == 3 and np.all(np.isfinite(value["loss"]))
    assert value["after"] < 0.8 * value["before"], value
    # A step is one whole global batch (16 rows, or a pass's last 8).
    assert sum(value["rows"]) % 8 == 0 and sum(value["rows"]) > 0, value


def test_slow_worker_is_flagged_and_does_fewer_steps():
    with _coordinator("slow_worker") as (_, _, result):
        value = result()
    fast, slow = value["steps_per_worker"]
    assert fast + slow == 60, value
    assert slow < fast, value  # asynchronous: the fast worker takes more steps
    flagged = [e for e in value["events"] if e[0] == "straggler"]
    assert flagged, value
    kind, worker, replica, device, relative = flagged[0]
    assert (worker, replica) == (1, 1), value
    assert device == "/job:worker/replica:0/task:1"
    assert relative < 0.5  # 20x slower per row
    # Worker 0 is never slow against the others (its own step times,
    # which include the parameter-server round trips, may vary).
    assert all(e[4] > 0.7 for e in value["events"] if e[1] == 0), value


def test_killed_worker_restarts_and_fit_completes():
    with _coordinator("killed_worker") as (cluster, events, result):
        assert events.get(timeout=240) == "kill"
        cluster.kill("worker", 1)
        events.put("killed")
        cluster.start("worker", 1)  # the same address: it rejoins
        _wait_until_listening(cluster.spec["worker"][1])
        events.put("restarted")
        value = result(timeout=300)
    assert value["finite"], value
    assert len(value["loss"]) == 2
    # Every scheduled step completed (a step lost with the worker was run
    # again elsewhere: at-least-once); a few finished on worker 1 just
    # before it died, their telemetry gone with it.
    done = sum(value["steps_per_worker"]) + value["unattributed_steps"]
    assert done == 30, value
    assert value["iterations"] >= 30
    assert value["steps_per_worker"][0] > 0
    assert value["after_kill"][1] > 0, value  # the restarted worker rejoined


def test_arguments_without_meaning_under_parameter_server_are_refused():
    from keras_hetero.training import parameter_server

    with pytest.raises(ValueError, match=r"\['batch_size'\]"):
        parameter_server.fit_arguments(
            "fit", lambda c: None, None, (), {"batch_size": 32}
        )
    data = kh.data.shard(helpers.examples(), 16)
    with pytest.raises(ValueError, match=r"\['class_weight'\]"):
        parameter_server.fit_arguments(
            "fit", data, None, (), {"class_weight": {0: 1.0}}
        )
    options = parameter_server.fit_arguments(
        "evaluate", "fn", None, (), {"steps": 3, "verbose": 0}
    )
    assert options == {
        "x": "fn",
        "steps": 3,
        "verbose": 0,
        "return_dict": False,
    }


@pytest.mark.parametrize(
    "steps_per_execution",
    [
        pytest.param(1, marks=pytest.mark.both_flavours),
        pytest.param(2, marks=pytest.mark.extended),
    ],
)
def test_elastic_checkpoint_resumes_at_the_saved_step(
    tmp_path, steps_per_execution
):
    # With 2 steps per closure the stop comes after the closure of steps
    # 5 and 6: the checkpoint counts steps, not closures.
    with _coordinator(
        "checkpoint_resume", (str(tmp_path), steps_per_execution)
    ) as (_, _, result):
        value = result()
    # The coordinator wrote the parameter servers' variables; the resumed
    # fit starts with them, at epoch 0 step 6 (fresh input: at-least-once).
    assert value["same_weights"], value
    assert value["restored_iterations"] == 6
    assert (value["first_epoch"], value["first_batch"]) == (0, 6)
    assert value["final_iterations"] == 20  # 6 + the 4 left + 10
    assert str(tmp_path) in value["restored_from"]


def test_keras_callbacks_on_the_coordinator_resume_at_the_epoch(tmp_path):
    with _coordinator("keras_callbacks_resume", (str(tmp_path),)) as (
        _,
        _,
        result,
    ):
        value = result()
    # Only the coordinator runs callbacks (it writes every file); the
    # restored epoch reaches the parameter-server loop.
    assert value["interrupted"] == [0, 1, 2]
    assert value["resumed"] == [2, 3]
    assert value["iterations"] == 4 * 5  # 2 epochs restored + 2 run
    assert value["files"] == [
        "checkpoints/1.keras",
        "checkpoints/2.keras",
        "checkpoints/3.keras",
        "checkpoints/4.keras",
        "log.csv",
    ]  # the backup is deleted at the end
    assert value["logged_epochs"] == ["0", "1", "2", "3"]
