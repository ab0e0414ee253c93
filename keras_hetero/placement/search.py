"""The planner's search over device order, device subset and split points.

Pure numpy, testable without TensorFlow. A stage runs layers `[start, end)`
on one device and takes `sum(costs[start:end]) / speed + input_seconds[start]`
seconds, or infinity when its memory exceeds the device's. The objective is
lexicographic: the smallest slowest stage (the pipeline's pace), then, among
splits within `TIE_TOLERANCE` of it, the smallest sum of stages (one batch's
latency through the pipeline).

Exact search: a dynamic program whose state is how many devices of each
*kind* (equal speed and memory) hold the stages so far, and where the last
stage ends. Devices of one kind are interchangeable, so the states number
`prod(count_k + 1)` (`2**devices` when all differ, far fewer on real
clusters with a few device generations), each with `layers + 1` ends; a
transition appends one stage on one more device, `O(layers**2)` per kind.
Beyond `MAX_EXACT_STATES` states the search is a local search instead: the
fixed-order dynamic program (which may skip devices) over a few starting
orders (as given, fastest first, slowest first, most memory first),
improved by swapping pairs of devices while the result improves.

`partition` is the exact split over every device in the given order (the
original planner's; `plan` keeps it whenever it is as good, and names each
device's memory shortfall from it when nothing fits).

With `device_costs` (measured seconds per layer on each device, as
`kh.placement.profile` gives), a layer may be relatively faster on one
device than on another: a stage on device `d` then takes
`sum(device_costs[d][start:end]) + input_seconds[start]`, and devices are
of one kind when their costs and memory are equal.
"""

import itertools
import math

import numpy as np

# Beyond this many device-count states the search is local (see above).
MAX_EXACT_STATES = 4096
# Relative slack within which two bottlenecks count as equal.
TIE_TOLERANCE = 1e-9


def stage_times(costs, memory, input_seconds, speed, capacity):
    """`times[start, end]`: seconds of the stage `[start, end)` on a device.

    Infinity where `start >= end` or the stage's memory exceeds `capacity`.
    """
    layers = len(costs)
    cost_sums = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    memory_sums = np.concatenate([[0.0], np.cumsum(memory, dtype=float)])
    inputs = np.asarray(list(input_seconds) + [0.0], dtype=float)
    times = (cost_sums[None, :] - cost_sums[:, None]) / speed + inputs[:, None]
    invalid = np.tri(layers + 1, dtype=bool)  # start >= end
    if capacity is not None:
        invalid |= (memory_sums[None, :] - memory_sums[:, None]) > capacity
    times[invalid] = math.inf
    return times


def search(
    costs,
    memory,
    input_seconds,
    speeds,
    capacity,
    *,
    keep_order=False,
    use_all_devices=False,
    method="auto",
    device_costs=None,
):
    """The best stages: `[(device index, start, end), ...]` in pipeline order.

    Args:
        costs: Seconds per layer on a speed-1.0 device.
        memory: Bytes per layer.
        input_seconds: Seconds to receive each layer's input.
        speeds: Relative speed per device.
        capacity: Bytes per device, or None for no limit.
        keep_order: Stages follow the devices' order. Defaults to `False`.
        use_all_devices: Every device gets a stage. Defaults to `False`.
        method: `"auto"` (exact up to `MAX_EXACT_STATES` states), `"exact"`
            or `"local"`. Defaults to `"auto"`.
        device_costs: Seconds per layer on each device (a list per device);
            given, they replace `costs / speeds`. Defaults to `None`.

    Returns:
        `(stages or None if no split fits the memory, "exact" or "local
        search")`.
    """
    devices = len(speeds)
    times = {}

    def kind(device):
        if device_costs is None:
            return speeds[device], capacity[device]
        return tuple(device_costs[device]), capacity[device]

    def times_of(device):
        key = kind(device)
        if key not in times:
            if device_costs is None:
                layer_costs, speed = costs, speeds[device]
            else:
                layer_costs, speed = device_costs[device], 1.0
            times[key] = stage_times(
                layer_costs, memory, input_seconds, speed, capacity[device]
            )
        return times[key]

    if keep_order:
        order = list(range(devices))
        return _chain(len(costs), order, times_of, use_all_devices), "exact"
    kinds = {}
    for device in range(devices):
        kinds.setdefault(kind(device), []).append(device)
    members = list(kinds.values())
    states = math.prod(len(m) + 1 for m in members)
    if method == "local" or (method == "auto" and states > MAX_EXACT_STATES):
        if device_costs is not None:
            # The starting orders rank devices by their whole-model time.
            speeds = [1.0 / max(sum(c), 1e-300) for c in device_costs]
        found = _local(len(costs), speeds, capacity, times_of, use_all_devices)
        return found, "local search"
    return _counts(len(costs), members, times_of, use_all_devices), "exact"


def bottleneck_and_total(
    stages, costs, input_seconds, speeds, device_costs=None
):
    """`(slowest stage, sum of stages)` in seconds of `[(device, s, e)]`."""
    seconds = [
        stage_seconds(
            costs, input_seconds, speeds, device, start, end, device_costs
        )
        for device, start, end in stages
    ]
    return max(seconds), sum(seconds)


def stage_seconds(
    costs, input_seconds, speeds, device, start, end, device_costs=None
):
    """Seconds of the stage `[start, end)` on `device` (an index)."""
    if device_costs is None:
        work = sum(costs[start:end]) / speeds[device]
    else:
        work = sum(device_costs[device][start:end])
    return work + input_seconds[start]


def _counts(layers, members, times_of, use_all_devices):
    """Exact: states are device counts per kind (mixed-radix index)."""
    radix = [len(m) + 1 for m in members]
    strides = [math.prod(radix[:k]) for k in range(len(radix))]
    states = math.prod(radix)
    full = states - 1

    def predecessors(state):
        for kind, stride in enumerate(strides):
            if (state // stride) % radix[kind]:
                yield state - stride, kind

    kind_times = [times_of(m[0]) for m in members]
    finals = [full] if use_all_devices else list(range(1, states))
    steps = _two_phase(
        states, predecessors, kind_times, layers, finals, skip=False
    )
    if steps is None:
        return None
    used = [0] * len(members)
    stages = []
    for kind, start, end in steps:
        stages.append((members[kind][used[kind]], start, end))
        used[kind] += 1
    return stages


def _chain(layers, order, times_of, use_all_devices):
    """Devices in `order`; unless `use_all_devices`, any may be skipped."""
    states = len(order) + 1

    def predecessors(state):
        yield state - 1, state - 1

    steps = _two_phase(
        states,
        predecessors,
        [times_of(device) for device in order],
        layers,
        [states - 1],
        skip=not use_all_devices,
    )
    if steps is None:
        return None
    return [(order[index], start, end) for index, start, end in steps]


def _local(layers, speeds, capacity, times_of, use_all_devices):
    """Local search over orders with the fixed-order program."""
    devices = list(range(len(speeds)))
    memory_rank = [math.inf if c is None else c for c in capacity]
    starts = [
        devices,
        sorted(devices, key=lambda d: -speeds[d]),
        sorted(devices, key=lambda d: speeds[d]),
        sorted(devices, key=lambda d: -memory_rank[d]),
    ]

    def score(order):
        stages = _chain(layers, order, times_of, use_all_devices)
        if stages is None:
            return (math.inf, math.inf), None
        seconds = [
            times_of(device)[start, end] for device, start, end in stages
        ]
        return (max(seconds), sum(seconds)), stages

    best_value, best_stages = (math.inf, math.inf), None
    for order in starts:
        value, stages = score(order)
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(len(order)), 2):
                swapped = list(order)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                new_value, new_stages = score(swapped)
                if is_better(new_value, value):
                    order, value, stages = swapped, new_value, new_stages
                    improved = True
        if is_better(value, best_value):
            best_value, best_stages = value, stages
    return best_stages


def is_better(a, b):
    """Whether `(bottleneck, total)` `a` beats `b` beyond the tolerance."""
    if a[0] < b[0] * (1 - TIE_TOLERANCE):
        return True
    return a[0] <= b[0] * (1 + TIE_TOLERANCE) and a[1] < b[1] * (
        1 - TIE_TOLERANCE
    )


def _two_phase(states, predecessors, kind_times, layers, finals, skip):
    """Min-max, then min-sum among splits within tolerance of the min-max.

    `predecessors(state)` yields `(previous state, kind)`: one more stage on
    a device of that kind. With `skip`, a state may also take its previous
    state's values as they are (the device is left out).
    """
    bottleneck, _ = _program(
        states, predecessors, kind_times, layers, np.maximum, skip
    )
    reached = min(bottleneck[state][layers] for state in finals)
    if reached == math.inf:
        return None
    limit = reached * (1 + TIE_TOLERANCE) + 1e-300
    capped = [np.where(t <= limit, t, math.inf) for t in kind_times]
    total, choice = _program(states, predecessors, capped, layers, np.add, skip)
    final = min(finals, key=lambda state: total[state][layers])
    steps, state, end = [], final, layers
    came_from, kinds, starts = choice
    while end > 0:
        previous, kind = int(came_from[state][end]), int(kinds[state][end])
        if kind >= 0:
            start = int(starts[state][end])
            steps.append((kind, start, end))
            end = start
        state = previous
    return steps[::-1]


def _program(states, predecessors, kind_times, layers, combine, skip):
    """`best[state, end]` and how it was reached: `(previous state, kind or
    -1 for a skipped device, start)` arrays."""
    best = np.full((states, layers + 1), math.inf)
    best[0][0] = 0.0
    shape = (states, layers + 1)
    came_from = np.full(shape, -1)
    kinds = np.full(shape, -1)
    starts_of = np.zeros(shape, dtype=int)
    ends = np.arange(layers + 1)
    for state in range(1, states):
        row = best[state]
        for previous, kind in predecessors(state):
            before = best[previous]
            if skip:
                better = before < row
                row[better] = before[better]
                came_from[state][better] = previous
                kinds[state][better] = -1
            starts = np.flatnonzero(np.isfinite(before))
            if not len(starts):
                continue
            values = combine(before[starts, None], kind_times[kind][starts])
            picked = values.argmin(axis=0)
            values = values[picked, ends]
            better = values < row
            row[better] = values[better]
            came_from[state][better] = previous
            kinds[state][better] = kind
            starts_of[state][better] = starts[picked[better]]
    return best, (came_from, kinds, starts_of)


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
