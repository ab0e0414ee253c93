"""This process's devices, what they are, and how fast each is alone.

Speed is the rate of a float32 matmul sized so one run takes about
`TARGET_SECONDS` on the device, timed from the host: each run ends with a
host copy of one element of its result, so an accelerator's asynchronous
execution is counted (a host clock around an enqueued kernel reads the time
to enqueue it).
"""

import math
import statistics
import time

import tensorflow as tf

from keras_hetero import _distribute
from keras_hetero import devices as devices_lib
from keras_hetero.doctor.report import DeviceReport

TARGET_SECONDS = 0.02
MIN_SIZE = 64
MAX_SIZE = 8192
REPEATS = 7
# Device types that run no user ops.
_SKIPPED_TYPES = ("TPU_SYSTEM",)


def local_devices(devices=None, task=None):
    """Names of this task's logical devices, or of those `devices` names.

    Args:
        devices: Device names or patterns (`"CPU:1"`, `"GPU"`, a full
            name); None for all. Defaults to `None`.
        task: This task's `/job:NAME/task:INDEX` under a cluster, whose
            devices count as local (the others' are listed too once a
            cluster runs). Defaults to `None`.

    Returns:
        A list of full device names, in TensorFlow's order (or in the order
        of `devices`).

    Raises:
        ValueError: If `devices` is empty or an entry names no local
            device.
        TypeError: If `devices` is not a list of strings.
    """
    local = [
        device.name
        for device in tf.config.list_logical_devices()
        if device.device_type not in _SKIPPED_TYPES
        and _is_this_task(device.name, task)
    ]
    if devices is None:
        return local
    if (
        isinstance(devices, str)
        or not isinstance(devices, (list, tuple))
        or not all(isinstance(pattern, str) for pattern in devices)
    ):
        raise TypeError(
            "Invalid value for argument `devices`. Received: "
            f"devices={devices!r}. Expected a list of device names, e.g. "
            '["/device:CPU:0", "GPU:1"].'
        )
    if not devices:
        raise ValueError(
            "Invalid value for argument `devices`. Received: devices=[]. "
            f"Expected at least one of this process's devices: {local}."
        )
    chosen = []
    for pattern in devices:
        matches = [
            name for name in local if _distribute.device_matches(pattern, name)
        ]
        if not matches:
            raise ValueError(
                "Invalid value for argument `devices`. Received: "
                f"devices={list(devices)!r}: {pattern!r} names no device "
                f"of this process. Its devices: {local}."
            )
        chosen.extend(name for name in matches if name not in chosen)
    return chosen


def _is_this_task(name, task):
    spec = tf.DeviceSpec.from_string(name)
    if spec.job in (None, "localhost"):
        return True
    if task is None:
        return False
    own = tf.DeviceSpec.from_string(task)
    return spec.job == own.job and (spec.task or 0) == (own.task or 0)


def describe(name, host):
    """A `DeviceReport` of device `name` without timings, from its
    description (`keras_hetero.devices.describe`, which precision "auto"
    reads too).

    Args:
        name: A full logical device name.
        host: The `HostReport` of this machine (a CPU device's memory).

    Returns:
        A `DeviceReport`.
    """
    device = devices_lib.describe(name, cpu_memory_bytes=host.memory_bytes)
    description = device.model
    if device.compute_capability is not None:
        major, minor = device.compute_capability
        description += f" (cc {major}.{minor})"
    if device.emulated:
        description += " [emulated]"
    return DeviceReport(
        name=name,
        kind=device.kind,
        description=description,
        compute_capability=device.compute_capability,
        memory_bytes=device.memory_bytes,
        bfloat16=device.bfloat16,
    )


def available_memory(device, host, cpu_devices):
    """Bytes free for a model on `device` now, or None if unknown.

    Args:
        device: A `DeviceReport`.
        host: The `HostReport` (a CPU's memory is the host's).
        cpu_devices: How many of the listed devices are CPUs (logical CPUs
            share the host's memory).

    Returns:
        An int or None.
    """
    if device.kind == "CPU":
        if host.available_memory_bytes is None:
            return None
        return host.available_memory_bytes // max(cpu_devices, 1)
    return devices_lib.free_memory(device.name, device.memory_bytes)


def time_matmuls(names, target_seconds=TARGET_SECONDS, repeats=REPEATS):
    """Float32 matmul FLOP/s of each device, host-synchronised.

    For each device, doubles `n` from `MIN_SIZE` until one `n x n` matmul
    takes an eighth of `target_seconds`, then scales `n` to take about
    `target_seconds` (at most `MAX_SIZE`). The timed runs go round the
    devices `repeats` times (after a warm-up round), so a burst of other
    load on the host falls on all of them alike; each device's median
    counts.

    Args:
        names: Device names.
        target_seconds: About how long one timed run takes. Defaults to
            `TARGET_SECONDS`.
        repeats: Timed rounds. Defaults to `REPEATS`.

    Returns:
        A list of `(flops, n)`, one per device: FLOP/s and the size timed.
    """
    sizes = [_calibrated_size(name, target_seconds) for name in names]
    operands = [_operands(name, size) for name, size in zip(names, sizes)]
    timings = [[] for _ in names]
    for run in range(repeats + 1):
        for name, operand, timing in zip(names, operands, timings):
            seconds = _matmul_seconds(name, *operand)
            if run:
                timing.append(seconds)
    return [
        (2.0 * size**3 / statistics.median(timing), size)
        for size, timing in zip(sizes, timings)
    ]


def _calibrated_size(name, target_seconds):
    size = MIN_SIZE
    while True:
        operands = _operands(name, size)
        _matmul_seconds(name, *operands)  # warm-up
        seconds = min(_matmul_seconds(name, *operands) for _ in range(2))
        if seconds >= target_seconds / 8 or size >= MAX_SIZE:
            break
        size *= 2
    scale = (target_seconds / max(seconds, 1e-9)) ** (1 / 3)
    return int(min(MAX_SIZE, max(MIN_SIZE, round(size * scale / 64) * 64)))


def _operands(name, size):
    with tf.device(name):
        return (
            tf.random.uniform([size, size], dtype=tf.float32),
            tf.random.uniform([size, size], dtype=tf.float32),
        )


def _matmul_seconds(name, left, right):
    """Seconds of one matmul on `name`, until its result reached the
    host."""
    with tf.device(name):
        start = time.perf_counter()
        product = tf.linalg.matmul(left, right)
        # The host copy waits until the device has run the matmul.
        product[0, 0].numpy()
        return time.perf_counter() - start


def relative_speeds(speeds):
    """Each speed over the fastest (fastest = 1.0); NaN stays NaN."""
    finite = [s for s in speeds if s is not None and math.isfinite(s)]
    fastest = max(finite, default=0.0)
    return [
        s / fastest
        if fastest > 0 and s is not None and math.isfinite(s)
        else math.nan
        for s in speeds
    ]
