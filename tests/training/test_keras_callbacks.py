"""Keras' own callbacks under MultiWorkerMirroredStrategy (slow).

The workers run `tests/scripts/tutorial_callbacks.py` (TensorFlow's
"Multi-worker training with Keras" tutorial with HeteroModel) under the
launcher, 2 workers on 127.0.0.1. Files in the user's directories must come
from the chief only: Python-level writes are recorded per worker, a second
CSVLogger writer would duplicate rows (`append=True`), a second TensorBoard
writer would add its own event file, and the non-chief's temporary
directories must be gone afterwards.
"""

import csv
import importlib.util
import io
import json
import os
import signal
import sys

import numpy as np
import pytest

from keras_hetero import launcher
from keras_hetero._compat import keras
from tests.support import helpers

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(__file__)),
    "scripts",
    "tutorial_callbacks.py",
)
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _launch(out, *args, tmp=None, max_restarts=0):
    """Runs the script on 2 workers; returns (LaunchResult, output)."""
    log = io.StringIO()
    result = launcher.launch(
        [sys.executable, SCRIPT, "--out", str(out), *map(str, args)],
        2,
        max_restarts=max_restarts,
        grace_seconds=5,
        env={"TMPDIR": str(tmp)} if tmp else None,
        output=log,
    )
    return result, log.getvalue()


def _worker(out, index):
    with open(os.path.join(out, f"worker{index}.json")) as f:
        record = json.load(f)
    with np.load(os.path.join(out, f"worker{index}.npz")) as arrays:
        record["weights"] = [arrays[f"arr_{i}"] for i in range(len(arrays))]
    return record


def _files(root):
    """Every file under `root`, relative to it."""
    return sorted(
        os.path.relpath(os.path.join(directory, name), root)
        for directory, _, names in os.walk(root)
        for name in names
    )


def _csv_epochs(path):
    with open(path, newline="") as f:
        return [int(row["epoch"]) for row in csv.DictReader(f)]


def _users_files_written(worker):
    """Python-level writes into the user's directories, leaving out
    tf-keras' own temporary `workertemp_<i>` directories there."""
    return [path for path in worker["writes"] if "workertemp_" not in path]


def _early_stopping_epoch(values, min_delta, patience):
    """The epoch after which EarlyStopping (mode "min") stops, or None."""
    best, wait = np.inf, 0
    for epoch, value in enumerate(values):
        if value < best - min_delta:
            best, wait = value, 0
            continue
        wait += 1
        if wait >= patience:
            return epoch
    return None


@pytest.mark.both_flavours
def test_tutorial_callbacks_write_from_the_chief_and_resume_exactly(tmp_path):
    root = tmp_path / "root"
    reference_out = tmp_path / "reference"
    result, log = _launch(reference_out, "--root", tmp_path / "reference-root")
    assert result.exit_code == 0, log[-4000:]

    # Worker 1 is killed (SIGKILL) in epoch 2; the launcher stops worker 0.
    result, log = _launch(tmp_path / "out0", "--root", root, "--fault-epoch", 2)
    assert result.attempts[0].failed == (1,), log[-4000:]
    assert result.attempts[0].exit_codes[1] == -signal.SIGKILL
    assert _files(root / "checkpoints") == ["1.keras", "2.keras"]
    assert _csv_epochs(root / "log.csv") == [0, 1]
    backup = _files(root / "backup")
    assert backup and not [p for p in backup if "workertemp" in p], backup

    # Both workers restart; BackupAndRestore resumes at epoch 2.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out1"
    result, log = _launch(out, "--root", root, tmp=tmp)
    assert result.exit_code == 0, log[-4000:]
    chief, other = _worker(out, 0), _worker(out, 1)
    assert chief["epochs"] == other["epochs"] == [2, 3]
    reference = _worker(reference_out, 0)
    helpers.assert_weights_close(chief["weights"], reference["weights"])
    helpers.assert_weights_close(other["weights"], chief["weights"])

    files = _files(root)
    checkpoints = [f"checkpoints/{epoch}.keras" for epoch in (1, 2, 3, 4)]
    assert [f for f in files if not f.startswith("tensorboard/")] == [
        *checkpoints,
        "log.csv",
    ]  # the backup is deleted at the end, no temporary directory is left
    assert _csv_epochs(root / "log.csv") == [0, 1, 2, 3]
    assert _users_files_written(other) == []
    written = {str(root / path) for path in checkpoints[2:]}
    assert set(_users_files_written(chief)) >= written
    assert os.listdir(tmp) == []  # the non-chief's temporary directories
    if TENSORBOARD:
        events = [f for f in files if f.startswith("tensorboard/")]
        # One event file per attempt (a second writer would add its own),
        # named after the writing process.
        assert len(events) == 2 and all("/train/" in f for f in events)
        assert any(f".{chief['pid']}." in f for f in events), events
        assert not any(f".{other['pid']}." in f for f in events), events


def test_backup_dir_not_shared_by_the_workers_is_refused(tmp_path):
    # Each worker gets its own backup directory, as with a local directory
    # on each machine: after the restart only the chief finds a backup.
    root = tmp_path / "root"
    result, log = _launch(
        tmp_path / "out",
        "--root",
        root,
        "--backup-dir",
        root / "local{task}",
        "--fault-epoch",
        2,
        max_restarts=1,
    )
    assert len(result.attempts) == 2, log[-4000:]
    assert result.exit_code == 1, log[-4000:]
    assert "the workers see different files in it" in log
    assert "must be storage that all workers read" in log
    assert _csv_epochs(root / "log.csv") == [0, 1]  # no epoch ran after it


def test_early_stopping_and_reduce_lr_decide_the_same_on_every_worker(
    tmp_path,
):
    root, out = tmp_path / "root", tmp_path / "out"
    epochs, min_delta, patience = 30, 0.02, 2
    result, log = _launch(
        out,
        "--scenario",
        "early_stopping",
        "--root",
        root,
        "--epochs",
        epochs,
        "--min-delta",
        min_delta,
    )
    assert result.exit_code == 0, log[-4000:]
    chief, other = _worker(out, 0), _worker(out, 1)
    assert chief["epochs"] == other["epochs"]
    assert chief["history"] == other["history"]
    assert chief["learning_rates"] == other["learning_rates"]
    helpers.assert_weights_close(other["weights"], chief["weights"])
    # It stopped where EarlyStopping's rule puts it for the global logs.
    val_loss = chief["history"]["val_loss"]
    assert len(val_loss) == len(chief["epochs"]) < epochs
    assert _early_stopping_epoch(val_loss, min_delta, patience) == (
        len(val_loss) - 1
    ), val_loss
    rates = chief["learning_rates"]
    assert rates[-1] < rates[0], rates  # ReduceLROnPlateau acted
    assert _files(root) == ["best.keras"]
    assert _users_files_written(other) == []
    model = keras.saving.load_model(str(root / "best.keras"))
    assert type(model).__name__ == "HeteroModel"
