"""keras-hetero under Ray Train on a local Ray cluster (127.0.0.1).

One Ray session per module, 2 CPUs; the job is
`tests/support/ray_workers.py`: 80
examples, global batch 8 (10 steps per epoch), replica 1 simulated 8x
slower, ShardRebalancer + StragglerDetector + ElasticCheckpoint. It runs
as Ray's `TensorflowTrainer` (MultiWorkerMirrored from Ray's TF_CONFIG) and,
for reference, under `keras-hetero run`. Set `KH_RAY_DEBUG=1` to see the
Ray workers' output.
"""

import glob
import io
import json
import os
import pathlib
import sys

# Keep the local cluster small and quiet: loopback only, no usage stats,
# no dashboard, no Train state/preemption actors polling in the background.
# Set before Ray is imported: it reads some of them at import.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node IP = 127.0.0.1
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
os.environ.update(RAY_ENV)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
from ray.train import FailureConfig  # noqa: E402
from ray.train import RunConfig  # noqa: E402
from ray.train import ScalingConfig  # noqa: E402
from ray.train.tensorflow import TensorflowTrainer  # noqa: E402

import keras_hetero as kh  # noqa: E402
import keras_hetero.ray as kh_ray  # noqa: E402
from keras_hetero import launcher  # noqa: E402
from tests.checkpointing import test_elastic_processes as elastic  # noqa: E402
from tests.conftest import DEVICES  # noqa: E402
from tests.support import helpers  # noqa: E402
from tests.support import ray_workers  # noqa: E402

# Ray's local cluster takes both cores, and the shares its runs end with
# follow measured speed: `make test` runs this file alone (serial).
pytestmark = pytest.mark.serial

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
STEPS_PER_EPOCH = ray_workers.ROWS // ray_workers.BATCH


@pytest.fixture(scope="module")
def ray_cluster():
    path = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=bool(os.environ.get("KH_RAY_DEBUG")),
        runtime_env={
            "env_vars": {"PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"}
        },
    )
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield
    finally:
        ray.shutdown()


def _fit(config, num_workers, storage, name, max_failures=0):
    trainer = TensorflowTrainer(
        ray_workers.train,
        train_loop_config=config,
        tensorflow_config=kh_ray.TensorflowConfig(),
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


@pytest.fixture(scope="module")
def launcher_run(tmp_path_factory):
    """The same job under `keras-hetero run` (2 workers, no fault)."""
    root = tmp_path_factory.mktemp("launcher")
    out = str(root / "out")
    config = {"out": out, "mode": "launcher", "ckpt": str(root / "ckpt")}
    log = io.StringIO()
    result = launcher.launch(
        [sys.executable, ray_workers.__file__, json.dumps(config)],
        2,
        max_restarts=0,
        output=log,
    )
    assert result.exit_code == 0, log.getvalue()[-4000:]
    return out


def _records(out, attempt):
    """{step: ids of all workers} of one attempt."""
    steps = {}
    for path in glob.glob(os.path.join(out, f"attempt{attempt}-worker*.jsonl")):
        for record in elastic._step_records(path):
            steps.setdefault(record["step"], []).extend(record["ids"])
    return steps


def _committed(out):
    """Ids per step as the run counts, from its exactly-once ledger: attempt
    0 up to the step attempt 1 resumed after, then attempt 1; and that step
    (the last step if it did not restart)."""
    steps, restored = elastic._committed_attempts(out, ray_workers.ROWS)
    return steps, restored[1] if len(restored) > 1 else max(steps)


def _assert_exactly_once(steps, epochs):
    elastic._assert_exactly_once(steps, epochs, ray_workers.ROWS)


def _load(path):
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _callbacks(out, attempt):
    with open(
        os.path.join(out, f"attempt{attempt}-worker0-callbacks.json")
    ) as f:
        return json.load(f)


def _reported_step(result):
    with result.checkpoint.as_directory() as directory:
        with open(os.path.join(directory, "state.json")) as f:
            return json.load(f)["global_step"]


@pytest.mark.slow
@pytest.mark.extended  # CI: the killed worker and the smaller restart
def test_ray_run_equals_keras_hetero_run(ray_cluster, launcher_run, tmp_path):
    out = str(tmp_path / "out")
    result = _fit({"out": out}, 2, str(tmp_path / "ray"), "plain")
    assert result.error is None
    assert result.metrics["step"] == 2 * STEPS_PER_EPOCH
    assert result.metrics["epoch"] == 1 and "loss" in result.metrics
    assert "share/replica_0" in result.metrics  # the epoch's logs
    assert _reported_step(result) == 2 * STEPS_PER_EPOCH
    assert not _records(out, 1)
    _assert_exactly_once(_committed(out)[0], epochs=2)
    helpers.assert_weights_close(
        _load(os.path.join(out, "attempt0-worker0-final.npz")),
        _load(os.path.join(launcher_run, "attempt0-worker0-final.npz")),
    )
    # Heterogeneity works as under `keras-hetero run`: rows move to the
    # fast replica 0, and replica 1, slower from the start, is a slower
    # device, not a straggler (docs/stragglers.md, "A slower device is not
    # a straggler").
    for seen in (_callbacks(out, 0), _callbacks(launcher_run, 0)):
        assert seen["num_replicas"] == 2
        assert seen["flavour"] == kh.FLAVOUR
        assert seen["changes"] and seen["changes"][-1][0] > 0.75
        assert seen["stragglers"] == []


@pytest.mark.slow
def test_killed_worker_restarts_at_the_reported_step(
    ray_cluster, launcher_run, tmp_path
):
    out = str(tmp_path / "out")
    fault_at = 7  # reports with a checkpoint after steps 2, 4 and 6
    result = _fit(
        {"out": out, "fault_at": fault_at},
        2,
        str(tmp_path / "ray"),
        "killed",
        max_failures=1,
    )
    assert result.error is None
    assert max(_records(out, 0)) >= fault_at  # worker 1 got to the fault
    steps, resumed_from = _committed(out)
    print(f"killed after step {fault_at}; resumed after step {resumed_from}")
    assert resumed_from in (2, 4, 6)
    _assert_exactly_once(steps, epochs=2)
    assert _reported_step(result) == 2 * STEPS_PER_EPOCH
    helpers.assert_weights_close(
        _load(os.path.join(out, "attempt1-worker0-final.npz")),
        _load(os.path.join(launcher_run, "attempt0-worker0-final.npz")),
    )


@pytest.mark.slow
# CI: low-communication kill and resume under the launcher
# (tests/checkpointing/test_elastic_processes.py).
@pytest.mark.extended
def test_low_communication_killed_worker_resumes_exactly(ray_cluster, tmp_path):
    # Each report (every 2 steps) ends the round on every worker and saves
    # each replica's inner optimizer state (SGD momentum): the resumed run
    # ends with the weights of the same job without the kill.
    plain, killed = str(tmp_path / "plain"), str(tmp_path / "killed")
    config = {"sync_every": 3}
    result = _fit({**config, "out": plain}, 2, str(tmp_path / "r1"), "low")
    assert result.error is None
    result = _fit(
        {**config, "out": killed, "fault_at": 7},
        2,
        str(tmp_path / "r2"),
        "low-killed",
        max_failures=1,
    )
    assert result.error is None
    steps, resumed_from = _committed(killed)
    assert resumed_from in (2, 4, 6)
    _assert_exactly_once(steps, epochs=2)
    helpers.assert_weights_close(
        _load(os.path.join(killed, "attempt1-worker0-final.npz")),
        _load(os.path.join(plain, "attempt0-worker0-final.npz")),
    )


@pytest.mark.slow
# CI: a resume with another worker count under the launcher
# (tests/checkpointing/test_elastic_processes.py).
@pytest.mark.extended
def test_restart_with_fewer_workers_reshards_exactly(ray_cluster, tmp_path):
    out, storage = str(tmp_path / "out"), str(tmp_path / "ray")
    first = _fit({"out": out, "epochs": 1, "stop_after": 7}, 2, storage, "rs")
    assert first.error is None
    assert _reported_step(first) == 7
    # Same run name and storage: Ray resumes the run from its checkpoint,
    # here with an elastic group of (min, max) = (1, 1) workers.
    second = _fit({"out": out, "epochs": 1}, (1, 1), storage, "rs")
    assert second.error is None
    assert _callbacks(out, 1)["num_replicas"] == 1
    steps, resumed_from = _committed(out)
    assert resumed_from == 7
    _assert_exactly_once(steps, epochs=1)
    initial = _load(os.path.join(out, "attempt0-worker0-initial.npz"))
    helpers.assert_weights_close(
        _load(os.path.join(out, "attempt1-worker0-final.npz")),
        _single_device(initial, epochs=1),
    )


def _single_device(initial, epochs):
    strategy = helpers.mirrored(DEVICES[:1])
    with strategy.scope():
        model = helpers.id_model([], 0.0)
    model.set_weights(initial)
    data = kh.data.shard(
        helpers.id_examples(ray_workers.ROWS),
        ray_workers.BATCH,
        strategy=strategy,
    )
    model.fit(data, epochs=epochs, verbose=0)
    return model.get_weights()


def test_import_without_ray_names_the_extra():
    message = helpers.import_error_without("ray", "keras_hetero.ray")
    assert 'pip install "ray[train]==2.60.0"' in message


def test_elastic_checkpoint_needs_a_step_schedule():
    for bad in ("5m", "auto", 0, True):
        with pytest.raises(ValueError, match="save_every"):
            kh_ray.ElasticCheckpoint(save_every=bad)


def test_elastic_checkpoint_outside_ray_says_so():
    strategy = helpers.mirrored(DEVICES[:1])
    with strategy.scope():
        model = helpers.hetero_model()
    data = kh.data.shard(helpers.examples(), 16, strategy=strategy)
    checkpoint = kh_ray.ElasticCheckpoint(save_every=2)
    with pytest.raises(RuntimeError, match="inside a Ray Train"):
        model.fit(data, callbacks=[checkpoint], verbose=0)
