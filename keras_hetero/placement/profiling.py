"""`profile`: measured per-layer seconds and memory, the planner's input.

`plan` and `plan_layout` need each device's speed and memory and each
layer's cost. `profile` measures them: every top-level layer's forward +
backward pass on every device, timed until the result is on the host, and
the bytes of its weights and of its outputs (kept for the backward pass).
The result is a `Profile`, a frozen record that plans can be made from and
that is saved and loaded as JSON.
"""

import dataclasses
import json
import math
import time

import numpy as np

from keras_hetero import _distribute
from keras_hetero._checks import check_int
from keras_hetero._compat import keras
from keras_hetero.balancing import memory
from keras_hetero.layers import chain_with_outputs

# A layer measured as fast as the harness alone (within its noise) gets
# this many seconds: a device's total must be positive to give a speed.
MIN_SECONDS = 1e-6
# `Profile.to_json`'s format tag; `from_json` refuses other formats.
JSON_FORMAT = "keras_hetero.placement.Profile"
JSON_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Profile:
    """Measured seconds per layer and device, and bytes per layer.

    Made by `profile` (or loaded with `Profile.from_json`); `plan(...,
    profile=...)` and `plan_layout(..., profile=...)` take it.

    Attributes:
        devices: The profiled device names, as given to `profile`.
        layer_names: The model's top-level layers, in order.
        seconds: `{device: {layer: seconds}}`, the median seconds of the
            layer's forward + backward pass on that device for one batch.
        param_bytes: `{layer: bytes}` of the layer's trainable weights.
        activation_bytes: `{layer: bytes}` of the layer's outputs for one
            batch (kept for the backward pass, and sent to the next stage).
        device_memory: `{device: bytes}` a device has free for the model,
            or None where unknown (CPUs; see `profile`).
        batch_size: The rows of the profiled batch.
    """

    devices: list
    layer_names: list
    seconds: dict
    param_bytes: dict
    activation_bytes: dict
    device_memory: dict
    batch_size: int

    def __post_init__(self):
        _check_profile(self)

    def device_speeds(self):
        """Relative speed per device: the fastest is 1.0.

        A device's speed is the fastest device's total seconds (all layers)
        over its own, so a device twice as slow overall has speed 0.5.

        Returns:
            `{device: speed}`.

        Example:

        >>> profile(model, ["/cpu:0", "/cpu:1"], x).device_speeds()
        {'/cpu:0': 1.0, '/cpu:1': 0.5}
        """
        _, (speeds,), _ = common_scale([self])
        return speeds

    def layer_costs(self):
        """`{layer: seconds on a speed-1.0 device}`, as `plan` takes them.

        A layer's cost is the mean over devices of its seconds times the
        device's speed (`device_speeds`): its seconds on the fastest device
        when every device is uniformly slower, and the mean otherwise.
        `cost / speed` then reproduces each device's total seconds exactly
        and each layer's as well as one speed per device can.

        Returns:
            `{layer: seconds}` for one batch of `batch_size` rows.

        Example:

        >>> costs = profile(model, ["/cpu:0"], x).layer_costs()
        """
        _, _, costs = common_scale([self])
        return dict(zip(self.layer_names, costs))

    def find_device(self, name):
        """The profiled device that `name` names, or None.

        Names match on device type and index (`"/cpu:0"` is
        `"/device:CPU:0"`); a job and task in `name` are ignored, so a
        profile of one host stands for every worker with the same devices.

        Args:
            name: A device name.

        Returns:
            The name as in `devices`, or None if it was not profiled.
        """
        wanted = _local_key(name)
        for device in self.devices:
            if _local_key(device) == wanted:
                return device
        return None

    def summary(self):
        """A text table: milliseconds per layer and device, and bytes.

        Returns:
            The table as a string.

        Example:

        >>> print(profile(model, ["/cpu:0", "/cpu:1"], x).summary())
        """
        header = ["layer", *(f"{d} ms" for d in self.devices)]
        rows = [header + ["params B", "activations B"]]
        for layer in self.layer_names:
            rows.append(
                [layer]
                + [f"{self.seconds[d][layer] * 1e3:.4g}" for d in self.devices]
                + [
                    str(self.param_bytes[layer]),
                    str(self.activation_bytes[layer]),
                ]
            )
        speeds = self.device_speeds()
        rows.append(
            ["speed"] + [f"{speeds[d]:.3g}" for d in self.devices] + ["", ""]
        )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        widths += [max(len(row[i]) for row in rows) for i in (-2, -1)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths))
            for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"batch: {self.batch_size} rows")
        return "\n".join(line.rstrip() for line in lines)

    def to_json(self):
        """This profile as a JSON string, for `Profile.from_json`.

        Returns:
            The JSON text.

        Example:

        >>> pathlib.Path("profile.json").write_text(measured.to_json())
        """
        fields = dataclasses.asdict(self)
        return json.dumps(
            {"format": JSON_FORMAT, "version": JSON_VERSION, **fields},
            indent=1,
        )

    @classmethod
    def from_json(cls, text):
        """The `Profile` that `to_json` wrote.

        Args:
            text: The JSON text.

        Returns:
            A `Profile`.

        Raises:
            ValueError: If `text` is not JSON of a profile.

        Example:

        >>> text = pathlib.Path("profile.json").read_text()
        >>> measured = Profile.from_json(text)
        """
        try:
            data = json.loads(text)
        except (TypeError, ValueError):
            data = None
        if (
            not isinstance(data, dict)
            or data.get("format") != JSON_FORMAT
            or data.get("version") != JSON_VERSION
        ):
            raise ValueError(
                "Invalid value for argument `text`. Received: "
                f"text={_short(text)}. Expected the JSON of "
                f"`Profile.to_json` (format {JSON_FORMAT!r}, version "
                f"{JSON_VERSION})."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data))
        if missing:
            raise ValueError(
                "Invalid value for argument `text`. Received: a profile "
                f"without {missing}. Expected every field of `Profile`."
            )
        return cls(**{name: data[name] for name in fields})


def profile(model, devices, batch, *, repeats=5, warmup=2):
    """Measures each layer's seconds on each device, and its bytes.

    For every top-level layer of `model` (a nested model counts as one
    layer, as `plan` places top-level layers) and every device: a copy of
    the layer with its weights, created on the device, runs its forward
    pass on the layer's real input for `batch` (also on the device) and the
    backward pass (the gradient of the sum of its outputs with respect to
    its weights and its input) in a `tf.function` under
    `tf.device(device)`. A run's clock stops only when a scalar made from
    the outputs and every gradient has been copied to the host (`.numpy()`
    of a small reduction), so work a GPU runs asynchronously is counted,
    not just enqueued. Each layer runs `warmup` times untimed (its tracing
    comes before those), then `repeats` times, the devices taking turns in
    each round so a passing load slows them alike; the median is kept, less
    the median of the harness alone (a function call that sums the input
    and copies the sum to the host: about 0.3 ms on a CPU), which a layer
    inside a training step does not pay. A layer within that noise of zero
    gets 1 µs.

    Bytes: a layer's `param_bytes` are its trainable weights (what gets
    gradients and optimizer slots), its `activation_bytes` its outputs for
    this batch. A device's memory is the memory limit configured for it
    (`tf.config.set_logical_device_configuration(..., memory_limit=...)`)
    less what TensorFlow already holds there
    (`tf.config.experimental.get_memory_info`). It is None for CPUs, and
    for accelerators without a configured limit (TensorFlow's public API
    reports use, not capacity): pass `device_memory=` to `plan` there.

    The model is not changed, except that an unbuilt `Sequential` model is
    built for the batch's shape. The input of each layer comes from one
    forward pass of the model's own layers (inference mode) on the first
    device.

    Args:
        model: A `keras.Sequential` or functional model whose top-level
            layers form a chain (as for `plan`), built or buildable from
            the batch's shape.
        devices: Names of this process's devices, e.g. `["/gpu:0",
            "/cpu:0"]` or `kh.testing.logical_cpus(2)`.
        batch: `(x, y)`, `(x, y, sample_weight)` or `x`: numpy arrays or
            tensors; `x` a single array with the rows first. Only `x` is
            used (the backward pass starts from the sum of each layer's
            outputs, not the loss).
        repeats: Timed runs per layer and device; the median is kept.
            Defaults to `5`.
        warmup: Untimed runs per layer and device before them. Defaults to
            `2`.

    Returns:
        A `Profile`.

    Raises:
        ValueError: If `devices` is empty, names a device twice, or names a
            device this process lacks (the message lists those it has);
            if `batch` is empty or not an array; if `model` is not built
            and cannot be built from the batch, or is not a chain; if a
            layer fails on the batch; or if `repeats` or `warmup` is not a
            positive (non-negative) integer.

    Example:

    >>> measured = profile(model, ["/cpu:0", "/cpu:1"], (x, y))
    >>> plan(model, ["/cpu:0", "/cpu:1"], profile=measured).stages
    """
    import tensorflow as tf

    repeats = check_int("repeats", repeats, expected="a positive integer")
    warmup = check_int(
        "warmup", warmup, minimum=0, expected="a non-negative integer"
    )
    devices = _checked_devices(devices)
    inputs = _batch_inputs(batch)
    chain = _chain(model, inputs)
    layers = [layer for layer, _ in chain]
    names = [layer.name for layer in layers]
    memory = {device: _device_memory(device) for device in devices}
    with tf.device(devices[0]):
        layer_inputs, outputs = _forward(layers, inputs, model)
    harness = _medians(
        {device: _harness_run(device, inputs) for device in devices},
        warmup,
        repeats,
    )
    seconds = {device: {} for device in devices}
    for index, layer in enumerate(layers):
        # The model's first input needs no gradient in training.
        runs = {
            device: _timed_run(layer, device, layer_inputs[index], index > 0)
            for device in devices
        }
        for device, median in _medians(runs, warmup, repeats).items():
            seconds[device][layer.name] = max(
                median - harness[device], MIN_SECONDS
            )
    return Profile(
        devices=devices,
        layer_names=names,
        seconds=seconds,
        param_bytes={layer.name: weight_bytes(layer) for layer in layers},
        activation_bytes={
            name: _nbytes(output) for name, output in zip(names, outputs)
        },
        device_memory=memory,
        batch_size=int(inputs.shape[0]),
    )


def common_scale(profiles, batch_size=None):
    """Seconds, speeds and layer costs of profiles of one model, on one scale.

    The speed-1.0 device is the fastest device of all the profiles (fewest
    seconds for the whole model); a device's speed is that device's total
    seconds over its own; a layer's cost is the mean over all devices of
    its seconds times the device's speed.

    Args:
        profiles: `Profile`s of the same layers (e.g. one per worker).
        batch_size: Rows to scale every profile's seconds to (in
            proportion). Defaults to `None` (each profile's own).

    Returns:
        `(seconds, speeds, costs)`: per profile `{device: [seconds per
        layer]}` and `{device: speed}`, and the costs per layer.
    """
    names = profiles[0].layer_names
    seconds = []
    for measured in profiles:
        scale = 1.0 if batch_size is None else batch_size / measured.batch_size
        seconds.append(
            {
                device: [measured.seconds[device][n] * scale for n in names]
                for device in measured.devices
            }
        )
    totals = [{d: sum(row) for d, row in rows.items()} for rows in seconds]
    fastest = min(t for each in totals for t in each.values())
    speeds = [{d: fastest / t for d, t in each.items()} for each in totals]
    scaled = [
        [value * speed[device] for value in rows[device]]
        for rows, speed in zip(seconds, speeds)
        for device in rows
    ]
    costs = [float(np.mean(column)) for column in zip(*scaled)]
    return seconds, speeds, costs


def weight_bytes(layer):
    """Bytes of `layer`'s trainable weights."""
    return memory.tensor_bytes(layer.trainable_weights)


def itemsize(dtype):
    """Bytes per element of `dtype` (a TensorFlow, numpy or Keras name)."""
    import tensorflow as tf

    return tf.as_dtype(dtype).size


def _nbytes(structure):
    import tensorflow as tf

    return memory.tensor_bytes(tf.nest.flatten(structure))


def _checked_devices(devices):
    import tensorflow as tf

    if isinstance(devices, str) or not devices:
        raise ValueError(
            "Invalid value for argument `devices`. Received: "
            f"devices={devices!r}. Expected a non-empty list of device "
            'names such as ["/cpu:0", "/gpu:0"].'
        )
    names, seen = [], {}
    for device in devices:
        key = _local_key(device) if isinstance(device, str) else None
        spec = (
            None
            if key is None
            else tf.DeviceSpec.from_string(_with_prefix(device))
        )
        if key is None or spec.job is not None or spec.task is not None:
            raise ValueError(
                "Invalid value for argument `devices`. Received: the device "
                f"{device!r}. Expected a name of one of this process's "
                'devices such as "/cpu:0" or "/device:GPU:1" (no job or '
                "task: `profile` measures local devices)."
            )
        if not _distribute.is_local_device(_with_prefix(device)):
            available = [d.name for d in tf.config.list_logical_devices()]
            raise ValueError(
                "Invalid value for argument `devices`. Received: the device "
                f"{device!r}, which this process does not have. Expected "
                f"one of {available}."
            )
        if key in seen:
            raise ValueError(
                "Invalid value for argument `devices`. Received: "
                f"devices={list(devices)!r}, which names {seen[key]!r} and "
                f"{device!r}, one device. Expected each device once."
            )
        seen[key] = device
        names.append(device)
    return names


def _with_prefix(name):
    name = name.strip()
    return name if name.startswith("/") else "/device:" + name


def _local_key(name):
    """`(device type, index)` of a device name, or None if it names none."""
    import tensorflow as tf

    try:
        spec = tf.DeviceSpec.from_string(_with_prefix(name))
    except (AttributeError, ValueError):
        return None
    if spec.device_type is None:
        return None
    return spec.device_type.upper(), spec.device_index or 0


def _batch_inputs(batch):
    """The `x` of a batch as a tensor with at least one row."""
    import tensorflow as tf

    x = batch[0] if isinstance(batch, tuple) and batch else batch
    try:
        inputs = tf.convert_to_tensor(x)
    except (TypeError, ValueError):
        inputs = None
    if inputs is None or inputs.shape.rank in (None, 0):
        raise ValueError(
            "Invalid value for argument `batch`. Received: "
            f"batch={_short(batch)}. Expected `(x, y)` or `x`, with `x` "
            "one numpy array or tensor whose first axis is the rows."
        )
    if inputs.shape[0] == 0:
        raise ValueError(
            "Invalid value for argument `batch`. Received: an empty batch "
            f"(x of shape {tuple(inputs.shape)}). Expected at least one row."
        )
    return inputs


def _chain(model, inputs):
    """`[(layer, output)]` of `model`, built for `inputs` if need be."""
    import tensorflow as tf

    try:
        built = bool(model.inputs)
    except (AttributeError, ValueError):
        built = False
    # Only a Sequential model gets symbolic inputs from `build`; any other
    # unbuilt model is refused by `chain_with_outputs`.
    if not built and isinstance(model, keras.Sequential):
        try:
            model.build((None, *inputs.shape[1:]))
        except (AttributeError, TypeError, ValueError, NotImplementedError,
                tf.errors.OpError) as error:  # fmt: skip
            raise ValueError(
                "Invalid value for argument `model`. Received: "
                f"model={getattr(model, 'name', model)!r}, not built, which "
                "could not be built for the batch's shape "
                f"{tuple(inputs.shape)}: {error}"
            ) from error
    return chain_with_outputs(model)


def _forward(layers, inputs, model):
    """Each layer's input and output for `inputs` (inference mode)."""
    import tensorflow as tf

    dtype = tf.as_dtype(model.inputs[0].dtype)
    values = inputs
    if values.dtype != dtype and values.dtype.is_floating == dtype.is_floating:
        values = tf.cast(values, dtype)
    layer_inputs, outputs = [], []
    for layer in layers:
        layer_inputs.append(values)
        try:
            values = layer(values, training=False)
        except (TypeError, ValueError, tf.errors.OpError) as error:
            raise ValueError(
                "Invalid value for argument `batch`. Received: x of shape "
                f"{tuple(inputs.shape)} and dtype {inputs.dtype.name}, on "
                f"which layer {layer.name!r} of the model fails: {error}"
            ) from error
        outputs.append(values)
    return layer_inputs, outputs


def _medians(runs, warmup, repeats):
    """`{device: median seconds}` of `runs`, the devices taking turns."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    timings = {device: [] for device in runs}
    for _ in range(repeats):
        for device, run in runs.items():
            timings[device].append(run())
    return {device: float(np.median(t)) for device, t in timings.items()}


def _harness_run(device, inputs):
    """A run of the timing harness alone: a function call that sums its
    input on `device` and copies the sum to the host."""
    import tensorflow as tf

    with tf.device(device):
        inputs = tf.identity(inputs)

    @tf.function
    def step(values):
        with tf.device(device):
            return _sum([values])

    return _timer(step, inputs)


def _timer(step, inputs):
    """`run()`: seconds of `step(inputs)` until its result is on the host."""
    step.get_concrete_function(inputs)

    def run():
        start = time.perf_counter()
        step(inputs).numpy()
        return time.perf_counter() - start

    return run


def _timed_run(layer, device, inputs, input_gradient):
    """A function that runs `layer`'s forward + backward on `device` once and
    returns the seconds until the result was on the host."""
    import tensorflow as tf

    with tf.device(device):
        copy = _copy(layer, inputs)
        inputs = tf.identity(inputs)

    @tf.function
    def step(values):
        # Gradient ops go where `tape.gradient` is called: on the device.
        with tf.device(device):
            with tf.GradientTape() as tape:
                if input_gradient:
                    tape.watch(values)
                outputs = copy(values, training=True)
                total = _sum(tf.nest.flatten(outputs))
            sources = list(copy.trainable_weights)
            if input_gradient and values.dtype.is_floating:
                sources.append(values)
            gradients = tape.gradient(total, sources) if sources else []
            return total + _sum([g for g in gradients if g is not None])

    return _timer(step, inputs)


def _copy(layer, inputs):
    """`layer` re-created in the current device scope with its weights.

    Weights live where they are created: timing the original layer on
    another device would count copying its weights there on every run. A
    layer that cannot be re-created from its config (no `get_config`) is
    timed as it is.
    """
    import tensorflow as tf

    try:
        copy = type(layer).from_config(layer.get_config())
        copy(inputs[:1], training=False)  # creates the weights here
        copy.set_weights(layer.get_weights())
    except (NotImplementedError, TypeError, ValueError, tf.errors.OpError):
        return layer
    return copy


def _sum(tensors):
    import tensorflow as tf

    if not tensors:
        return tf.constant(0.0)
    return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tensors])


def _device_memory(device):
    """Free bytes of an accelerator whose memory its description knows,
    else None (a CPU's memory is the host's, shared)."""
    from keras_hetero import devices as devices_lib

    kind, _ = _local_key(device)
    if kind == "CPU":
        return None
    name = _with_prefix(device)
    return devices_lib.free_memory(
        name, devices_lib.describe(name).memory_bytes
    )


def _check_profile(measured):
    devices, layers = measured.devices, measured.layer_names
    problems = []
    if (
        not isinstance(devices, list)
        or not devices
        or not all(isinstance(d, str) for d in devices)
    ):
        problems.append(f"devices={devices!r} (expected a list of names)")
    if not isinstance(layers, list) or not all(
        isinstance(name, str) for name in layers
    ):
        problems.append(f"layer_names={layers!r} (expected a list of names)")
    if problems:
        _raise(problems)
    if len(set(devices)) != len(devices) or len(set(layers)) != len(layers):
        _raise([f"devices={devices!r}, layer_names={layers!r} (repeated)"])
    seconds = measured.seconds
    if not isinstance(seconds, dict) or set(seconds) != set(devices):
        _raise(["seconds (expected a dict with one entry per device)"])
    for device in devices:
        row = seconds[device]
        if not isinstance(row, dict) or set(row) != set(layers):
            problems.append(f"seconds[{device!r}] (expected every layer)")
        elif not all(_is_seconds(row[name]) for name in layers):
            problems.append(f"seconds[{device!r}]={row!r}")
        elif not sum(row.values()) > 0:
            problems.append(f"seconds[{device!r}] (all zero)")
    for field in ("param_bytes", "activation_bytes"):
        sizes = getattr(measured, field)
        if (
            not isinstance(sizes, dict)
            or set(sizes) != set(layers)
            or not all(_is_bytes(sizes[name]) for name in layers)
        ):
            problems.append(f"{field}={sizes!r}")
    memory = measured.device_memory
    if (
        not isinstance(memory, dict)
        or set(memory) != set(devices)
        or not all(m is None or _is_bytes(m) for m in memory.values())
    ):
        problems.append(f"device_memory={memory!r}")
    if not _is_bytes(measured.batch_size) or measured.batch_size < 1:
        problems.append(f"batch_size={measured.batch_size!r}")
    if problems:
        _raise(problems)


def _is_seconds(value):
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _is_bytes(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _raise(problems):
    raise ValueError(
        "Invalid `Profile`. Received: "
        + "; ".join(problems)
        + ". Expected measured seconds (>= 0, some > 0 per device) for "
        "every device and layer, bytes (integers >= 0) for every layer, "
        "memory (bytes or None) for every device and a positive batch size."
    )


def _short(value, limit=80):
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
