"""Every benchmark script imports (a moved module fails here, not when
someone next runs the benchmark), and real_devices.py's smoke mode runs."""

import os
import pathlib
import subprocess
import sys

import pytest

import keras_hetero as kh

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _run(code_or_script, *args, timeout=600):
    result = subprocess.run(
        [sys.executable, *code_or_script, *args],
        cwd=BENCHMARKS,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


def test_every_benchmark_script_imports():
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert "interleaved" in scripts and "real_devices" in scripts
    printed = _run(
        [
            "-c",
            "import importlib, sys\n"
            f"for name in {scripts!r}:\n"
            "    module = importlib.import_module(name)\n"
            "    assert hasattr(module, 'main') or name.startswith('_'), name\n"
            "    print('imported', name)\n",
        ]
    )
    assert printed.count("imported") == len(scripts)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.one_flavour  # an import and plumbing check
def test_real_devices_smoke():
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        pytest.skip(reason)
    printed = _run(["real_devices.py", "--smoke"])
    assert "CPU quotas, no simulation" in printed
    assert "| mlp | 1:2 |" in printed
    assert "Straggler detection" in printed
