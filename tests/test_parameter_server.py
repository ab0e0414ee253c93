"""ParameterServerStrategy: worker and ps servers as processes on 127.0.0.1,
the coordinator in its own process (a coordinator in the pytest process would
connect the whole test session's eager context to the cluster)."""

import multiprocessing

import numpy as np
import pytest
import workers_lib

import keras_hetero as kh

pytestmark = pytest.mark.slow


def _run_cluster():
    ports = kh.testing.free_ports(4)
    cluster = {
        "worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"],
        "ps": [f"127.0.0.1:{ports[2]}"],
        "chief": [f"127.0.0.1:{ports[3]}"],
    }
    context = multiprocessing.get_context("spawn")
    servers = [
        context.Process(
            target=workers_lib.pss_server,
            args=(cluster, job, index),
            daemon=True,
        )
        for job, index in (("worker", 0), ("worker", 1), ("ps", 0))
    ]
    queue = context.Queue()
    coordinator = context.Process(
        target=workers_lib.pss_coordinator, args=(cluster, queue), daemon=True
    )
    try:
        for server in servers:
            server.start()
        coordinator.start()
        return queue.get(timeout=240)
    finally:
        for process in [coordinator, *servers]:
            if process.is_alive():
                process.kill()
            process.join()


def test_parameter_server_strategy():
    status, value = _run_cluster()
    if kh.FLAVOUR == "keras3":
        # Stock Keras 3 has no ClusterCoordinator path at all; say so clearly.
        assert status == "not_implemented", value
        assert "ParameterServerStrategy" in value
        assert "Keras 3" in value
        return
    assert status == "ok", value
    assert value["iterations"] == 10
    assert len(value["loss"]) == 2
    assert np.all(np.isfinite(value["loss"]))
    assert value["loss"][1] < value["loss"][0]
