"""Rows per step that fit in a device's memory: the estimate that
`ShardRebalancer(max_rows="auto")` caps each replica's rows with, and that
`kh.doctor` reports as `max_rows`.

An ESTIMATE, the same everywhere it is used: the model's state (weights,
their gradients, the optimizer's variables) plus, per row, twice the bytes
of every layer's output (kept for the backward pass, and their gradients),
with `MEMORY_HEADROOM` of the device's memory left free. It leaves out
TensorFlow's and cuDNN's workspaces and a layer's inner temporaries, which
is what the headroom is for. A device's memory is its
`keras_hetero.devices.DeviceDescription.memory_bytes` (a GPU's, or the
host's for a CPU, shared by the worker's CPU replicas). Every input is the
same on every worker of a job (the devices are exchanged at the start of
`fit`, the model is the same), so every worker computes the same caps and
the shares stay identical. `auto_caps` is what the rebalancer calls.
"""

import logging

import numpy as np
import tensorflow as tf

from keras_hetero.training import state as state_lib

logger = logging.getLogger("keras_hetero")

# Memory left free when estimating the rows a device holds.
MEMORY_HEADROOM = 0.1


def state_bytes(model):
    """Bytes of `model`'s weights, their gradients and its optimizer's
    variables.

    Args:
        model: A `keras.Model` (compiled or not).

    Returns:
        An int.
    """
    optimizer = getattr(model, "optimizer", None)
    variables = getattr(optimizer, "variables", ()) or ()
    if callable(variables):
        variables = variables()
    return (
        tensor_bytes(model.weights)
        + tensor_bytes(model.trainable_weights)
        + tensor_bytes(variables)
    )


def activation_bytes_per_row(model):
    """Twice the bytes of every layer's output per row (kept for the
    backward pass, and their gradients), in the dtype each layer computes
    in: an estimate.

    Args:
        model: A `keras.Model`.

    Returns:
        An int, or None if no layer's output shape is known (a subclassed
        model, or a Sequential one without an input shape).
    """
    total = 0
    for layer in model.layers:
        try:
            outputs = tf.nest.flatten(layer.output)
        except (AttributeError, ValueError, RuntimeError):
            continue
        for output in outputs:
            shape = list(output.shape[1:])
            if any(d is None for d in shape):
                continue
            total += int(np.prod(shape)) * tf.as_dtype(output.dtype).size
    return 2 * total or None


def rows_that_fit(memory_bytes, state, bytes_per_row):
    """ESTIMATED rows per step that fit in `memory_bytes`.

    Leaves `MEMORY_HEADROOM` of the memory free, takes the model's state,
    and divides the rest by the bytes per row.

    Args:
        memory_bytes: The device's memory for this model, or None.
        state: Bytes of weights, gradients and optimizer state.
        bytes_per_row: Bytes each row needs, or None.

    Returns:
        An int >= 0, or None if a quantity is unknown.

    Example:

    >>> rows_that_fit(1000, 100, 8)  # (0.9 * 1000 - 100) / 8
    100
    """
    if memory_bytes is None or not bytes_per_row:
        return None
    free = memory_bytes * (1.0 - MEMORY_HEADROOM) - state
    return max(0, int(free // bytes_per_row))


def replica_memory(worker_devices):
    """Each replica's memory, in global replica order.

    Args:
        worker_devices: One list of `DeviceDescription`s per worker (by
            global worker index), its replica devices.

    Returns:
        A list of ints or None (unknown): a GPU's own memory; a CPU's is
        the host's, divided between the worker's CPU replicas.
    """
    memory = []
    for devices in worker_devices:
        cpus = sum(d.kind == "CPU" for d in devices)
        for device in devices:
            if device.memory_bytes is None:
                memory.append(None)
            elif device.kind == "CPU":
                memory.append(int(device.memory_bytes) // max(cpus, 1))
            else:
                memory.append(int(device.memory_bytes))
    return memory


def replica_caps(model, worker_devices):
    """Each replica's estimated rows per step (see the module docstring).

    Args:
        model: The model being trained (built: a layer's output shape is
            what the per-row estimate reads).
        worker_devices: As `replica_memory` takes.

    Returns:
        `(caps, bytes_per_row)`: a list with an int or None (unknown) per
        replica, and the per-row estimate (None if unknown: then every cap
        is None).
    """
    per_row = activation_bytes_per_row(model)
    state = state_bytes(model)
    caps = [
        rows_that_fit(memory, state, per_row)
        for memory in replica_memory(worker_devices)
    ]
    return caps, per_row


def auto_caps(model, dataset):
    """`ShardRebalancer(max_rows="auto")`'s caps for `dataset`'s replicas.

    Reads every worker's devices as the workers exchanged them at the
    start of this `fit` (`RunState.worker_devices`). Warns (logger
    `keras_hetero`) about each replica that holds more rows than its cap
    now, and instead of caps when they cannot hold the global batch.

    Args:
        model: The `HeteroModel` being trained (built).
        dataset: Its `kh.data.HeteroDataset`.

    Returns:
        `(caps, bytes_per_row)`: a list with an int or None (no cap) per
        replica (all None when the caps cannot hold the global batch), and
        the per-row estimate (or None).
    """
    replicas = dataset.num_replicas
    worker_devices = state_lib.run_state(model).worker_devices
    if not worker_devices or sum(map(len, worker_devices)) != replicas:
        return [None] * replicas, None
    caps, per_row = replica_caps(model, worker_devices)
    known = [c for c in caps if c is not None]
    total = dataset.global_batch_size
    if len(known) == replicas and sum(known) < total:
        logger.warning(
            "ShardRebalancer: the replicas' memory is estimated to hold %d "
            "rows per step together (%s), less than the global batch of %d; "
            "max_rows='auto' caps none of them. Give max_rows by hand, or a "
            "smaller global batch.",
            sum(known),
            " ".join(str(c) for c in caps),
            total,
        )
        return [None] * replicas, per_row
    for replica, (rows, cap) in enumerate(zip(dataset.rows, caps)):
        if cap is not None and rows > cap:
            logger.warning(
                "ShardRebalancer: replica %d (%s) has %d rows per global "
                "batch, more than its memory is estimated to hold (%d); it "
                "moves down now.",
                replica,
                device_text(model, replica),
                rows,
                cap,
            )
    return caps, per_row


def device_text(model, replica):
    """Replica `replica`'s device as a warning names it: its model name
    and memory (`"Tesla T4, 15.0 GiB"`)."""
    worker_devices = state_lib.run_state(model).worker_devices or []
    described = [d for devices in worker_devices for d in devices]
    if replica >= len(described):
        return "its device"
    device = described[replica]
    text = device.model
    if device.memory_bytes is not None:
        text += f", {device.memory_bytes / 2**30:.1f} GiB"
    return text


def tensor_bytes(tensors):
    """Bytes of `tensors` (variables or tensors of known shape), summed.

    Example:

    >>> tensor_bytes([tf.zeros((2, 3)), tf.zeros((4,), tf.float16)])
    32
    """
    return int(
        sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in tensors)
    )
