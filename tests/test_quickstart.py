"""`make demo` (examples/quickstart.py) runs and writes its run report."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_prints_the_table_and_writes_the_report(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quickstart.py"),
            "--out",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    printed = result.stdout
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
