"""ElasticCheckpoint and the launcher with real processes (slow).

The worker script is `tests/scripts/elastic_train.py`: 80 examples, global
batch 8 (10 steps per epoch), 2 epochs; it records the ids each train step
used, per attempt and worker.
"""

import glob
import io
import json
import os
import signal
import subprocess
import sys

import helpers
import numpy as np
import pytest
from conftest import DEVICES

import keras_hetero as kh
from keras_hetero import checkpointing
from keras_hetero import launcher

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "elastic_train.py")
ROWS, BATCH, STEPS_PER_EPOCH = 80, 8, 10


def _records(out, attempt):
    """{step: ids of all workers} of one attempt."""
    steps = {}
    for path in glob.glob(os.path.join(out, f"attempt{attempt}-worker*.jsonl")):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                steps.setdefault(record["step"], []).extend(record["ids"])
    return steps


def _committed(out, resumed_from):
    """Ids per step of the run as it counts: attempt 0 up to the restored
    step, attempt 1 after it."""
    first, second = _records(out, 0), _records(out, 1)
    steps = {s: ids for s, ids in first.items() if s <= resumed_from}
    assert set(second) & set(steps) == set()
    steps.update(second)
    return steps


def _restored_step(out):
    second = _records(out, 1)
    return min(second) - 1


def _assert_exactly_once(steps, epochs=2):
    assert sorted(steps) == list(range(1, epochs * STEPS_PER_EPOCH + 1))
    for epoch in range(epochs):
        ids = []
        for step in range(
            epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1
        ):
            ids += steps[step]
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}"


def _reference(initial):
    strategy = helpers.mirrored(DEVICES[:1])
    with strategy.scope():
        model = helpers.id_model([], 0.0)
    model.set_weights(initial)
    data = kh.data.shard(helpers.id_examples(ROWS), BATCH, strategy=strategy)
    model.fit(data, epochs=2, verbose=0)
    return model.get_weights()


def _load(path):
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def test_kill_9_a_worker_under_the_launcher_then_finish_exactly(tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    fault_at = int(np.random.default_rng().integers(3, 16))
    log = io.StringIO()
    result = launcher.launch(
        [
            sys.executable,
            SCRIPT,
            "--out",
            out,
            "--ckpt",
            ckpt,
            "--fault-at",
            str(fault_at),
            "--save-every",
            "2",
        ],
        2,
        max_restarts=2,
        grace_seconds=5,
        output=log,
    )
    context = f"fault_at={fault_at}\n" + log.getvalue()[-4000:]
    assert result.exit_code == 0, context
    assert len(result.attempts) == 2, context
    assert result.attempts[0].failed == (1,)
    assert result.attempts[0].exit_codes[1] == -signal.SIGKILL
    assert "[worker 1]" in log.getvalue() and "[launcher]" in log.getvalue()
    resumed_from = _restored_step(out)
    assert resumed_from <= fault_at, context
    _assert_exactly_once(_committed(out, resumed_from))
    initial = _load(os.path.join(out, "attempt0-worker0-initial.npz"))
    final = _load(os.path.join(out, "attempt1-worker0-final.npz"))
    helpers.assert_weights_close(final, _reference(initial))


@pytest.mark.parametrize("after", [3, 1], ids=["2to3", "2to1"])
def test_resume_with_a_different_worker_count(tmp_path, after):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    base = [sys.executable, SCRIPT, "--out", out, "--ckpt", ckpt]
    log = io.StringIO()
    first = launcher.launch(
        base + ["--stop-after", "7", "--epochs", "1"],
        2,
        max_restarts=0,
        output=log,
    )
    assert first.exit_code == 0, log.getvalue()[-4000:]
    assert checkpointing.read_latest(ckpt) == "ckpt-0000000007"
    second = launcher.launch(
        base + ["--epochs", "1", "--attempt", "1"],
        after,
        max_restarts=0,
        output=log,
    )
    assert second.exit_code == 0, log.getvalue()[-4000:]
    assert "resuming a 2-replica checkpoint (2 worker(s))" in log.getvalue()
    steps = _committed(out, 7)
    _assert_exactly_once(steps, epochs=1)


def test_sigterm_saves_stops_and_resume_continues_next_step(tmp_path):
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    base = [sys.executable, SCRIPT, "--out", out, "--ckpt", ckpt]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    first = subprocess.run(
        base
        + ["--fault", "TERM", "--fault-worker", "0", "--fault-at", "5"]
        + ["--save-every", "100"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        first.returncode == kh.callbacks.ElasticCheckpoint.PREEMPTED_EXIT_CODE
    ), first.stderr[-3000:]
    assert "got SIGTERM" in first.stderr
    # The signal came after step 5's checkpoint hook: step 6 is saved.
    assert checkpointing.read_latest(ckpt) == "ckpt-0000000006"
    second = subprocess.run(
        base + ["--attempt", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert min(_records(out, 1)) == 7
    _assert_exactly_once(_committed(out, 6))


def test_launcher_gives_up_after_max_restarts_with_the_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    log = io.StringIO()
    result = launcher.launch(
        [sys.executable, str(script)], 2, max_restarts=1, output=log
    )
    assert result.exit_code == 3
    assert len(result.attempts) == 2
    assert "[worker 0] about to fail" in log.getvalue()


def test_launcher_shrinks_to_survivors_down_to_min_workers(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(
        "import json, os, sys\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "n = int(os.environ['KERAS_HETERO_NUM_WORKERS'])\n"
        "sys.exit(5 if n > 2 and task == n - 1 else 0)\n"
    )
    log = io.StringIO()
    result = launcher.launch(
        [sys.executable, str(script)],
        4,
        max_restarts=3,
        min_workers=2,
        output=log,
    )
    assert result.exit_code == 0
    assert [a.workers for a in result.attempts] == [4, 3, 2]


def test_command_line_entry_point(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(
        "import json, os\n"
        "c = json.loads(os.environ['TF_CONFIG'])\n"
        "print('task', c['task']['index'], 'of', len(c['cluster']['worker']),"
        " c['cluster']['worker'][0].split(':')[0])\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_hetero.run",
            "--workers",
            "2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "[worker 1] task 1 of 2 127.0.0.1" in done.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_hetero.run",
            "--workers",
            "0",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "workers=0" in bad.stderr


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": 0}, "workers=0"),
        ({"workers": 2, "min_workers": 3}, "min_workers=3"),
        ({"workers": 2, "max_restarts": -1}, "max_restarts=-1"),
    ],
)
def test_launcher_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launcher.launch([sys.executable, "-c", "pass"], **kwargs)


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path):
    script = tmp_path / "forever.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "print('pid', os.getpid(), flush=True)\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    launcher_process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keras_hetero.run",
            "--workers",
            "2",
            "--grace-seconds",
            "5",
            str(script),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = []
    for line in launcher_process.stdout:
        if " pid " in line:
            pids.append(int(line.split()[-1]))
        if len(pids) == 2:
            break
    launcher_process.send_signal(signal.SIGINT)
    rest = launcher_process.communicate(timeout=60)[0]
    assert launcher_process.returncode == 130, rest
    assert "got SIGINT; stopping workers" in rest
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
