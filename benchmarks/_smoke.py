"""Runs every benchmark script's `--smoke` mode (`make bench-smoke`).

Two scripts at a time (the figures of a smoke run mean nothing, so they may
share the machine); each one's wall time is printed as it ends, a failing
script's output in full. Exits 1 if any script failed.

    python benchmarks/_smoke.py [--jobs 2] [--timeout 600] [SCRIPT ...]
"""

import argparse
import concurrent.futures
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def _run(script, timeout):
    started = time.perf_counter()
    try:
        result = subprocess.run(
            [sys.executable, str(script), "--smoke"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        code = "timeout"
        output = f"{error.stdout or ''}{error.stderr or ''}"
    return script, code, output, time.perf_counter() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="*", help="default: all")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    scripts = [pathlib.Path(s) for s in args.scripts] or sorted(
        path for path in HERE.glob("*.py") if not path.name.startswith("_")
    )
    started = time.perf_counter()
    failed = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(_run, script, args.timeout) for script in scripts]
        for run in concurrent.futures.as_completed(runs):
            script, code, output, seconds = run.result()
            name = script.relative_to(HERE.parent)
            if code == 0:
                print(f"ok      {seconds:5.1f} s  {name}", flush=True)
            else:
                print(output)
                print(f"FAILED  {seconds:5.1f} s  {name} (exit {code})")
                failed.append(str(name))
    print(
        f"total   {time.perf_counter() - started:5.1f} s, {args.jobs} at a time"
    )
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
