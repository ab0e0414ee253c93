"""What the planners know of a model on devices: each layer's seconds,
weight and activation bytes, and each device's speed and memory -- given,
measured (`kh.placement.profile`) or estimated from FLOPs."""

import math
from typing import NamedTuple

import numpy as np

from keras_hetero._checks import check_int
from keras_hetero.placement.profiling import Profile
from keras_hetero.placement.profiling import common_scale
from keras_hetero.placement.profiling import itemsize
from keras_hetero.placement.profiling import profile
from keras_hetero.placement.profiling import weight_bytes

# A speed-1.0 device's rate for estimated costs, and the link between
# devices (about PCIe 4.0 x16 in practice).
DEFAULT_FLOPS_PER_SECOND = 1e11
DEFAULT_BANDWIDTH = 1e10
# Training keeps weights, their gradients and two optimizer slots (Adam).
PARAMETER_COPIES = 4
# Backward costs about twice the forward pass.
TRAINING_FLOP_FACTOR = 3


class CostModel(NamedTuple):
    """What the search needs of a model on devices, per layer and device."""

    costs: list  # seconds per layer on a speed-1.0 device
    device_costs: list  # seconds per layer on each device, or None
    speeds: list
    memory: list  # bytes per device, None for no limit
    weight_bytes: list  # per layer
    output_bytes: list  # per layer, for the batch


def cost_model(
    model,
    chain,
    devices,
    device_speeds,
    device_memory,
    layer_costs,
    profile,
    batch_size,
    flops_per_second,
):
    """Costs, speeds and memory: given, else measured, else estimated."""
    names = [layer.name for layer, _ in chain]
    measured = checked_profiles(profile, names)
    if batch_size is None:
        batch_size = measured[0].batch_size if measured else 32
    batch_size = check_int("batch_size", batch_size)
    speeds = _per_device("device_speeds", device_speeds, devices, None)
    memory = _per_device("device_memory", device_memory, devices, None)
    entries = [
        (name, speed, limit, device_memory is not None)
        for name, speed, limit in zip(devices, speeds, memory)
    ]
    sizes = layer_sizes(chain, batch_size, measured)
    if measured is None:
        costs = seconds_per_layer(
            model, chain, layer_costs, profile, batch_size, flops_per_second
        )
        resolved = [resolve_device(*entry, None) for entry in entries]
    else:
        (seconds,), (measured_speeds,), costs = common_scale(
            measured, batch_size
        )
        if layer_costs is not None:
            costs = given_costs(names, layer_costs)
        resolved = resolve_devices(
            entries, measured[0], seconds, measured_speeds, "devices"
        )
    return cost_model_of(costs, resolved, layer_costs is None, *sizes)


def cost_model_of(costs, resolved, measured_costs, weights, outputs):
    """A `CostModel` of devices `(speed, memory, seconds or None)`."""
    speeds = [speed for speed, _, _ in resolved]
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(
            "Invalid value for argument `device_speeds`. Received: "
            f"device_speeds={speeds!r}. Expected positive numbers."
        )
    device_costs = None
    if measured_costs and any(seconds for _, _, seconds in resolved):
        device_costs = [
            [cost / speed for cost in costs] if seconds is None else seconds
            for speed, _, seconds in resolved
        ]
    return CostModel(
        costs=costs,
        device_costs=device_costs,
        speeds=speeds,
        memory=[None if m is None else int(m) for _, m, _ in resolved],
        weight_bytes=weights,
        output_bytes=outputs,
    )


def resolve_device(
    name, speed, memory, memory_given, measured, seconds=None, speeds=None
):
    """`(speed, memory, measured seconds per layer or None)` of a device;
    None if neither its speed is given nor `measured` profiled it.
    `seconds` and `speeds` are `measured`'s on the common scale."""
    if measured is None:
        return (1.0 if speed is None else speed), memory, None
    found = measured.find_device(name)
    if not memory_given:
        memory = None if found is None else measured.device_memory[found]
    if speed is not None:
        return speed, memory, None
    if found is None:
        return None
    return speeds[found], memory, seconds[found]


def resolve_devices(entries, measured, seconds, speeds, argument):
    """`resolve_device` of each `(name, speed, memory, memory given)` entry;
    raises naming `argument` if the profile lacks a device without speed."""
    resolved = [
        resolve_device(*entry, measured, seconds, speeds) for entry in entries
    ]
    missing = [e[0] for e, found in zip(entries, resolved) if found is None]
    if missing:
        raise ValueError(
            f"Invalid value for argument `{argument}`. Received: the "
            f"devices {missing}, which the profile did not measure (it has "
            f"{measured.devices}). Expected profiled devices, or the "
            "devices' speeds."
        )
    return resolved


def layer_sizes(chain, batch_size, measured):
    """`(weight bytes, output bytes for batch_size rows)` per layer."""
    if measured is None:
        return (
            [weight_bytes(layer) for layer, _ in chain],
            [_output_bytes(output, batch_size) for _, output in chain],
        )
    # Activations grow with the rows (an approximation when `batch_size`
    # is not the profile's).
    first = measured[0]
    scale = batch_size / first.batch_size
    return (
        [first.param_bytes[layer.name] for layer, _ in chain],
        [
            round(first.activation_bytes[layer.name] * scale)
            for layer, _ in chain
        ],
    )


def checked_profiles(profile, names, workers=None):
    """The `Profile`s in `profile` (None for a bool), checked against the
    model's layers: one, or one per worker (`workers` of them) if a list."""
    if isinstance(profile, bool):
        return None
    several = isinstance(profile, (list, tuple)) and workers is not None
    profiles = list(profile) if several else [profile]
    if not all(isinstance(p, Profile) for p in profiles):
        expected = "a `kh.placement.Profile` (from `kh.placement.profile`)"
        if workers is not None:
            expected += ", a list of them (one per worker)"
        raise TypeError(
            "Invalid value for argument `profile`. Received: "
            f"profile={profile!r}. Expected {expected}, True or False."
        )
    if several and len(profiles) != workers:
        raise ValueError(
            "Invalid value for argument `profile`. Received: "
            f"{len(profiles)} profiles. Expected one per worker ({workers})."
        )
    for measured in profiles:
        if list(measured.layer_names) != names:
            raise ValueError(
                "Invalid value for argument `profile`. Received: a profile "
                f"of the layers {measured.layer_names}. Expected one of "
                f"this model's layers, {names}."
            )
    return profiles if several else profiles * (workers or 1)


def seconds_per_layer(
    model, chain, layer_costs, profile, batch_size, flops_per_second
):
    """Seconds per layer on a speed-1.0 device (given, profiled, estimated)."""
    names = [layer.name for layer, _ in chain]
    if layer_costs is not None:
        return given_costs(names, layer_costs)
    if profile:
        return _profiled_seconds(model, names, batch_size)
    return [
        TRAINING_FLOP_FACTOR
        * _flops(layer, output, batch_size)
        / flops_per_second
        for layer, output in chain
    ]


def given_costs(names, layer_costs):
    """`layer_costs[name]` for each of `names`; raises if one is missing."""
    missing = sorted(set(names) - set(layer_costs))
    if missing:
        raise ValueError(
            "Invalid value for argument `layer_costs`. Received: no "
            f"cost for layers {missing}. Expected seconds for every "
            f"layer of {names}."
        )
    return [float(layer_costs[name]) for name in names]


def _per_device(name, values, devices, default):
    if values is None:
        return [default] * len(devices)
    values = list(values)
    if len(values) != len(devices):
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}="
            f"{values!r}. Expected one entry per device ({len(devices)})."
        )
    return [None if v is None else float(v) for v in values]


def _shape(tensor, batch_size):
    return [batch_size if d is None else int(d) for d in tensor.shape]


def _output_bytes(output, batch_size):
    return int(np.prod(_shape(output, batch_size)) * itemsize(output.dtype))


def _flops(layer, output, batch_size):
    """Forward floating-point operations of `layer` for `batch_size` rows."""
    shape = _shape(output, batch_size)
    elements = int(np.prod(shape))
    weights = sum(int(np.prod(w.shape)) for w in layer.trainable_weights)
    if weights == 0:
        return float(elements)
    # A multiply-add per weight at every output position (a dense layer
    # has one per row, a convolution one per row and pixel).
    positions = elements // max(shape[-1], 1)
    return 2.0 * weights * positions


def _profiled_seconds(model, names, batch_size, repeats=5):
    """Median seconds of each layer's forward + backward on this machine's
    first GPU (else its CPU), on random inputs."""
    import tensorflow as tf

    spec = model.inputs[0]
    shape = _shape(spec, batch_size)
    if tf.as_dtype(spec.dtype).is_floating:
        values = tf.random.normal(shape, dtype=spec.dtype)
    else:
        values = tf.zeros(shape, dtype=spec.dtype)
    device = (
        tf.config.list_logical_devices("GPU")
        or tf.config.list_logical_devices("CPU")
    )[0].name
    measured = profile(model, [device], values, repeats=repeats, warmup=1)
    return [measured.seconds[device][name] for name in names]
