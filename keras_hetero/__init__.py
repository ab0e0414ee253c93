"""keras-hetero: Keras `fit()` that trains well on unequal hardware.

Import as `import keras_hetero as kh`. The Keras flavour (Keras 3 or tf-keras)
follows TensorFlow's own switch, `TF_USE_LEGACY_KERAS`; `kh.keras` is the
selected Keras module (`keras`, or `tf_keras` under `TF_USE_LEGACY_KERAS=1`).

`import keras_hetero` loads the core: the model and its training step,
input, the callbacks, reports and precision. The tools around it load when
first used (`kh.launcher`, `kh.testing`, `kh.placement`, `kh.doctor`,
`kh.DoctorReport`, and `keras_hetero.spark` / `keras_hetero.ray` by their
full names): they start processes, touch cgroups and network namespaces,
or time devices, and a training script needs none of that to import.
"""

import importlib

from keras_hetero import _phases
from keras_hetero import callbacks
from keras_hetero import checkpointing
from keras_hetero import data
from keras_hetero import layers
from keras_hetero import report
from keras_hetero._compat import FLAVOUR
from keras_hetero._compat import keras
from keras_hetero.model import HeteroModel
from keras_hetero.precision import set_precision
from keras_hetero.sequential import HeteroSequential
from keras_hetero.timeouts import Timeouts
from keras_hetero.training.low_communication import LowCommunication
from keras_hetero.training.telemetry import StepStats

__version__ = "0.1.0"

# Name -> (module, attribute or None for the module itself), imported on
# first access (PEP 562).
_TOOLS = {
    "DoctorReport": ("keras_hetero.doctor", "DoctorReport"),
    "doctor": ("keras_hetero.doctor", "doctor"),
    "launcher": ("keras_hetero.launcher", None),
    "placement": ("keras_hetero.placement", None),
    "testing": ("keras_hetero.testing", None),
}


def __getattr__(name):
    if name not in _TOOLS:
        raise AttributeError(f"module 'keras_hetero' has no attribute {name!r}")
    module_name, attribute = _TOOLS[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_TOOLS))


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

# For the launcher's restart timing (`keras_hetero._phases`).
_phases.mark(_phases.IMPORTED)
