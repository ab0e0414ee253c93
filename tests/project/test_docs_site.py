"""The documentation site builds cleanly, and its API page is complete.

`mkdocs build --strict` turns every warning into a failure: a page missing
from the nav, a broken link or anchor, a docstring mkdocstrings cannot
parse, an API entry that does not resolve. mkdocs is in the `test` extra;
without it these tests fail rather than skip.
"""

import functools
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import types

import keras_hetero as kh

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
# Public names of modules without `__all__`, from the API contract
# (DESIGN.md) and the guides.
CONTRACT = [
    "keras_hetero.layers.Placed",
    "keras_hetero.layers.hint",
    "keras_hetero.layers.place",
    "keras_hetero.placement.plan",
    "keras_hetero.placement.Plan",
    "keras_hetero.launcher.launch",
    "keras_hetero.launcher.LaunchResult",
]


def test_site_builds_without_warnings(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def _documented_object(path):
    """What a `::: path` entry documents: like mkdocstrings, a module
    wins over a package attribute of the same name."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            value = getattr(value, part)
        return value
    raise ImportError(path)


def test_api_page_covers_the_public_api():
    text = API.read_text()
    entries = re.findall(r"^::: ([\w.]+)", text, re.M)
    documented = [_documented_object(entry) for entry in entries]

    def missing_from_page(path):
        public = functools.reduce(getattr, path.split(".")[1:], kh)
        return not any(public is value for value in documented)

    missing = [path for path in CONTRACT if missing_from_page(path)]
    for name in kh.__all__:
        value = getattr(kh, name)
        path = f"keras_hetero.{name}"
        if value is kh._compat.keras:  # Keras itself, re-exported
            if "`kh.keras`" not in text:
                missing.append("kh.keras")
        elif isinstance(value, types.ModuleType):
            # Every name a subpackage exports; a module at least once.
            # A constant (a number, a name) is named in the text.
            missing += [
                f"{path}.{member}"
                for member in getattr(value, "__all__", [])
                if missing_from_page(f"{path}.{member}")
                and not (
                    isinstance(getattr(value, member), (str, int, float))
                    and f"kh.{name}.{member}`" in text
                )
            ]
            if not any(entry.startswith(path) for entry in entries):
                missing.append(path)
        elif callable(value):
            if missing_from_page(path):
                missing.append(path)
        elif f"kh.{name}" not in text:  # a constant, e.g. kh.FLAVOUR
            missing.append(f"kh.{name}")
    assert not missing, f"add these to docs/api.md: {missing}"


def test_keras_style_examples_become_code_blocks():
    spec = importlib.util.spec_from_file_location(
        "griffe_examples", ROOT / "docs" / "griffe_examples.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    docstring = "Summary.\n\nExample:\n\n>>> f(1)\n2\n"
    assert module.indent_examples(docstring) == (
        "Summary.\n\nExample:\n    ```pycon\n    >>> f(1)\n    2\n    ```"
    )
    plain = "Summary.\n\nArgs:\n    x: A number.\n"
    assert module.indent_examples(plain) == plain


def test_readme_links_every_page():
    linked = set(
        re.findall(r"\]\(docs/([\w-]+\.md)", (ROOT / "README.md").read_text())
    )
    pages = {page.name for page in (ROOT / "docs").glob("*.md")}
    assert not pages - linked, f"link these from README.md: {pages - linked}"


def test_install_lines_need_no_registry_release():
    # keras-hetero is not on a package registry yet: a user installs it from
    # a checkout or a wheel (README, "Install"). Drop this test at the first
    # registry release.
    registry_install = re.compile(r"pip install [\"']?keras[-_]hetero")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("examples", "keras_hetero"):
        files += (ROOT / folder).rglob("*.py")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if registry_install.search(line)
    ]
    assert not found, f"install from a checkout or a wheel instead: {found}"
