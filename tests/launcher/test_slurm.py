"""examples/slurm/train.sbatch on a real Slurm on this machine.

`.ci/slurm/start.sh` installs Debian's Slurm if missing and starts munged,
slurmctld and two slurmd (nodes `a100node` and `t4node`, partitions `a100`
and `t4`) in a directory the test owns; `stop.sh` stops them and removes
it. The recipe runs as written but for `SBATCH_GRES=none` (Slurm's own
override of the `--gres` lines: the nodes have no GPUs): a heterogeneous
job, one `keras-hetero run` per component, two workers in all, and a
real time limit: the test submits with `--time=3 --signal=B:USR1@120`
(the command line overrides the recipe's 4 hours and 300 s), so
slurmctld itself sends the batch shell USR1 about a minute into the run,
once the workers train; the recipe's trap stops the training with a
checkpoint and requeues the job. The requeued run would get the same
signal again, so the test, as the administrator, gives it a longer limit
and lets it start at once; it resumes and ends with the weights of an
uninterrupted run of the same script without Slurm, which runs alongside.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "slurm" / "train.sbatch"
START = ROOT / ".ci" / "slurm" / "start.sh"
STOP = ROOT / ".ci" / "slurm" / "stop.sh"

# A tiny regression on generated data under ElasticCheckpoint; worker 0
# writes the final weights. In the job's first run SimulatedSpeed makes a
# step last ~0.1 s, so that run outlasts the window in which the signal
# comes; the requeued run and the reference take no such time (the layer
# only sleeps: the weights do not depend on it).
TRAIN = """
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import keras

checkpoint, weights_file, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
first_run = "SLURM_JOB_ID" in os.environ and os.environ.get(
    "SLURM_RESTART_COUNT", "0"
) == "0"
strategy = tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
keras.utils.set_random_seed(0)
with strategy.scope():
    inputs = keras.Input((8,))
    slowed = kh.testing.SimulatedSpeed(0.006 if first_run else 0.0)(
        inputs
    )
    hidden = keras.layers.Dense(16, activation="relu")(slowed)
    model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
data = kh.data.shard(
    tf.data.Dataset.from_tensor_slices((x, y)), 32, strategy=strategy
)
model.fit(
    data,
    epochs=epochs,
    verbose=0,
    callbacks=[kh.callbacks.ElasticCheckpoint(checkpoint, save_every=10)],
)
if (strategy.cluster_resolver.task_id or 0) == 0:
    np.savez(weights_file, *model.get_weights())
    print("trained; weights in", weights_file)
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    # The scheduler lies below Keras (CI runs this under Keras 3): the
    # resume itself is covered under both flavours by
    # tests/checkpointing/test_elastic_processes.py.
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or os.geteuid() != 0,
        reason="a local Slurm needs Linux and root (it installs packages "
        "and runs slurmd as root)",
    ),
    pytest.mark.skipif(
        not shutil.which("slurmctld") and not shutil.which("apt-get"),
        reason="Slurm is not installed and apt-get, to install it, is not "
        "available",
    ),
]


def _job(job, environ):
    """`scontrol show job` of the job's first component, as a dict."""
    text = subprocess.run(
        ["scontrol", "show", "job", "-o", str(job)],
        env=environ,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[0]
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait(condition, seconds, what, log):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    text = log.read_text() if log.exists() else "(no log)"
    pytest.fail(f"timed out waiting for {what}; job log:\n{text[-4000:]}")


def _diagnosis(state, text, environ):
    """The job's record, its log and the Slurm daemons' last log lines."""
    logs = pathlib.Path(environ["SLURM_CONF"]).parent / "log"
    tails = [
        f"--- {path.name} ---\n"
        + "\n".join(path.read_text(errors="replace").splitlines()[-25:])
        for path in sorted(logs.glob("slurm*.log"))
    ]
    return "\n".join([f"job: {state}", "--- job log ---", text[-3000:], *tails])


@pytest.fixture
def slurm():
    """A running Slurm, stopped and removed afterwards; its environment."""
    # munged wants every directory above its socket open to all, which
    # pytest's tmp_path is not.
    directory = pathlib.Path(tempfile.mkdtemp(prefix="keras-hetero-slurm-"))
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(START), str(directory)], capture_output=True, text=True
    )
    print(
        f"Slurm installed if needed and up in {time.monotonic() - started:.1f}s"
    )
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        yield {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(STOP), str(directory)], check=False)


# 16 steps an epoch, ~0.1 s each in the first run: ~100 s of steps, longer
# than the workers' start (10-45 s, with the machine's load) and the
# signal's time (nominally 60 s into the run; here slurmctld sent it from
# ~20 s before to ~15 s after the requested time). A signal before `fit`
# would kill a worker before it could save (the requeued run then starts
# over, exact but not what this test checks).
EPOCHS = 64
TIME_LIMIT = "3"  # minutes
SIGNAL = "B:USR1@120"


def test_time_limit_save_requeue_resume_exactly(slurm, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    checkpoint = tmp_path / "ckpt"
    log = tmp_path / "job.out"
    environ = {
        **slurm,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_HETERO_VENV": sys.prefix,  # the recipe activates it
        "SBATCH_GRES": "none",  # no GPUs here
    }
    # The same script without Slurm, uninterrupted (2 local workers),
    # alongside: its steps mostly sleep.
    reference = subprocess.Popen(
        [sys.executable, "-m", "keras_hetero.run", "--workers", "2"]
        + [str(script), str(tmp_path / "ref-ckpt"), str(tmp_path / "ref.npz")]
        + [str(EPOCHS)],
        env={k: v for k, v in environ.items() if not k.startswith("SLURM")},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--output={log}"]
            + [f"--time={TIME_LIMIT}", f"--signal={SIGNAL}", str(RECIPE)]
            + [str(script), str(checkpoint), str(tmp_path / "final.npz")]
            + [str(EPOCHS)],
            env=environ,
            cwd=tmp_path,
            capture_output=True,
            text=True,
        )
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip().split(";")[0]
        record = _job(job, environ)
        assert record["TimeLimit"] == "00:03:00", record

        # No signal from the test: slurmctld sends USR1 before the limit.
        _wait(
            lambda: _job(job, environ)["Restarts"] == "1",
            180,
            "the time limit's signal and the requeue",
            log,
        )
        first = log.read_text()
        assert "time limit near: saving, then requeueing" in first, first
        assert "run 2 of job" not in first
        # The requeued run would be signalled again ~60 s in; as the
        # administrator, give it time to finish, and let it start now
        # (Slurm holds a requeued job back, here ~150 s). Not within the
        # second its first run ended: slurmd revoked that run's credential
        # at a time in whole seconds and refuses a launch whose credential
        # is not newer ("Job 1 already killed, do not launch batch job";
        # the job then fails).
        _wait(
            lambda: _job(job, environ)["JobState"] == "PENDING",
            30,
            "the requeued job to be pending",
            log,
        )
        time.sleep(2)
        subprocess.run(
            ["scontrol", "update", f"JobId={job}", "TimeLimit=10"]
            + ["StartTime=now"],
            env=environ,
            check=True,
        )
        state = _wait(
            lambda: (
                _job(job, environ)["JobState"]
                in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED")
                and _job(job, environ)
            ),
            240,
            "the requeued run to finish",
            log,
        )
        text = log.read_text()
        assert state["JobState"] == "COMPLETED", _diagnosis(state, text, slurm)
        assert state["Restarts"] == "1", state
        # Both hosts' launchers got the recipe's SIGTERM (not only host
        # rank 0's, which would stop the other through the rendezvous).
        assert text.count("[launcher] got SIGTERM") == 2, text[-4000:]
        assert text.count("run 2 of job") == 1 and "run 3" not in text
        restored = re.search(r"ElasticCheckpoint: restored \S+ckpt-(\d+)", text)
        assert restored, text[-4000:]
        # Mid-run: something was saved and something was left to do.
        print(f"job record after the requeued run: {state}")
        print(f"resumed at step {restored.group(1)} of {EPOCHS * 16}")
        assert 0 < int(restored.group(1)) < EPOCHS * 16, restored.group(0)

        output, _ = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    assert reference.returncode == 0, output[-4000:]
    expected = np.load(tmp_path / "ref.npz")
    final = np.load(tmp_path / "final.npz")
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5)
