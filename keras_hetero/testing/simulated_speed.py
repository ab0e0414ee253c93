"""`SimulatedSpeed`: an identity layer that makes a replica look slow."""

import collections
import threading
import time

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._compat import keras

# One lock per simulated device: a device does one thing at a time, so two
# sleeps on one device (two micro-batches of a pipeline stage, two slow
# layers in parallel branches) take the sum of their times.
_DEVICE_LOCKS = collections.defaultdict(threading.Lock)


def _sleep(rows, replica, layer, where):
    seconds = layer.seconds_for(int(replica), where["device"]) * int(rows)
    if seconds > 0:
        with _DEVICE_LOCKS[where["device"]]:
            time.sleep(seconds)
    return np.float32(0.0)


@_compat.register_serializable("SimulatedSpeed")
class SimulatedSpeed(keras.layers.Layer):
    """Identity layer that sleeps `rows * seconds_per_row` for its replica.

    A simulation of a slow device, for tests and benchmarks: put it in a
    model and each replica's forward pass takes longer in proportion to its
    rows. Replicas' sleeps overlap as real devices would (the sleep is a
    stateless `numpy_function` whose output feeds the layer's result, so
    TensorFlow does not serialise it), and a device does one thing at a
    time: two sleeps on one device (two micro-batches of a pipeline stage)
    queue. A dict of speeds is looked up by the device the layer runs on,
    so inside a `kh.layers.Placed` stage `{"CPU:1": 0.002}` slows that
    stage. Assign `seconds_per_row` at any time, also during `fit`, to
    simulate a slowdown.

    Args:
        seconds_per_row: A float for every replica; a list with one float per
            global replica; or a dict `{device name: float}` where names are
            matched on the parts the name gives (device type and index, job,
            task), e.g. `{"CPU:1": 0.002}` or `{"/job:worker/task:1": 0.002}`
            (a ParameterServerStrategy worker). Replicas not in the dict do
            not sleep. Under ParameterServerStrategy a list indexes workers
            and the speeds are read when the step is traced.
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

    def seconds_for(self, replica, device=None):
        """Seconds per row for global replica index `replica`.

        A dict of speeds is looked up by `device` when given (the device the
        sleep runs on, e.g. a `kh.layers.Placed` stage's), else by the
        replica's device.
        """
        value = self._seconds_per_row
        if isinstance(value, list):
            return value[replica] if replica < len(value) else 0.0
        if isinstance(value, dict):
            if device is None:
                device = self._device_by_replica.get(replica)
            return _match_device(value, device)
        return value

    def call(self, inputs):
        worker = _distribute.parameter_server_worker_id()
        if worker is not None:
            return self._call_on_worker(inputs, worker)
        replica = _distribute.replica_id()
        where = {"device": None}
        if isinstance(replica, int):
            strategy = tf.distribute.get_strategy()
            devices = _distribute.global_replica_devices(strategy)
            self._device_by_replica[replica] = devices[replica]
            where["device"] = devices[replica]
        first = tf.nest.flatten(inputs)[0]
        rows = tf.shape(first)[0]
        # A stateless op whose inputs are all known when the step is traced
        # (a static batch size) is constant-folded away: feed it a piece of
        # the data too.
        probe = tf.reshape(first, [-1])[:1]
        delay = tf.numpy_function(
            lambda r, _: _sleep(r, replica, self, where),
            [rows, probe],
            tf.float32,
            stateful=False,
        )
        if not tf.executing_eagerly() and delay.op.device:
            # Traced under a device scope (a replica's, a Placed stage's):
            # the sleep belongs to that device.
            where["device"] = delay.op.device
        delay.set_shape([])
        return tf.nest.map_structure(
            lambda t: t + tf.cast(delay, t.dtype), inputs
        )

    def _call_on_worker(self, inputs, worker):
        # A parameter-server worker runs the step without this process's
        # Python: the sleep is a TensorFlow op there (a dataset that sleeps
        # before its element), and the speeds are fixed when the step is
        # traced (`seconds_per_row` indexes workers).
        strategy = tf.distribute.get_strategy()
        workers = _distribute.num_workers(strategy)
        for index in range(workers):
            self._device_by_replica[index] = (
                f"/job:worker/replica:0/task:{index}/device:CPU:0"
            )
        table = tf.constant(
            [self.seconds_for(index) for index in range(workers)], tf.float64
        )
        first = tf.nest.flatten(inputs)[0]
        rows = tf.cast(tf.shape(first)[0], tf.float64)
        microseconds = tf.cast(rows * tf.gather(table, worker) * 1e6, tf.int64)
        delay = tf.cast(_tf_sleep(microseconds), tf.float32)
        return tf.nest.map_structure(
            lambda t: t + tf.cast(delay, t.dtype), inputs
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        value = self._seconds_per_row
        return {**super().get_config(), "seconds_per_row": value}


def _tf_sleep(microseconds):
    """Sleeps in a TensorFlow op (on whatever device runs it); returns 0."""
    start = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
    variant = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(start),
        sleep_microseconds=microseconds,
        output_types=[tf.int64],
        output_shapes=[[]],
    )
    slept = tf.data.experimental.from_variant(variant, start.element_spec)
    return slept.take(1).get_single_element()


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
    for key, seconds in table.items():
        if _distribute.device_matches(key, device):
            return seconds
    return 0.0
