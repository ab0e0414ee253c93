"""`keras-hetero run --nnodes ... --rdzv-backend etcd`: the rendezvous in
whichever launcher holds the role in a real etcd (Debian's etcd-server,
started per module by `.ci/etcd/start.sh` on 127.0.0.1).

The hosts here are threads of this process with tiny worker scripts; the
case with training hosts in network namespaces, the serving host killed,
is in test_hosts.py.
"""

import io
import socket
import sys
import threading
import time

import pytest

from keras_hetero.launcher import cli
from keras_hetero.launcher import etcd
from keras_hetero.launcher import hosts
from tests.support import helpers


@pytest.fixture(scope="module")
def etcd_url():
    with helpers.etcd_server() as url:
        yield url


def test_endpoints_backend_and_job_id_are_checked(capsys):
    assert etcd.parse_endpoints("10.0.0.5:2379") == ["http://10.0.0.5:2379"]
    assert etcd.parse_endpoints("http://a:1, https://b:2") == [
        "http://a:1",
        "https://b:2",
    ]
    for bad in ("10.0.0.5", "grpc://a:1", "a:1/path", "a:port"):
        with pytest.raises(ValueError, match="rdzv_endpoint=.*HOST:PORT"):
            etcd.parse_endpoints(bad)
    assert etcd.check_job_id("train-2026.12_07") == "train-2026.12_07"
    for bad in (None, "", "a/b", "x" * 65, "é"):
        with pytest.raises(ValueError, match="rdzv_id=.*same on every host"):
            etcd.check_job_id(bad)
    common = dict(nnodes=2, node_rank=0, rdzv_token="t")
    with pytest.raises(ValueError, match="rdzv_backend='zk'.*'tcp'.*'etcd'"):
        hosts.launch_host(
            [sys.executable, "x.py"],
            rdzv_endpoint="a:1",
            rdzv_backend="zk",
            **common,
        )
    with pytest.raises(ValueError, match="rdzv_id='j' with rdzv_backend='tcp'"):
        hosts.launch_host(
            [sys.executable, "x.py"], rdzv_endpoint="a:1", rdzv_id="j", **common
        )
    with pytest.raises(ValueError, match="rdzv_id=None"):
        hosts.launch_host(
            [sys.executable, "x.py"],
            rdzv_endpoint="127.0.0.1:1",
            rdzv_backend="etcd",
            **common,
        )
    code = cli.main(["run", "--workers", "2", "--rdzv-backend", "etcd", "t.py"])
    assert code == 2
    assert "--rdzv-backend need --nnodes" in capsys.readouterr().err


def test_an_unreachable_etcd_is_named_at_once():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once closed
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        hosts.launch_host(
            [sys.executable, "x.py"],
            nnodes=2,
            node_rank=1,
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_backend="etcd",
            rdzv_id="job",
            rdzv_token="t",
        )
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert f"Cannot reach etcd at http://127.0.0.1:{port}" in message
    assert "refused" in message and "--rdzv-endpoint" in message


def test_one_launcher_holds_the_role_and_another_takes_it_over(etcd_url):
    client = etcd.EtcdClient(etcd.parse_endpoints(etcd_url))
    first = etcd.Role(client, "takeover", keep_seconds=60)
    second = etcd.Role(client, "takeover", keep_seconds=60)
    assert first.claim("10.0.0.1:7000") == {"round": 0, "failures": 0}
    assert second.claim("10.0.0.2:7000") is None  # one holder at a time
    assert second.server() == "10.0.0.1:7000"
    first.record(state={"round": 3, "failures": 1})
    time.sleep(etcd.LEASE_SECONDS + 1)  # the holder keeps its lease alive
    assert second.server() == "10.0.0.1:7000"
    # The holder's host dies: its lease is no longer kept alive.
    first._stop.set()
    died = time.monotonic()
    while second.server() is not None:
        assert time.monotonic() - died < etcd.LEASE_SECONDS + 2
        time.sleep(0.1)
    assert second.claim("10.0.0.2:7000") == {"round": 3, "failures": 1}
    assert first.server() == "10.0.0.2:7000"
    assert second.done() is None
    second.record(done={"type": "done", "exit_code": 0})
    assert first.done() == {"type": "done", "exit_code": 0}
    second.release()
    assert first.server() is None  # released at once, not at expiry


_ECHO = """\
import json, os, sys
config = json.loads(os.environ["TF_CONFIG"])
restart = int(os.environ["KERAS_HETERO_RESTART"])
print("launched", config["task"]["index"], restart, flush=True)
if config["task"]["index"] == 1 and restart == 0:
    sys.exit(3)
"""


def _launch(tmp_path, url, job_id, ranks):
    script = tmp_path / "echo.py"
    script.write_text(_ECHO)
    results = {}

    def run(rank):
        output = io.StringIO()
        try:
            value = hosts.launch_host(
                [sys.executable, str(script)],
                nnodes=2,
                node_rank=rank,
                rdzv_endpoint=url,
                rdzv_backend="etcd",
                rdzv_id=job_id,
                rdzv_token="secret",
                rdzv_last_call=1,
                output=output,
                warm=False,
            )
        except Exception as error:  # checked by the test
            value = error
        results[rank] = (value, output.getvalue())

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == len(ranks), results
    return results


def test_two_hosts_restart_after_a_failure_and_a_late_host_sees_the_end(
    tmp_path, etcd_url
):
    results = _launch(tmp_path, etcd_url, "restart-and-end", [1, 0])
    text = "\n".join(output for _, output in results.values())
    for result, output in results.values():
        assert not isinstance(result, Exception), output
        assert result.exit_code == 0, output
        assert [a.exit_codes for a in result.attempts] == [(0, 3), (0, 0)]
    serving = [r for r, (_, out) in results.items() if "serving the" in out]
    assert len(serving) == 1, text
    assert "worker 1 on host rank 1 exited with 3" in text
    assert text.count("launched") == 4  # 2 workers, 2 attempts
    # A host started after the end learns it from etcd: no worker runs.
    late = _launch(tmp_path, etcd_url, "restart-and-end", [1])[1]
    assert late[0].exit_code == 0 and late[0].attempts == (), late[1]
    assert "launched" not in late[1] and "serving" not in late[1], late[1]
