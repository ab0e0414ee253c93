# Set-up and everyday commands. Each target installs what it needs into
# .venv, so a fresh machine needs only python3 (>= 3.10) and make.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo test test-quick test-keras3 test-legacy conformance lint bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## The main demo: HeteroModel on simulated unequal devices (it writes
## TensorBoard logs: the extra gives the `tensorboard` command it prints).
demo: $(STAMP)
	$(BIN)/pip install --quiet -e ".[tensorboard]"
	$(BIN)/python examples/quickstart.py

## The whole suite, Keras 3 then tf-keras (what CI runs).
test: test-keras3 test-legacy

test-keras3: $(STAMP)
	$(BIN)/python -m pytest tests

test-legacy: $(STAMP)
	TF_USE_LEGACY_KERAS=1 $(BIN)/python -m pytest tests

## Without the slow multi-process tests, Keras 3 only.
test-quick: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow"

## Keras' own tests, stock vs HeteroModel (docs/conformance.md). Downloads
## the installed Keras' sdist; fails on a difference in neither
## tests/conformance/allowed.txt nor known_failures.txt.
conformance: $(STAMP)
	$(BIN)/python tests/conformance/run.py
	TF_USE_LEGACY_KERAS=1 $(BIN)/python tests/conformance/run.py

lint: $(STAMP)
	$(BIN)/ruff check keras_hetero tests benchmarks examples docs/griffe_examples.py
	$(BIN)/ruff format --check keras_hetero tests benchmarks examples docs/griffe_examples.py

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/rebalance.py
	$(BIN)/python benchmarks/straggler.py
	$(BIN)/python benchmarks/checkpoint.py
	$(BIN)/python benchmarks/precision.py
	$(BIN)/python benchmarks/input.py
	$(BIN)/python benchmarks/arrays.py
	$(BIN)/python benchmarks/placement.py
	$(BIN)/python benchmarks/steps_per_execution.py

## The documentation site (mkdocs.yml, docs/) into site/; warnings fail.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
