"""Test set-up: quiet TensorFlow and four logical CPUs before any TF op."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import _compat  # noqa: E402
from keras_hetero._compat import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(4)

# No tf.data autotuning thread in any iterator the tests make: joining it
# when an abandoned iterator is collected can stall a later test for up to
# a minute (_compat.iterators_without_autotuning).
_compat.iterators_without_autotuning()


@pytest.fixture
def mixed_float16():
    """Keras' global policy is mixed_float16 during the test."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


# The files with the longest runs (measured: `make test`'s --durations),
# longest first. `make test` gives whole files to two xdist workers in
# collection order; starting with the longest keeps one worker from
# running a long file alone at the end (longest-processing-time first).
LONGEST_FILES = (
    "tests/checkpointing/test_elastic_processes.py",
    "tests/training/test_parameter_server.py",
    "tests/project/test_examples.py",
    "tests/spark/test_spark.py",
    "tests/launcher/test_hosts.py",
    "tests/training/test_multi_worker.py",
    "tests/launcher/test_warm.py",
    "tests/project/test_quickstart.py",
    "tests/training/test_keras_callbacks.py",
    "tests/training/test_steps_per_execution.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        if path in LONGEST_FILES:
            return LONGEST_FILES.index(path)
        return len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file keeps its own order
