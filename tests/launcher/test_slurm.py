"""examples/slurm/train.sbatch on a real Slurm on this machine.

`.ci/slurm/start.sh` installs Debian's Slurm if missing and starts munged,
slurmctld and two slurmd (nodes `a100node` and `t4node`, partitions `a100`
and `t4`) in a directory the test owns; `stop.sh` stops them and removes
it. The recipe runs as written but for `SBATCH_GRES=none` (Slurm's own
override of the `--gres` lines: the nodes have no GPUs): a heterogeneous
job, one `keras-hetero run` per component, two workers in all. The test
sends the batch shell the USR1 that `--signal=B:USR1@300` sends before the
time limit (waiting for a real one would take minutes); the recipe's trap
stops the training with a checkpoint and requeues the job, which resumes
and ends with the weights of an uninterrupted run.
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
# writes the final weights. SimulatedSpeed makes a step last ~0.1 s, so the
# signal lands mid-run.
TRAIN = """
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import keras

checkpoint, weights_file = sys.argv[1], sys.argv[2]
strategy = tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
keras.utils.set_random_seed(0)
with strategy.scope():
    inputs = keras.Input((8,))
    slowed = kh.testing.SimulatedSpeed(0.003)(inputs)
    hidden = keras.layers.Dense(16, activation="relu")(slowed)
    model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
data = kh.data.shard(
    tf.data.Dataset.from_tensor_slices((x, y)), 32, strategy=strategy
)
model.fit(
    data,
    epochs=8,
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
    # The scheduler lies below Keras: the resume itself is covered under
    # both flavours by tests/checkpointing/test_elastic_processes.py.
    pytest.mark.one_flavour,
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
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={log}", str(RECIPE)]
        + [str(script), str(checkpoint), str(tmp_path / "final.npz")],
        env=environ,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]

    # Mid-run (a periodic checkpoint exists), the time limit's signal.
    _wait(lambda: (checkpoint / "latest").exists(), 90, "training", log)
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", job], env=environ, check=True
    )
    _wait(
        lambda: _job(job, environ)["Restarts"] == "1",
        60,
        "the requeue",
        log,
    )
    # Slurm holds a requeued job back (here EligibleTime was set ~150 s
    # ahead); as the administrator, let it start now.
    subprocess.run(
        ["scontrol", "update", f"JobId={job}", "StartTime=now"],
        env=environ,
        check=True,
    )
    state = _wait(
        lambda: (
            _job(job, environ)["JobState"] in ("COMPLETED", "FAILED")
            and _job(job, environ)
        ),
        120,
        "the requeued run to finish",
        log,
    )
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", _diagnosis(state, text, slurm)
    assert state["Restarts"] == "1", state
    assert "time limit near: saving, then requeueing" in text
    assert "got SIGTERM" in text
    assert text.count("run 2 of job") == 1 and "run 3" not in text
    restored = re.search(r"ElasticCheckpoint: restored \S+ckpt-(\d+)", text)
    assert restored, text[-4000:]

    # The same script without Slurm, uninterrupted: 2 local workers.
    reference = subprocess.run(
        [sys.executable, "-m", "keras_hetero.run", "--workers", "2"]
        + [str(script), str(tmp_path / "ref-ckpt"), str(tmp_path / "ref.npz")],
        env={k: v for k, v in environ.items() if not k.startswith("SLURM")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stdout[-4000:]
    expected = np.load(tmp_path / "ref.npz")
    final = np.load(tmp_path / "final.npz")
    for name in expected:
        np.testing.assert_allclose(final[name], expected[name], rtol=1e-5)
