"""Keras' own tests against `kh.HeteroModel` (the conformance suite).

Downloads the sdist of the installed Keras from the package registry, takes
its test files and runs them twice with pytest:

- STOCK: the files as shipped;
- HETERO: the same files with `keras.Model` rewritten to `kh.HeteroModel`
  and `keras.Sequential` to `kh.HeteroSequential` in the test modules'
  source (see `rewrite_source`; Keras itself is not touched).

Then prints, per file, how many tests pass in each run and which tests pass
STOCK but fail HETERO. Such a test is a regression unless it is listed in
allowed.txt (a difference that is right by design) or known_failures.txt (a
bug in keras_hetero being fixed); the exit status is 1 when there is one.
Known failures that now pass are printed, so the list can shrink.

    python tests/conformance/run.py                  # the default files
    python tests/conformance/run.py --files keras/src/models/model_test.py
    python tests/conformance/run.py -k fit --keep /tmp/conformance

Under `TF_USE_LEGACY_KERAS=1` it skips, saying why: tf-keras' sdist ships no
tests. Given a copy of tf-keras' repository at the installed version's tag
(`--tf-keras-tests DIR`), it runs its test files the same way, with their
`tf_keras.` imports mapped to the installed package's `tf_keras.src.`:

    TF_USE_LEGACY_KERAS=1 python tests/conformance/run.py \
        --tf-keras-tests ~/tf-keras --files tf_keras/engine/training_test.py
"""

import argparse
import ast
import concurrent.futures
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIM = "_kh_conformance"

FILES = (
    "keras/src/trainers/trainer_test.py",
    "keras/src/models/model_test.py",
    "keras/src/models/functional_test.py",
    "keras/src/saving/saving_lib_test.py",
    "keras/src/saving/saving_api_test.py",
    "keras/src/callbacks/*_test.py",
)

# The class that `Sequential` in the test modules becomes in the HETERO run,
# as an attribute of the shim (kh_shim.py): `kh.HeteroSequential`
# (`--sequential ""` leaves Sequential alone).
SEQUENTIAL = "HeteroSequential"

# Names of Keras modules whose `Model` / `Sequential` attribute is rewritten
# when a test module imports them (`from keras.src import models`; tf-keras:
# `from tf_keras.engine import training`).
MODEL_MODULES = {"models", "model", "sequential", "training"}
KERAS_PACKAGES = ("keras", "tf_keras")

PER_TEST_TIMEOUT = 300
MAX_RESTARTS = 5


# --- the rewrite ---------------------------------------------------------


def rewrite_source(source, classes):
    """`source` with the Keras classes in `classes` taken from the shim.

    In the module's own code (never in Keras):

    - `X.Model` where `X` is a Keras module (`keras.Model`,
      `models.Model`, `keras.src.models.Model`, ...) becomes
      `_kh_conformance.Model`;
    - `from keras... import Model [as M]` is followed by
      `M = _kh_conformance.Model`, so every use of the name (calls,
      base classes, `Model.from_config`, isinstance checks) sees the shim's
      class;

    and the same for each name in `classes`. `import _kh_conformance` is
    added before the first statement. Everything else (comments, line
    layout) is kept.

    Args:
        source: The text of a test module.
        classes: {Keras class name: shim attribute}, e.g.
            `{"Model": "Model"}`.

    Returns:
        `(new_source, rewrites)`, with the number of places rewritten.
    """
    tree = ast.parse(source)
    aliases = _keras_module_aliases(tree)
    lines = source.splitlines(keepends=True)
    edits = []  # (line, col, end_line, end_col, text), 1-based lines
    inserts = []  # (after_line, text)

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in classes
            and isinstance(node.ctx, ast.Load)
            and _rooted_at(node.value, aliases)
        ):
            edits.append(_span(node, lines, f"{SHIM}.{classes[node.attr]}"))
        elif isinstance(node, ast.ImportFrom) and _is_keras(node.module):
            indent = " " * node.col_offset
            for alias in node.names:
                if alias.name in classes:
                    bound = alias.asname or alias.name
                    inserts.append(
                        (
                            node.end_lineno,
                            f"{indent}{bound} = {SHIM}.{classes[alias.name]}\n",
                        )
                    )
    if not edits and not inserts:
        return source, 0
    _check_disjoint(edits)
    for line, col, end_line, end_col, text in sorted(edits, reverse=True):
        first, last = lines[line - 1], lines[end_line - 1]
        lines[line - 1 : end_line] = [first[:col] + text + last[end_col:]]
    for after, text in sorted(inserts, reverse=True):
        if not lines[after - 1].endswith("\n"):
            lines[after - 1] += "\n"
        lines.insert(after, text)
    lines.insert(_first_statement_line(tree) - 1, f"import {SHIM}\n")
    return "".join(lines), len(edits) + len(inserts)


def _is_keras(module):
    return module is not None and module.split(".")[0] in KERAS_PACKAGES


def _keras_module_aliases(tree):
    """Names bound to Keras modules anywhere in the module."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_keras(alias.name):
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and _is_keras(node.module):
            for alias in node.names:
                if alias.name in MODEL_MODULES:
                    aliases.add(alias.asname or alias.name)
    return aliases


def _rooted_at(node, aliases):
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in aliases


def _span(node, lines, text):
    """The node's (line, col, end_line, end_col) in characters, not bytes."""

    def column(line, offset):
        return len(lines[line - 1].encode()[:offset].decode())

    return (
        node.lineno,
        column(node.lineno, node.col_offset),
        node.end_lineno,
        column(node.end_lineno, node.end_col_offset),
        text,
    )


def _check_disjoint(edits):
    ordered = sorted(edits)
    for before, after in zip(ordered, ordered[1:]):
        if (before[2], before[3]) > (after[0], after[1]):
            raise ValueError(f"Overlapping rewrites: {before} and {after}")


def _first_statement_line(tree):
    """Where `import _kh_conformance` goes: after the docstring and any
    `from __future__` imports."""
    body = list(tree.body)
    while body and (
        (
            isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        )
        or (
            isinstance(body[0], ast.ImportFrom)
            and body[0].module == "__future__"
        )
    ):
        body.pop(0)
    return body[0].lineno if body else len(tree.body) + 1


def relevant_tests(source):
    """Qualified names of the test functions in `source` (a rewritten
    module) whose code can reach the shim, e.g. `{"ModelTest.test_fit"}`.

    A module-level name is tainted when its definition refers to
    `_kh_conformance` or to another tainted name (a fixed point), a method
    when it refers to a tainted name or to a tainted method of its class
    through `self.` / `cls.`; a test is relevant when it is tainted, or its
    class's bases, class body or `setUp*` / `tearDown*` methods are (a
    string constant naming a method counts as a reference to it). Tests
    that are not relevant run the same code in both runs (they cannot
    build a HeteroModel), so leaving them out of both loses no difference.

    Args:
        source: The text of a rewritten test module.

    Returns:
        A set of `__qualname__`s.
    """
    tree = ast.parse(source)
    bindings = {}  # module-level name -> names its definition refers to
    for node in _module_statements(tree.body):
        refs = _names(node)
        for name in _bound(node):
            bindings.setdefault(name, set()).update(refs)
    tainted = _fixed_point({SHIM}, bindings)
    relevant = set()
    for node in _module_statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("test") and _names(node) & tainted:
                relevant.add(node.name)
        elif isinstance(node, ast.ClassDef):
            relevant |= _relevant_methods(node, tainted)
    return relevant


def _relevant_methods(node, tainted):
    methods = {
        item.name: item
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    body = [
        item
        for item in node.body
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    whole = any(
        _names(item) & tainted
        for item in [*node.bases, *node.decorator_list, *body]
    )
    calls = {
        name: _names(method) | _self_attributes(method)
        for name, method in methods.items()
    }
    seeds = {
        name for name, method in methods.items() if _names(method) & tainted
    }
    hit = _fixed_point(seeds, calls)
    if whole or any(name.startswith(("setUp", "tearDown")) for name in hit):
        hit = set(methods)
    return {
        f"{node.name}.{name}"
        for name in methods
        if name.startswith("test") and name in hit
    }


def _module_statements(body):
    """Top-level statements, looking inside module-level if/try/with."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = list(node.body) + list(getattr(node, "orelse", []))
            inner += list(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            yield from _module_statements(inner)
        else:
            yield node


def _bound(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [
            alias.asname or alias.name.split(".")[0] for alias in node.names
        ]
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return [
        name.id
        for target in targets
        for name in ast.walk(target)
        if isinstance(name, ast.Name)
    ]


def _names(node):
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def _self_attributes(node):
    """`x` of `self.x` / `cls.x`, and every string constant (tests that
    pick a method with `getattr(self, name)`)."""
    found = set()
    for child in ast.walk(node):
        if (
            isinstance(child, ast.Attribute)
            and isinstance(child.value, ast.Name)
            and child.value.id in ("self", "cls")
        ):
            found.add(child.attr)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
    return found


def _fixed_point(seeds, edges):
    """Names whose `edges` reach `seeds` (the seeds included)."""
    reached = set(seeds)
    changed = True
    while changed:
        changed = False
        for name, refs in edges.items():
            if name not in reached and refs & reached:
                reached.add(name)
                changed = True
    return reached


# --- the runs --------------------------------------------------------------


def download_sdist(version, directory):
    """Downloads keras==`version`'s sdist into `directory`; returns it."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"keras=={version}",
        "--no-binary",
        ":all:",
        "--no-deps",
        "--quiet",
        "-d",
        str(directory),
    ]
    subprocess.run(command, check=True)
    found = sorted(Path(directory).glob(f"keras-{version}.tar.gz"))
    if not found:
        raise FileNotFoundError(f"No keras-{version}.tar.gz in {directory}")
    return found[0]


def extract(sdist, patterns, directory):
    """Extracts the test files matching `patterns` (paths inside the
    package, e.g. `keras/src/callbacks/*_test.py`) and Keras' pytest
    settings (pyproject.toml). Returns the test paths, sorted."""
    directory = Path(directory)
    found = []
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2 or not member.isfile():
                continue
            inner = Path(*parts[1:])
            if inner.as_posix() == "pyproject.toml" or (
                inner.name.endswith("_test.py")
                and any(inner.match(pattern) for pattern in patterns)
            ):
                target = directory / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                stream = archive.extractfile(member)
                target.write_bytes(stream.read())
                if inner.name.endswith("_test.py"):
                    found.append(inner.as_posix())
    missing = [
        pattern
        for pattern in patterns
        if not any(Path(path).match(pattern) for path in found)
    ]
    if missing:
        raise FileNotFoundError(f"No test file in the sdist matches {missing}")
    return sorted(found)


def copy_tf_keras_tests(checkout, patterns, directory):
    """Copies the tf-keras test files matching `patterns` from a repository
    checkout, importing `tf_keras.src.X` for the repository's `tf_keras.X`
    (the installed package's layout). Returns the paths, sorted."""
    checkout, directory = Path(checkout), Path(directory)
    found = sorted(
        {
            path.relative_to(checkout).as_posix()
            for pattern in patterns
            for path in checkout.glob(pattern)
            if path.name.endswith("_test.py")
        }
    )
    if not found:
        raise FileNotFoundError(
            f"No test file in {checkout} matches {patterns}"
        )
    for path in found:
        text = (checkout / path).read_text()
        text = re.sub(
            r"^(\s*)from tf_keras(\.| import )",
            lambda m: (
                m.group(1)
                + "from tf_keras.src"
                + (m.group(2) if m.group(2) == "." else " import ")
            ),
            text,
            flags=re.M,
        )
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    (directory / "pytest.ini").write_text("[pytest]\n")
    return found


def make_tree(source_dir, target_dir, files, classes=None):
    """A directory to run pytest in: the test files, Keras' pytest settings
    and our conftest.py; with `classes` (see `rewrite_source`) the files
    are rewritten and the shim added. Returns {file: (rewrites, relevant
    test qualnames)}."""
    target_dir = Path(target_dir)
    shutil.copytree(source_dir, target_dir)
    shutil.copy(HERE / "keras_conftest.py", target_dir / "conftest.py")
    found = {}
    if not classes:
        return found
    shutil.copy(HERE / "kh_shim.py", target_dir / f"{SHIM}.py")
    for path in files:
        file = target_dir / path
        text, count = rewrite_source(file.read_text(), classes)
        file.write_text(text)
        found[path] = (count, relevant_tests(text))
    return found


def run_pytest(
    tree, files, keyword, log, selection=None, timeout=PER_TEST_TIMEOUT
):
    """Runs `files` in `tree` (only the tests in `selection`, a path to a
    JSON file of {file: [qualname, ...]}, if given).

    A test that takes longer than `timeout` seconds (a hang) kills
    the pytest process (pytest-timeout's thread method: a test blocked in
    TensorFlow's C++ code ignores signals); it is counted as failed and
    pytest starts again after it, up to MAX_RESTARTS times.

    Returns:
        ({node id: result}, seconds).
    """
    tree = Path(tree)
    report = tree / "results.jsonl"
    done_file = tree / "done.json"
    env = dict(os.environ)
    if selection:
        env["KH_CONFORMANCE_SELECT"] = str(selection)
    env["KERAS_BACKEND"] = "tensorflow"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["KH_CONFORMANCE_REPORT"] = str(report)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(REPO), env.get("PYTHONPATH")) if part
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-q",
        "-rN",
        *files,
    ]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += [f"--timeout={timeout}", "--timeout-method=thread"]
    if keyword:
        command += ["-k", keyword]
    start = time.perf_counter()
    results = {}
    with open(log, "w") as stream:
        for _ in range(MAX_RESTARTS + 1):
            process = subprocess.run(
                command,
                cwd=tree,
                env=env,
                stdout=stream,
                stderr=subprocess.STDOUT,
            )
            results = _read_results(report)
            hung = [n for n, r in results.items() if r["outcome"] == "started"]
            if not hung:
                break
            for nodeid in hung:
                results[nodeid] = {
                    "nodeid": nodeid,
                    "outcome": "failed",
                    "seconds": timeout,
                    "message": f"killed: still running after {timeout} s "
                    "(a hang?)",
                }
                _append(report, results[nodeid])
            stream.write(f"\n[run.py] restarting after {hung}\n")
            stream.flush()
            done_file.write_text(json.dumps(sorted(results)))
            env["KH_CONFORMANCE_DONE"] = str(done_file)
    seconds = time.perf_counter() - start
    if process.returncode not in (0, 1, 5) or not results:
        sys.stdout.write(Path(log).read_text()[-5000:])
        raise RuntimeError(
            f"pytest in {tree} exited with {process.returncode}; see {log}"
        )
    return results, seconds


def _read_results(report):
    """The last line per node id of the conftest's report."""
    results = {}
    if report.exists():
        for line in report.read_text().splitlines():
            entry = json.loads(line)
            results[entry["nodeid"]] = entry
    return results


def _append(report, entry):
    with open(report, "a") as stream:
        stream.write(json.dumps(entry) + "\n")


# --- the lists and the table ----------------------------------------------


def read_list(path):
    """{node id: reason} from a file of `node id  reason` lines (# comments).

    A node id ending in `*` matches every test whose id starts with the
    rest (parametrized variants)."""
    entries = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        nodeid, _, reason = line.partition(" ")
        entries[nodeid] = reason.strip()
    return entries


def listed(nodeid, entries):
    for pattern in entries:
        if pattern == nodeid or (
            pattern.endswith("*") and nodeid.startswith(pattern[:-1])
        ):
            return pattern
    return None


def file_of(nodeid):
    return nodeid.split("::", 1)[0]


def compare(files, stock, hetero, allowed, known):
    """Per-file rows and the lost tests, classified."""
    rows = []
    lists = {"new": [], "allowed": [], "known": [], "fixed": []}
    for path in files:
        ids = sorted(
            {n for n in stock if file_of(n) == path}
            | {n for n in hetero if file_of(n) == path}
        )
        ran = [n for n in ids if _outcome(hetero, n) != "deselected"]
        passed_stock = [n for n in ran if _outcome(stock, n) == "passed"]
        passed_hetero = [n for n in ran if _outcome(hetero, n) == "passed"]
        lost = [n for n in passed_stock if _outcome(hetero, n) != "passed"]
        rows.append(
            {
                "file": path,
                "tests": len(ids),
                "ran": len(ran),
                "stock": len(passed_stock),
                "hetero": len(passed_hetero),
                "built": sum(
                    1 for n in ran if hetero[n].get("hetero_models", 0)
                ),
                "lost": lost,
                "stock_seconds": _seconds(stock, ids),
                "hetero_seconds": _seconds(hetero, ids),
            }
        )
        for nodeid in lost:
            lists[_tag(nodeid, allowed, known)].append(nodeid)
        lists["fixed"] += [
            n
            for n in passed_stock
            if listed(n, known) and _outcome(hetero, n) == "passed"
        ]
    return rows, lists


def _tag(nodeid, allowed, known):
    if listed(nodeid, allowed):
        return "allowed"
    return "known" if listed(nodeid, known) else "new"


def _outcome(results, nodeid):
    entry = results.get(nodeid)
    return "missing" if entry is None else entry["outcome"]


def _seconds(results, ids):
    return sum(results[n].get("seconds", 0.0) for n in ids if n in results)


def print_table(rows, hetero, allowed, known):
    header = (
        f"{'file (keras/src/)':<40} {'tests':>5} {'ran':>4} {'stock':>5} "
        f"{'hetero':>6} {'built':>5} {'lost':>4} {'s stock':>7} "
        f"{'s hetero':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['file'].removeprefix('keras/src/'):<40} "
            f"{row['tests']:>5} {row['ran']:>4} {row['stock']:>5} "
            f"{row['hetero']:>6} {row['built']:>5} {len(row['lost']):>4} "
            f"{row['stock_seconds']:>7.0f} {row['hetero_seconds']:>8.0f}"
        )
    total = {
        key: sum(row[key] for row in rows)
        for key in ("tests", "ran", "stock", "hetero", "built")
    }
    lost = sum(len(row["lost"]) for row in rows)
    print(
        f"{'total':<40} {total['tests']:>5} {total['ran']:>4} "
        f"{total['stock']:>5} {total['hetero']:>6} {total['built']:>5} "
        f"{lost:>4}"
    )
    print(
        "\ntests: collected; ran: run in both (the tests whose code reaches "
        "the rewritten\nclasses, or all with --all); stock / hetero: passed; "
        "built: built a HeteroModel;\nlost: passed stock, failed hetero "
        "(listed below); s: seconds in the tests."
    )
    for row in rows:
        for nodeid in row["lost"]:
            tag = _tag(nodeid, allowed, known).upper()
            message = hetero.get(nodeid, {}).get("message", "not run")
            print(f"  [{tag}] {nodeid}\n      {message}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--files",
        nargs="+",
        default=list(FILES),
        help="test files (globs) inside the sdist",
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument(
        "--all",
        action="store_true",
        help="run every test, not only those that reach the rewritten classes",
    )
    parser.add_argument(
        "--keep", help="work in this directory and keep it (else a temp dir)"
    )
    parser.add_argument(
        "--sequential",
        default=SEQUENTIAL,
        help="shim class that Sequential becomes ('' leaves it alone)",
    )
    parser.add_argument(
        "--allowed", default=str(HERE / "allowed.txt"), help="allowed list"
    )
    parser.add_argument(
        "--known", default=str(HERE / "known_failures.txt"), help="known list"
    )
    parser.add_argument("--json", help="write the rows and results here")
    parser.add_argument(
        "--timeout",
        type=int,
        default=PER_TEST_TIMEOUT,
        help="seconds after which a test counts as hung",
    )
    parser.add_argument(
        "--tf-keras-tests",
        help="under TF_USE_LEGACY_KERAS=1: a tf-keras repository checkout",
    )
    args = parser.parse_args(argv)

    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in (
        "1",
        "true",
    )
    if legacy and not args.tf_keras_tests:
        print(
            "conformance tf-keras: skipped. tf-keras' sdist ships no tests "
            "and CI cannot reach its repository (--tf-keras-tests DIR runs "
            "them from a checkout); docs/conformance.md has the figures for "
            "tf_keras/engine/training_test.py, measured by hand."
        )
        return 0
    if legacy and args.files == list(FILES):
        args.files = ["tf_keras/engine/training_test.py"]
    version = importlib.metadata.version("tf-keras" if legacy else "keras")
    allowed, known = read_list(args.allowed), read_list(args.known)
    work = Path(args.keep or tempfile.mkdtemp(prefix="kh-conformance-"))
    if args.keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _conformance(args, version, allowed, known, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _conformance(args, version, allowed, known, work):
    if args.tf_keras_tests:
        flavour = "tf-keras"
        files = copy_tf_keras_tests(
            args.tf_keras_tests, args.files, work / "sdist"
        )
    else:
        flavour = "keras3"
        sdist = download_sdist(version, work / "download")
        files = extract(sdist, args.files, work / "sdist")
    classes = {"Model": "Model"}
    if args.sequential:
        classes["Sequential"] = args.sequential
    make_tree(work / "sdist", work / "stock", files)
    found = make_tree(work / "sdist", work / "hetero", files, classes)
    selection = None
    if not args.all:
        selection = work / "selection.json"
        selection.write_text(
            json.dumps({path: sorted(found[path][1]) for path in files})
        )
    rewritten = sum(1 for count, _ in found.values() if count)
    print(
        f"{flavour} {version}: {len(files)} test files, {rewritten} of them "
        f"rewritten ({', '.join(sorted(classes))}); "
        + ("all tests" if args.all else "the tests that reach the shim")
    )
    runs = {}
    # The two runs at once: each is one pytest process, and the machine has
    # a core for each (CI's time, docs/versions.md).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(
                run_pytest,
                work / name,
                files,
                args.keyword,
                work / f"{name}.log",
                selection,
                args.timeout,
            )
            for name in ("stock", "hetero")
        }
    for name, future in futures.items():
        results, seconds = future.result()
        runs[name] = results
        ran = sum(1 for r in results.values() if r["outcome"] != "deselected")
        print(f"{name}: {ran} tests in {seconds:.0f} s")
    rows, lists = compare(files, runs["stock"], runs["hetero"], allowed, known)
    print()
    print_table(rows, runs["hetero"], allowed, known)
    if lists["fixed"]:
        print("\nKnown failures that now pass (remove them from the list):")
        for nodeid in lists["fixed"]:
            print(f"  {nodeid}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"keras": version, "rows": rows, **runs}, indent=1)
        )
    print(
        f"\nconformance {flavour} ({version}): "
        f"{sum(row['stock'] for row in rows)} pass stock, "
        f"{sum(row['hetero'] for row in rows)} pass hetero; lost: "
        f"{len(lists['allowed'])} allowed, {len(lists['known'])} known, "
        f"{len(lists['new'])} new"
    )
    if lists["new"]:
        print(
            "New differences: fix them, or add them to known_failures.txt "
            "(a bug) or allowed.txt (right by design) with a reason."
        )
    return 1 if lists["new"] else 0


if __name__ == "__main__":
    sys.exit(main())
