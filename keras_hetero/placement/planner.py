"""`plan`: a chain model's layers split into pipeline stages on devices.

`plan` builds the cost model (`costs`), searches the split
(`search`) and returns a `Plan`; `Plan.apply` writes the stages' device
hints onto the model's layers.
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from keras_hetero import layers as layers_lib
from keras_hetero._checks import check_choice
from keras_hetero.layers import chain_layers
from keras_hetero.placement import costs as costs_lib
from keras_hetero.placement import search as search_lib
from keras_hetero.placement.costs import DEFAULT_BANDWIDTH
from keras_hetero.placement.costs import DEFAULT_FLOPS_PER_SECOND
from keras_hetero.placement.costs import PARAMETER_COPIES


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
    check_choice(
        "method",
        method,
        ("auto", "exact", "local"),
        expected='"auto", "exact" or "local"',
    )
    if not devices or (use_all_devices and len(devices) > len(layers)):
        raise ValueError(
            f"Invalid value for argument `devices`. Received: "
            f"devices={devices!r}. Expected 1 to {len(layers)} device names "
            f"(one stage each, and the model has {len(layers)} layers)."
        )
    inputs = costs_lib.cost_model(
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
    return plan_from_costs(
        names,
        devices,
        inputs,
        bandwidth,
        keep_order=keep_order,
        use_all_devices=use_all_devices,
        method=method,
    )


def plan_from_costs(names, devices, inputs, bandwidth, **search_options):
    """The `Plan` of layers `names` on `devices` under a `CostModel`."""
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
            search_lib.stage_seconds(
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


def _search(costs, memory, input_seconds, speeds, capacity, devices, **kw):
    """`([(device index, start, end)], method)`; raises if nothing fits."""
    keep_order, use_all = kw["keep_order"], kw["use_all_devices"]
    device_costs = kw["device_costs"]
    ordered = None
    if len(devices) <= len(costs):
        # The original planner's split: kept whenever it is as good.
        try:
            bounds = search_lib.partition(
                costs,
                memory,
                input_seconds,
                speeds,
                capacity,
                device_costs=device_costs,
            )
        except ValueError:
            if keep_order and use_all:
                search_lib.partition(
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
    found, method = search_lib.search(
        costs, memory, input_seconds, speeds, capacity, **kw
    )
    if found is None:
        if len(devices) <= len(costs):
            # Name the shortfall of the split over all devices in order.
            search_lib.partition(
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
        value = search_lib.bottleneck_and_total(
            found, costs, input_seconds, speeds, device_costs
        )
        kept = search_lib.bottleneck_and_total(
            ordered, costs, input_seconds, speeds, device_costs
        )
        if not search_lib.is_better(value, kept):
            found = ordered
    return found, method


def _layer_list(names, width=40):
    text = ", ".join(names)
    return text if len(text) <= width else text[: width - 3] + "..."
