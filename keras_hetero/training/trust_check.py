"""The trust check: a replica's work timed from the host, synchronised.

The in-step clock (`telemetry.clock`) is device time by construction, and
`ClockCheck` watches its readings for signs of blindness. Two equally blind
devices (clocks that see only the queueing of their kernels) show none of
those signs: their readings are plausible, equal, and nothing moves for the
rows test to see. What tells them apart is the same work timed another way:
from the host, a `tf.function` computing the forward pass, loss and
gradients on the replica's device and returning a host copy of one element
of each gradient, so the time includes the device finishing them; the
host's round trip to the device (the same function shape doing nothing) is
subtracted. Each takes the least of a few runs: other load on the host only
ever adds time.

`kh.doctor` runs it once per device on a copy of the model;
`ShardRebalancer` runs it during `fit` every few hundred steps on one
replica at a time (`ClockCheck.compare` judges the two timings).
"""

import time

import numpy as np
import tensorflow as tf

from keras_hetero import _compat


def random_batch(model, rows):
    """`(x, y)` of `rows` random rows shaped like `model`'s inputs and
    outputs (integer labels in `[0, classes)` for a sparse loss).

    Args:
        model: A compiled `keras.Model` with symbolic inputs.
        rows: The rows.

    Returns:
        `(x, y)` numpy structures, or None if `model` has no symbolic
        inputs to shape them by.
    """
    inputs, outputs = _compat.symbolic_inputs_outputs(model)
    if inputs is None:
        return None
    generator = np.random.default_rng(0)
    sparse = "sparse" in str(compile_config(model).get("loss")).lower()

    def features(tensor):
        shape = [rows, *(d or 1 for d in tensor.shape[1:])]
        dtype = tf.as_dtype(tensor.dtype)
        if dtype.is_floating:
            return generator.standard_normal(shape).astype(dtype.as_numpy_dtype)
        return np.zeros(shape, dtype.as_numpy_dtype)

    def labels(tensor):
        shape = [rows, *(d or 1 for d in tensor.shape[1:])]
        if sparse:
            return generator.integers(0, max(shape[-1], 1), shape[:-1])
        return generator.random(shape).astype(np.float32)

    x = tf.nest.map_structure(features, inputs)
    y = tf.nest.map_structure(labels, outputs)
    return x, y


def compile_config(model):
    """`model`'s compile config, or `{}`."""
    try:
        return model.get_compile_config() or {}
    except (AttributeError, ValueError):
        return {}


def host_timed(model, arrays, device, training=True):
    """Two functions, each returning the host-synchronised seconds of one
    call: forward, loss and gradients on `device`; and the host's round
    trip to it (a host copy of one input element).

    Args:
        model: A compiled `keras.Model`.
        arrays: `(x, y)` or `(x, y, sample_weight)` numpy structures.
        device: The device name.
        training: True: the forward pass in training mode and the
            compiled loss (on a copy of the model, as the doctor times).
            False (during `fit`, on the model being trained) leaves its
            state as it is: inference mode (no batch-norm statistics move)
            and, for the loss, the sum of the predictions (the compiled
            loss would update the loss metrics; the backward pass costs
            the same through the network). Defaults to `True`.

    Returns:
        `(gradients, round_trip)`: functions of no arguments.
    """
    with tf.device(device):
        placed = tf.nest.map_structure(tf.convert_to_tensor, arrays)
    x, y, sample_weight = (*placed, None)[:3]

    @tf.function(reduce_retracing=True)
    def gradients(x, y, sample_weight):
        with tf.device(device):
            with tf.GradientTape() as tape:
                predictions = model(x, training=training)
                if training:
                    loss = model.compute_loss(x, y, predictions, sample_weight)
                else:
                    loss = _sum(predictions)
            grads = tape.gradient(loss, _on_device(model, device))
            return _first_elements([loss, *grads])

    @tf.function(reduce_retracing=True)
    def round_trip(x, y, sample_weight):
        with tf.device(device):
            return _first_elements(tf.nest.flatten(x))

    def timed(function):
        function(x, y, sample_weight).numpy()  # traces

        def seconds():
            start = time.perf_counter()
            function(x, y, sample_weight).numpy()
            return time.perf_counter() - start

        return seconds

    return timed(gradients), timed(round_trip)


def host_seconds(model, arrays, device, repeats=3, training=False):
    """Host-synchronised seconds of forward, loss and gradients of
    `arrays` on `device`, minus the host's round trip: the least of
    `repeats` runs of each (see `host_timed`).

    Args:
        model: A compiled `keras.Model`.
        arrays: `(x, y)` or `(x, y, sample_weight)` numpy structures.
        device: The device name.
        repeats: Runs of each. Defaults to `3`.
        training: See `host_timed`. Defaults to `False`.

    Returns:
        Seconds (a float >= 0).
    """
    gradients, round_trip = host_timed(model, arrays, device, training)
    steps = [gradients() for _ in range(repeats)]
    trips = [round_trip() for _ in range(repeats)]
    return max(min(steps) - min(trips), 0.0)


def _sum(predictions):
    return tf.add_n(
        [
            tf.reduce_sum(tf.cast(tensor, tf.float32))
            for tensor in tf.nest.flatten(predictions)
        ]
    )


def _on_device(model, device):
    """`model`'s trainable variables as read on `device`: under a strategy
    with a copy per device (MirroredStrategy), that device's copy (the one
    a read under `tf.device(device)` takes, and the tape sees)."""
    wanted = tf.DeviceSpec.from_string(device)
    variables = []
    for variable in model.trainable_variables:
        variable = _compat.distributed_variable(variable)
        copies = getattr(variable, "values", None) or (variable,)
        variables.append(
            next(
                (copy for copy in copies if _same_device(copy.device, wanted)),
                copies[0],
            )
        )
    return variables


def _same_device(name, wanted):
    spec = tf.DeviceSpec.from_string(name or "")
    return (spec.device_type or "").upper() == (
        wanted.device_type or ""
    ).upper() and spec.device_index == wanted.device_index


def _first_elements(tensors):
    """A float32 sum of one element of each tensor: its host copy exists
    only once the device computed them all."""
    pieces = []
    for tensor in tensors:
        if isinstance(tensor, tf.IndexedSlices):
            tensor = tensor.values
        if tensor is not None:
            pieces.append(tf.cast(tf.reshape(tensor, [-1])[:1], tf.float32))
    return tf.reduce_sum(tf.concat(pieces, 0))
