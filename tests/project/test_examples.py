"""The digits examples run, as a user would run them, and learn.

Each example runs in its own interpreter (they set up logical CPUs before
TensorFlow starts), with fewer epochs than its default to keep this quick.
Most of an example's time is starting TensorFlow and tracing, so the
single-process ones run two at a time, all started when the first of their
tests starts. Checks are on what the examples print: held-out accuracy well
above chance (0.1 for ten digits) and the behaviour each one demonstrates.
"""

import ast
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LEARNED = 0.5


def run(command, cwd, timeout=300):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


def run_example(name, *args, cwd):
    return run([sys.executable, str(EXAMPLES / name), *args], cwd)


LAUNCHED = "digits_launcher.py"  # runs under `keras-hetero run`
# test name -> the example and its arguments ("{cwd}": the run's directory)
SINGLE_PROCESS = {
    "test_rebalance": ["digits_rebalance.py", "--epochs", "2"],
    "test_stragglers": [
        "digits_stragglers.py",
        "--epochs",
        "2",
        "--slow-at-step",
        "20",
    ],
    "test_checkpoint_resumes_exactly": [
        "digits_checkpoint.py",
        "--epochs",
        "2",
        "--directory",
        "{cwd}/run1",
    ],
    "test_precision": ["digits_precision.py", "--epochs", "1"],
    "test_placement": ["digits_placement.py", "--epochs", "2"],
}


@pytest.fixture(scope="module")
def output_of(request, tmp_path_factory):
    """Starts the selected single-process examples, two at a time; returns
    a function that waits for one test's example and returns its stdout."""
    selected = {item.name for item in request.session.items}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    runs = {}
    for test, (script, *args) in SINGLE_PROCESS.items():
        if test in selected:
            cwd = tmp_path_factory.mktemp(test)
            args = [arg.format(cwd=cwd) for arg in args]
            runs[test] = pool.submit(run_example, script, *args, cwd=cwd)
    yield lambda test: runs[test].result()
    pool.shutdown(cancel_futures=True)


def number_after(text, label):
    match = re.search(rf"{re.escape(label)}\s*([-+0-9.e]+)", text)
    assert match, f"{label!r} not in output:\n{text}"
    return float(match.group(1))


def array_after(text, label):
    match = re.search(rf"{re.escape(label)}\s*\[([^\]]*)\]", text)
    assert match, f"{label!r} not in output:\n{text}"
    return np.array(match.group(1).split(), dtype=float)


def test_every_example_has_a_smoke_test():
    tested = {args[0] for args in SINGLE_PROCESS.values()}
    tested.add(LAUNCHED)
    assert {p.name for p in EXAMPLES.glob("digits_*.py")} <= tested


@pytest.mark.parametrize(
    "path", sorted(EXAMPLES.glob("digits_*.py")), ids=lambda p: p.name
)
def test_example_has_main_and_docstring(path):
    module = ast.parse(path.read_text())
    assert ast.get_docstring(module), "say what it shows and how to run it"
    assert any(
        isinstance(node, ast.FunctionDef) and node.name == "main"
        for node in module.body
    )


# Each example runs in its own process (10-40 s): `slow`, so CI runs them
# under Keras 3 and `make test-all` under both flavours.
@pytest.mark.slow
def test_rebalance(output_of):
    out = output_of("test_rebalance")
    assert "SIMULATED" in out
    shares = array_after(out, "ShardRebalancer")
    # Simulated speeds 1 : 2 : 4: the fastest replica gets the most rows.
    assert shares[2] > shares[1] > shares[0]
    assert number_after(out, "held-out accuracy:") > LEARNED


@pytest.mark.slow
def test_stragglers(output_of):
    out = output_of("test_stragglers")
    assert "slows down 5x (simulated)" in out
    match = re.search(r"straggler events: \[\((\d+), 2\)\]", out)
    assert match, out
    assert 20 < int(match.group(1)) <= 40
    assert array_after(out, "shares after the rebalance:")[2] < 0.25
    assert number_after(out, "held-out accuracy:") > LEARNED


@pytest.mark.slow
def test_checkpoint_resumes_exactly(output_of):
    out = output_of("test_checkpoint_resumes_exactly")
    assert "resumed at step 40 (epoch 1, global batch 10)" in out
    assert number_after(out, "vs the uninterrupted run:") < 1e-5
    assert number_after(out, "held-out accuracy:") > LEARNED


@pytest.mark.slow
def test_precision(output_of):
    out = output_of("test_precision")
    assert '"auto" picks float32' in out
    rows = re.findall(r"^(\S+)\s+(\S+)\s+([0-9.]+)\s+([0-9.]+)$", out, re.M)
    assert [row[:2] for row in rows] == [
        ("float32", "float32"),
        ("mixed_float16", "fp16"),
        ("mixed_bfloat16", "bf16"),
    ], out
    assert all(float(row[3]) > LEARNED for row in rows)


@pytest.mark.slow
def test_placement(output_of):
    out = output_of("test_placement")
    assert "SIMULATED" in out and "bottleneck" in out
    assert "run on: ['/device:CPU:0', '/device:CPU:1']" in out
    assert "pipeline: 4 micro-batches of 12 rows" in out
    assert number_after(out, "held-out accuracy:") > LEARNED


@pytest.mark.slow
def test_launcher_two_workers(tmp_path):
    out = run(
        [
            sys.executable,
            "-m",
            "keras_hetero.run",
            "--workers",
            "2",
            "--max-restarts",
            "0",
            str(EXAMPLES / LAUNCHED),
            "--simulate-speeds",
            "--epochs",
            "2",
            "--checkpoint",
            str(tmp_path / "ckpt"),
        ],
        cwd=tmp_path,
    )
    lines = re.findall(r"^\[worker (\d)\] worker \1 of 2: (.*)$", out, re.M)
    assert sorted(index for index, _ in lines) == ["0", "1"], out
    results = {text for _, text in lines}
    assert len(results) == 1, "every worker reports the same global numbers"
    shares = array_after(out, "shares")
    assert shares[0] > shares[1]  # worker 1 is simulated 4x slower
    assert number_after(out, "held-out accuracy") > LEARNED
    assert (tmp_path / "ckpt").is_dir()
