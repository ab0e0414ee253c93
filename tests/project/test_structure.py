"""The package's layout rules (docs/how-it-works.md, "Where things live").

- Flavour branches and private TensorFlow/Keras internals live in
  `keras_hetero/_compat/` only.
- No import cycle between keras_hetero's modules, counting imports inside
  functions (they hide a cycle, they do not remove it) and the package
  `__init__`s an import runs first.
- The modules form layers (`LAYERS`, bottom first): no module imports one
  of a higher layer, counting those `__init__`s too.
- The `__init__`s of `FACADES` only re-export.
- Every module imports on its own, in a fresh interpreter.
- `TF_CONFIG` is parsed in one place (`_distribute.env_task`).
"""

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

from keras_hetero import _distribute

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "keras_hetero"
COMPAT = "keras_hetero._compat"

# Modules only the compat layer may import.
INTERNAL_MODULES = ("tf_keras", "keras.src", "tensorflow.python")
# Private attributes of TensorFlow / Keras objects that keras_hetero reads or
# sets (each behind a function of `_compat`); found by reading the code.
# keras_hetero's own private names are not listed.
INTERNAL_ATTRIBUTES = {
    "IS_LEGACY",  # the flavour switch itself
    "_in_multi_worker_mode",
    "_num_workers",
    "_cluster",
    "_cardinality",
    "_inbound_nodes",
    "_variant_tensor",
    "_learning_rate",
    "_as_serialized_graph",
    "_distribution_strategy",
    "_collective_key_base",
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _is_package(name):
    path = PACKAGE.parent.joinpath(*name.split("."))
    return (path / "__init__.py").is_file()


def _exists(name):
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or _is_package(name)


def _imports(name, path):
    """The keras_hetero modules `name` imports (anywhere in its code)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = []
            for alias in node.names:
                # `from keras_hetero import _compat` imports a module;
                # `from keras_hetero.data import shard` may be either.
                child = f"{base}.{alias.name}"
                targets.append(child if _exists(child) else base)
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == "keras_hetero")
    found.discard(name)
    return found


def test_internals_and_flavour_branches_live_in_compat_only():
    offences = []
    for name, path in _modules():
        if name == COMPAT or name.startswith(COMPAT + "."):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{node_line(node)}"
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                modules = []
            for module in modules:
                if module.startswith(INTERNAL_MODULES):
                    offences.append(f"{where} imports {module}")
            if isinstance(node, ast.Attribute):
                if node.attr in INTERNAL_ATTRIBUTES:
                    offences.append(f"{where} uses .{node.attr}")
            if isinstance(node, ast.Constant) and node.value in (
                INTERNAL_ATTRIBUTES
            ):
                offences.append(f"{where} names {node.value!r}")
    assert not offences, "move these into keras_hetero/_compat/:\n" + (
        "\n".join(offences)
    )


def node_line(node):
    return getattr(node, "lineno", "?")


def test_the_rule_finds_what_it_looks_for(tmp_path):
    # The scan above must see an internal in a function body.
    source = (
        "def f(strategy):\n"
        "    from tensorflow.python.eager import context\n"
        "    return strategy.extended._in_multi_worker_mode()\n"
    )
    tree = ast.parse(source)
    seen = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
    }
    assert "_in_multi_worker_mode" in seen & INTERNAL_ATTRIBUTES
    assert any(str(m).startswith(INTERNAL_MODULES) for m in seen)


def _cycles(graph):
    """Every strongly connected component of more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _runs(importer, target):
    """What importing `target` from module `importer` runs: `target` and
    each package above it (importing `a.b.c` runs `a/__init__` and
    `a/b/__init__` first), less the packages `importer` is inside (already
    running). A name taken from one of those (`from keras_hetero import
    checkpointing` in `checkpointing/callback.py`) still counts."""
    parts = target.split(".")
    prefixes = [".".join(parts[:end]) for end in range(1, len(parts))]
    inside = importer if _is_package(importer) else importer.rpartition(".")[0]
    runs = {
        prefix
        for prefix in prefixes
        if not (inside == prefix or inside.startswith(prefix + "."))
    }
    return (runs | {target}) - {importer}


def _graph():
    """Module -> the keras_hetero modules and packages its imports run."""
    graph = {}
    for name, path in _modules():
        graph[name] = set()
        for target in _imports(name, path):
            graph[name] |= _runs(name, target)
    return graph


# The layers, bottom first (docs/how-it-works.md, "Where things live"). A
# module belongs to the layer of the longest name here that it equals or
# lies inside; it may import its own layer and those below.
LAYERS = (
    (  # Foundations: argument checks, Keras flavours, strategy facts.
        "keras_hetero._checks",
        "keras_hetero._environment",
        "keras_hetero._phases",
        "keras_hetero._compat",
        "keras_hetero._batches",
        "keras_hetero._distribute",
        "keras_hetero._agreement",
        "keras_hetero.devices",
        "keras_hetero.timeouts",
        "keras_hetero.precision",
    ),
    (  # What every callback builds on.
        "keras_hetero._callback_protocol",
        "keras_hetero._scalar_writer",
    ),
    (  # Model parallel hints and input.
        "keras_hetero.layers",
        "keras_hetero.data",
    ),
    (  # The training step.
        "keras_hetero.training",
        "keras_hetero.model",
        "keras_hetero.sequential",
    ),
    (  # The callbacks, each with its pure core.
        "keras_hetero.balancing",
        "keras_hetero.stragglers",
        "keras_hetero.checkpointing",
    ),
    (  # Callbacks that watch the others.
        "keras_hetero.report",
    ),
    (  # Facades and tools: nothing below imports them.
        "keras_hetero",
        "keras_hetero.callbacks",
        "keras_hetero.placement",
        "keras_hetero.doctor",
        "keras_hetero.launcher",
        "keras_hetero.run",
        "keras_hetero.testing",
        "keras_hetero.ray",
        "keras_hetero.spark",
    ),
)
# The package itself is listed for its `__init__` only: a module of it is
# in a layer only if a longer name lists it.
ROOT = "keras_hetero"
# What `import keras_hetero` must not load: the tools (processes, cgroups,
# network namespaces, device timing, Spark, Ray; docs/how-it-works.md).
TOOLS = (
    "keras_hetero.doctor",
    "keras_hetero.launcher",
    "keras_hetero.placement",
    "keras_hetero.ray",
    "keras_hetero.run",
    "keras_hetero.spark",
    "keras_hetero.testing",
)


# Packages whose `__init__` only re-exports (a docstring, imports,
# `__all__`): importing one of their modules runs nothing else.
FACADES = (
    "keras_hetero.callbacks",
    "keras_hetero.checkpointing",
    "keras_hetero.placement",
    "keras_hetero.report",
)


def _layer(name):
    """The index in `LAYERS` of module `name`, or None."""
    found, length = None, -1
    for index, members in enumerate(LAYERS):
        for member in members:
            inside = name == member or (
                member != ROOT and name.startswith(member + ".")
            )
            if inside and len(member) > length:
                found, length = index, len(member)
    return found


def _upward_imports(graph):
    return sorted(
        f"{name} (layer {_layer(name)}) imports {target} "
        f"(layer {_layer(target)})"
        for name, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(name)
    )


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, (
        "import cycles (counting function-level imports and package "
        f"__init__s): {cycles}"
    )


def test_every_module_has_a_layer():
    names = [name for name, _ in _modules()]
    assert [name for name in names if _layer(name) is None] == []
    listed = [member for members in LAYERS for member in members]
    assert [member for member in listed if not _exists(member)] == []


def test_a_module_no_layer_lists_has_no_layer():
    # The package's own name covers its `__init__` only, so a new module
    # that no entry lists fails the check above.
    assert _layer(ROOT) is not None
    assert _layer("keras_hetero.new_module") is None
    assert _layer("keras_hetero.training.new_module") == _layer(
        "keras_hetero.training"
    )


def test_import_keras_hetero_loads_the_core_only():
    script = (
        "import sys\n"
        "import keras_hetero as kh\n"
        "print(sorted(m for m in sys.modules if m.startswith(\n"
        f"    {TOOLS!r})))\n"
        "assert callable(kh.doctor) and kh.testing.logical_cpus\n"
        "print(sorted(m for m in sys.modules if m.startswith(\n"
        "    ('keras_hetero.doctor', 'keras_hetero.testing'))))\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=PACKAGE.parent,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    loaded, used = result.stdout.splitlines()[-2:]
    assert loaded == "[]", f"import keras_hetero loaded tools: {loaded}"
    # ... and they load when used.
    assert "'keras_hetero.doctor'" in used
    assert "'keras_hetero.testing'" in used


def test_no_module_imports_a_higher_layer():
    upward = _upward_imports(_graph())
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_facades_only_re_export():
    offences = []
    for name in FACADES:
        path = PACKAGE.parent.joinpath(*name.split("."), "__init__.py")
        for node in ast.parse(path.read_text()).body:
            docstring = isinstance(node, ast.Expr) and isinstance(
                node.value, ast.Constant
            )
            exports = isinstance(node, ast.Assign) and [
                getattr(target, "id", None) for target in node.targets
            ] == ["__all__"]
            imports = isinstance(node, ast.ImportFrom) and (
                node.module or ""
            ).startswith("keras_hetero.")
            if not (docstring or exports or imports):
                offences.append(f"{name}: line {node.lineno}")
    assert not offences, "code in a facade's __init__: " + ", ".join(offences)


def test_an_import_runs_the_packages_above_it():
    # `from keras_hetero.callbacks import base` in `balancing/rebalancer.py`
    # runs `callbacks/__init__.py`, which imports the rebalancer: a loop.
    assert _runs(
        "keras_hetero.balancing.rebalancer", "keras_hetero.callbacks.base"
    ) == {"keras_hetero.callbacks", "keras_hetero.callbacks.base"}
    # Inside its own package, a module's packages are already running...
    assert _runs(
        "keras_hetero.checkpointing.callback",
        "keras_hetero.checkpointing.storage",
    ) == {"keras_hetero.checkpointing.storage"}
    # ... but taking a name from one of them reads it half-initialised.
    assert _runs(
        "keras_hetero.checkpointing.callback", "keras_hetero.checkpointing"
    ) == {"keras_hetero.checkpointing"}


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c"]
    ]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# A fresh interpreter and a fork per module (about 40 s): under Keras 3 in CI,
# both flavours in `make test-all` (under tf-keras the rest of the suite
# imports every module too).
@pytest.mark.slow
def test_each_module_imports_alone_in_a_fresh_interpreter():
    # One fresh interpreter imports TensorFlow and the selected Keras, then
    # forks one child per module; each child imports only its module (so
    # an import that works only after another module was imported fails).
    names = [name for name, _ in _modules()]
    script = (
        "import importlib, os, sys\n"
        "import tensorflow\n"
        "if os.environ.get('TF_USE_LEGACY_KERAS', '0') in ('1', 'true'):\n"
        "    import tf_keras\n"
        "else:\n"
        "    import keras\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            importlib.import_module(name)\n"
        "        except BaseException as error:\n"
        "            print(name, type(error).__name__, error, flush=True)\n"
        "            os._exit(1)\n"
        "        os._exit(0)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    if status:\n"
        "        failed.append(name)\n"
        "print('FAILED', failed)\n"
        "sys.exit(1 if failed else 0)\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-c", script, *names],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=PACKAGE.parent,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "FAILED []" in result.stdout


def test_every_module_is_listed():
    # The scans above cover the whole package (a module missed by the walk
    # would escape every rule).
    names = {name for name, _ in _modules()}
    assert {"keras_hetero", "keras_hetero._compat", "keras_hetero.model"} <= (
        names
    )
    assert all(importlib.util.find_spec(name) for name in names)


@pytest.mark.parametrize(
    "config, expected",
    [
        (None, (None, 0, 1, 0, True, "/job:worker/task:0", ())),
        ("not json", (None, 0, 1, 0, True, "/job:worker/task:0", ())),
        (
            '{"cluster": {"worker": ["a:1", "b:2"]},'
            ' "task": {"type": "worker", "index": 1}}',
            ("worker", 1, 2, 1, False, "/job:worker/task:1", ("a:1", "b:2")),
        ),
        (
            '{"cluster": {"chief": ["c:0"], "worker": ["a:1", "b:2"]},'
            ' "task": {"type": "worker", "index": 0}}',
            (
                "worker",
                0,
                3,
                1,
                False,
                "/job:worker/task:0",
                ("c:0", "a:1", "b:2"),  # global order: the chief first
            ),
        ),
        (
            '{"cluster": {"chief": ["c:0"], "worker": ["a:1"]},'
            ' "task": {"type": "chief", "index": 0}}',
            ("chief", 0, 2, 0, True, "/job:chief/task:0", ("c:0", "a:1")),
        ),
    ],
)
def test_env_task_reads_tf_config(config, expected):
    environ = {} if config is None else {"TF_CONFIG": config}
    task = _distribute.env_task(environ)
    assert (
        task.task_type,
        task.task_index,
        task.num_workers,
        task.worker_index,
        task.is_chief,
        task.device_job,
        task.addresses,
    ) == expected


def test_tf_config_is_parsed_in_one_place():
    # A module that names the variable in code (not in a docstring) and
    # parses JSON reads it.
    readers = []
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        nodes = list(ast.walk(tree))
        names_it = any(
            isinstance(node, ast.Constant) and node.value == "TF_CONFIG"
            for node in nodes
        )
        parses = any(
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "loads"
            for node in nodes
        )
        if names_it and parses:
            readers.append(name)
    assert readers == ["keras_hetero._distribute"], readers


@pytest.mark.parametrize(
    "pattern, device, expected",
    [
        ("CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1", True),
        ("CPU:1", "/job:localhost/replica:0/task:0/device:CPU:0", False),
        ("cpu:1", "/device:CPU:1", True),
        ("GPU:0", "/device:CPU:0", False),
        (
            "/job:worker/task:1",
            "/job:worker/replica:0/task:1/device:CPU:0",
            True,
        ),
        (
            "/job:worker/task:1",
            "/job:worker/replica:0/task:0/device:CPU:0",
            False,
        ),
        ("/job:worker/task:1", "/device:CPU:0", False),
    ],
)
def test_device_matches_compares_the_parts_the_pattern_names(
    pattern, device, expected
):
    assert _distribute.device_matches(pattern, device) is expected


def _map_of_the_code():
    """The modules docs/how-it-works.md's table names, as paths inside the
    package. In a cell, `folder/` makes `folder` the folder of the bare names
    after it (`_compat/`: `flavour.py`, ...)."""
    text = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    table = text[text.index("| capability |") :]
    table = table[: table.index("\n\n")]
    named = set()
    for row in table.splitlines()[2:]:
        for cell in row.split("|"):
            folder = ""
            for token in re.findall(r"`([\w/]+\.py|\w+/)`", cell):
                if token.endswith("/"):
                    folder = token
                    named.add(folder)
                elif "/" in token:
                    named.add(token)
                else:
                    named.add(folder + token)
    return named


def test_the_map_of_the_code_names_every_module():
    named = _map_of_the_code()
    missing, stale = [], []
    for _, path in _modules():
        relative = path.relative_to(PACKAGE).as_posix()
        folder = relative.rsplit("/", 1)[0] + "/" if "/" in relative else ""
        package_init = relative.endswith("__init__.py")
        if relative == "__init__.py" or (
            package_init
            and (folder in named or any(n.startswith(folder) for n in named))
        ):
            continue
        if relative not in named:
            missing.append(relative)
    for name in named:
        if not (PACKAGE / name).exists():
            stale.append(name)
    assert not missing and not stale, (
        "docs/how-it-works.md's table of the code and the package differ: "
        f"not in the table {sorted(missing)}; not in the package "
        f"{sorted(stale)}"
    )
