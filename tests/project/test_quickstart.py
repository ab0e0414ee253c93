"""`make demo`: the real-devices demo (examples/real_devices.py) and the
simulated one (examples/quickstart.py, which writes its run report)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import keras_hetero as kh

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_example(name, *args, cwd):
    """What examples/`name` prints, run as a user runs it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=cwd,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


# 30 s. CI runs it under Keras 3, the demo's flavour, in both version rows
# and from the installed wheel (`make package-check`); under tf-keras it is
# slow (`make test-all`).
@(pytest.mark.slow if kh.FLAVOUR != "keras3" else lambda test: test)
def test_quickstart_prints_the_table_and_writes_the_report(tmp_path):
    printed = _run_example(
        "quickstart.py", "--out", str(tmp_path), cwd=tmp_path
    )
    assert "SIMULATED" in printed
    for setup in (
        "stock keras.Model, equal split",
        "kh.HeteroModel + callbacks, epoch 2",
        "epoch 3, replica 1 SIMULATED 10x slower",
    ):
        assert re.search(re.escape(setup) + r"\s+\d+\s+\d+%", printed), setup
    # The slowed replica is flagged; the math equals one device.
    assert re.search(r"straggler: replica 1 at step \d+", printed)
    gap = float(re.search(r"training: ([0-9.e+-]+)", printed).group(1))
    assert gap < 1e-5
    report = tmp_path / "report"
    assert f"run report: {report / 'report.html'}" in printed
    png = (report / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "report.html").read_text()
    assert "data:image/png;base64," in page
    assert "<td>straggler</td>" in page
    assert list((tmp_path / "tensorboard" / "hetero").glob("events.out.*"))


@pytest.mark.slow
@pytest.mark.serial
# tests/balancing/test_real_devices.py covers both flavours.
def test_real_devices_demo_rebalances_two_capped_workers(tmp_path):
    """`make demo` where CPU quotas exist: real workers, real speed-up."""
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        pytest.skip(reason)
    printed = _run_example("real_devices.py", cwd=tmp_path)
    assert "CPU quota, no simulation" in printed
    ratio = float(re.search(r"worker 1 / worker 0: ([0-9.]+)", printed)[1])
    assert "rebalanced / equal shares:" in printed  # a speed: not asserted
    # A quarter of a core against a whole one: the clocks see it, and the
    # rebalancer gives the fast worker most of the rows.
    assert ratio > 2.0, printed
    shares = re.search(
        r"\| rebalanced \| \d+ \| ([0-9.]+), ([0-9.]+) \|", printed
    )
    assert float(shares[1]) > 2 * float(shares[2]), printed
