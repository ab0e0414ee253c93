"""Test set-up: quiet TensorFlow and four logical CPUs before any TF op."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_hetero as kh  # noqa: E402

DEVICES = kh.testing.logical_cpus(4)
