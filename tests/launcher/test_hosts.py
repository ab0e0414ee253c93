"""The multi-host launcher: `keras-hetero run --nnodes ... --node-rank ...`.

Pure decisions (`kh.launcher.policy`, `kh.launcher.devices`) are tested
directly. Jobs whose workers are tiny scripts run their hosts' launchers in
threads of this process on 127.0.0.1. Training jobs run each host's
launcher in its own network namespace (`kh.testing.NetworkHosts`, root)
with `tests/scripts/host_train.py` (elastic_train.py: 80 examples, global
batch 8, a checkpoint every step), and compare the final weights with one
device trained on the same global batches. The launcher's own behaviour
lies below Keras: CI runs these under Keras 3 (`make test-all`: both
flavours).
"""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import keras_hetero as kh
from keras_hetero.launcher import cli
from keras_hetero.launcher import devices
from keras_hetero.launcher import hosts
from keras_hetero.launcher import policy
from keras_hetero.launcher import rendezvous
from keras_hetero.launcher import timing
from tests.checkpointing import test_elastic_processes as elastic
from tests.support import helpers

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts")
HOST_TRAIN = os.path.join(SCRIPTS, "host_train.py")
NETWORK, NO_NETWORK = kh.testing.network_available()
needs_namespaces = pytest.mark.skipif(not NETWORK, reason=NO_NETWORK)

# --- pure decisions --------------------------------------------------------


def test_nnodes_and_endpoint_are_parsed_or_named():
    assert policy.parse_nnodes("3") == (3, 3)
    assert policy.parse_nnodes("2:4") == (2, 4)
    for bad in ("0", "3:2", "a", "", True, "1:2:3"):
        with pytest.raises(ValueError, match="argument `nnodes`"):
            policy.parse_nnodes(bad)
    assert policy.parse_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("host", "host:0", ":29400", "host:99999", None):
        with pytest.raises(ValueError, match="rdzv_endpoint="):
            policy.parse_endpoint(bad)


def test_a_round_starts_with_all_hosts_or_min_after_the_last_call():
    def decide(joined, low, high, waited=0.0, quiet=0.0):
        return policy.decide_round(
            joined,
            low,
            high,
            waited=waited,
            quiet=quiet,
            timeout=60,
            last_call=5,
        )

    assert decide([1, 0], 3, 3) == policy.Decision("wait", (), (2,))
    assert decide([2, 1, 0], 3, 3) == policy.Decision("start", (0, 1, 2))
    # MIN:MAX: with MIN in, wait for more until no host joined for 5 s.
    assert decide([0, 2], 2, 3, waited=9, quiet=4).action == "wait"
    assert decide([0, 2], 2, 3, waited=9, quiet=5) == policy.Decision(
        "start", (0, 2), (1,)
    )
    # Fewer than MIN at the timeout: the missing ranks are named.
    assert decide([0], 2, 3, waited=60, quiet=60) == policy.Decision(
        "fail", (), (1, 2)
    )
    # A running group admits hosts that joined, after the same last call.
    assert policy.should_admit([0, 2], [0, 1, 2], 3, quiet=0, last_call=5)
    assert not policy.should_admit([0], [0, 1], 3, quiet=1, last_call=5)
    assert policy.should_admit([0], [0, 1], 3, quiet=5, last_call=5)
    assert not policy.should_admit([0, 1], [0, 1], 3, quiet=9, last_call=5)


def test_workers_are_numbered_host_by_host_in_rank_order():
    workers = policy.assign_workers(
        {
            2: ("10.0.0.3", [7000], [None]),
            0: ("10.0.0.1", [5000, 5001], ["0", "1"]),
            1: ("fd00::2", [6000], [None]),
        }
    )
    assert [(w.index, w.rank, w.local_index) for w in workers] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 2, 0),
    ]
    assert [w.address for w in workers] == [
        "10.0.0.1:5000",
        "10.0.0.1:5001",
        "[fd00::2]:6000",
        "10.0.0.3:7000",
    ]
    assert [w.devices for w in workers] == ["0", "1", None, None]
    with pytest.raises(ValueError, match="one port per worker"):
        policy.assign_workers({0: ("10.0.0.1", [5000], ["0", "1"])})


def test_auto_makes_one_worker_per_gpu_8_and_4_gpus_make_12():
    eight = devices.worker_devices("auto", [str(i) for i in range(8)])
    four = devices.worker_devices("auto", ["0", "1", "2", "3"])
    assert len(eight) + len(four) == 12
    assert eight == [str(i) for i in range(8)] and four == ["0", "1", "2", "3"]
    assert devices.worker_devices("auto", []) == [None]
    assert devices.worker_devices(2, ["0", "1", "2", "3"]) == ["0,1", "2,3"]
    assert devices.worker_devices(3, []) == [None, None, None]
    with pytest.raises(ValueError, match="divisor of the GPU count"):
        devices.worker_devices(3, ["0", "1", "2", "3"])
    for bad in (0, "x", True, "-1"):
        with pytest.raises(ValueError, match="argument `workers_per_host`"):
            devices.parse_workers_per_host(bad)
    # Every auto worker has one GPU, so the group is MWMS-shaped; a worker
    # without GPUs runs on the CPU, which cannot join them.
    assert {policy.devices_per_worker(d) for d in eight + four} == {"1 GPU"}
    assert policy.devices_per_worker(None) == "CPU"
    assert policy.devices_per_worker("0,1") == "2 GPU"


def test_gpus_are_discovered_without_tensorflow(tmp_path):
    # The launcher's own CUDA_VISIBLE_DEVICES restricts the GPUs.
    assert devices.discover_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == [
        "2",
        "3",
    ]
    assert devices.discover_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert devices.discover_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]
    # Else nvidia-smi -L (a fake one on PATH; `run` stands for it).
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    listing = (
        "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1)\n"
        "  MIG 1g.5gb Device 0: (UUID: MIG-1)\n"
        "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-2)\n"
    )

    def run(argv, **kwargs):
        assert argv == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(argv, 0, listing, "")

    assert devices.discover_gpus({"PATH": str(tmp_path)}, run=run) == [
        "0",
        "1",
    ]


def test_hosts_must_run_the_same_job():
    reference = {
        "script": "train.py (sha256 ab...)",
        "arguments": ["--epochs", "3"],
        "tensorflow": "2.21.0",
        "devices_per_worker": "1 GPU",
    }
    assert policy.job_mismatch(reference, dict(reference), rank=1) is None
    message = policy.job_mismatch(
        reference, {**reference, "tensorflow": "2.20.0"}, rank=2
    )
    assert message.startswith(
        "Host rank 2 does not match host rank 0: tensorflow '2.20.0' (host "
        "rank 0: '2.21.0')."
    )
    message = policy.job_mismatch(
        reference, {**reference, "devices_per_worker": "4 GPU"}, rank=1
    )
    assert "--workers-per-host auto" in message
    message = policy.job_mismatch(
        reference, {**reference, "devices_per_worker": "CPU"}, rank=1
    )
    assert "hosts without GPUs cannot join hosts with GPUs" in message
    job = hosts.job_description([sys.executable, HOST_TRAIN, "--x"], ["0"])
    assert job["script"].startswith("host_train.py (sha256 ")
    assert job["arguments"] == ["--x"]
    assert set(job) == set(policy.JOB_FIELDS)


def test_the_token_comes_from_env_or_file_and_is_never_shown(tmp_path):
    assert rendezvous.read_token(environ={rendezvous.TOKEN_ENV: "s3"}) == (
        b"s3"
    )
    path = tmp_path / "token"
    path.write_text("  from-file\n")
    assert rendezvous.read_token(token_file=str(path), environ={}) == (
        b"from-file"
    )
    with pytest.raises(ValueError, match="KERAS_HETERO_RDZV_TOKEN"):
        rendezvous.read_token(environ={})
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        rendezvous.read_token(token_file=str(path), environ={})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "2", "x.py"], "--nnodes needs --node-rank and"),
        (["--workers", "2", "--node-rank", "1", "x.py"], "--node-rank need"),
        (["x.py"], "needs --workers N"),
        (
            ["--nnodes", "2", "--node-rank", "0", "--workers", "2"]
            + ["--rdzv-endpoint", "127.0.0.1:1", "x.py"],
            "--workers and --min-workers are for one machine",
        ),
    ],
)
def test_cli_names_flags_that_do_not_go_together(argv, message, capsys):
    assert cli.main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_non_loopback_endpoint_needs_an_explicit_bind(monkeypatch, capsys):
    monkeypatch.setenv(rendezvous.TOKEN_ENV, "t")
    code = cli.main(
        ["run", "--nnodes", "2", "--node-rank", "0"]
        + ["--rdzv-endpoint", "10.1.2.3:29400", "x.py"]
    )
    assert code == 2
    assert "--rdzv-bind 10.1.2.3" in capsys.readouterr().err


# --- hosts in threads on 127.0.0.1, tiny worker scripts --------------------

_ECHO = """\
import json, os, sys
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]["index"]
print("launched " + json.dumps({
    "worker": task,
    "cluster": config["cluster"]["worker"],
    "restart": int(os.environ["KERAS_HETERO_RESTART"]),
    "workers": int(os.environ["KERAS_HETERO_NUM_WORKERS"]),
    "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}))
fail = [int(w) for w in sys.argv[1].split(",") if w]
restarts = int(sys.argv[2]) if len(sys.argv) > 2 else 1
if task in fail and int(os.environ["KERAS_HETERO_RESTART"]) < restarts:
    sys.exit(3)
"""


def _host_threads(tmp_path, specs, **common):
    """Runs `launch_host` for each `(rank, arguments, kwargs)` of `specs` in
    a thread; returns `{rank: (result or exception, output)}`."""
    script = tmp_path / "echo.py"
    script.write_text(_ECHO)
    port = kh.testing.free_ports(1)[0]
    results = {}

    def run(rank, arguments, kwargs):
        output = io.StringIO()
        try:
            value = hosts.launch_host(
                [sys.executable, str(script), *arguments],
                node_rank=rank,
                rdzv_endpoint=f"127.0.0.1:{port}",
                rdzv_token=kwargs.pop("token", "secret"),
                output=output,
                **{**common, **kwargs},
            )
        except Exception as error:  # checked by the test
            value = error
        results[rank] = (value, output.getvalue())

    threads = [
        threading.Thread(target=run, args=spec, daemon=True) for spec in specs
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == len(specs), results
    return results


def _launched(output):
    """`{(restart, worker): what it printed}` from `launched {...}` lines."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"\[worker (\d+)\] launched (\{.*\})$", line)
        if match:
            record = json.loads(match.group(2))
            assert record["worker"] == int(match.group(1))
            found[(record["restart"], record["worker"])] = record
    return found


@pytest.mark.slow
def test_two_hosts_auto_devices_and_a_restart_after_a_failed_worker(
    tmp_path,
):
    # Rank 0 has 2 (fake) GPUs, rank 1 one: 2 + 1 workers. Worker 2 fails
    # in attempt 0; the group restarts once.
    results = _host_threads(
        tmp_path,
        [
            (0, ["2"], {"devices_per_host": 2}),
            (1, ["2"], {"devices_per_host": 1}),
        ],
        nnodes=2,
        workers_per_host="auto",
        rdzv_timeout=30,
        grace_seconds=2,
    )
    (first, out0), (second, out1) = results[0], results[1]
    assert first.exit_code == 0 and second.exit_code == 0, out0 + out1
    assert first.attempts == second.attempts
    assert [a.workers for a in first.attempts] == [3, 3]
    assert first.attempts[0].failed == (2,)
    assert (
        first.attempts[0].exit_codes[2] == 3
    )  # the others: done (0) or stopped (-15)
    assert first.attempts[0].hosts == (0, 0, 1)
    on0, on1 = _launched(out0), _launched(out1)
    # Attempt 0's workers on rank 0 may be stopped before they print.
    assert {(1, 0), (1, 1)} <= set(on0) <= {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert set(on1) == {(0, 2), (1, 2)}
    done = [on0[(1, 0)], on0[(1, 1)], on1[(1, 2)]]
    assert [r["devices"] for r in done] == ["0", "1", "0"]
    assert [r["workers"] for r in done] == [3, 3, 3]
    cluster = done[0]["cluster"]
    assert len(set(cluster)) == 3 and all(r["cluster"] == cluster for r in done)
    assert on1[(0, 2)]["cluster"] != cluster  # new ports after a restart
    assert "[rendezvous] worker 2 on host rank 1 exited with 3" in out0
    # Each host times its attempts' start, from what it saw end the one
    # before (these workers train no step: logged when they exit): rank
    # 1 its worker's failure; rank 0 the stop, or its own workers' exit if
    # they finished first. Stopped workers are stopped at once.
    since = "attempt 1 ended before every worker trained a step, seconds since"
    assert f"{since} worker 2 failed" in out1
    assert (
        f"{since} the rendezvous stopped the group" in out0
        or f"{since} the workers exited" in out0
    ), out0
    for output in (out0, out1):
        timed = dict(filter(None, map(timing.parse, output.splitlines())))
        assert list(timed[1]) == ["peers stopped", "started"], output
        assert timed[1]["peers stopped"] < 1.0, output


@pytest.mark.slow
def test_no_restarts_left_ends_every_host_with_the_workers_status(tmp_path):
    results = _host_threads(
        tmp_path,
        [(0, ["1", "9"], {}), (1, ["1", "9"], {})],
        nnodes=2,
        max_restarts=1,
        rdzv_timeout=30,
        grace_seconds=2,
    )
    for rank in (0, 1):
        result, output = results[rank]
        assert result.exit_code == 3, output
        assert len(result.attempts) == 2, output
        assert "no restarts left (--max-restarts 1); exit 3" in output


@pytest.mark.slow
def test_a_host_with_other_arguments_is_refused_and_named(tmp_path):
    results = _host_threads(
        tmp_path,
        [(0, ["", "--epochs", "2"], {}), (1, ["", "--epochs", "3"], {})],
        nnodes=2,
        rdzv_timeout=6,
    )
    refused, _ = results[1]
    assert isinstance(refused, ValueError), results
    assert str(refused).startswith(
        "Host rank 1 does not match host rank 0: arguments ['', '--epochs', "
        "'3'] (host rank 0: ['', '--epochs', '2'])."
    )
    waited, output = results[0]
    assert isinstance(waited, TimeoutError), results
    assert str(waited).startswith(
        "Host rank(s) [1] did not join the rendezvous at 127.0.0.1:"
    )
    assert "Host rank 1 was refused: Host rank 1 does not match" in str(waited)
    assert "[rendezvous] refused host rank 1 from 127.0.0.1:" in output


def _cli_rank0(port, script):
    """Rank 0's launcher of a 2-host job on 127.0.0.1, as a process."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_hetero.run", "--nnodes", "2"]
        + ["--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        + ["--grace-seconds", "2", str(script)],
        env=_host_env("secret"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


class _Rank1:
    """Rank 1's `launch_host` of that job, in a thread."""

    def __init__(self, port, script):
        self.output, self.result = _Lines(), None

        def run():
            self.result = hosts.launch_host(
                [sys.executable, str(script)],
                nnodes=2,
                node_rank=1,
                rdzv_endpoint=f"127.0.0.1:{port}",
                rdzv_token="secret",
                rdzv_timeout=120,
                grace_seconds=2,
                output=self.output,
            )

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_for(self, text, seconds=120):
        deadline = time.monotonic() + seconds
        while text not in self.output.text():
            assert time.monotonic() < deadline, self.output.text()
            time.sleep(0.05)


@pytest.mark.slow
def test_ctrl_c_on_rank_0_ends_the_job_on_every_host(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('training', flush=True)\n"
                      "time.sleep(120)\n")  # fmt: skip
    port = kh.testing.free_ports(1)[0]
    rank0 = _cli_rank0(port, script)
    rank1 = _Rank1(port, script)
    try:
        rank1.wait_for("[worker 1] training")
        rank0.send_signal(signal.SIGINT)
        text0 = rank0.communicate(timeout=60)[0]
    finally:
        rank0.kill()
        rank0.wait()
    rank1.thread.join(60)
    assert rank0.returncode == 130, text0
    assert "[launcher] got SIGINT; stopping workers" in text0
    assert rank1.result.exit_code == 130, rank1.output.text()
    assert "[launcher] host rank 0's launcher got SIGINT" in (
        rank1.output.text()
    )


@pytest.mark.slow
def test_hosts_rejoin_a_rank_0_that_comes_back(tmp_path):
    # Rank 0's launcher is SIGKILLed mid-attempt (its worker, a 3 s sleep,
    # ends on its own): rank 1 stops its worker, joins the new rank 0's
    # rendezvous, and the job finishes there.
    script = tmp_path / "nap.py"
    script.write_text("import time\nprint('napping', flush=True)\n"
                      "time.sleep(3)\n")  # fmt: skip
    port = kh.testing.free_ports(1)[0]
    first, second = _cli_rank0(port, script), None
    rank1 = _Rank1(port, script)
    try:
        rank1.wait_for("[worker 1] napping")
        first.kill()
        first.wait()
        second = _cli_rank0(port, script)
        text = second.communicate(timeout=120)[0]
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                process.wait()
    rank1.thread.join(60)
    assert second.returncode == 0, text
    output = rank1.output.text()
    assert rank1.result.exit_code == 0, output
    assert "[launcher] lost the rendezvous at 127.0.0.1:" in output
    # The new rendezvous counts attempts from 0; the first one never ended.
    assert [a.workers for a in rank1.result.attempts] == [2], output
    assert output.count("[worker 1] napping") == 2


class _Lines(io.StringIO):
    """A thread-safe text stream."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def write(self, text):
        with self._lock:
            return super().write(text)

    def text(self):
        with self._lock:
            return self.getvalue()


def test_a_rendezvous_port_in_use_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"127.0.0.1:{port}.*in use"):
            hosts.launch_host(
                [sys.executable, "x.py"],
                nnodes=1,
                node_rank=0,
                rdzv_endpoint=f"127.0.0.1:{port}",
                rdzv_token="t",
            )


# --- hosts in network namespaces --------------------------------------------


def _host_env(token):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env[rendezvous.TOKEN_ENV] = token
    return env


class _Hosts:
    """Launchers (`keras-hetero run --nnodes ...`) in `NetworkHosts`
    namespaces, each writing its output to `<tmp>/rank<i>-<n>.log`."""

    def __init__(
        self, net, tmp_path, nnodes, script, token="s3cret-t0ken", etcd=None
    ):
        self.net, self.tmp_path = net, tmp_path
        self.nnodes, self.script, self.token = nnodes, script, token
        self.endpoint = etcd or f"{net.address(0)}:29400"
        self.etcd = (
            ["--rdzv-backend", "etcd", "--rdzv-id", tmp_path.name]
            if etcd
            else None
        )
        self.processes, self.logs = [], []

    def start(self, rank, *flags, token=None):
        log = self.tmp_path / f"rank{rank}-{len(self.logs)}.log"
        command = [
            sys.executable,
            "-m",
            "keras_hetero.run",
            "--nnodes",
            self.nnodes,
            "--node-rank",
            str(rank),
            "--rdzv-endpoint",
            self.endpoint,
            *(self.etcd or []),
            *(
                ["--rdzv-bind", self.net.address(0)]
                if rank == 0 and not self.etcd
                else []
            ),
            *flags,
            *self.script,
        ]
        with open(log, "w") as f:
            process = self.net.popen(
                rank,
                command,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=_host_env(token or self.token),
            )
        self.processes.append(process)
        self.logs.append(log)
        return process

    def wait(self, process, seconds=240):
        try:
            return process.wait(seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a launcher did not finish:\n{self.text()[-6000:]}")

    def text(self, index=None):
        logs = self.logs if index is None else [self.logs[index]]
        return "\n".join(f"== {log.name}\n{log.read_text()}" for log in logs)

    def stop(self):
        for host in range(self.net.hosts):
            self.net.kill(host)
        for process in self.processes:
            process.wait()


def _train_args(out, ckpt, *more):
    return [
        HOST_TRAIN,
        "--out",
        out,
        "--ckpt",
        ckpt,
        "--save-every",
        "1",
        "--sync-save",
        "--step-seconds",
        "0",
        *more,
    ]


def _steps(out, attempt):
    path = os.path.join(out, f"attempt{attempt}-worker0.jsonl")
    return len(elastic._step_records(path))


def _wait_until(condition, what, hosts_, seconds=180):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} never came:\n{hosts_.text()[-6000:]}")
        time.sleep(0.1)


def _slow_second_attempt(out, ckpt, epochs):
    """host_train.py's arguments for a kill-and-readmit run: 0.3 s per
    step, 1 s per step in attempt 1 (so a host comes back while it
    trains)."""
    script = _train_args(
        out,
        ckpt,
        "--epochs",
        str(epochs),
        "--slow-attempt",
        "1",
        "--slow-step-seconds",
        "1.0",
    )
    script[script.index("--step-seconds") + 1] = "0.3"
    return script


def _assert_three_attempts_like_one_device(out, epochs):
    """Three attempts, each resuming later, trained every example once per
    epoch and ended with one device's weights on the same global batches;
    returns the steps each attempt resumed from."""
    committed, restored = elastic._committed_attempts(out)
    assert len(restored) == 3 and restored[1] < restored[2], restored
    elastic._assert_exactly_once(committed, epochs=epochs)
    initial = elastic._load(os.path.join(out, "attempt0-worker0-initial.npz"))
    final = elastic._load(os.path.join(out, "attempt2-worker0-final.npz"))
    weights, steps = elastic._one_device_run(
        initial, elastic._reference_data("plain", None, None), epochs
    )
    elastic._assert_same_batches(committed, steps)
    elastic.helpers.assert_weights_close(final, weights)
    return restored


def _rounds(text):
    """`[(workers, host ranks)]` of each attempt the rendezvous started."""
    return [
        (int(count), json.loads(ranks))
        for count, ranks in re.findall(
            r"\[rendezvous\] attempt \d+: (\d+) worker\(s\) on host rank\(s\) "
            r"(\[[\d, ]*\])",
            text,
        )
    ]


@pytest.mark.slow
@needs_namespaces
def test_two_hosts_with_2_and_1_workers_train_like_one_device(tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    started = time.monotonic()
    with kh.testing.NetworkHosts(2) as net:
        job = _Hosts(net, tmp_path, "2", _train_args(out, ckpt))
        try:
            auto = ["--workers-per-host", "auto", "--rdzv-timeout", "120"]
            first = job.start(0, *auto, "--devices-per-host", "2")
            second = job.start(1, *auto, "--devices-per-host", "1")
            codes = [job.wait(first), job.wait(second)]
        finally:
            job.stop()
    seconds = time.monotonic() - started
    assert codes == [0, 0], job.text()[-6000:]
    # Each worker saw the (fake) GPU the launcher gave it.
    seen = {}
    for host, log in enumerate(job.logs):
        for (_, worker), record in _launched(log.read_text()).items():
            seen[worker] = (record["devices"], record["workers"], host)
    assert seen == {0: ("0", 3, 0), 1: ("1", 3, 0), 2: ("0", 3, 1)}
    assert _rounds(job.text(0)) == [(3, [0, 1])]
    # Each host timed its workers' start, every phase in order.
    for host in (0, 1):
        lines = job.text(host).splitlines()
        timed = dict(filter(None, map(timing.parse, lines)))
        assert list(timed[0]) == [
            "started",
            "imported",
            "in fit",
            "restored",
            "first step",
        ], job.text(host)
        assert list(timed[0].values()) == sorted(timed[0].values())
    committed, _ = elastic._committed_attempts(out)
    elastic._assert_exactly_once(committed)
    initial = elastic._load(os.path.join(out, "attempt0-worker0-initial.npz"))
    final = elastic._load(os.path.join(out, "attempt0-worker0-final.npz"))
    elastic.helpers.assert_weights_close(final, elastic._reference(initial))
    print(f"2 hosts (2 + 1 workers) trained 20 steps in {seconds:.1f}s")


@pytest.mark.slow
@needs_namespaces
@pytest.mark.extended  # CI: the rejoin and shrink cases
def test_killed_host_group_continues_at_min_then_readmits_it(tmp_path):
    # --nnodes 2:3; ranks 0, 1, 2 have 1, 2, 1 (fake) GPUs, so 1, 2, 1
    # workers with --workers-per-host auto. Host 1 (workers 1
    # and 2) is killed mid-run: the group continues on hosts 0 and 2 (2
    # workers), then host 1's launcher is started again and the group
    # restarts with all 4 workers. Attempt 1 sleeps 1 s per step, so
    # host 1 comes back while it trains.
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    epochs = 3
    script = _slow_second_attempt(out, ckpt, epochs)
    flags = [
        "--workers-per-host",
        "auto",
        "--rdzv-timeout",
        "120",
        "--rdzv-last-call",
        "1",
        "--grace-seconds",
        "5",
    ]
    started = time.monotonic()
    with kh.testing.NetworkHosts(3) as net:
        job = _Hosts(net, tmp_path, "2:3", script)
        try:
            rank0 = job.start(0, *flags, "--devices-per-host", "1")
            job.start(1, *flags, "--devices-per-host", "2")
            rank2 = job.start(2, *flags, "--devices-per-host", "1")
            _wait_until(lambda: _steps(out, 0) >= 4, "step 4", job)
            killed_at = time.monotonic()
            assert net.kill(1)
            _wait_until(lambda: _steps(out, 1) >= 2, "attempt 1's steps", job)
            back_at = time.monotonic()
            again = job.start(1, *flags, "--devices-per-host", "2")
            codes = [job.wait(p) for p in (rank0, rank2, again)]
        finally:
            job.stop()
    seconds = time.monotonic() - started
    text = job.text()
    assert codes == [0, 0, 0], text[-6000:]
    rank0_log = job.text(0)
    assert (
        "[rendezvous] lost host rank 1: its launcher's connection closed"
        in (rank0_log)
    )
    assert "[rendezvous] host rank(s) [1] joined: restarting the group" in (
        rank0_log
    )
    assert _rounds(rank0_log) == [(4, [0, 1, 2]), (2, [0, 2]), (4, [0, 1, 2])]
    restored = _assert_three_attempts_like_one_device(out, epochs)
    print(
        f"3 hosts (1 + 2 + 1 workers), 2:3: host 1 killed after step "
        f"{restored[1]} ({killed_at - started:.1f}s in), attempt 1 on 2 "
        f"workers trained steps {restored[1] + 1}-{restored[2]}, host 1 "
        f"started again {back_at - killed_at:.1f}s after the kill, attempt 2 "
        f"on 4 workers finished; {seconds:.1f}s in all"
    )


@pytest.mark.slow
@needs_namespaces
def test_etcd_rendezvous_survives_its_host_killed_and_readmits_it(tmp_path):
    # --rdzv-backend etcd, --nnodes 1:2, one worker per host. Host 0's
    # launcher starts first and serves the rendezvous; host 0 (launcher
    # and worker) is killed mid-run (attempt 0). Host 1's launcher takes
    # the role once the lease runs out, the group continues on host 1
    # alone, then host 0's launcher is started again and is readmitted as
    # a plain member.
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    epochs = 2
    script = _slow_second_attempt(out, ckpt, epochs)
    flags = ["--rdzv-timeout", "120", "--rdzv-last-call", "1"]
    started = time.monotonic()
    with kh.testing.NetworkHosts(2) as net:
        with helpers.etcd_server(net.bridge_address) as url:
            job = _Hosts(net, tmp_path, "1:2", script, etcd=url)
            try:
                # Host 0's server waits for host 1 (a round of both
                # starts once both are in).
                job.start(0, "--rdzv-timeout", "120", "--rdzv-last-call", "30")
                _wait_until(
                    lambda: "serving the rendezvous" in job.text(0),
                    "host 0 serving",
                    job,
                )
                rank1 = job.start(1, *flags)
                _wait_until(lambda: _steps(out, 0) >= 4, "step 4", job)
                killed_at = time.monotonic()
                assert net.kill(0)
                _wait_until(
                    lambda: _steps(out, 1) >= 2, "attempt 1's steps", job
                )
                took_over = time.monotonic() - killed_at
                again = job.start(0, *flags)
                codes = [job.wait(p) for p in (rank1, again)]
            finally:
                job.stop()
    seconds = time.monotonic() - started
    text = job.text()
    assert codes == [0, 0], text[-6000:]
    rank1_log, again_log = job.text(1), job.text(2)
    assert "serving the rendezvous" in rank1_log, rank1_log
    assert "from attempt 1" in rank1_log  # the round count went on
    assert "serving the rendezvous" not in again_log, again_log
    assert "[rendezvous] host rank(s) [0] joined: restarting the group" in (
        rank1_log
    )
    assert _rounds(rank1_log) == [(1, [1]), (2, [0, 1])], rank1_log
    restored = _assert_three_attempts_like_one_device(out, epochs)
    print(
        f"etcd rendezvous: serving host 0 killed after step {restored[1]}, "
        f"host 1 took the role and attempt 1 trained {took_over:.1f}s after "
        f"the kill; host 0 readmitted; {seconds:.1f}s in all"
    )


@pytest.mark.slow
@needs_namespaces
def test_wrong_token_is_refused_and_the_timeout_names_the_missing_host(
    tmp_path,
):
    script = [os.path.join(SCRIPTS, "echo_server.py")]  # never started
    with kh.testing.NetworkHosts(2) as net:
        job = _Hosts(net, tmp_path, "2", script)
        try:
            stray = job.start(1, token="not-the-token")
            rank0 = job.start(0, "--rdzv-timeout", "10")
            codes = [job.wait(stray), job.wait(rank0)]
        finally:
            job.stop()
    text = job.text()
    assert codes == [2, 1], text
    stray_log, rank0_log = job.text(0), job.text(1)
    assert "keras-hetero: Host rank 1: the rendezvous at " in stray_log
    assert "holds another token than this host" in stray_log
    assert (
        f"[rendezvous] refused a connection from {net.address(1)}:" in rank0_log
    )
    assert (
        "keras-hetero: Host rank(s) [1] did not join the rendezvous at "
        f"{net.address(0)}:29400 within 10 s (1 joined: [0]; at least 2 "
        "needed). 1 connection(s) were refused for a wrong token (from "
        f"['{net.address(1)}'])." in rank0_log
    ), rank0_log
    assert "s3cret-t0ken" not in text and "not-the-token" not in text
