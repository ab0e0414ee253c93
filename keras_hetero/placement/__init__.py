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
"""

import dataclasses
import math
import time
from typing import NamedTuple

import numpy as np

from keras_hetero import layers as layers_lib
from keras_hetero.layers import chain_layers
from keras_hetero.placement import search as _placement_search

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
    batch_size=32,
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
    activations for `batch_size` rows. The split minimises the slowest
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
        device_speeds: Relative speed per device (2.0 = twice as fast).
            Defaults to `None` (all 1.0).
        device_memory: Bytes available per device; `None` (or a `None`
            entry) for no limit. Defaults to `None`.
        layer_costs: `{layer name: seconds on a speed-1.0 device}` for every
            layer; given, nothing is estimated or profiled. Defaults to
            `None`.
        batch_size: Rows per batch for activation sizes, FLOPs and
            profiling. Defaults to `32`.
        profile: Time each layer on this machine (random inputs, median of
            a few runs) instead of estimating FLOPs. Defaults to `False`.
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
            `layer_costs` or `method` do not match; or if no split fits the
            memory (the message names, for the split over all devices in
            the given order that needs the least extra memory, each device
            short of memory and by how many bytes).

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
    speeds = _per_device("device_speeds", device_speeds, devices, 1.0)
    if any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise ValueError(
            "Invalid value for argument `device_speeds`. Received: "
            f"device_speeds={device_speeds!r}. Expected positive numbers."
        )
    memory = [
        None if m is None else int(m)
        for m in _per_device("device_memory", device_memory, devices, None)
    ]
    outputs = [_output_bytes(output, batch_size) for _, output in chain]
    costs = _layer_costs(
        model, chain, layer_costs, profile, batch_size, flops_per_second
    )
    layer_memory = [
        PARAMETER_COPIES * _weight_bytes(layer) + outputs[i]
        for i, layer in enumerate(layers)
    ]
    input_seconds = [0.0] + [b / bandwidth for b in outputs[:-1]]
    found, used_method = _search(
        costs,
        layer_memory,
        input_seconds,
        speeds,
        memory,
        devices,
        keep_order=keep_order,
        use_all_devices=use_all_devices,
        method=method,
    )
    stages, seconds, needs = [], [], []
    for device, start, end in found:
        stages.append(Stage(devices[device], names[start:end]))
        seconds.append(
            _stage_seconds(costs, input_seconds, speeds[device], start, end)
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


def _layer_costs(
    model, chain, layer_costs, profile, batch_size, flops_per_second
):
    """Seconds per layer on a speed-1.0 device (given, profiled, estimated)."""
    names = [layer.name for layer, _ in chain]
    if layer_costs is not None:
        missing = sorted(set(names) - set(layer_costs))
        if missing:
            raise ValueError(
                "Invalid value for argument `layer_costs`. Received: no "
                f"cost for layers {missing}. Expected seconds for every "
                f"layer of {names}."
            )
        return [float(layer_costs[name]) for name in names]
    if profile:
        layers = [layer for layer, _ in chain]
        return _profiled_seconds(model, layers, batch_size)
    return [
        TRAINING_FLOP_FACTOR
        * _flops(layer, output, batch_size)
        / flops_per_second
        for layer, output in chain
    ]


def _search(costs, memory, input_seconds, speeds, capacity, devices, **kw):
    """`([(device index, start, end)], method)`; raises if nothing fits."""
    keep_order, use_all = kw["keep_order"], kw["use_all_devices"]
    ordered = None
    if len(devices) <= len(costs):
        # The original planner's split: kept whenever it is as good.
        try:
            bounds = partition(costs, memory, input_seconds, speeds, capacity)
        except ValueError:
            if keep_order and use_all:
                partition(
                    costs, memory, input_seconds, speeds, capacity, devices
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
            partition(costs, memory, input_seconds, speeds, capacity, devices)
        raise ValueError(
            "No split of the layers fits the devices' memory "
            f"(device_memory={list(capacity)}; the layers need "
            f"{int(sum(memory))} bytes in all, the largest layer "
            f"{int(max(memory))}). Add memory, or shrink the batch or the "
            "model."
        )
    if ordered is not None:
        value = _placement_search.bottleneck_and_total(
            found, costs, input_seconds, speeds
        )
        kept = _placement_search.bottleneck_and_total(
            ordered, costs, input_seconds, speeds
        )
        if not _placement_search.is_better(value, kept):
            found = ordered
    return found, method


def partition(costs, memory, input_seconds, speeds, capacity, names=None):
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
    cost_sums = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    memory_sums = np.concatenate([[0.0], np.cumsum(memory, dtype=float)])

    def stage_memory(start, end):
        return memory_sums[end] - memory_sums[start]

    def stage_time(device, start, end):
        if capacity[device] is not None and (
            stage_memory(start, end) > capacity[device]
        ):
            return math.inf
        work = (cost_sums[end] - cost_sums[start]) / speeds[device]
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


def _stage_seconds(costs, input_seconds, speed, start, end):
    return sum(costs[start:end]) / speed + input_seconds[start]


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


def _itemsize(dtype):
    import tensorflow as tf

    return tf.as_dtype(dtype).size


def _output_bytes(output, batch_size):
    return int(np.prod(_shape(output, batch_size)) * _itemsize(output.dtype))


def _weight_bytes(layer):
    return int(
        sum(
            np.prod(w.shape) * _itemsize(w.dtype)
            for w in layer.trainable_weights
        )
    )


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


def _profiled_seconds(model, layers, batch_size, repeats=5):
    """Median seconds of each layer's forward + backward on this machine."""
    import tensorflow as tf

    spec = model.inputs[0]
    shape = _shape(spec, batch_size)
    if tf.as_dtype(spec.dtype).is_floating:
        values = tf.random.normal(shape, dtype=spec.dtype)
    else:
        values = tf.zeros(shape, dtype=spec.dtype)
    seconds = []
    for layer in layers:
        timings = []
        for _ in range(repeats + 1):  # the first run traces and warms up
            start = time.perf_counter()
            with tf.GradientTape() as tape:
                tape.watch(values)
                outputs = layer(values, training=True)
                loss = tf.reduce_sum(tf.cast(outputs, tf.float32))
            sources = list(layer.trainable_weights)
            if values.dtype.is_floating:
                sources.append(values)
            if sources:
                tape.gradient(loss, sources)
            timings.append(time.perf_counter() - start)
        seconds.append(float(np.median(timings[1:])))
        values = tf.stop_gradient(outputs)
    return seconds


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
    batch_size=32,
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

    Args:
        model: A chain model (as for `plan`).
        cluster: The workers, each a list of its devices: `Device`s,
            `(name, speed)` or `(name, speed, memory)` tuples, or names
            (speed 1.0, no memory limit).
        batch_size: The global batch size. Defaults to `32`.
        microbatches: `pipeline_microbatches` for the pipelines. Defaults
            to `4`.
        layer_costs: `{layer name: seconds on a speed-1.0 device}` for one
            global batch; given, nothing is estimated or profiled. Defaults
            to `None`.
        profile: Time each layer on this machine. Defaults to `False`.
        bandwidth: Bytes per second between devices of one worker.
            Defaults to `1e10`.
        network_bandwidth: Bytes per second between workers. Defaults to
            `1.25e9`.
        flops_per_second: As for `plan`. Defaults to `1e11`.

    Returns:
        A `LayoutChoice`.

    Raises:
        ValueError: If `cluster` is empty or malformed, `microbatches` is
            not a positive integer, or as `plan`.

    Example:

    >>> choice = plan_layout(
    ...     model,
    ...     [[("/cpu:0", 1.0), ("/cpu:1", 2.0)], [("/cpu:0", 1.0)]],
    ...     batch_size=64,
    ... )
    >>> choice.best.kind, choice.best.step_seconds
    """
    workers = _cluster(cluster)
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
    costs = _layer_costs(
        model, chain, layer_costs, profile, batch_size, flops_per_second
    )
    weight_bytes = sum(_weight_bytes(layer) for layer, _ in chain)
    activation_bytes = sum(_output_bytes(out, batch_size) for _, out in chain)
    options = dict(layer_costs=dict(zip(names, costs)), batch_size=batch_size)
    devices = [device for worker in workers for device in worker]
    if len(workers) > 1:
        # One pipeline across workers names each worker's devices.
        devices = [
            device._replace(name=_on_worker(device.name, index))
            for index, worker in enumerate(workers)
            for device in worker
        ]
    layouts = {
        DATA_PARALLEL: _data_parallel(
            workers,
            sum(costs),
            weight_bytes,
            activation_bytes,
            bandwidth,
            network_bandwidth,
        ),
        PIPELINE: _pipelines(
            PIPELINE,
            model,
            [devices],
            microbatches,
            0.0,
            network_bandwidth if len(workers) > 1 else bandwidth,
            options,
        ),
        REPLICATED_PIPELINES: _pipelines(
            REPLICATED_PIPELINES,
            model,
            workers,
            microbatches,
            _allreduce_seconds(len(workers), weight_bytes, network_bandwidth),
            bandwidth,
            options,
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
    return LayoutChoice(layouts=layouts, best=best, cluster=workers)


def _cluster(cluster):
    def device(entry):
        if isinstance(entry, Device):
            return entry
        if isinstance(entry, str):
            return Device(entry)
        if isinstance(entry, (tuple, list)) and 1 <= len(entry) <= 3:
            return Device(*entry)
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
    for device_ in (d for worker in workers for d in worker):
        if not (device_.speed > 0 and math.isfinite(device_.speed)):
            raise ValueError(
                "Invalid value for argument `cluster`. Received: the device "
                f"{device_!r}. Expected a positive speed."
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


def _pipelines(kind, model, groups, microbatches, communication, link, options):
    plans, times = [], []
    for devices in groups:
        try:
            group_plan = plan(
                model,
                [device.name for device in devices],
                device_speeds=[device.speed for device in devices],
                device_memory=[device.memory for device in devices],
                bandwidth=link,
                **options,
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
