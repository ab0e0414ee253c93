"""Every ```python block in README.md and docs/*.md runs, page by page.

Each page's blocks run together, in order, as `__main__` of a fresh process
(pages call `kh.testing.logical_cpus`, which must come before TensorFlow
starts), forked from the forkserver `kh.testing.run_workers` uses: TensorFlow
and Keras are imported there once, and nothing of TensorFlow's runtime has
started before the fork.
"""

import os
import pathlib
import re
import runpy
import subprocess
import sys
import traceback

import pytest

from keras_hetero.testing import workers

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _code(page):
    return "\n".join(BLOCK.findall(page.read_text()))


def test_pages_have_code_or_are_prose():
    assert _code(ROOT / "README.md").strip(), "README must show runnable code"


# A process per page (5-50 s each): `slow`, so CI runs the pages under Keras
# 3 and `make test-all` under both flavours.
@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if _code(p).strip()],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_page_code_runs(page, tmp_path):
    script = tmp_path / "page.py"
    script.write_text(_code(page))
    output = tmp_path / "output.txt"
    environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = workers._context().Process(
        target=_run_script, args=(str(script), str(output), environ)
    )
    process.start()
    process.join(300)
    if process.is_alive():
        process.kill()
        process.join()
    assert process.exitcode == 0, output.read_text()[-4000:]


def _run_script(script, output, environ):
    """`python script` in this (forked) process: its directory as the working
    directory and first on `sys.path`, stdout and stderr to `output`, the exit
    status of the script's `SystemExit` (1 for an uncaught exception)."""
    workers._take_over(environ, output)
    os.chdir(os.path.dirname(script))
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script]
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            status = 0
        elif isinstance(stop.code, int):
            status = stop.code
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def test_block_extraction_catches_a_broken_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nraise SystemExit(3)\n```\n")
    script = tmp_path / "page.py"
    script.write_text(_code(page))
    result = subprocess.run([sys.executable, str(script)])
    assert result.returncode == 3


@pytest.mark.parametrize(
    "code, status, shown",
    [
        ("print('fine')", 0, "fine"),
        ("raise SystemExit(3)", 3, ""),
        ("raise ValueError('broken page')", 1, "ValueError: broken page"),
        ("import os\nassert os.getcwd() == {cwd!r}", 0, ""),
    ],
    ids=["prints", "exit-3", "exception", "working-directory"],
)
def test_pages_run_as_a_script_would(tmp_path, code, status, shown):
    script = tmp_path / "page.py"
    script.write_text(code.format(cwd=str(tmp_path)))
    output = tmp_path / "output.txt"
    process = workers._context().Process(
        target=_run_script, args=(str(script), str(output), dict(os.environ))
    )
    process.start()
    process.join(60)
    assert process.exitcode == status, output.read_text()
    assert shown in output.read_text()
