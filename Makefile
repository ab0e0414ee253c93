# Set-up and everyday commands. Each target installs what it needs into
# .venv, so a fresh machine needs only python3 (>= 3.10) and make.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 2

# Tests run on two pytest-xdist workers (the machine has 2 cores; many
# tests spend their time in subprocesses and worker processes). Whole files
# go to one worker (--dist loadfile): a module's shared fixtures (a Ray
# cluster, the examples' runs) start once, and no two tests of a file run
# at once. Tests marked `serial` (judged by measured speed) run alone
# afterwards. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST := -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=30

# The oldest tested versions (docs/versions.md): Colab's TensorFlow and
# Keras, installed first as a user has them; `pip install .` must keep them.
# Python 3.10, the oldest supported, if one runs (a pyenv shim may not).
OLDEST_PYTHON ?= $(firstword $(shell for p in python3.10 \
	$(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10); do \
	$$p -c "" 2>/dev/null && echo $$p; done) $(PYTHON))
OLDEST := tensorflow==2.19.1 keras==3.10.0 tf-keras==2.19.0
OLD_VENV := .venv-oldest
OLD_BIN := $(OLD_VENV)/bin
OLD_STAMP := $(OLD_VENV)/.installed
# One real multi-worker job: 2 processes, MultiWorkerMirroredStrategy.
MULTI_WORKER_TEST := tests/training/test_multi_worker.py::test_fit_evaluate_predict_match_single_device[2w-75_25]

# The release check: the sdist and wheel built from the checkout, checked
# with twine, the wheel installed into a clean venv on Python 3.12 (Colab's;
# docs/versions.md) that then runs the quickstart from outside the checkout
# and a core subset of the suite against the installed package
# (--import-mode=append: the checkout, which the `tests` package needs on
# sys.path, goes after site-packages, so keras_hetero is the wheel's).
WHEEL_PYTHON ?= $(firstword $(shell for p in python3.12 \
	$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12); do \
	$$p -c "" 2>/dev/null && echo $$p; done) $(PYTHON))
WHEEL_VENV := .venv-wheel
WHEEL_TESTS := tests/model/test_api.py tests/model/test_equivalence.py \
	tests/training/test_clock_graph.py tests/training/test_clock_check.py

.PHONY: install install-oldest demo demo-simulated test test-quick test-keras3 test-legacy \
	test-all test-all-keras3 test-all-legacy test-quick-keras3 test-quick-legacy test-oldest \
	test-oldest-keras3 test-oldest-legacy conformance lint bench docs clean \
	package package-install package-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

$(OLD_STAMP): pyproject.toml
	$(OLDEST_PYTHON) -m venv $(OLD_VENV)
	$(OLD_BIN)/pip install --quiet --upgrade pip
	$(OLD_BIN)/pip install --quiet $(OLDEST)
	$(OLD_BIN)/pip install --quiet .
	$(OLD_BIN)/pip check
	$(OLD_BIN)/python .ci/check_versions.py $(OLDEST)
	$(OLD_BIN)/pip install --quiet -e ".[test]"
	$(OLD_BIN)/pip check
	$(OLD_BIN)/python .ci/check_versions.py $(OLDEST)
	touch $(OLD_STAMP)

install-oldest: $(OLD_STAMP)

## The demo: HeteroModel on REAL unequal devices (two workers, one under a
## CPU quota: Linux, root) where the machine allows it, else the SIMULATED
## demo examples/quickstart.py (it writes TensorBoard logs: the extra gives
## the `tensorboard` command it prints). `make demo-simulated` runs that one.
demo: $(STAMP)
	$(BIN)/pip install --quiet -e ".[tensorboard]"
	$(BIN)/python examples/real_devices.py

demo-simulated: $(STAMP)
	$(BIN)/pip install --quiet -e ".[tensorboard]"
	$(BIN)/python examples/quickstart.py

## The suite CI runs (README's test command; docs/versions.md, "CI"):
## under Keras 3 every test but the `extended` cases, then under tf-keras
## the quick suite and the `both_flavours` multi-process cases.
test: test-keras3 test-legacy

# Each recipe runs both of its steps and fails if either did; a serial step
# that selects no test (pytest's exit 5) passes.
RUN_SERIAL = $(BIN)/python -m pytest --durations=5 -m

test-keras3: $(STAMP)
	$(BIN)/python $(PYTEST) tests -m "not serial and not extended"; \
	status=$$?; \
	$(RUN_SERIAL) "serial and not extended" tests || status=1; exit $$status

# tf-keras: the quick suite, and of the multi-process cases those marked
# `both_flavours`, where the flavours' code paths differ (MultiWorkerMirrored
# and ParameterServer fit, kill and resume, Keras' own callbacks); the rest
# lies below Keras or repeats an axis (`make test-all` runs them).
LEGACY_CI := (not slow or both_flavours)

test-legacy: $(STAMP)
	export TF_USE_LEGACY_KERAS=1; \
	$(BIN)/python $(PYTEST) tests -m "$(LEGACY_CI) and not serial"; \
	status=$$?; \
	$(RUN_SERIAL) "$(LEGACY_CI) and serial" tests; serial=$$?; \
	[ $$serial = 0 ] || [ $$serial = 5 ] || status=1; exit $$status

## Every test under both flavours, the `extended` cases too, and every
## benchmark script's smoke mode: before a release, and before a change to
## the launcher, the harness, the input kinds or a benchmark lands
## (docs/versions.md, "CI").
test-all: test-all-keras3 test-all-legacy bench-smoke

test-all-keras3: $(STAMP)
	$(BIN)/python $(PYTEST) tests -m "not serial"; status=$$?; \
	$(RUN_SERIAL) serial tests || status=1; exit $$status

test-all-legacy: $(STAMP)
	export TF_USE_LEGACY_KERAS=1; \
	$(BIN)/python $(PYTEST) tests -m "not serial"; status=$$?; \
	$(RUN_SERIAL) serial tests || status=1; exit $$status

## Without the slow multi-process tests, Keras 3 then tf-keras.
test-quick: test-quick-keras3 test-quick-legacy

test-quick-keras3: $(STAMP)
	$(BIN)/python $(PYTEST) tests -m "not slow"

test-quick-legacy: $(STAMP)
	TF_USE_LEGACY_KERAS=1 $(BIN)/python $(PYTEST) tests -m "not slow"

## The oldest tested versions in .venv-oldest (CI's second row): the quick
## suite and one real multi-worker job, Keras 3 then tf-keras.
test-oldest: test-oldest-keras3 test-oldest-legacy

# The oldest versions run the quick tests of what differs between releases:
# the model's Keras surface (tests/model) and the version keys
# (tests/compat) under both flavours; under Keras 3.10, whose epoch iterator
# and optional inputs differ (docs/versions.md, "Version-keyed code"), also
# the epoch iterators, the loop with several steps per call, loss scaling,
# the checkpoint callback's resume and the quickstart (Colab's user).
# keras-hetero's own gradient path, buckets, pipelines, low-communication
# rounds and input pipelines run the same code on every release, through
# the loop tested here, and run in the newest row under both flavours.
OLDEST_TESTS := tests/model tests/compat
OLDEST_KERAS3_TESTS := $(OLDEST_TESTS) \
	tests/training/test_epoch_boundary.py \
	tests/training/test_steps_per_execution.py \
	tests/training/test_precision.py \
	tests/checkpointing/test_elastic_checkpoint.py \
	tests/project/test_quickstart.py

test-oldest-keras3: $(OLD_STAMP)
	$(OLD_BIN)/python $(PYTEST) $(OLDEST_KERAS3_TESTS) -m "not slow"; \
	status=$$?; \
	$(OLD_BIN)/python -m pytest "$(MULTI_WORKER_TEST)" || status=1; \
	exit $$status

test-oldest-legacy: $(OLD_STAMP)
	export TF_USE_LEGACY_KERAS=1; \
	$(OLD_BIN)/python $(PYTEST) $(OLDEST_TESTS) -m "not slow"; \
	status=$$?; \
	$(OLD_BIN)/python -m pytest "$(MULTI_WORKER_TEST)" || status=1; \
	exit $$status

## Keras' own tests, stock vs HeteroModel (docs/conformance.md). Downloads
## the installed Keras' sdist; fails on a difference in neither
## tests/conformance/allowed.txt nor known_failures.txt.
conformance: $(STAMP)
	$(BIN)/python tests/conformance/run.py
	TF_USE_LEGACY_KERAS=1 $(BIN)/python tests/conformance/run.py

lint: $(STAMP)
	$(BIN)/ruff check keras_hetero tests benchmarks examples docs/griffe_examples.py .ci
	$(BIN)/ruff format --check keras_hetero tests benchmarks examples docs/griffe_examples.py .ci

## Every benchmark behind a table in the docs (docs/benchmarks.md, and
## docs/arrow.md's input table), in that page's order; hours in all. Under
## the Keras that TF_USE_LEGACY_KERAS selects: run it once per flavour
## (epoch_boundary.py runs both itself). The CPU-quota and network-namespace
## measurements need root on Linux: without it they print why and fail; the
## others still run, and `make bench` fails at the end if any failed.
## benchmarks/RESULTS.md has every table with its date and machine state.
BENCH_RUNS := \
	"real_devices.py" \
	"slow_host.py" \
	"interleaved.py --replicas 2 --widths 64 256 --blocks 300" \
	"interleaved.py --replicas 3 --widths 64 256 --blocks 300" \
	"interleaved.py --replicas 4 --widths 64 256 --blocks 300" \
	"interleaved.py --workers 2 --widths 64 256 --blocks 300" \
	"interleaved.py --replicas 2 --widths 64 256 --blocks 100 \
		--profile 'clock by control edges' 'no clocks'" \
	"collective_floor.py" \
	"rebalance.py" \
	"rebalance.py --strategies mwms --cases 1:2,1:4,1:1:2:4" \
	"scale.py" \
	"checkpoint.py" \
	"epoch_boundary.py --where one workers --rounds 2 --epochs 5" \
	"low_communication.py" \
	"soak.py --minutes 30" \
	"straggler.py" \
	"steps_per_execution.py --rounds 9" \
	"precision.py --rounds 2" \
	"placement.py" \
	"input.py" \
	"input_reads.py"

bench: $(STAMP)
	status=0; for run in $(BENCH_RUNS); do \
		echo "=== python benchmarks/$$run"; \
		eval "$(BIN)/python benchmarks/$$run" || status=1; \
	done; exit $$status

## Every script in benchmarks/ (but the _-prefixed shared modules) in its
## --smoke mode, two at a time: tiny sizes, seconds each, the same tables
## (their figures mean nothing). Checks that each still runs; prints each
## one's wall time and its output if it failed; fails if any failed.
.PHONY: bench-smoke
bench-smoke: $(STAMP)
	$(BIN)/python benchmarks/_smoke.py

## The documentation site (mkdocs.yml, docs/) into site/; warnings fail.
## Build the sdist and wheel into dist/ and check them.
package: $(STAMP)
	rm -rf dist build
	$(BIN)/python -m build --sdist --wheel --outdir dist .
	$(BIN)/twine check --strict dist/*

## The wheel in a clean Python 3.12 venv (CI installs it in the background
## while the suite runs), then the quickstart and a core subset from it.
package-install: package
	rm -rf $(WHEEL_VENV)
	$(WHEEL_PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install --quiet --upgrade pip
	$(WHEEL_VENV)/bin/pip install --quiet "$$(ls dist/*.whl)[report,tensorboard]" \
		"pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5"
	$(WHEEL_VENV)/bin/pip check
	touch $(WHEEL_VENV)/.installed

package-check:
	test -f $(WHEEL_VENV)/.installed || $(MAKE) package-install
	cd $$(mktemp -d) && $(CURDIR)/$(WHEEL_VENV)/bin/python -c \
		"import keras_hetero, sys; assert 'site-packages' in keras_hetero.__file__, keras_hetero.__file__; print(sys.version.split()[0], keras_hetero.__file__)" \
		&& $(CURDIR)/$(WHEEL_VENV)/bin/python $(CURDIR)/examples/quickstart.py
	cd $$(mktemp -d) && $(CURDIR)/$(WHEEL_VENV)/bin/python -m pytest -q \
		-n $(PYTEST_WORKERS) --dist loadfile -p no:cacheprovider \
		--import-mode=append \
		--rootdir $(CURDIR) -c $(CURDIR)/pyproject.toml \
		$(addprefix $(CURDIR)/,$(WHEEL_TESTS))

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(OLD_VENV) $(WHEEL_VENV) .pytest_cache build dist site *.egg-info
