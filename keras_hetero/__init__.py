"""keras-hetero: Keras `fit()` that trains well on unequal hardware.

Import as `import keras_hetero as kh`. The Keras flavour (Keras 3 or tf-keras)
follows TensorFlow's own switch, `TF_USE_LEGACY_KERAS`; `kh.keras` is the
selected Keras module (`keras`, or `tf_keras` under `TF_USE_LEGACY_KERAS=1`).
"""

from keras_hetero import callbacks
from keras_hetero import checkpointing
from keras_hetero import data
from keras_hetero import launcher
from keras_hetero import layers
from keras_hetero import placement
from keras_hetero import report
from keras_hetero import testing
from keras_hetero._compat import FLAVOUR
from keras_hetero._compat import keras

# `kh.doctor` is the function (the package `keras_hetero.doctor` stays
# importable by its full name: `from keras_hetero.doctor import ...`).
from keras_hetero.doctor import DoctorReport
from keras_hetero.doctor import doctor
from keras_hetero.model import HeteroModel
from keras_hetero.precision import set_precision
from keras_hetero.sequential import HeteroSequential
from keras_hetero.timeouts import Timeouts
from keras_hetero.training.low_communication import LowCommunication
from keras_hetero.training.telemetry import StepStats

__version__ = "0.1.0"

__all__ = [
    "DoctorReport",
    "FLAVOUR",
    "HeteroModel",
    "HeteroSequential",
    "LowCommunication",
    "StepStats",
    "Timeouts",
    "callbacks",
    "set_precision",
    "checkpointing",
    "data",
    "doctor",
    "keras",
    "launcher",
    "layers",
    "placement",
    "report",
    "testing",
]
