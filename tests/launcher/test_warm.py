"""Warm workers (`launcher.warm`): a restarted worker runs in a spare that
imported TensorFlow, Keras and keras_hetero while the previous attempt
trained, exactly as a new `python SCRIPT` would run it."""

import argparse
import io
import json
import os
import signal
import sys

import pytest

from keras_hetero import _phases
from keras_hetero import launcher
from keras_hetero.launcher import cli
from keras_hetero.launcher import timing
from keras_hetero.launcher import warm


@pytest.mark.parametrize(
    "argv, split",
    [
        (["python", "t.py", "-x"], ([], "path", "t.py", ["-x"])),
        (["/v/bin/python3.11", "-u", "t.py"], (["-u"], "path", "t.py", [])),
        (
            ["python", "-W", "ignore", "-X", "dev", "t.py"],
            (["-W", "ignore", "-X", "dev"], "path", "t.py", []),
        ),
        (
            ["python", "-Wignore", "-uB", "-m", "pkg.mod", "a"],
            (["-Wignore", "-uB"], "module", "pkg.mod", ["a"]),
        ),
        (["python", "-c", "print(1)"], None),
        (["python", "-i", "t.py"], None),
        (["python", "--check-hash-based-pycs", "never", "t.py"], None),
        (["python", "-"], None),
        (["python"], None),
        (["bash", "train.sh"], None),
        (["taskset", "-c", "1", "python", "t.py"], None),
    ],
)
def test_a_spare_serves_python_scripts_and_modules_only(argv, split):
    command, parts = warm.spare_command(argv), warm._split(argv)
    if split is None:
        assert command is None and parts is None
        return
    assert parts[1:] == split
    # The spare: the same interpreter and options, then its own program.
    assert command[0] == argv[0] and command[1:-2] == split[0]
    assert command[-2] == "-c"


def test_a_spare_is_keyed_by_everything_but_the_attempt():
    env = {"A": "1", "TF_CONFIG": "{}", launcher.RESTART_ENV: "2"}
    assert warm.key(env) == {"A": "1"}
    for name in warm.PER_ATTEMPT_ENV:
        assert name not in warm.key({name: "x"})


def test_a_spare_that_could_not_import_says_why(tmp_path):
    # An interpreter without TensorFlow: the spare exits at its import, and
    # the launcher gets None (it then starts the worker cold) and the error.
    python = os.path.realpath("/usr/bin/python3")
    if not os.path.exists(python):
        pytest.skip("no system python3")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}
    spare = warm.Spare([python, "t.py"], env)
    try:
        spare.process.wait(timeout=30)
        assert spare.serves([python, "t.py"], {**env, "TF_CONFIG": "x"})
        assert not spare.serves([python, "u.py"], env)
        assert not spare.serves([python, "t.py"], {**env, "B": "1"})
        assert spare.take([python, "t.py"], env) is None
        assert "ModuleNotFoundError" in spare.output()
    finally:
        spare.close()


# Attempt 0's workers "train a step" (mark the phase), wait until the
# launcher's spares for the next attempt wait for their worker (blocked in
# `read` on stdin, /proc/PID/syscall), then fail.
WAIT_FOR_SPARES = """
import os
import time


def _ready(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"warm.main()" not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) != os.getppid():
                return False  # another launcher's
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split()[:2] == ["0", "0x0"]  # read(0, ...)
    except (OSError, ValueError, IndexError):
        return False


def wait_for_spares(count, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sum(_ready(p) for p in os.listdir("/proc") if p.isdigit()) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError("no spares")
"""

# Attempt 1 fails as 0 did, in spares; attempt 2 records how it was run. The
# script sets the Keras flavour itself before its imports, as TensorFlow's
# docs tell users to.
SCRIPT = """
import json
import os
import sys
import time

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import keras_hetero as kh
from keras_hetero import _phases

restart = int(os.environ[kh.launcher.RESTART_ENV])
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
_phases.mark(_phases.FIRST_STEP)
if restart < 2:
    if index == 1:
        time.sleep(600)  # the launcher stops it when worker 0 fails
    wait_for_spares(2)
    sys.exit(3)
record = {
    "argv": sys.argv,
    "name": __name__,
    "file": __file__,
    "path0": sys.path[0],
    "legacy": kh._compat.IS_LEGACY,
    "restart": restart,
    "stdin": sys.stdin.read(),
    "pid": os.getpid(),
}
if index == 1:
    # Worker 0 exits 0 first: its record, then its process gone.
    while not os.path.exists(os.path.join(sys.argv[1], "run0.json")):
        time.sleep(0.05)
    with open(os.path.join(sys.argv[1], "run0.json")) as f:
        pid = json.load(f)["pid"]
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
with open(os.path.join(sys.argv[1], f"run{index}.json.tmp"), "w") as f:
    json.dump(record, f)
os.rename(f.name, f.name[:-4])
if index == 1:
    raise ValueError("boom from a warm worker")
"""


def _job(tmp_path, monkeypatch, script, max_restarts, module=False):
    # The script by a relative path, as `keras-hetero run job.py` has it,
    # or as a module (`python -m job`, from the working directory).
    path = tmp_path / "job.py"
    path.write_text(WAIT_FOR_SPARES + script)
    monkeypatch.chdir(tmp_path)
    log = io.StringIO()
    result = launcher.launch(
        [sys.executable, *(["-m", "job"] if module else ["job.py"])]
        + [str(tmp_path)],
        2,
        max_restarts=max_restarts,
        output=log,
    )
    return path, result, log.getvalue()


@pytest.mark.slow
def test_a_restarted_worker_runs_in_a_warm_spare_as_a_new_process_would(
    tmp_path, monkeypatch
):
    path, result, log = _job(tmp_path, monkeypatch, SCRIPT, 2)
    assert result.exit_code == 1, log
    codes = [a.exit_codes for a in result.attempts]
    assert codes == [(3, -signal.SIGTERM)] * 2 + [(0, 1)], log
    # The spares had imported: the restarted workers imported at once.
    parsed = dict(filter(None, map(timing.parse, log.splitlines())))
    assert parsed[0]["imported"] - parsed[0]["started"] > 1.0, log
    for attempt in (1, 2):
        phases = parsed[attempt]
        assert phases["imported"] - phases["started"] < 0.5, log
    for index in (0, 1):
        record = json.loads((tmp_path / f"run{index}.json").read_text())
        del record["pid"]
        assert record == {
            "argv": ["job.py", str(tmp_path)],
            "name": "__main__",
            "file": str(path),  # absolute, as Python makes it
            "path0": str(tmp_path),
            # The flavour the script chose (the spare learnt it from the
            # first attempt's workers).
            "legacy": True,
            "restart": 2,
            "stdin": "",
        }
    # An exception: its traceback, exit status 1, as `python job.py`.
    assert "[worker 1] ValueError: boom from a warm worker" in log
    assert "warm workers" not in log and "cold" not in log


REFUSED = """
import os
import sys
import time

if os.environ["KERAS_HETERO_RESTART"] != "0":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

import keras_hetero as kh
from keras_hetero import _phases

_phases.mark(_phases.FIRST_STEP)
if os.environ["KERAS_HETERO_RESTART"] == "0":
    if os.environ["TF_CONFIG"].endswith('"index": 1}}'):
        time.sleep(600)  # the launcher stops it when worker 0 fails
    wait_for_spares(2)
    sys.exit(3)
print("legacy", kh._compat.IS_LEGACY)
"""


@pytest.mark.slow
def test_a_script_that_changes_the_flavour_in_a_spare_restarts_cold(
    tmp_path, monkeypatch
):
    # The first attempt imported Keras 3; the second (the module run in a
    # spare) sets tf-keras before its imports, which a spare imported with
    # Keras 3 cannot honour: it exits with the reason, and the next
    # attempt's workers start cold.
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0")
    _, result, log = _job(tmp_path, monkeypatch, REFUSED, 2, module=True)
    assert result.exit_code == 0, log
    codes = [a.exit_codes for a in result.attempts]
    # Worker 0 fails first in attempt 0 and is refused in attempt 1 (the
    # other may be stopped first).
    assert codes[0][0] == 3 and 76 in codes[1] and codes[2] == (0, 0), log
    assert "sets TF_USE_LEGACY_KERAS='1', but this process imported" in log
    assert "workers start cold from now on" in log
    assert log.count("legacy True") == 2, log
    parsed = dict(filter(None, map(timing.parse, log.splitlines())))
    assert parsed[2]["imported"] - parsed[2]["started"] > 1.0, log


def test_no_warm_and_a_phase_file_without_an_import(tmp_path, monkeypatch):
    # `warm=False` (`--no-warm`) starts no spare; a worker that never
    # imported keras_hetero gets none either (nothing to save).
    parser = argparse.ArgumentParser()
    cli._add_run_arguments(parser)
    assert parser.parse_args(["--no-warm", "t.py"]).warm is False
    assert parser.parse_args(["t.py"]).warm is True
    monkeypatch.setenv(_phases.PHASES_ENV, str(tmp_path / "w0"))
    monkeypatch.setattr(_phases, "_marked", set())
    assert _phases.import_env(str(tmp_path / "w0")) is None
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    _phases.mark(_phases.IMPORTED)
    env = _phases.import_env(str(tmp_path / "w0"))
    assert env["TF_USE_LEGACY_KERAS"] == "1" and set(env) == set(
        _phases.IMPORT_ENV
    )
    assert list(_phases.read(str(tmp_path / "w0"))) == [_phases.IMPORTED]
