"""A model's step on each device alone, and the check of the in-step clock.

For each device the model is copied under `tf.distribute.OneDeviceStrategy`
and timed twice for the same work (forward pass, loss and gradients of one
batch):

- from the host, synchronised (`keras_hetero.training.trust_check`, which
  `ShardRebalancer` also runs during `fit`): a `tf.function` computing the
  gradients returns a host copy of one element of each, so the time
  includes the device finishing them; the host's round trip to the device
  (the same function shape doing nothing) is subtracted;
- by `HeteroModel`'s in-step clock (`model.step_stats.compute_seconds`)
  during a `fit` of a few steps.

Each takes the least of several runs: other load on the host only ever
adds time, so the least is the most repeatable reading of each.

If the clock reads under half of the host's time, it does not see the
device's work (a clock ordered after enqueued kernels, not finished ones),
and everything that reads `step_stats` (ShardRebalancer, StragglerDetector)
would misjudge that device.
"""

import dataclasses
import os
import warnings

import numpy as np
import tensorflow as tf

from keras_hetero._compat import keras
from keras_hetero.balancing import memory
from keras_hetero.training import trust_check

# Rounds of REPEATS host-synchronised calls and a `fit` of FIT_STEPS steps
# (read by the in-step clock).
ROUNDS = 3
REPEATS = 3
FIT_STEPS = 3
DEFAULT_BATCH_SIZE = 32


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One device's timings of the model's step (see the module docstring).

    Attributes:
        step_seconds: Host-synchronised seconds of forward, loss and
            gradients, minus the host's round trip.
        clock_seconds: The least in-step clock reading over the `fit` steps
            (the first one left out: it warms up).
        state_bytes: Weights, gradients and optimizer state, in bytes.
        activation_bytes_per_row: Estimated bytes per row, or None.
    """

    step_seconds: float
    clock_seconds: float
    state_bytes: int
    activation_bytes_per_row: int = None


def check(model):
    """Refuses a `model` argument the doctor cannot time, before any work.

    Args:
        model: A compiled `keras.Model`, or the path of a saved `.keras`
            (or `.h5`) model.

    Raises:
        ValueError: If the path does not exist or the model is not
            compiled.
        TypeError: If `model` is neither a model nor a path.
    """
    if isinstance(model, (str, os.PathLike)):
        if not os.path.exists(model):
            raise ValueError(
                "Invalid value for argument `model`. Received: "
                f"model={str(model)!r}, which does not exist. Expected a "
                "compiled keras.Model or the path of a saved .keras model."
            )
        return
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Invalid value for argument `model`. Received: "
            f"model={model!r} of type {type(model).__name__}. Expected a "
            "compiled keras.Model or the path of a saved .keras model."
        )
    if not trust_check.compile_config(model):
        raise ValueError(
            "Invalid value for argument `model`. Received: "
            f"model={model.name!r}, which is not compiled. Compile it (the "
            "doctor times its train step) before passing it."
        )


def load(model):
    """`model` as a compiled Keras model: itself, or loaded from its path.

    Args:
        model: What `check` accepted.

    Returns:
        A `keras.Model`.

    Raises:
        ValueError: If the loaded model is not compiled.
    """
    if isinstance(model, (str, os.PathLike)):
        with warnings.catch_warnings():
            # Keras 3 before the optimizer is built; the doctor times
            # copies with fresh optimizers anyway.
            warnings.filterwarnings(
                "ignore", message="Skipping variable loading for optimizer"
            )
            model = keras.models.load_model(model)
    check(model)
    return model


def batch_arrays(model, batch):
    """`(x, y)` or `(x, y, sample_weight)` as numpy structures.

    Args:
        model: A compiled `keras.Model`.
        batch: `(x, y)` / `(x, y, sample_weight)`, or an int: that many
            rows of random data shaped like the model's inputs and outputs
            (integer labels in `[0, classes)` for a sparse loss). None is
            `DEFAULT_BATCH_SIZE` random rows.

    Returns:
        A tuple of numpy structures and the batch's rows.

    Raises:
        ValueError: If `batch` is neither, or random data cannot be shaped
            for `model` (it has no symbolic inputs).
    """
    if batch is None:
        batch = DEFAULT_BATCH_SIZE
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, bool):
        if batch < 1:
            raise ValueError(
                "Invalid value for argument `batch`. Received: "
                f"batch={batch!r}. Expected (x, y) or a positive row count."
            )
        return _random_batch(model, int(batch)), int(batch)
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            "Invalid value for argument `batch`. Received: "
            f"batch of type {type(batch).__name__}. Expected (x, y), "
            "(x, y, sample_weight) or a positive row count."
        )
    arrays = tuple(tf.nest.map_structure(np.asarray, part) for part in batch)
    rows = int(tf.nest.flatten(arrays[0])[0].shape[0])
    return arrays, rows


def _random_batch(model, rows):
    batch = trust_check.random_batch(model, rows)
    if batch is None:
        raise ValueError(
            "Invalid value for argument `batch`. Received: "
            f"batch={rows}, but model {model.name!r} has no symbolic inputs "
            "to shape random data by. Pass batch=(x, y) instead."
        )
    return batch


def time_step(model, arrays, device):
    """`StepTiming` of `model`'s step on `device` alone.

    Args:
        model: A compiled `keras.Model` (copied; its weights are not used).
        arrays: `(x, y)` or `(x, y, sample_weight)` numpy structures.
        device: The device name.

    Returns:
        A `StepTiming`.
    """
    strategy = tf.distribute.OneDeviceStrategy(device)
    with strategy.scope():
        hetero = _copy(model)
    fit_steps = _fit_readings(hetero, arrays)
    gradients, round_trip = trust_check.host_timed(hetero, arrays, device)
    # The first step of the first fit warms up.
    clock_readings = fit_steps()[1:]
    step_timings, trip_timings = [], []
    # Rounds of both, so that a burst of other load on the host meets both.
    for _ in range(ROUNDS):
        for _ in range(REPEATS):
            step_timings.append(gradients())
            trip_timings.append(round_trip())
        clock_readings += fit_steps()
    return StepTiming(
        step_seconds=max(min(step_timings) - min(trip_timings), 0.0),
        clock_seconds=min(clock_readings),
        state_bytes=memory.state_bytes(hetero),
        activation_bytes_per_row=memory.activation_bytes_per_row(hetero),
    )


def _copy(model):
    """A compiled HeteroModel like `model`, made in the current scope."""
    from keras_hetero.model import HeteroModel

    clone = keras.models.clone_model(model)
    if not isinstance(clone, HeteroModel):
        clone = HeteroModel.from_model(clone)
    clone.compile_from_config(model.get_compile_config())
    return clone


def _fit_readings(hetero, arrays):
    """A function that fits `FIT_STEPS` steps of the batch and returns the
    in-step clock's reading of each."""
    rows = int(tf.nest.flatten(arrays[0])[0].shape[0])
    readings = []

    class Readings(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            readings.append(float(hetero.step_stats.compute_seconds[0]))

    repeated = tuple(
        tf.nest.map_structure(
            lambda array: np.concatenate([array] * FIT_STEPS), part
        )
        for part in arrays
    )

    def fit_steps():
        readings.clear()
        hetero.fit(
            *repeated[:2],
            sample_weight=repeated[2] if len(repeated) > 2 else None,
            batch_size=rows,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[Readings()],
        )
        return list(readings)

    return fit_steps
