"""`plan`: split a chain of layers into stages on (unequal) devices.

Each top-level layer gets a cost (seconds of forward + backward work on a
speed-1.0 device for one batch), a memory need and the bytes of its output
activations. A stage is a contiguous run of layers on one device; its time is
its cost divided by the device's speed plus the time to receive its input
activations. The planner picks which devices take stages, in which order,
and the split points, so that the slowest stage (the pipeline's bottleneck)
is as fast as possible and every stage fits its device's memory (exact
dynamic programs, `keras_hetero/placement/search.py`). The search is pure
Python, testable without TensorFlow; `plan` adapts it to a Keras model.
`profile` (`keras_hetero/placement/profiling.py`) measures the costs, speeds
and memory on the devices themselves.
"""

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from keras_hetero import layers as layers_lib
from keras_hetero._checks import check_int
from keras_hetero.layers import chain_layers
from keras_hetero.placement import search as _placement_search
from keras_hetero.placement.profiling import Profile
from keras_hetero.placement.profiling import common_scale as _common_scale
from keras_hetero.placement.profiling import itemsize as _itemsize
from keras_hetero.placement.profiling import profile
from keras_hetero.placement.profiling import weight_bytes as _weight_bytes

# A speed-1.0 device's rate for estimated costs, and the link between
# devices (about PCIe 4.0 x16 in practice).
DEFAULT_FLOPS_PER_SECOND = 1e11
DEFAULT_BANDWIDTH = 1e10
# Training keeps weights, their gradients and two optimizer slots (Adam).
PARAMETER_COPIES = 4
# Backward costs about twice the forward pass.
TRAINING_FLOP_FACTOR = 3


class Stage(NamedTuple):
    """One stage of a `Plan`: a device and the layers it runs, in order."""

    device: str
    layers: list


@dataclasses.dataclass(frozen=True)
class Plan:
    """A split of a model's layers into stages, one per device used.

    Attributes:
        stages: `Stage(device, [layer names])` per device used, in pipeline
            order.
        stage_seconds: Estimated seconds per stage and batch: compute on
            that device plus receiving the stage's input activations.
        stage_memory: Estimated bytes each stage needs on its device.
        device_memory: Each stage's device's memory limit in bytes, or None.
        device_speeds: Each stage's device's relative speed.
        unused_devices: The devices given to `plan` that hold no stage
            (leaving them out makes the pipeline no slower).
        method: How the split was found: `"exact"` or `"local search"`
            (see `plan`).
    """

    stages: list
    stage_seconds: list
    stage_memory: list
    device_memory: list
    device_speeds: list
    unused_devices: list = dataclasses.field(default_factory=list)
    method: str = "exact"

    @property
    def bottleneck(self):
        """Index of the slowest stage (the pipeline's pace)."""
        return int(np.argmax(self.stage_seconds))

    @property
    def bottleneck_seconds(self):
        """Estimated seconds of the slowest stage."""
        return max(self.stage_seconds)

    @property
    def total_seconds(self):
        """Estimated seconds for one batch through all stages in turn."""
        return sum(self.stage_seconds)

    def apply(self, model):
        """Writes each stage's device hint onto the model's layers.

        In place (`kh.layers.hint`): from the next trace on, every layer's
        forward and backward passes run on its stage's device, and the
        activations move between stages. The weights stay where they were
        created; for weights that live on their stage's devices, and hints
        that are saved with the model, use `kh.layers.place(model,
        plan.hints())`, which returns a copy of `Placed` layers.

        Args:
            model: The model this plan was made for.

        Returns:
            `model` (so `model = plan.apply(model)` reads naturally).

        Raises:
            ValueError: If `model`'s layers are not the planned ones.

        Example:

        >>> plan(model, ["/cpu:0", "/cpu:1"]).apply(model)
        """
        layers = chain_layers(model)
        names = [layer.name for layer in layers]
        planned = [name for stage in self.stages for name in stage.layers]
        if names != planned:
            raise ValueError(
                "Invalid value for argument `model`. Received: a model with "
                f"layers {names}. Expected the planned layers {planned}."
            )
        hints = self.hints()
        for layer in layers:
            layers_lib.hint(layer, **hints[layer.name])
        # Keras keeps traced step functions: trace again with the hints.
        for attribute in (
            "train_function",
            "test_function",
            "predict_function",
        ):
            if getattr(model, attribute, None) is not None:
                setattr(model, attribute, None)
        return model

    def hints(self):
        """`{layer name: {"device": ..., "stage": ...}}` of this plan.

        Returns:
            A dict, usable with `kh.layers.place(model, plan.hints())`.
        """
        return {
            name: {"device": stage.device, "stage": index}
            for index, stage in enumerate(self.stages)
            for name in stage.layers
        }

    def summary(self):
        """A text table of the stages; `*` marks the bottleneck.

        Returns:
            The table as a string.

        Example:

        >>> print(plan(model, ["/cpu:0", "/cpu:1"]).summary())
        """
        rows = [("stage", "device", "speed", "layers", "ms", "memory MiB")]
        for index, stage in enumerate(self.stages):
            mark = "*" if index == self.bottleneck else ""
            limit = self.device_memory[index]
            memory = f"{self.stage_memory[index] / 2**20:.2f}"
            if limit is not None:
                memory += f" / {limit / 2**20:.2f}"
            rows.append(
                (
                    f"{index}{mark}",
                    stage.device,
                    f"{self.device_speeds[index]:g}",
                    _layer_list(stage.layers),
                    f"{self.stage_seconds[index] * 1e3:.4g}",
                    memory,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths))
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(
            f"bottleneck: stage {self.bottleneck} "
            f"({self.bottleneck_seconds * 1e3:.4g} ms per batch); "
            f"all stages in turn: {self.total_seconds * 1e3:.4g} ms"
        )
        if self.unused_devices:
            lines.append(f"unused devices: {', '.join(self.unused_devices)}")
        return "\n".join(lines)


def plan(
    model,
    devices,
    device_speeds=None,
    device_memory=None,
    layer_costs=None,
    *,
    batch_size=None,
    profile=False,
    bandwidth=DEFAULT_BANDWIDTH,
    flops_per_second=DEFAULT_FLOPS_PER_SECOND,
    keep_order=False,
    use_all_devices=False,
    method="auto",
):
    """Splits a chain model's layers into contiguous stages on devices.

    Each top-level layer's cost is, by default, estimated from its weights
    and output shape (multiply-adds of a dense or convolutional layer, one
    operation per output element otherwise, times 3 for forward + backward)
    at `flops_per_second` on a speed-1.0 device; `profile=True` times each
    layer's forward and backward pass on this machine instead, and
    `layer_costs` gives them outright. Memory per layer is 4 copies of its
    weights (weights, gradients, two optimizer slots) plus its output
    activations for `batch_size` rows.

    `profile=kh.placement.profile(model, devices, batch)` gives measured
    values instead; explicit arguments win over it. Without
    `device_speeds` (or for its `None` entries) and `layer_costs`, a
    device's stage takes the seconds its layers took on that device, so a
    layer relatively faster on one device (a convolution on a GPU) counts
    so; with either given, stages take `layer_costs` (or
    `profile.layer_costs()`) over `device_speeds` (or
    `profile.device_speeds()`). Without `device_memory`, memory is the
    profile's; weights and activations are its measured bytes. With a
    `batch_size` other than the profile's, its seconds and activation
    bytes are scaled in proportion to the rows (an approximation: profile
    at the batch size you train with).

    The split minimises the slowest
    stage's time (cost / speed + its input activations' bytes / `bandwidth`)
    subject to every device's memory; among splits as fast, the one with the
    smallest sum of stage times, and among those the devices' given order
    with every device used if that is one of them.

    The search covers which device takes which stage (the order) and which
    devices take one at all (a very slow device can be worth leaving out):
    exactly, by dynamic programming over how many devices of each kind
    (equal speed and memory) hold the stages so far and where the last one
    ends, `O(states * kinds * layers^2)` with `prod(devices of a kind + 1)`
    states (`2^devices` if all differ; 200 layers on 8 different devices
    plan in about 0.1 s). Beyond 4096 states (e.g. 13 or more different
    devices) it is a local search instead (`plan.method == "local
    search"`): the fixed-order program, which may skip devices, from four
    starting orders (as given, fastest first, slowest first, most memory
    first), improved by swapping pairs of devices while that helps; on
    random 200-layer profiles over 8 different devices its bottleneck was
    within the gap `benchmarks/placement.py` prints of the exact one.
    `keep_order=True, use_all_devices=True` is the original planner: every
    device, in the given order (`O(layers^2 * devices)`).

    Args:
        model: A `keras.Sequential` or functional model with one input and
            one output whose top-level layers form a chain.
        devices: Device names. With `keep_order`, in pipeline order.
        device_speeds: Relative speed per device (2.0 = twice as fast); a
            `None` entry takes the profile's measurement (1.0 without a
            profile). Defaults to `None` (the profile's, or all 1.0).
        device_memory: Bytes available per device; a `None` entry for no
            limit. Defaults to `None` (the profile's, or no limits).
        layer_costs: `{layer name: seconds on a speed-1.0 device}` for every
            layer; given, nothing is estimated or profiled. Defaults to
            `None`.
        batch_size: Rows per batch for activation sizes, FLOPs and
            profiling. Defaults to `None` (the profile's batch size, or
            32).
        profile: A `kh.placement.Profile` of this model's layers on these
            devices (see above); or `True` to time each layer here (random
            inputs, on the first GPU or else the CPU: the same speed for
            every device) instead of estimating FLOPs. Defaults to `False`.
        bandwidth: Bytes per second between consecutive devices. Defaults
            to `1e10`.
        flops_per_second: Speed of a speed-1.0 device for estimated costs.
            Defaults to `1e11`.
        keep_order: Stages follow the order of `devices`. Defaults to
            `False` (the planner orders them).
        use_all_devices: Every device gets at least one layer. Defaults to
            `False` (the planner may leave devices out).
        method: `"auto"` (exact up to 4096 states, local search beyond),
            `"exact"` or `"local"`. Defaults to `"auto"`.

    Returns:
        A `Plan`.

    Raises:
        ValueError: If the model is not a chain; if `devices` is empty, or
            has more entries than the model has layers with
            `use_all_devices`; if `device_speeds`, `device_memory`,
            `layer_costs`, `batch_size` or `method` do not match; if
            `profile` is of other layers, or lacks a device whose speed is
            not given; or if no split fits the memory (the message names,
            for the split over all devices in the given order that needs
            the least extra memory, each device short of memory and by how
            many bytes).
        TypeError: If `profile` is neither a bool nor a `Profile`.

    Example:

    >>> model = keras.Sequential(
    ...     [keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(4)]
    ... )
    >>> plan(model, ["/cpu:0", "/cpu:1"], device_speeds=[1.0, 2.0]).stages
    """
    chain = layers_lib.chain_with_outputs(model)
    layers = [layer for layer, _ in chain]
    names = [layer.name for layer in layers]
    devices = list(devices)
    if method not in ("auto", "exact", "local"):
        raise ValueError(
            "Invalid value for argument `method`. Received: "
            f'method={method!r}. Expected "auto", "exact" or "local".'
        )
    if not devices or (use_all_devices and len(devices) > len(layers)):
        raise ValueError(
            f"Invalid value for argument `devices`. Received: "
            f"devices={devices!r}. Expected 1 to {len(layers)} device names "
            f"(one stage each, and the model has {len(layers)} layers)."
        )
    inputs = _cost_model(
        model,
        chain,
        devices,
        device_speeds,
        device_memory,
        layer_costs,
        profile,
        batch_size,
        flops_per_second,
    )
    return _plan(
        names,
        devices,
        inputs,
        bandwidth,
        keep_order=keep_order,
        use_all_devices=use_all_devices,
        method=method,
    )


def _plan(names, devices, inputs, bandwidth, **search_options):
    """The `Plan` of layers `names` on `devices` under a `_CostModel`."""
    costs, speeds, memory = inputs.costs, inputs.speeds, inputs.memory
    layer_memory = [
        PARAMETER_COPIES * weights + output
        for weights, output in zip(inputs.weight_bytes, inputs.output_bytes)
    ]
    input_seconds = [0.0] + [b / bandwidth for b in inputs.output_bytes[:-1]]
    found, used_method = _search(
        costs,
        layer_memory,
        input_seconds,
        speeds,
        memory,
        devices,
        device_costs=inputs.device_costs,
        **search_options,
    )
    stages, seconds, needs = [], [], []
    for device, start, end in found:
        stages.append(Stage(devices[device], names[start:end]))
        seconds.append(
            _placement_search.stage_seconds(
                costs,
                input_seconds,
                speeds,
                device,
                start,
                end,
                inputs.device_costs,
            )
        )
        needs.append(int(sum(layer_memory[start:end])))
    used = {device for device, _, _ in found}
    return Plan(
        stages=stages,
        stage_seconds=seconds,
        stage_memory=needs,
        device_memory=[memory[device] for device, _, _ in found],
        device_speeds=[speeds[device] for device, _, _ in found],
        unused_devices=[
            name for index, name in enumerate(devices) if index not in used
        ],
        method=used_method,
    )


class _CostModel(NamedTuple):
    """What the search needs of a model on devices, per layer and device."""

    costs: list  # seconds per layer on a speed-1.0 device
    device_costs: list  # seconds per layer on each device, or None
    speeds: list
    memory: list  # bytes per device, None for no limit
    weight_bytes: list  # per layer
    output_bytes: list  # per layer, for the batch


def _cost_model(
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
    measured = _checked_profiles(profile, names)
    if batch_size is None:
        batch_size = measured[0].batch_size if measured else 32
    batch_size = check_int("batch_size", batch_size)
    speeds = _per_device("device_speeds", device_speeds, devices, None)
    memory = _per_device("device_memory", device_memory, devices, None)
    entries = [
        (name, speed, limit, device_memory is not None)
        for name, speed, limit in zip(devices, speeds, memory)
    ]
    sizes = _layer_sizes(chain, batch_size, measured)
    if measured is None:
        costs = _layer_costs(
            model, chain, layer_costs, profile, batch_size, flops_per_second
        )
        resolved = [_resolved(*entry, None) for entry in entries]
    else:
        (seconds,), (measured_speeds,), costs = _common_scale(
            measured, batch_size
        )
        if layer_costs is not None:
            costs = _given_costs(names, layer_costs)
        resolved = _resolved_devices(
            entries, measured[0], seconds, measured_speeds, "devices"
        )
    return _cost_model_of(costs, resolved, layer_costs is None, *sizes)


def _cost_model_of(costs, resolved, measured_costs, weights, outputs):
    """A `_CostModel` of devices `(speed, memory, seconds or None)`."""
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
    return _CostModel(
        costs=costs,
        device_costs=device_costs,
        speeds=speeds,
        memory=[None if m is None else int(m) for _, m, _ in resolved],
        weight_bytes=weights,
        output_bytes=outputs,
    )


def _resolved(
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


def _resolved_devices(entries, measured, seconds, speeds, argument):
    """`_resolved` of each `(name, speed, memory, memory given)` entry;
    raises naming `argument` if the profile lacks a device without speed."""
    resolved = [
        _resolved(*entry, measured, seconds, speeds) for entry in entries
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


def _layer_sizes(chain, batch_size, measured):
    """`(weight bytes, output bytes for batch_size rows)` per layer."""
    if measured is None:
        return (
            [_weight_bytes(layer) for layer, _ in chain],
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


def _checked_profiles(profile, names, workers=None):
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


def _layer_costs(
    model, chain, layer_costs, profile, batch_size, flops_per_second
):
    """Seconds per layer on a speed-1.0 device (given, profiled, estimated)."""
    names = [layer.name for layer, _ in chain]
    if layer_costs is not None:
        return _given_costs(names, layer_costs)
    if profile:
        return _profiled_seconds(model, names, batch_size)
    return [
        TRAINING_FLOP_FACTOR
        * _flops(layer, output, batch_size)
        / flops_per_second
        for layer, output in chain
    ]


def _given_costs(names, layer_costs):
    missing = sorted(set(names) - set(layer_costs))
    if missing:
        raise ValueError(
            "Invalid value for argument `layer_costs`. Received: no "
            f"cost for layers {missing}. Expected seconds for every "
            f"layer of {names}."
        )
    return [float(layer_costs[name]) for name in names]


def _search(costs, memory, input_seconds, speeds, capacity, devices, **kw):
    """`([(device index, start, end)], method)`; raises if nothing fits."""
    keep_order, use_all = kw["keep_order"], kw["use_all_devices"]
    device_costs = kw["device_costs"]
    ordered = None
    if len(devices) <= len(costs):
        # The original planner's split: kept whenever it is as good.
        try:
            bounds = partition(
                costs,
                memory,
                input_seconds,
                speeds,
                capacity,
                device_costs=device_costs,
            )
        except ValueError:
            if keep_order and use_all:
                partition(
                    costs,
                    memory,
                    input_seconds,
                    speeds,
                    capacity,
                    devices,
                    device_costs=device_costs,
                )
        else:
            ordered = [(d, s, e) for d, (s, e) in enumerate(bounds)]
    if keep_order and use_all:
        return ordered, "exact"
    found, method = _placement_search.search(
        costs, memory, input_seconds, speeds, capacity, **kw
    )
    if found is None:
        if len(devices) <= len(costs):
            # Name the shortfall of the split over all devices in order.
            partition(
                costs,
                memory,
                input_seconds,
                speeds,
                capacity,
                devices,
                device_costs=device_costs,
            )
        raise ValueError(
            "No split of the layers fits the devices' memory "
            f"(device_memory={list(capacity)}; the layers need "
            f"{int(sum(memory))} bytes in all, the largest layer "
            f"{int(max(memory))}). Add memory, or shrink the batch or the "
            "model."
        )
    if ordered is not None:
        value = _placement_search.bottleneck_and_total(
            found, costs, input_seconds, speeds, device_costs
        )
        kept = _placement_search.bottleneck_and_total(
            ordered, costs, input_seconds, speeds, device_costs
        )
        if not _placement_search.is_better(value, kept):
            found = ordered
    return found, method


def partition(
    costs,
    memory,
    input_seconds,
    speeds,
    capacity,
    names=None,
    device_costs=None,
):
    """The exact min-max split of a chain of layers over devices in order.

    Pure Python: stage `d` runs layers `[start, end)` on device `d` and
    takes `sum(costs[start:end]) / speeds[d] + input_seconds[start]`; its
    memory is `sum(memory[start:end])`, at most `capacity[d]` (None = no
    limit). Every device gets at least one layer.

    Args:
        costs: Seconds per layer on a speed-1.0 device.
        memory: Bytes per layer.
        input_seconds: Seconds to receive each layer's input from another
            device (the first layer's is usually 0).
        speeds: Relative speed per device.
        capacity: Bytes per device, or None for no limit.
        names: Device names for the error message. Defaults to `None`
            (device indices).
        device_costs: Seconds per layer on each device (a list per
            device, e.g. measured by `profile`); given, they replace
            `costs / speeds`. Defaults to `None`.

    Returns:
        `[(start, end), ...]`, one per device, minimising the largest stage
        time (ties: the earliest split points).

    Raises:
        ValueError: If no split fits the memory; the message names, for the
            split that needs the least extra memory in total, each device
            that lacks memory and by how many bytes.

    Example:

    >>> partition([1, 1, 1, 1], [0] * 4, [0] * 4, [1, 1], [None, None])
    [(0, 2), (2, 4)]
    """
    layers, devices = len(costs), len(speeds)
    if device_costs is None:
        device_costs = [costs] * devices
    else:
        speeds = [1.0] * devices
    cost_sums = [
        np.concatenate([[0.0], np.cumsum(c, dtype=float)]) for c in device_costs
    ]
    memory_sums = np.concatenate([[0.0], np.cumsum(memory, dtype=float)])

    def stage_memory(start, end):
        return memory_sums[end] - memory_sums[start]

    def stage_time(device, start, end):
        if capacity[device] is not None and (
            stage_memory(start, end) > capacity[device]
        ):
            return math.inf
        sums = cost_sums[device]
        work = (sums[end] - sums[start]) / speeds[device]
        return work + input_seconds[start]

    bounds = _dynamic_program(layers, devices, stage_time, max)
    if bounds is not None:
        return bounds

    def shortfall(device, start, end):
        limit = capacity[device]
        return (
            0.0 if limit is None else max(0.0, stage_memory(start, end) - limit)
        )

    closest = _dynamic_program(layers, devices, shortfall, _add)
    labels = names or [f"device {d}" for d in range(devices)]
    short = [
        f"{labels[d]} lacks {math.ceil(shortfall(d, s, e))} bytes (needs "
        f"{int(stage_memory(s, e))}, has {int(capacity[d])})"
        for d, (s, e) in enumerate(closest)
        if shortfall(d, s, e) > 0
    ]
    raise ValueError(
        "No split of the layers fits the devices' memory "
        f"(device_memory={list(capacity)}). With the split that needs the "
        f"least extra memory, {'; '.join(short)}. Add memory there, use "
        "more devices, or shrink the batch or the model."
    )


def _dynamic_program(layers, devices, stage_value, combine):
    """Split points minimising `combine` over stages of `stage_value(d, s, e)`.

    Returns None when every split is infinite (infeasible).
    """
    best = np.full((devices + 1, layers + 1), math.inf)
    choice = np.zeros((devices + 1, layers + 1), dtype=int)
    best[0][0] = 0.0
    for device in range(1, devices + 1):
        # Every earlier device holds at least one layer, every later one too.
        for end in range(device, layers - (devices - device) + 1):
            for start in range(device - 1, end):
                before = best[device - 1][start]
                if before == math.inf:
                    continue
                value = combine(before, stage_value(device - 1, start, end))
                if value < best[device][end]:
                    best[device][end] = value
                    choice[device][end] = start
    if best[devices][layers] == math.inf:
        return None
    bounds, end = [], layers
    for device in range(devices, 0, -1):
        start = int(choice[device][end])
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def _add(a, b):
    return a + b


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
    return int(np.prod(_shape(output, batch_size)) * _itemsize(output.dtype))


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


def _layer_list(names, width=40):
    text = ", ".join(names)
    return text if len(text) <= width else text[: width - 3] + "..."


# --- choosing a layout --------------------------------------------------------

# Bytes per second between workers (about 10 Gbit/s Ethernet).
DEFAULT_NETWORK_BANDWIDTH = 1.25e9
# Measured (TF 2.21): a replica of a tf.distribute strategy runs on one
# worker; a layer hinted onto another worker's device fails at the first
# step with "InvalidArgumentError: /job:worker/replica:0/task:0/device:CPU:0
# unknown device".
CROSS_WORKER_PIPELINE = (
    "spans workers: a replica runs on one worker under tf.distribute "
    "(TensorFlow: 'unknown device' for another worker's device)"
)
DATA_PARALLEL = "data parallel"
PIPELINE = "pipeline"
REPLICATED_PIPELINES = "replicated pipelines"


class Device(NamedTuple):
    """One device of a worker in a `plan_layout` cluster.

    Attributes:
        name: Its name on its worker, e.g. `"/device:GPU:0"`.
        speed: Relative speed (2.0 = twice as fast). Defaults to `1.0`.
        memory: Bytes available, or None for no limit. Defaults to `None`.
    """

    name: str
    speed: float = 1.0
    memory: int = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step on a cluster, with its predicted time.

    Attributes:
        kind: `"data parallel"`, `"pipeline"` or `"replicated pipelines"`.
        step_seconds: Predicted seconds per training step (`compute_seconds
            + communication_seconds`); infinity if it does not fit.
        compute_seconds: Predicted forward + backward seconds of a step.
        communication_seconds: Predicted seconds of the gradient
            all-reduce.
        shares: Each replica's fraction of the global batch, for
            `kh.data.shard(..., shares=...)`: one per device (data
            parallel), `[1.0]` (pipeline) or one per worker (replicated
            pipelines).
        plans: The `Plan` of each replica's pipeline (one for `"pipeline"`,
            one per worker for `"replicated pipelines"`, none for data
            parallel).
        microbatches: `pipeline_microbatches` of the pipelines.
        reason: Why the layout cannot run (memory, or a pipeline across
            workers), or None. Such a layout is never `best` while another
            can run.
    """

    kind: str
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    shares: list
    plans: list
    microbatches: int
    reason: str = None


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """The layouts `plan_layout` compared and the fastest.

    Attributes:
        layouts: `{kind: Layout}` of the three layouts.
        best: The `Layout` with the smallest predicted step time.
        cluster: The cluster, as lists of `Device` per worker.
    """

    layouts: dict
    best: Layout
    cluster: list

    def summary(self):
        """A text table of the layouts' predicted step times; `*` = best.

        Returns:
            The table as a string.

        Example:

        >>> print(plan_layout(model, [["/cpu:0", "/cpu:1"]]).summary())
        """
        rows = [("layout", "step ms", "compute ms", "all-reduce ms", "shares")]
        for kind, layout in self.layouts.items():
            mark = "*" if layout is self.best else ""
            if layout.reason is not None:
                step = layout.step_seconds
                rows.append(
                    (
                        kind + mark,
                        f"({step * 1e3:.4g})" if step < math.inf else "-",
                        "-",
                        "-",
                        "not run: " + layout.reason,
                    )
                )
                continue
            rows.append(
                (
                    kind + mark,
                    f"{layout.step_seconds * 1e3:.4g}",
                    f"{layout.compute_seconds * 1e3:.4g}",
                    f"{layout.communication_seconds * 1e3:.4g}",
                    "[" + ", ".join(f"{s:.3f}" for s in layout.shares) + "]",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths))
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"best: {self.best.kind}")
        for index, stage_plan in enumerate(self.best.plans):
            stages = "; ".join(
                f"{stage.device}: {len(stage.layers)} layers"
                for stage in stage_plan.stages
            )
            lines.append(f"  replica {index}: {stages}")
        return "\n".join(lines)

    def apply(self, model, worker=None):
        """Sets up the best layout: a `kh.HeteroModel` over `model`'s layers.

        Data parallel: `kh.HeteroModel.from_model(model)`. Pipelines: a copy
        of `model` whose layers are `Placed` on the stages' devices
        (`kh.layers.place`), with `pipeline_microbatches`; for replicated
        pipelines, the pipeline of `worker`. Feed it
        `kh.data.shard(..., shares=choice.best.shares)`. Under a strategy,
        call it inside `strategy.scope()` (the copy's weights are created
        there).

        Args:
            model: The model this choice was made for.
            worker: Which worker's pipeline (replicated pipelines only).
                Defaults to `None`: this process's worker index from
                `TF_CONFIG` (a chief counts as worker 0), or 0.

        Returns:
            A `kh.HeteroModel`.

        Raises:
            ValueError: If no layout can run (each one's reason is named),
                or `worker` is not one of the cluster's workers.

        Example:

        >>> hetero = plan_layout(model, [["/cpu:0", "/cpu:1"]]).apply(model)
        """
        from keras_hetero.model import HeteroModel

        best = self.best
        if best.reason is not None:
            raise ValueError(
                "No layout runs on this cluster: "
                + "; ".join(
                    f"{kind}: {layout.reason}"
                    for kind, layout in self.layouts.items()
                )
            )
        if best.kind == DATA_PARALLEL:
            return HeteroModel.from_model(model)
        if worker is None:
            worker = _this_worker() if best.kind == REPLICATED_PIPELINES else 0
        if not 0 <= worker < len(best.plans):
            raise ValueError(
                "Invalid value for argument `worker`. Received: "
                f"worker={worker!r}. Expected 0 to {len(best.plans) - 1} "
                f"(the {best.kind} layout has {len(best.plans)} "
                "replicas)."
            )
        placed = layers_lib.place(model, best.plans[worker].hints())
        return HeteroModel.from_model(
            placed, pipeline_microbatches=best.microbatches
        )


def plan_layout(
    model,
    cluster,
    *,
    batch_size=None,
    microbatches=4,
    layer_costs=None,
    profile=False,
    bandwidth=DEFAULT_BANDWIDTH,
    network_bandwidth=DEFAULT_NETWORK_BANDWIDTH,
    flops_per_second=DEFAULT_FLOPS_PER_SECOND,
):
    """Compares data parallel, one pipeline and replicated pipelines.

    One cost model for all three (see docs/placement.md, "Choosing a
    layout"). With `C` the model's seconds per global batch of
    `batch_size` rows on a speed-1.0 device, `P` its trainable weights'
    bytes and `allreduce(R, link) = 2 (R - 1) / R * P / link` (a ring over
    R replicas; `link` is `network_bandwidth` when they span workers,
    `bandwidth` otherwise):

    - data parallel: every device a replica, shares proportional to speed,
      `C / sum(speeds) + allreduce(devices)`; each device holds the whole
      model (weights, gradients, two optimizer slots, its share's
      activations).
    - pipeline: one replica over all devices, split by `plan`; with stage
      times `t_k` for the whole batch, GPipe's `(sum(t) + (M - 1) *
      max(t)) / M` for `M = microbatches`; no all-reduce. Over several
      workers it is predicted (every hop at `network_bandwidth`) but never
      chosen: a replica of a `tf.distribute` strategy runs on one worker,
      and TensorFlow fails on another worker's device ("unknown device",
      measured), so its `reason` says so.
    - replicated pipelines: one pipeline per worker over its own devices
      (`plan` with `bandwidth`), the global batch shared in proportion to
      each pipeline's speed (`T_w` its step time for the whole batch), so
      `1 / sum(1 / T_w) + allreduce(workers)`.

    With `profile` (one `kh.placement.Profile` for every worker, when they
    have the same devices, or a list with one per worker), a device given
    as a name takes its speed and memory from its worker's profile, and a
    `(name, speed)` tuple its memory; `Device`s and `(name, speed, memory)`
    tuples are taken as given. Speeds are relative to the fastest device
    of all the profiles, `C` and `P` are measured, and the pipelines take
    each profiled device's own seconds per layer (as `plan` does); given
    `layer_costs`, they take `layer_costs / speed` instead.

    Args:
        model: A chain model (as for `plan`).
        cluster: The workers, each a list of its devices: `Device`s,
            `(name, speed)` or `(name, speed, memory)` tuples, or names
            (speed 1.0 and no memory limit, or the profile's).
        batch_size: The global batch size. Defaults to `None` (the first
            profile's batch size, or 32).
        microbatches: `pipeline_microbatches` for the pipelines. Defaults
            to `4`.
        layer_costs: `{layer name: seconds on a speed-1.0 device}` for one
            global batch; given, nothing is estimated or profiled. Defaults
            to `None`.
        profile: A `kh.placement.Profile`, or a list with one per worker
            (see above); or `True` to time each layer on this machine.
            Defaults to `False`.
        bandwidth: Bytes per second between devices of one worker.
            Defaults to `1e10`.
        network_bandwidth: Bytes per second between workers. Defaults to
            `1.25e9`.
        flops_per_second: As for `plan`. Defaults to `1e11`.

    Returns:
        A `LayoutChoice`.

    Raises:
        ValueError: If `cluster` is empty or malformed, `microbatches` is
            not a positive integer, a profile lacks a device given without
            a speed, there is not one profile per worker, or as `plan`.
        TypeError: If `profile` is not a bool, a `Profile` or a list of
            them.

    Example:

    >>> choice = plan_layout(
    ...     model,
    ...     [[("/cpu:0", 1.0), ("/cpu:1", 2.0)], [("/cpu:0", 1.0)]],
    ...     batch_size=64,
    ... )
    >>> choice.best.kind, choice.best.step_seconds
    """
    entries = _cluster(cluster)
    if (
        isinstance(microbatches, bool)
        or not isinstance(microbatches, int)
        or microbatches < 1
    ):
        raise ValueError(
            "Invalid value for argument `microbatches`. Received: "
            f"microbatches={microbatches!r}. Expected a positive integer."
        )
    chain = layers_lib.chain_with_outputs(model)
    names = [layer.name for layer, _ in chain]
    measured = _checked_profiles(profile, names, len(entries))
    if batch_size is None:
        batch_size = measured[0].batch_size if measured else 32
    batch_size = check_int("batch_size", batch_size)
    weights, outputs = _layer_sizes(chain, batch_size, measured)
    if measured is None:
        costs = _layer_costs(
            model, chain, layer_costs, profile, batch_size, flops_per_second
        )
        workers = [
            [_resolved(*entry, None) for entry in worker] for worker in entries
        ]
    else:
        # One profile for several workers is scaled once.
        distinct = list({id(p): p for p in measured}.values())
        seconds, speeds, costs = _common_scale(distinct, batch_size)
        if layer_costs is not None:
            costs = _given_costs(names, layer_costs)
        workers = []
        for worker, worker_profile in zip(entries, measured):
            index = distinct.index(worker_profile)
            workers.append(
                _resolved_devices(
                    worker,
                    worker_profile,
                    seconds[index],
                    speeds[index],
                    "cluster",
                )
            )
    names_of = [[entry[0] for entry in worker] for worker in entries]
    cluster_devices = [
        [
            Device(name, speed, memory)
            for name, (speed, memory, _) in zip(worker_names, worker)
        ]
        for worker_names, worker in zip(names_of, workers)
    ]
    weight_bytes = sum(weights)
    sizes = (weights, outputs)
    measured_costs = layer_costs is None

    def cost_model(group):
        return _cost_model_of(
            costs, [resolved for _, resolved in group], measured_costs, *sizes
        )

    # A group is a pipeline's devices: `[(name, resolved)]`.
    groups = [list(zip(n, w)) for n, w in zip(names_of, workers)]
    everything = [device for group in groups for device in group]
    if len(workers) > 1:
        # One pipeline across workers names each worker's devices.
        everything = [
            (_on_worker(name, index), resolved)
            for index, group in enumerate(groups)
            for name, resolved in group
        ]
    layouts = {
        DATA_PARALLEL: _data_parallel(
            cluster_devices,
            sum(costs),
            weight_bytes,
            sum(outputs),
            bandwidth,
            network_bandwidth,
        ),
        PIPELINE: _pipelines(
            PIPELINE,
            names,
            [everything],
            cost_model,
            microbatches,
            0.0,
            network_bandwidth if len(workers) > 1 else bandwidth,
        ),
        REPLICATED_PIPELINES: _pipelines(
            REPLICATED_PIPELINES,
            names,
            groups,
            cost_model,
            microbatches,
            _allreduce_seconds(len(workers), weight_bytes, network_bandwidth),
            bandwidth,
        ),
    }
    if len(workers) > 1:
        layouts[PIPELINE] = dataclasses.replace(
            layouts[PIPELINE], reason=CROSS_WORKER_PIPELINE
        )
    runnable = [layout for layout in layouts.values() if layout.reason is None]
    best = min(
        runnable or layouts.values(), key=lambda layout: layout.step_seconds
    )
    return LayoutChoice(layouts=layouts, best=best, cluster=cluster_devices)


def _cluster(cluster):
    """`[[(name, speed or None, memory, memory given)]]`, one list per
    worker; a speed or memory not given is the profile's, or the default."""

    def device(entry):
        if isinstance(entry, Device):
            return (*entry, True)
        if isinstance(entry, str):
            return entry, None, None, False
        if isinstance(entry, (tuple, list)) and 1 <= len(entry) <= 3:
            name, speed, memory = (*entry, None, None)[:3]
            return name, speed, memory, len(entry) == 3
        raise ValueError(
            "Invalid value for argument `cluster`. Received: the device "
            f"{entry!r}. Expected a `kh.placement.Device`, a name, or a "
            "(name, speed[, memory]) tuple."
        )

    if isinstance(cluster, (str, Device)) or not cluster:
        raise ValueError(
            "Invalid value for argument `cluster`. Received: "
            f"cluster={cluster!r}. Expected a list of workers, each a list "
            "of devices."
        )
    workers = []
    for worker in cluster:
        if isinstance(worker, (str, Device)) or not worker:
            raise ValueError(
                "Invalid value for argument `cluster`. Received: the worker "
                f"{worker!r}. Expected a non-empty list of devices."
            )
        workers.append([device(entry) for entry in worker])
    for entry in (e for worker in workers for e in worker):
        speed = entry[1]
        if speed is not None and not (speed > 0 and math.isfinite(speed)):
            raise ValueError(
                "Invalid value for argument `cluster`. Received: the device "
                f"{entry[0]!r} with speed {speed!r}. Expected a positive "
                "speed."
            )
    return workers


def _allreduce_seconds(replicas, weight_bytes, link):
    """A ring all-reduce: each replica sends and receives 2 (R-1)/R of P."""
    if replicas <= 1:
        return 0.0
    return 2 * (replicas - 1) / replicas * weight_bytes / link


def _data_parallel(
    workers, cost, weight_bytes, activation_bytes, bandwidth, network
):
    devices = [device for worker in workers for device in worker]
    total_speed = sum(device.speed for device in devices)
    shares = [device.speed / total_speed for device in devices]
    link = network if len(workers) > 1 else bandwidth
    communication = _allreduce_seconds(len(devices), weight_bytes, link)
    short = [
        f"{device.name} needs {int(need)} bytes, has {device.memory}"
        for device, share in zip(devices, shares)
        for need in [PARAMETER_COPIES * weight_bytes + share * activation_bytes]
        if device.memory is not None and need > device.memory
    ]
    compute = cost / total_speed
    return Layout(
        kind=DATA_PARALLEL,
        step_seconds=math.inf if short else compute + communication,
        compute_seconds=compute,
        communication_seconds=communication,
        shares=shares,
        plans=[],
        microbatches=1,
        reason=(
            "the whole model does not fit: " + "; ".join(short)
            if short
            else None
        ),
    )


def _pipelines(
    kind, names, groups, cost_model, microbatches, communication, link
):
    """One pipeline per group of `(device name, resolved device)`."""
    plans, times = [], []
    for group in groups:
        try:
            group_plan = _plan(
                names,
                [name for name, _ in group],
                cost_model(group),
                link,
                keep_order=False,
                use_all_devices=False,
                method="auto",
            )
        except ValueError as error:
            return Layout(
                kind=kind,
                step_seconds=math.inf,
                compute_seconds=math.inf,
                communication_seconds=communication,
                shares=[],
                plans=plans,
                microbatches=microbatches,
                reason=str(error).split(". ")[0],
            )
        plans.append(group_plan)
        times.append(pipeline_seconds(group_plan.stage_seconds, microbatches))
    rates = [1.0 / seconds for seconds in times]
    compute = 1.0 / sum(rates)
    return Layout(
        kind=kind,
        step_seconds=compute + communication,
        compute_seconds=compute,
        communication_seconds=communication,
        shares=[rate / sum(rates) for rate in rates],
        plans=plans,
        microbatches=microbatches,
    )


def pipeline_seconds(stage_seconds, microbatches):
    """GPipe's step time of stages taking `stage_seconds` per whole batch.

    Each of `microbatches` micro-batches takes `t_k / M` on stage k; the
    first passes every stage, the other `M - 1` follow at the slowest
    stage's pace: `(sum(t) + (M - 1) * max(t)) / M`.

    Args:
        stage_seconds: Seconds of each stage for the whole batch.
        microbatches: M, the number of micro-batches.

    Returns:
        Seconds per step.

    Example:

    >>> pipeline_seconds([1.0, 1.0], 4)
    1.25
    """
    return (
        sum(stage_seconds) + (microbatches - 1) * max(stage_seconds)
    ) / microbatches


def _on_worker(name, worker):
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(layers_lib._device_name(name))
    return spec.replace(job="worker", task=worker).to_string()


def _this_worker():
    from keras_hetero import _distribute

    task = _distribute.env_task()
    if task.task_type is None:
        return 0
    if task.has_chief:
        return 0 if task.task_type == "chief" else task.task_index + 1
    return task.task_index
