"""`kh.doctor()` and `keras-hetero doctor`: devices, speeds, the clock trust
check, TF_CONFIG errors, and a real 2-worker collective run.

Worker processes import this module to run `collective_doctor`: keep it
free of conftest (its logical CPUs) and of TensorFlow work at import.
"""

import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _distribute
from keras_hetero.balancing import memory
from keras_hetero.doctor import cluster as cluster_lib
from keras_hetero.doctor import host as host_lib
from keras_hetero.doctor import report as report_lib
from keras_hetero.training import telemetry

keras = kh.keras
REPORT_KEYS = {
    "host",
    "devices",
    "suggested_shares",
    "shares_basis",
    "precision",
    "model",
    "cluster",
    "versions",
}
DEVICE_KEYS = {
    "bfloat16",
    "name",
    "kind",
    "description",
    "compute_capability",
    "memory_bytes",
    "matmul_size",
    "flops",
    "relative_speed",
    "step_seconds",
    "clock_seconds",
    "clock_trusted",
    "max_rows",
    "notes",
}


def _model():
    """Big enough that a step's compute (several ms) outweighs timer noise."""
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def _free_ports(count):
    return kh.launcher.free_ports(count)


def _tf_config(ports, index):
    return json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
    )


def _cli(*arguments, env=None):
    script = os.path.join(os.path.dirname(sys.executable), "keras-hetero")
    command = (
        [script]
        if os.path.exists(script)
        else [
            sys.executable,
            "-c",
            "import sys; from keras_hetero.launcher import main; "
            "sys.exit(main())",
        ]
    )
    environ = {
        key: value for key, value in os.environ.items() if key != "TF_CONFIG"
    }
    environ.update(TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run(
        [*command, "doctor", *arguments],
        capture_output=True,
        text=True,
        env=environ,
        timeout=180,
    )


# --- devices and speeds ---------------------------------------------------


def test_lists_and_times_every_logical_cpu(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    logical = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(logical) == 4  # conftest's kh.testing.logical_cpus(4)

    report = kh.doctor()

    assert isinstance(report, kh.DoctorReport)
    assert [device.name for device in report.devices] == logical
    for device in report.devices:
        assert device.kind == "CPU"
        assert device.flops > 0 and device.matmul_size >= 64
        assert 0 < device.relative_speed <= 1.0
        assert device.memory_bytes == report.host.memory_bytes
        assert device.clock_trusted is None and device.max_rows is None
    assert max(d.relative_speed for d in report.devices) == 1.0
    assert len(report.suggested_shares) == 4
    assert sum(report.suggested_shares) == pytest.approx(1.0)
    assert report.shares_basis == "matmul"
    assert report.precision == "float32"
    assert report.cluster is None and report.model is None
    assert report.host.usable_cores >= 1
    table = report.table()
    for name in logical:
        assert name in table
    assert "suggested shares (matmul)" in table
    assert 'precision="auto" picks: float32' in table


def test_json_has_the_expected_keys(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    report = kh.doctor(devices=["CPU:1", "/device:CPU:3"])

    parsed = json.loads(report.to_json())

    assert set(parsed) == REPORT_KEYS
    assert [d["name"] for d in parsed["devices"]] == [
        "/device:CPU:1",
        "/device:CPU:3",
    ]
    assert set(parsed["devices"][0]) == DEVICE_KEYS
    assert parsed["precision"] == "float32"
    assert len(parsed["suggested_shares"]) == 2
    assert parsed["versions"]["TensorFlow"] == tf.__version__


def test_unknown_devices_and_bad_arguments_are_named(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"'GPU:7' names no device"):
        kh.doctor(devices=["CPU:0", "GPU:7"])
    with pytest.raises(TypeError, match=r"devices='CPU:0'"):
        kh.doctor(devices="CPU:0")
    with pytest.raises(ValueError, match=r"devices=\[\]"):
        kh.doctor(devices=[])
    with pytest.raises(ValueError, match=r"timeout=0"):
        kh.doctor(timeout=0)
    with pytest.raises(ValueError, match=r"model=None"):
        kh.doctor(batch=8)
    with pytest.raises(ValueError, match=r"not compiled"):
        kh.doctor(model=keras.Sequential([keras.Input((2,))]))
    with pytest.raises(ValueError, match=r"collective=True without TF_CONFIG"):
        kh.doctor(collective=True)


# --- the model's step and the clock trust check ---------------------------


def test_trust_check_passes_when_the_clock_sees_the_work(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 256)).astype("float32")
    y = rng.integers(0, 10, size=(512,))

    report = kh.doctor(_model(), batch=(x, y), devices=["CPU:0", "CPU:2"])

    assert report.model.batch_size == 512
    assert report.model.state_bytes > 0
    assert report.model.activation_bytes_per_row > 0
    for device in report.devices:
        assert device.step_seconds > 0 and device.clock_seconds > 0
        assert device.clock_trusted is True, device.notes
        assert device.max_rows > 0
    assert report.shares_basis == "model step"
    assert "max rows*" in report.table()


def test_trust_check_flags_a_clock_that_reads_a_constant(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)

    def constant_clock(dependencies, enabled=True):
        return tf.constant(123.0, tf.float64)

    monkeypatch.setattr(telemetry, "clock", constant_clock)

    report = kh.doctor(_model(), batch=256, devices=["CPU:1"])

    (device,) = report.devices
    assert device.clock_seconds == 0.0
    assert device.clock_trusted is False
    assert "clock does not see this device's work" in device.notes[0]
    assert "NO" in report.table()


def test_clock_verdict_and_estimates():
    assert report_lib.clock_verdict(0.009, 0.010) == (True, None)
    trusted, note = report_lib.clock_verdict(0.0001, 0.010)
    assert trusted is False and "1%" in note
    assert report_lib.clock_verdict(np.nan, 0.010)[0] is None
    assert report_lib.clock_verdict(0.0, 0.0002)[0] is None  # too short
    assert report_lib.suggest_shares([3.0, 1.0]) == (0.75, 0.25)
    thirds = report_lib.suggest_shares([1.0, 1.0, 1.0])
    assert thirds == (0.3334, 0.3333, 0.3333)
    assert report_lib.suggest_shares([0.0, np.nan]) == (0.5, 0.5)
    assert memory.rows_that_fit(1000, 100, 8) == 100
    assert memory.rows_that_fit(1000, 5000, 8) == 0
    assert memory.rows_that_fit(None, 100, 8) is None


def test_cgroup_cpu_quota_and_memory_limit(tmp_path):
    """The tightest quota along the path: v1 files, v2 `cpu.max`."""
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "job" / "task").mkdir(parents=True)
    (v1 / "memory" / "job").mkdir(parents=True)
    files = {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/job/task/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/job/task/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": str(2**63 - 4096),
        "memory/job/memory.limit_in_bytes": str(2**30),
        "memory/job/memory.usage_in_bytes": str(2**28),
    }
    for path, text in files.items():
        (v1 / path).write_text(text + "\n")
    lines = "4:memory:/job\n2:cpu,cpuacct:/job/task\n0::/\n"
    assert host_lib.cgroup_cpu_quota(lines, str(v1)) == 1.5
    assert host_lib.cgroup_memory(lines, str(v1)) == (2**30, 2**28)

    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "a" / "cpu.max").write_text("50000 100000\n")
    (v2 / "a" / "b" / "cpu.max").write_text("max 100000\n")
    (v2 / "a" / "b" / "memory.max").write_text("max\n")
    assert host_lib.cgroup_cpu_quota("0::/a/b\n", str(v2)) == 0.5
    assert host_lib.cgroup_memory("0::/a/b\n", str(v2)) == (None, None)
    assert host_lib.cgroup_cpu_quota("", str(v2)) is None


# --- TF_CONFIG ------------------------------------------------------------


def test_an_unreachable_worker_is_named(monkeypatch):
    ports = _free_ports(2)
    monkeypatch.setenv("TF_CONFIG", _tf_config(ports, 0))
    with pytest.raises(ConnectionError) as raised:
        kh.doctor(timeout=1.0)
    message = str(raised.value)
    assert f"worker:1 at 127.0.0.1:{ports[1]}" in message
    assert f"127.0.0.1:{ports[0]}" not in message


@pytest.mark.parametrize(
    "tf_config, named",
    [
        ('{"cluster": {"worker": ["127.0.0.1:1"]', "not valid JSON"),
        ('["127.0.0.1:1"]', "TF_CONFIG has no cluster"),
        (
            '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, '
            '"task": {"type": "worker", "index": 2}}',
            "task.index is out of range.*'index': 2.*indices 0 to 1",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1"]}, '
            '"task": {"type": "worker", "index": 0}}',
            r"cluster.worker\[0\] is not a 'host:port' address.*'127.0.0.1'",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}, '
            '"task": {"type": "chief", "index": 0}}',
            "task.type names no task type",
        ),
        (
            '{"cluster": {"chief": ["127.0.0.1:1"], '
            '"worker": ["127.0.0.1:1"]}, "task": {"type": "chief"}}',
            "names the address 127.0.0.1:1 twice: for chief:0 and worker:0",
        ),
    ],
)
def test_a_malformed_tf_config_is_named(monkeypatch, tf_config, named):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ValueError, match=named):
        kh.doctor(timeout=1.0)


def test_tasks_reach_each_other_and_a_used_port_is_named():
    ports = _free_ports(2)
    tasks, _ = _distribute.cluster_tasks({"TF_CONFIG": _tf_config(ports, 0)})
    results = {}

    def check(own):
        results[own] = cluster_lib.check_reachable(tasks, own, 10.0)

    threads = [
        threading.Thread(target=check, args=(own,))
        for own in ("worker:0", "worker:1")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [(p.task, p.reachable) for p in results["worker:0"]] == [
        ("worker:1", True)
    ]
    assert [(p.task, p.reachable) for p in results["worker:1"]] == [
        ("worker:0", True)
    ]

    with socket.create_server(("127.0.0.1", ports[0])):
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{ports[0]}"):
            cluster_lib.check_reachable(tasks, "worker:0", 1.0)


# --- the command line -----------------------------------------------------


def test_cli_prints_the_table():
    result = _cli()
    assert result.returncode == 0, result.stderr
    assert "device" in result.stdout and "GFLOP/s" in result.stdout
    assert "/device:CPU:0" in result.stdout
    assert "suggested shares (matmul)" in result.stdout


def test_cli_json_with_a_saved_model(tmp_path):
    path = str(tmp_path / "model.keras")
    _model().save(path)

    result = _cli("--json", "--model", path, "--batch-size", "128")

    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert set(parsed) == REPORT_KEYS
    assert parsed["model"]["batch_size"] == 128
    (device,) = parsed["devices"]
    assert set(device) == DEVICE_KEYS
    assert device["step_seconds"] > 0 and device["clock_seconds"] > 0
    assert parsed["shares_basis"] == "model step"


def test_cli_names_the_unreachable_worker_and_exits_non_zero():
    ports = _free_ports(2)
    result = _cli("--timeout", "1", env={"TF_CONFIG": _tf_config(ports, 0)})
    assert result.returncode == 1
    assert f"127.0.0.1:{ports[1]}" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cli_exits_2_naming_a_bad_tf_config_or_argument(monkeypatch, capsys):
    bad = '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"index": 3}}'
    monkeypatch.setenv("TF_CONFIG", bad)
    assert kh.launcher.main(["doctor"]) == 2
    assert "task.type names no task type" in capsys.readouterr().err
    monkeypatch.delenv("TF_CONFIG")
    assert kh.launcher.main(["doctor", "--model", "/no/such.keras"]) == 2
    assert "'/no/such.keras', which does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kh.launcher.main(["doctor", "--batch-size", "8"])
    assert "--batch-size needs --model" in capsys.readouterr().err


def test_gathered_speeds_survive_a_peer_that_left_after_them(monkeypatch):
    """The closing all-reduce after the speeds may fail on a peer that has
    already exited (CI: "Socket closed"); the gathered speeds stand."""
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps(
            {
                "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                "task": {"type": "worker", "index": 1},
            }
        ),
    )
    sent = []

    def sum_over_workers(strategy, allreduce, array):
        sent.append(array.copy())
        if len(sent) == 2:
            raise tf.errors.UnavailableError(None, None, "Socket closed")
        return array + [3.0, 0.0]

    monkeypatch.setattr(cluster_lib, "_sum_over_workers", sum_over_workers)
    monkeypatch.setattr(cluster_lib, "_allreduce_function", lambda s: None)
    assert cluster_lib.gather_speeds(None, [5.0]) == [3.0, 5.0]
    assert [list(array) for array in sent] == [[0.0, 5.0], [0.0]]
    # Any other failure of the closing all-reduce is not hidden.
    sent.clear()

    def broken(strategy, allreduce, array):
        sent.append(array)
        if len(sent) == 2:
            raise tf.errors.InvalidArgumentError(None, None, "shapes")
        return array

    monkeypatch.setattr(cluster_lib, "_sum_over_workers", broken)
    with pytest.raises(tf.errors.InvalidArgumentError):
        cluster_lib.gather_speeds(None, [5.0])


# --- a real cluster -------------------------------------------------------


def collective_doctor():
    """In a worker process: the doctor with the collective check."""
    return kh.doctor(collective=True, timeout=60.0).to_dict()


@pytest.mark.slow
def test_two_workers_time_an_allreduce():
    results = kh.testing.run_workers(collective_doctor, 2, timeout=180)
    for index, result in enumerate(results):
        cluster = result.value["cluster"]
        assert cluster["task"] == f"worker:{index}"
        assert cluster["worker_index"] == index
        assert cluster["num_workers"] == 2
        assert cluster["allreduce_bytes"] == 1_000_000
        assert cluster["allreduce_seconds"] > 0
        assert cluster["agree"] is True
        (peer,) = cluster["peers"]
        assert peer["task"] == f"worker:{1 - index}" and peer["reachable"]
        assert len(cluster["replica_devices"]) == 2
        assert sum(cluster["suggested_shares"]) == pytest.approx(1.0)
    assert (
        results[0].value["cluster"]["suggested_shares"]
        == results[1].value["cluster"]["suggested_shares"]
    )


@pytest.mark.slow
@pytest.mark.serial
def test_two_throttled_workers_see_their_quota_and_suggest_shares_by_it():
    """Real unequal devices (CPU quota): worker 1 capped at a quarter of its
    core reports the quota, and both suggest about 4 : 1 shares."""
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        pytest.skip(reason)
    results = kh.testing.run_workers(
        collective_doctor,
        2,
        timeout=180,
        cpu_quotas=[None, 0.25],
        cores="auto",
    )
    reports = [result.value for result in results]
    assert reports[0]["host"]["cpu_quota"] is None
    assert reports[1]["host"]["cpu_quota"] == pytest.approx(0.25)
    for report in reports:
        fast, slow = report["cluster"]["suggested_shares"]
        # Capacity 4 : 1; the matmul timing on a busy host may land lower.
        assert fast / slow > 2.5, report["cluster"]["suggested_shares"]
    assert (
        reports[0]["cluster"]["suggested_shares"]
        == reports[1]["cluster"]["suggested_shares"]
    )
