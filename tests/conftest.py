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
