"""The flavour, chosen once at import the way TensorFlow chooses it:
`TF_USE_LEGACY_KERAS=1` selects tf-keras, anything else Keras 3; the Keras
module, its version, and the version facts the overrides are keyed by."""

import os

import tensorflow as tf

IS_LEGACY = os.environ.get("TF_USE_LEGACY_KERAS", "0").lower() in (
    "1",
    "true",
    "yes",
)

# The flavour's private modules the other `_compat` modules use (imported
# here once; each use names its upstream reason where it is used).
if IS_LEGACY:
    import tf_keras as keras
    from tf_keras.src.engine import data_adapter as _data_adapter
    from tf_keras.src.engine import training as _training
    from tf_keras.src.engine.functional import Functional
    from tf_keras.src.optimizers.optimizer_v1 import TFOptimizer as _TFOptimizer

    unpack_x_y_sample_weight = _data_adapter.unpack_x_y_sample_weight
    functional_init_arguments = _training.is_functional_model_init_params
    _loss_module = _model_module = _data_adapter_utils = None  # Keras 3's
else:
    import keras
    from keras.src.losses import loss as _loss_module
    from keras.src.models import model as _model_module
    from keras.src.models.functional import Functional
    from keras.src.trainers.data_adapters import (
        data_adapter_utils as _data_adapter_utils,
    )

    unpack_x_y_sample_weight = _data_adapter_utils.unpack_x_y_sample_weight
    functional_init_arguments = _model_module.functional_init_arguments
    _training = _TFOptimizer = _data_adapter = None  # tf-keras'

__all__ = [  # also what the other `_compat` modules import from here
    "CONVERTS_OPTIONAL_INPUTS",
    "EPOCH_ITERATOR_YIELDS_STEP_RANGE",
    "FLAVOUR",
    "Functional",
    "IS_LEGACY",
    "KERAS_RELEASE",
    "KERAS_VERSION",
    "REPEATS_DISTRIBUTED_INPUT",
    "TF_RELEASE",
    "functional_init_arguments",
    "keras",
    "release",
    "unpack_x_y_sample_weight",
    "_TFOptimizer",
    "_data_adapter",
    "_data_adapter_utils",
    "_loss_module",
    "_model_module",
    "_training",
]

FLAVOUR = "tf-keras" if IS_LEGACY else "keras3"
KERAS_VERSION = keras.__version__


def release(version):
    """The `(major, minor)` release of a version string like `"3.10.0"`."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


TF_RELEASE = release(tf.__version__)
KERAS_RELEASE = release(KERAS_VERSION)

# Keras 3 internals that changed within the tested range (docs/versions.md),
# keyed by the release that changed them. tests/compat/test_versions.py
# checks each key against the installed Keras. tf-keras 2.19-2.21 and
# TF 2.19-2.21 need none.

# Keras 3.11 (keras/src/trainers/epoch_iterator.py, `_enumerate_iterator`):
# iterating an epoch iterator gives `(begin_step, end_step, iterator)`;
# Keras 3.10 gives `(step, iterator)`.
EPOCH_ITERATOR_YIELDS_STEP_RANGE = not IS_LEGACY and KERAS_RELEASE >= (3, 11)

# Keras 3.12 (keras-team/keras#21548): optional inputs fed None reach the
# step as empty `tf.experimental.Optional`s, which the train function turns
# back into None (`TensorFlowTrainer._autoconvert_optionals`). Keras 3.10
# and 3.11 have neither.
CONVERTS_OPTIONAL_INPUTS = not IS_LEGACY and KERAS_RELEASE >= (3, 12)


# tf-keras never re-iterates a distributed dataset: each epoch continues the
# same iterator, so it wants a repeated dataset and the steps per epoch
# (`steps_per_epoch`, `validation_steps`, `steps`). Keras 3 iterates the
# dataset again each epoch.
REPEATS_DISTRIBUTED_INPUT = IS_LEGACY
