"""`plan_layout`: data parallel, one pipeline or replicated pipelines,
compared on one cost model (docs/placement.md, "Choosing a layout")."""

import dataclasses
import math
from typing import NamedTuple

from keras_hetero import layers as layers_lib
from keras_hetero._checks import check_int
from keras_hetero.placement import costs as costs_lib
from keras_hetero.placement.costs import DEFAULT_BANDWIDTH
from keras_hetero.placement.costs import DEFAULT_FLOPS_PER_SECOND
from keras_hetero.placement.costs import PARAMETER_COPIES
from keras_hetero.placement.planner import plan_from_costs
from keras_hetero.placement.profiling import common_scale

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
    microbatches = check_int(
        "microbatches", microbatches, expected="a positive integer"
    )
    chain = layers_lib.chain_with_outputs(model)
    names = [layer.name for layer, _ in chain]
    measured = costs_lib.checked_profiles(profile, names, len(entries))
    if batch_size is None:
        batch_size = measured[0].batch_size if measured else 32
    batch_size = check_int("batch_size", batch_size)
    weights, outputs = costs_lib.layer_sizes(chain, batch_size, measured)
    if measured is None:
        costs = costs_lib.seconds_per_layer(
            model, chain, layer_costs, profile, batch_size, flops_per_second
        )
        workers = [
            [costs_lib.resolve_device(*entry, None) for entry in worker]
            for worker in entries
        ]
    else:
        costs, workers = _profiled(
            entries, measured, batch_size, names, layer_costs
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
        return costs_lib.cost_model_of(
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


def _profiled(entries, measured, batch_size, names, layer_costs):
    """`(costs, workers)` from profiles `measured` (one per worker): the
    layer costs on the profiles' common scale (or `layer_costs`), and each
    worker's devices resolved against its profile."""
    # One profile for several workers is scaled once.
    distinct = list({id(p): p for p in measured}.values())
    seconds, speeds, costs = common_scale(distinct, batch_size)
    if layer_costs is not None:
        costs = costs_lib.given_costs(names, layer_costs)
    workers = []
    for worker, worker_profile in zip(entries, measured):
        index = distinct.index(worker_profile)
        workers.append(
            costs_lib.resolve_devices(
                worker,
                worker_profile,
                seconds[index],
                speeds[index],
                "cluster",
            )
        )
    return costs, workers


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
            group_plan = plan_from_costs(
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
