"""Every ```python block in README.md and docs/*.md runs, page by page.

Each page's blocks run together, in order, in a fresh interpreter (pages
call `kh.testing.logical_cpus`, which must come before TensorFlow starts).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _code(page):
    return "\n".join(BLOCK.findall(page.read_text()))


def test_pages_have_code_or_are_prose():
    assert _code(ROOT / "README.md").strip(), "README must show runnable code"


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if _code(p).strip()],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_page_code_runs(page, tmp_path):
    script = tmp_path / "page.py"
    script.write_text(_code(page))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_block_extraction_catches_a_broken_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nraise SystemExit(3)\n```\n")
    script = tmp_path / "page.py"
    script.write_text(_code(page))
    result = subprocess.run([sys.executable, str(script)])
    assert result.returncode == 3
