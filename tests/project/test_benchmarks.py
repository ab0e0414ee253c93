"""Every benchmark script imports (a moved module fails here, not when
someone next runs the benchmark) and has a `--smoke` mode, and `make bench`
runs every script behind a table in the docs. The smoke runs themselves are
`make bench-smoke`'s (CI runs it once, after the suite)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# In one process: each script's `main` with `--help`, which prints the
# options and exits before the script measures anything.
HELP = """
import contextlib, importlib, io, sys
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    sys.argv = [name + ".py", "--help"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        module.main()
    print("help of", name, "lists --smoke:", "--smoke" in printed.getvalue())
"""


def test_every_benchmark_script_has_a_smoke_mode():
    scripts = sorted(
        path.stem
        for path in BENCHMARKS.glob("*.py")
        if not path.name.startswith("_")
    )
    assert "overhead" in scripts and "real_devices" in scripts
    result = subprocess.run(
        [sys.executable, "-c", HELP, *scripts],
        cwd=BENCHMARKS,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    found = {
        line.split()[2]: line.split()[-1]
        for line in result.stdout.splitlines()
        if line.startswith("help of ")
    }
    assert found == {name: "True" for name in scripts}, result.stdout


def test_make_bench_runs_every_script_behind_a_docs_table():
    pages = "".join(
        (ROOT / "docs" / page).read_text()
        for page in ("benchmarks.md", "arrow.md")
    )
    in_docs = set(re.findall(r"python\s+benchmarks/(\w+)\.py", pages))
    makefile = (ROOT / "Makefile").read_text()
    runs = makefile[makefile.index("BENCH_RUNS :=") :]
    in_make = set(re.findall(r'"(\w+)\.py', runs[: runs.index("\n\n")]))
    assert "real_devices" in in_docs, in_docs
    assert not in_docs - in_make, f"add to BENCH_RUNS: {in_docs - in_make}"
    assert not in_make - in_docs, f"no docs table: {in_make - in_docs}"
