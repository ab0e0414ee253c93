"""The root conftest.py of a conformance run (copied there by run.py).

Keras' sdist ships its tests but not the repository's root conftest.py.
This one does what Keras' does for the TensorFlow backend: it declares the
`requires_trainable_backend` and `multi_device` markers, skips
`multi_device` tests (Keras' conftest counts devices for JAX and torch only,
so under TensorFlow they are always skipped) and offers `skip_if_backend`,
which some tests import with `from conftest import skip_if_backend`.

Two additions of ours:

- JAX is not installed here. `trainer_test.py` imports it at module level
  and uses it only in JAX-backend tests and in tests parametrized with a
  "jax" data generator. A placeholder module stands in for the import (any
  use raises ModuleNotFoundError), and the parametrized tests are skipped.
- Each test's outcome, duration and the number of `kh.HeteroModel`s it
  built are appended as JSON lines to `$KH_CONFORMANCE_REPORT` for run.py
  as soon as it ends (and a "started" line when it starts, so run.py can
  tell which test a killed run hung in). `$KH_CONFORMANCE_SELECT` and
  `$KH_CONFORMANCE_DONE` choose the tests (see `_select`).
"""

import functools
import importlib.util
import inspect
import json
import os
import sys
import types

import pytest
from keras.src.backend import backend

JAX_MISSING = importlib.util.find_spec("jax") is None


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(
            f"jax is not installed (conformance placeholder; jax.{name})"
        )


if JAX_MISSING:
    sys.modules.setdefault("jax", _Placeholder("jax"))


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_trainable_backend: mark test for trainable backend only",
    )
    config.addinivalue_line(
        "markers",
        "multi_device: mark test for running with multiple devices only",
    )


def pytest_collection_modifyitems(config, items):
    _select(config, items)
    needs_jax = pytest.mark.skip(reason="needs jax, which is not installed")
    one_device = pytest.mark.skip(reason="Requires multiple devices")
    for item in items:
        if "multi_device" in item.keywords:
            item.add_marker(one_device)
        params = getattr(item, "callspec", None)
        name = item.name.lower()
        if JAX_MISSING and backend() != "jax" and "jax" in name:
            if params is not None or "[" in name or "_jax" in name:
                item.add_marker(needs_jax)


_REPORT = os.environ.get("KH_CONFORMANCE_REPORT")
_results = {}


def _write(entry):
    """Appends `entry` to the report at once, so a run killed in a hung
    test keeps what it had (run.py restarts it after that test)."""
    if _REPORT:
        with open(_REPORT, "a") as stream:
            stream.write(json.dumps(entry) + "\n")


def _read_json(variable, default):
    path = os.environ.get(variable)
    if not path:
        return default
    with open(path) as stream:
        return json.load(stream)


def _select(config, items):
    """Keeps the tests named in `$KH_CONFORMANCE_SELECT` (a JSON file of
    {test file: [function __qualname__, ...]}, written by run.py) and drops
    those in `$KH_CONFORMANCE_DONE` (node ids a killed run finished)."""
    wanted = _read_json("KH_CONFORMANCE_SELECT", None)
    done = set(_read_json("KH_CONFORMANCE_DONE", ()))
    kept, dropped = [], []
    for item in items:
        function = getattr(item.obj, "__func__", item.obj)
        qualname = getattr(function, "__qualname__", item.name)
        if item.nodeid in done:
            dropped.append(item)
        elif wanted is None or qualname in wanted.get(
            item.nodeid.split("::")[0], ()
        ):
            kept.append(item)
        else:
            dropped.append(item)
            _write({"nodeid": item.nodeid, "outcome": "deselected"})
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(autouse=True)
def _count_hetero_models(request, monkeypatch):
    """Counts the HeteroModels the test builds (0 in the stock run)."""
    module = sys.modules.get("keras_hetero.model")
    if module is None:
        yield
        return
    built = []
    init = module.HeteroModel.__init__

    @functools.wraps(init)
    def counting_init(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    # Keras reads `__init__`'s argument spec (Model.from_config).
    counting_init.__signature__ = inspect.signature(init)

    monkeypatch.setattr(module.HeteroModel, "__init__", counting_init)
    yield
    request.node.user_properties.append(("hetero_models", len(built)))


def pytest_runtest_logstart(nodeid, location):
    _write({"nodeid": nodeid, "outcome": "started"})


def pytest_runtest_logreport(report):
    entry = _results.setdefault(
        report.nodeid,
        {"nodeid": report.nodeid, "outcome": "passed", "seconds": 0.0},
    )
    entry["seconds"] += report.duration
    if report.failed:
        entry["outcome"] = "failed"
        if "message" not in entry:
            entry["message"] = _first_line(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    for name, value in report.user_properties:
        entry[name] = value
    if report.when == "teardown":
        _write(_results.pop(report.nodeid))


def _first_line(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return f"{report.when}: " + text.strip().splitlines()[0][:300]
