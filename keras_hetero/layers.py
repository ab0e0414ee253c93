"""`Placed`: run one layer (forward and backward) on a hinted device.

Model parallelism on unequal devices starts with a hint: this layer's work
belongs on that device. `Placed` wraps a layer and runs its forward pass, its
weights' creation and its backward pass under `tf.device(device)`, so the
activations cross devices where consecutive stages differ. `place(model,
hints)` wraps several layers of a chain model at once, and
`kh.placement.plan(...).apply(model)` does it from a plan.

`hint(layer, device)` hints a layer without a wrapper by replacing `call` on
that instance (neither Keras flavour has a per-layer device hook); such a
hint is not saved with the model, a `Placed` wrapper's is.
"""

import warnings

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._checks import check_int
from keras_hetero._compat import keras


@_compat.register_serializable("Placed")
class Placed(keras.layers.Wrapper):
    """Runs `layer` on `device`, optionally in its own dtype policy.

    The wrapped layer's weights are created on `device`; its forward pass
    runs there, and so does its backward pass (the gradients of its inputs
    and weights are computed under the same `tf.device`, whatever device
    the caller computes the rest of the gradient on). Activations are copied
    between devices where consecutive layers' devices differ.

    A hint naming a device this machine lacks raises at call time; a saved
    model whose hints name such a device loads with a `UserWarning` and its
    layers run wherever TensorFlow places them (soft placement), so a model
    planned for another machine still loads and runs. The hint stays in the
    config, so saving again keeps it.

    Under a strategy with several local replicas (`MirroredStrategy`) a
    device hint would pull every replica's computation onto one device, so
    calling a `Placed` layer with a `device` there raises; `dtype_policy`
    alone (no `device`) works under any strategy. See docs/placement.md.

    Args:
        layer: The `keras.layers.Layer` to wrap. With `dtype_policy` it must
            not be built yet (it is re-created in that policy).
        device: A device name such as `"/device:GPU:0"`, `"GPU:0"` or
            `"/cpu:1"`; `None` leaves placement to TensorFlow. Defaults to
            `None`.
        stage: The pipeline stage index this layer belongs to (a label, set
            by `kh.placement.Plan.apply`; it does not change placement).
            Defaults to `None`.
        dtype_policy: A Keras dtype policy name for the wrapped layer, e.g.
            `"mixed_bfloat16"` for a stage on a bfloat16-capable device while
            the rest of the model stays float32. Defaults to `None` (keep the
            layer's policy).
        **kwargs: What `keras.layers.Layer` takes (e.g. `name`).

    Raises:
        TypeError: If `layer` is not a Keras layer.
        ValueError: If `device` is not a device name, `stage` is not a
            non-negative integer, or `dtype_policy` is given for a layer
            that is already built. When called: if `device` is not one of
            this machine's logical devices, or the call is inside a replica
            of a strategy with several local replicas.

    Example:

    >>> dense = Placed(keras.layers.Dense(4), device="/device:CPU:0")
    >>> dense(np.ones((2, 3), "float32")).shape
    TensorShape([2, 4])
    """

    def __init__(
        self, layer, device=None, stage=None, dtype_policy=None, **kwargs
    ):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "Invalid value for argument `layer`. Received: "
                f"layer={layer!r}. Expected a `keras.layers.Layer`."
            )
        if dtype_policy is not None:
            layer = _in_policy(layer, dtype_policy)
        super().__init__(layer, **kwargs)
        self.device = _device_name(device)
        if stage is not None:
            stage = check_int(
                "stage", stage, 0, expected="a non-negative integer or None"
            )
        self.stage = stage
        self.dtype_policy_name = dtype_policy
        # Set by `from_config` when the hint names a device this machine
        # lacks: run with soft placement instead of raising.
        self._soft_placement = False

    def build(self, input_shape=None):
        device = self._checked_device()
        with tf.device(device):
            if not self.layer.built:
                self.layer.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        device = self._checked_device()
        if device is None:
            return self.layer(inputs, training=training)
        _refuse_local_replicas(self.name, device)
        return _on_device(
            lambda x: self.layer(x, training=training), device, inputs
        )

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        return {
            **super().get_config(),
            "device": self.device,
            "stage": self.stage,
            "dtype_policy": self.dtype_policy_name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        layer = keras.layers.deserialize(
            config.pop("layer"), custom_objects=custom_objects
        )
        placed = cls(layer, **config)
        device = placed.device
        if device is not None and not _is_available(device):
            warnings.warn(
                f"Layer `{placed.name}` was saved with the device hint "
                f"{device!r}, which this machine does not have (available: "
                f"{_available_names()}). It runs with soft placement: "
                "TensorFlow chooses its device.",
                UserWarning,
                stacklevel=2,
            )
            placed._soft_placement = True
        return placed

    def _checked_device(self):
        """The device to run on, or None for TensorFlow's choice."""
        if self.device is None or self._soft_placement:
            return None
        if not _is_available(self.device):
            raise ValueError(
                f"Invalid device hint for layer `{self.name}`. Received: "
                f"device={self.device!r}. Expected one of this machine's "
                f"logical devices: {_available_names()}."
            )
        return self.device


def hint(layer, device, stage=None):
    """Writes a device hint onto `layer` itself (no wrapper, no copy).

    From then on the layer's forward and backward passes run on `device`
    (as in `Placed`), in any model that contains it. Its weights stay where
    they were created and are read across devices; `place` builds copies
    whose weights live on their devices instead. The hint lives on this
    layer object: it is not part of `get_config`, so a saved and reloaded
    model has none (use `place` for hints that are saved).

    Args:
        layer: A built or unbuilt `keras.layers.Layer`.
        device: A device name such as `"/device:GPU:0"` or `"GPU:0"`, or
            None to remove a hint.
        stage: A pipeline stage label (does not change placement).

    Returns:
        `layer`.

    Raises:
        TypeError: If `layer` is not a Keras layer.
        ValueError: If `device` is not a device name. When called: as
            `Placed` (a device this machine lacks, or a replica of a
            multi-device strategy).

    Example:

    >>> dense = hint(keras.layers.Dense(2), "/device:CPU:0")
    >>> dense.placement_hint
    {'device': '/device:CPU:0', 'stage': None}
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(
            "Invalid value for argument `layer`. Received: "
            f"layer={layer!r}. Expected a `keras.layers.Layer`."
        )
    device = _device_name(device)
    # The class's `call`: a hinted layer's own attribute is never wrapped
    # twice, and removing the hint restores it.
    original = type(layer).call
    if device is None:
        layer.__dict__.pop("call", None)
        layer.__dict__.pop("placement_hint", None)
        return layer

    def call(inputs, *args, **kwargs):
        if not _is_available(device):
            raise ValueError(
                f"Invalid device hint for layer `{layer.name}`. Received: "
                f"device={device!r}. Expected one of this machine's "
                f"logical devices: {_available_names()}."
            )
        _refuse_local_replicas(layer.name, device)
        return _on_device(
            lambda x: original(layer, x, *args, **kwargs), device, inputs
        )

    # Plain attributes, outside Keras' tracking.
    object.__setattr__(layer, "call", call)
    object.__setattr__(
        layer, "placement_hint", {"device": device, "stage": stage}
    )
    return layer


def place(model, hints):
    """A copy of a chain model with some of its layers `Placed` on devices.

    Every layer is re-created from its config and gets a copy of its
    weights, so hinted layers create their weights on their devices (a
    layer's weights stay where they were created, and `model`'s were
    created before any hint). `model` itself is unchanged. Layers not named
    in `hints` are copied as they are.

    Args:
        model: A `keras.Sequential` or functional model whose layers form a
            chain (each layer feeds only the next).
        hints: `{layer name or layer: device}`, or `{layer name or layer:
            dict of Placed arguments}` such as `{"device": "GPU:0",
            "stage": 1, "dtype_policy": "mixed_bfloat16"}`.

    Returns:
        A functional `keras.Model` with the same weights. Wrap it with
        `kh.HeteroModel.from_model(...)` for HeteroModel's step.

    Raises:
        ValueError: If `model` is not a chain, or a hint names a layer that
            is not one of its top-level layers.

    Example:

    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> placed = place(model, {model.layers[-1].name: "/device:CPU:0"})
    """
    layers = chain_layers(model)
    names = [layer.name for layer in layers]
    by_name = {}
    for key, value in hints.items():
        name = key.name if isinstance(key, keras.layers.Layer) else key
        if name not in names:
            raise ValueError(
                "Invalid value for argument `hints`. Received: a hint for "
                f"{name!r}. Expected names of the model's layers: {names}."
            )
        by_name[name] = value if isinstance(value, dict) else {"device": value}
    inputs = keras.Input(
        batch_shape=tuple(model.inputs[0].shape),
        dtype=model.inputs[0].dtype,
    )
    outputs, copies = inputs, []
    for layer in layers:
        copy = type(layer).from_config(layer.get_config())
        copies.append((copy, layer))
        if layer.name in by_name:
            copy = Placed(
                copy, name=f"placed_{layer.name}", **by_name[layer.name]
            )
        outputs = copy(outputs)
    for copy, layer in copies:
        copy.set_weights(layer.get_weights())
    return keras.Model(inputs, outputs, name=f"placed_{model.name}")


def _on_device(function, device, inputs):
    """`function(inputs)` with forward and backward under `tf.device(device)`.

    TensorFlow creates gradient ops where `tape.gradient` is called, not where
    their forward ops ran, so the backward pass gets its own device scope
    through a custom gradient.
    """
    flat_inputs = tf.nest.flatten(inputs)
    structure = {}

    @tf.custom_gradient
    def forward(*tensors):
        with tf.device(device):
            with tf.GradientTape() as tape:
                tape.watch(tensors)
                outputs = function(
                    tf.nest.pack_sequence_as(inputs, list(tensors))
                )
        structure["outputs"] = outputs
        flat_outputs = tf.nest.flatten(outputs)

        def backward(*upstream, variables=None):
            variables = list(variables or [])
            sources = list(tensors) + variables
            with tf.device(device):
                grads = tape.gradient(
                    flat_outputs,
                    [s for s in sources if _differentiable(s)],
                    output_gradients=list(upstream),
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            grads = iter(grads)
            full = [
                next(grads) if _differentiable(s) else None for s in sources
            ]
            return full[: len(tensors)], full[len(tensors) :]

        return flat_outputs, backward

    flat_outputs = forward(*flat_inputs)
    return tf.nest.pack_sequence_as(structure["outputs"], list(flat_outputs))


def _differentiable(tensor):
    return tf.as_dtype(tensor.dtype).is_floating


def _refuse_local_replicas(name, device):
    if not tf.distribute.has_strategy() or (
        tf.distribute.in_cross_replica_context()
    ):
        return
    strategy = tf.distribute.get_strategy()
    local = list(getattr(strategy.extended, "worker_devices", ()))
    if len(local) > 1:
        raise ValueError(
            f"Layer `{name}` has the device hint {device!r} but runs in a "
            f"replica of {type(strategy).__name__} over {len(local)} local "
            f"devices {local}: the hint would pull every replica's "
            "computation onto one device, which defeats data parallelism. "
            "Either drop the device hints (keep `dtype_policy`) and let the "
            "strategy place replicas, or train the placed model without a "
            "multi-device strategy (one replica spanning the devices). "
            "See docs/placement.md."
        )


def _in_policy(layer, policy):
    """`layer`, or a copy of the unbuilt `layer` that computes in `policy`."""
    current = getattr(layer.dtype_policy, "name", None)
    if current == policy:
        return layer
    if layer.built:
        raise ValueError(
            "Invalid value for argument `dtype_policy`. Received: "
            f"dtype_policy={policy!r} for layer `{layer.name}`, which is "
            f"already built in policy {current!r}. Expected an unbuilt layer "
            "(it is re-created in the new policy)."
        )
    return type(layer).from_config({**layer.get_config(), "dtype": policy})


def _device_name(device):
    if device is None:
        return None
    if not isinstance(device, str) or not device.strip():
        raise ValueError(
            "Invalid value for argument `device`. Received: "
            f"device={device!r}. Expected a device name such as "
            '"/device:GPU:0", "GPU:0" or None.'
        )
    name = device.strip()
    if not name.startswith("/"):
        name = "/device:" + name
    try:
        tf.DeviceSpec.from_string(name)
    except ValueError:
        raise ValueError(
            "Invalid value for argument `device`. Received: "
            f"device={device!r}. Expected a device name such as "
            '"/device:GPU:0", "GPU:0" or None.'
        ) from None
    return name


def _is_available(device):
    return _distribute.is_local_device(device)


def _available_names():
    return [d.name for d in tf.config.list_logical_devices()]


def chain_layers(model):
    """The top-level layers of `model`, which must form a chain.

    Args:
        model: A `keras.Sequential` or functional model.

    Returns:
        The layers in order, input layers excluded.

    Raises:
        ValueError: If the model has several inputs or outputs, a layer is
            used more than once, or a layer's input is not the previous
            layer's output (a branch or skip connection).

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> [layer.name for layer in chain_layers(model)]
    """
    return [layer for layer, _ in chain_with_outputs(model)]


def chain_with_outputs(model):
    """`[(layer, its output tensor in model)]` of a chain model.

    Args:
        model: A `keras.Sequential` or functional model.

    Returns:
        A list of `(layer, output)` pairs in order, input layers excluded.

    Raises:
        ValueError: As `chain_layers`.

    Example:

    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> [layer.name for layer, _ in chain_with_outputs(model)]
    """
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs or len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(
            "Invalid value for argument `model`. Received: "
            f"model={model.name!r} with inputs {inputs} and outputs "
            f"{outputs}. Expected a Sequential or functional model with one "
            "symbolic input and one output (start a Sequential model with "
            "`keras.Input(...)`)."
        )
    layers = [
        layer
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    tensor, chain = inputs[0], []
    for layer in layers:
        # The layer's call on `tensor` (a layer may also be used by other
        # models; those calls are other nodes).
        follows = [
            node
            for node in _compat.inbound_nodes(layer)
            if len(tf.nest.flatten(node.input_tensors)) == 1
            and tf.nest.flatten(node.input_tensors)[0] is tensor
            and len(tf.nest.flatten(node.output_tensors)) == 1
        ]
        if len(follows) != 1:
            raise ValueError(
                f"Model {model.name!r} is not a chain of layers: layer "
                f"{layer.name!r} does not take exactly the previous layer's "
                "output. The planner splits a sequence of layers into "
                "contiguous stages; for a model with branches, skip "
                "connections or shared layers, wrap each branching block in "
                "its own model (one layer of the chain) or place layers by "
                "hand with `kh.layers.Placed`."
            )
        tensor = tf.nest.flatten(follows[0].output_tensors)[0]
        chain.append((layer, tensor))
    if tensor is not outputs[0]:
        raise ValueError(
            f"Model {model.name!r} is not a chain of layers: its output is "
            "not its last layer's output."
        )
    return chain
