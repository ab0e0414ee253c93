"""The launcher's GPU and network edges: `--workers N` splits the host's
GPUs (`CUDA_VISIBLE_DEVICES`), `--worker-ports A-B` (a fixed range, the
same ports after a restart) and `--advertise-address` (the address the
workers publish), on one host and with `--nnodes`.

GPUs are fake: the launcher's own `CUDA_VISIBLE_DEVICES` or
`--devices-per-host` (a CPU-only TensorFlow ignores the variable; the tiny
worker scripts only print it). Networks: 127.0.0.1 only.
"""

import socket
import sys

import pytest

from keras_hetero.launcher import addresses
from keras_hetero.launcher import cli
from keras_hetero.launcher import devices
from keras_hetero.launcher import group
from keras_hetero.launcher import hosts
from keras_hetero.launcher import ports
from keras_hetero.launcher import rendezvous
from tests.launcher.test_hosts import _host_threads
from tests.launcher.test_hosts import _launched

# --- pure parts ------------------------------------------------------------


def test_port_ranges_are_parsed_or_named():
    assert ports.parse_port_range("29500-29503") == range(29500, 29504)
    assert ports.parse_port_range(" 29500 - 29500 ") == range(29500, 29501)
    assert ports.parse_port_range("29500") == range(29500, 29501)
    assert ports.parse_port_range(range(10, 12)) == range(10, 12)
    for bad in ("29503-29500", "0-10", "1-65536", "a-b", "-5", "", None, 5):
        with pytest.raises(ValueError, match="`worker_ports`") as error:
            ports.parse_port_range(bad)
        assert f"worker_ports={bad!r}" in str(error.value)
        assert "Expected a port range A-B" in str(error.value)


def test_a_range_smaller_than_the_workers_is_named():
    with pytest.raises(ValueError) as error:
        ports.check_port_range(range(29500, 29502), 3)
    assert str(error.value) == (
        "Invalid value for argument `worker_ports`. Received: "
        "worker_ports='29500-29501' (2 port(s)) for 3 worker(s) on this "
        "host. Expected at least one port per worker, e.g. 29500-29502."
    )
    ports.check_port_range(range(29500, 29503), 3)


def _listening(reuse=False):
    """A socket listening on a free 127.0.0.1 port."""
    sock = socket.socket()
    if reuse:  # as a gRPC server's
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_ports_in_a_range_skip_those_in_use_and_come_back_the_same():
    held = _listening()
    try:
        first = held.getsockname()[1]
        span = range(first, min(first + 6, 65536))
        chosen = ports.ports_in_range(2, span)
        assert len(chosen) == 2 and first not in chosen
        assert set(chosen) <= set(span) and chosen == sorted(chosen)
        assert ports.ports_in_range(2, span) == chosen  # what a restart gets
        with pytest.raises(ValueError) as error:
            ports.ports_in_range(1, range(first, first + 1))
        assert f"whose port(s) [{first}] are in use on 127.0.0.1" in str(
            error.value
        )
        with pytest.raises(ValueError, match=r"\(1 port\(s\)\) for 2 work"):
            ports.ports_in_range(2, range(first, first + 1))
    finally:
        held.close()


def test_a_stopped_workers_port_in_time_wait_is_reused():
    # A worker's gRPC server that closed its connections first leaves them
    # in TIME_WAIT on its port: the restarted worker can bind it (gRPC sets
    # SO_REUSEADDR), so the range must not count it as taken.
    server = _listening(reuse=True)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    plain = socket.socket()
    with pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what a probe without it sees
    plain.close()
    assert ports.ports_in_range(1, range(port, port + 1)) == [port]


def test_the_advertised_address_must_be_this_hosts():
    assert addresses.advertise_address("127.0.0.1") == "127.0.0.1"
    assert addresses.advertise_address(" lo ") == "127.0.0.1"
    assert addresses.interface_addresses()["lo"] == "127.0.0.1"
    for bad, why in (
        ("198.51.100.7", "is not an address of this host"),
        ("nosuch0", "is not an IP address, nor an interface"),
        ("0.0.0.0", "is no address a worker can be reached at"),
        (None, "is not an IP address"),
    ):
        with pytest.raises(ValueError) as error:
            addresses.advertise_address(bad)
        message = str(error.value)
        assert f"advertise_address={bad!r}, which {why}" in message
        assert "lo 127.0.0.1" in message  # the host's interfaces listed


def test_workers_split_the_gpus_like_workers_per_host():
    assert devices.worker_devices(2, ["0", "1", "2", "3"], name="workers") == [
        "0,1",
        "2,3",
    ]
    with pytest.raises(ValueError) as error:
        devices.worker_devices(3, ["0", "1", "2", "3"], name="workers")
    message = str(error.value)
    assert "Received: workers=3 on a host with 4 GPU(s) (0,1,2,3)" in message
    assert "'auto'" not in message  # --workers takes no auto
    assert "--devices-per-host 0" in message
    assert devices.host_gpus(3) == ["0", "1", "2"]
    assert devices.host_gpus(None, {"CUDA_VISIBLE_DEVICES": "4,5"}) == [
        "4",
        "5",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--workers", "2", "--worker-ports", "29500-29500"],
            "worker_ports='29500-29500' (1 port(s)) for 2 worker(s)",
        ),
        (["--workers", "2", "--worker-ports", "2-1"], "worker_ports='2-1'"),
        (
            ["--workers", "2", "--advertise-address", "198.51.100.7"],
            "advertise_address='198.51.100.7', which is not an address of "
            "this host",
        ),
        (
            ["--workers", "3", "--devices-per-host", "4"],
            "workers=3 on a host with 4 GPU(s)",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--workers-per-host", "2"]
            + ["--rdzv-endpoint", "127.0.0.1:1", "--worker-ports", "9-9"],
            "worker_ports='9-9' (1 port(s)) for 2 worker(s)",
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--advertise-address"]
            + ["nosuch0", "--rdzv-endpoint", "127.0.0.1:1"],
            "advertise_address='nosuch0'",
        ),
    ],
)
def test_cli_refuses_bad_ports_addresses_and_gpu_counts(
    argv, message, monkeypatch, capsys
):
    # Refused before any worker starts or any rendezvous is joined.
    monkeypatch.setenv(rendezvous.TOKEN_ENV, "t")
    assert cli.main(["run", *argv, "x.py"]) == 2
    assert message in capsys.readouterr().err


class _Hosts:
    def addresses(self, count, restart):
        return [f"127.0.0.1:{9000 + i}" for i in range(count)]

    def command(self, index, command):
        return command


def test_the_launcher_own_gpus_are_split_and_hosts_take_no_local_flags(
    monkeypatch,
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match="workers=2 on a host with 3 GPU"):
        group.launch([sys.executable, "-c", "pass"], 2)
    with pytest.raises(ValueError, match="worker_ports='1-2' with hosts="):
        group.launch(
            [sys.executable, "-c", "pass"],
            2,
            hosts=_Hosts(),
            worker_ports="1-2",
        )


# --- jobs of tiny scripts on 127.0.0.1 --------------------------------------

_KILLED_ONCE = """\
import json, os, signal
config = json.loads(os.environ["TF_CONFIG"])
task = config["task"]["index"]
restart = int(os.environ["KERAS_HETERO_RESTART"])
print("launched " + json.dumps({
    "worker": task,
    "cluster": config["cluster"]["worker"],
    "restart": restart,
    "workers": int(os.environ["KERAS_HETERO_NUM_WORKERS"]),
    "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
}), flush=True)
if task == 1 and restart == 0:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _free_range(size):
    """A range of `size` ports from a free one (the launcher skips any
    taken meanwhile)."""
    first = ports.free_ports(1)[0]
    first = min(first, 65536 - size)
    return range(first, first + size)


@pytest.mark.slow
def test_workers_split_the_gpus_and_restart_on_the_same_ports(tmp_path, capsys):
    # Four fake GPUs, two workers: two each. Worker 1 is SIGKILLed in
    # attempt 0; attempt 1 runs on the same ports and GPUs.
    script = tmp_path / "killed_once.py"
    script.write_text(_KILLED_ONCE)
    span = _free_range(4)
    code = cli.main(
        ["run", "--workers", "2", "--devices-per-host", "4"]
        + ["--worker-ports", f"{span.start}-{span.stop - 1}"]
        + ["--advertise-address", "lo", "--grace-seconds", "5", str(script)]
    )
    output = capsys.readouterr().out
    assert code == 0, output
    assert "worker(s) [1] failed (exit [-9]) in attempt 0" in output
    launched = _launched(output)
    assert {(1, 0), (1, 1)} <= set(launched)
    assert (0, 1) in launched  # it printed before it was killed
    cluster = launched[(0, 1)]["cluster"]
    assert len(set(cluster)) == 2
    for (restart, worker), record in launched.items():
        assert record["cluster"] == cluster, (restart, worker)
        assert record["devices"] == ["0,1", "2,3"][worker]
    for address in cluster:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) in span


@pytest.mark.slow
def test_hosts_publish_the_advertised_address_and_reuse_their_ports(
    tmp_path,
):
    # Two hosts on one machine share 127.0.0.1, so their ranges differ.
    # Worker 2 (rank 1's) fails in attempt 0; attempt 1 keeps the ports.
    span0, span1 = _free_range(3), _free_range(3)
    while set(span0) & set(span1):
        span1 = _free_range(3)
    results = _host_threads(
        tmp_path,
        [
            (0, ["2"], {"worker_ports": span0, "devices_per_host": 2}),
            (
                1,
                ["2"],
                {
                    "worker_ports": f"{span1.start}-{span1.stop - 1}",
                    "devices_per_host": 1,
                },
            ),
        ],
        nnodes=2,
        workers_per_host="auto",
        advertise_address="127.0.0.1",
        rdzv_timeout=30,
        grace_seconds=2,
    )
    (first, out0), (second, out1) = results[0], results[1]
    assert first.exit_code == 0 and second.exit_code == 0, out0 + out1
    assert [a.workers for a in first.attempts] == [3, 3]
    on0, on1 = _launched(out0), _launched(out1)
    cluster = on1[(1, 2)]["cluster"]
    assert on1[(0, 2)]["cluster"] == cluster  # the same after the restart
    assert on0[(1, 0)]["cluster"] == cluster
    in_range = [
        int(address.rsplit(":", 1)[1]) in span
        for address, span in zip(cluster, (span0, span0, span1))
    ]
    assert all(a.startswith("127.0.0.1:") for a in cluster) and all(in_range)
    done = [on0[(1, 0)], on0[(1, 1)], on1[(1, 2)]]
    assert [r["devices"] for r in done] == ["0", "1", "0"]


def test_launch_host_refuses_a_range_smaller_than_its_workers():
    with pytest.raises(ValueError, match=r"\(2 port\(s\)\) for 3 worker"):
        hosts.launch_host(
            [sys.executable, "x.py"],
            nnodes=1,
            node_rank=0,
            rdzv_endpoint="127.0.0.1:1",
            rdzv_token="t",
            workers_per_host=3,
            worker_ports="5000-5001",
        )
