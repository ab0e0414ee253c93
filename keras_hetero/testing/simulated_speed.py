"""`SimulatedSpeed`: an identity layer that makes a replica look slow."""

import time

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._compat import keras


def _sleep(rows, replica, layer):
    seconds = layer.seconds_for(int(replica)) * int(rows)
    if seconds > 0:
        time.sleep(seconds)
    return np.float32(0.0)


@_compat.register_serializable("SimulatedSpeed")
class SimulatedSpeed(keras.layers.Layer):
    """Identity layer that sleeps `rows * seconds_per_row` for its replica.

    A simulation of a slow device, for tests and benchmarks: put it in a
    model and each replica's forward pass takes longer in proportion to its
    rows. Replicas' sleeps overlap as real devices would (the sleep is a
    stateless `numpy_function` whose output feeds the layer's result, so
    TensorFlow does not serialise it). Assign `seconds_per_row` at any time,
    also during `fit`, to simulate a slowdown.

    Args:
        seconds_per_row: A float for every replica; a list with one float per
            global replica; or a dict `{device name: float}` where names are
            matched on device type and index (and task, if given), e.g.
            `{"CPU:1": 0.002}`. Replicas not in the dict do not sleep.
            Defaults to `0.0`.
        **kwargs: What `keras.layers.Layer` takes.

    Raises:
        ValueError: If a value is negative or not a number.

    Example:

    >>> layer = SimulatedSpeed([0.0, 0.001])
    >>> layer.seconds_for(1)
    0.001
    """

    def __init__(self, seconds_per_row=0.0, **kwargs):
        super().__init__(**kwargs)
        self.seconds_per_row = seconds_per_row
        self.supports_masking = True

    @property
    def seconds_per_row(self):
        return self._seconds_per_row

    @seconds_per_row.setter
    def seconds_per_row(self, value):
        if isinstance(value, dict):
            checked = {
                str(k): _non_negative(v, value) for k, v in value.items()
            }
        elif isinstance(value, (list, tuple, np.ndarray)):
            checked = [_non_negative(v, value) for v in value]
        else:
            checked = _non_negative(value, value)
        # Bypass Keras attribute tracking: plain Python data, read at run time.
        object.__setattr__(self, "_seconds_per_row", checked)
        object.__setattr__(self, "_device_by_replica", {})

    def seconds_for(self, replica):
        """Seconds per row for global replica index `replica`."""
        value = self._seconds_per_row
        if isinstance(value, list):
            return value[replica] if replica < len(value) else 0.0
        if isinstance(value, dict):
            device = self._device_by_replica.get(replica)
            return _match_device(value, device)
        return value

    def call(self, inputs):
        replica = _distribute.replica_id()
        if isinstance(replica, int):
            strategy = tf.distribute.get_strategy()
            devices = _distribute.global_replica_devices(strategy)
            self._device_by_replica[replica] = devices[replica]
        first = tf.nest.flatten(inputs)[0]
        rows = tf.shape(first)[0]
        delay = tf.numpy_function(
            lambda r: _sleep(r, replica, self),
            [rows],
            tf.float32,
            stateful=False,
        )
        delay.set_shape([])
        return tf.nest.map_structure(
            lambda t: t + tf.cast(delay, t.dtype), inputs
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        value = self._seconds_per_row
        return {**super().get_config(), "seconds_per_row": value}


def _non_negative(value, whole):
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not np.isfinite(number) or number < 0:
        raise ValueError(
            "Invalid value for argument `seconds_per_row`. Received: "
            f"seconds_per_row={whole!r}. Expected non-negative numbers."
        )
    return number


def _match_device(table, device):
    if device is None:
        return 0.0
    spec = tf.DeviceSpec.from_string(device)
    for key, seconds in table.items():
        wanted = tf.DeviceSpec.from_string(
            key if key.startswith("/") else "/device:" + key
        )
        if (
            (wanted.device_type or "").upper()
            == (spec.device_type or "").upper()
            and wanted.device_index == spec.device_index
            and (wanted.task is None or wanted.task == spec.task)
        ):
            return seconds
    return 0.0
