"""Precision policies for mixed hardware: `kh.set_precision` and the rule
behind `precision="auto"`.

Every replica runs the same graph with the same variables, so a job has one
precision. "auto" picks the fastest one that every device runs well:

- all devices are GPUs of compute capability >= 8.0 (Ampere and newer) or
  TPUs: `"mixed_bfloat16"` (no loss scaling needed);
- all are GPUs of compute capability >= 7.0 (Volta, Turing): `"mixed_float16"`
  (HeteroModel scales the loss);
- anything else (a CPU, an older GPU, an unknown device): `"float32"`.
"""

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._compat import keras

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


def auto_precision(devices):
    """The policy "auto" picks for `devices`.

    Args:
        devices: One `(device_type, compute_capability)` per replica device,
            e.g. `("GPU", (8, 0))`, `("CPU", None)`, `("TPU", None)`.

    Returns:
        `"float32"`, `"mixed_float16"` or `"mixed_bfloat16"`.

    Example:

    >>> auto_precision([("GPU", (8, 6)), ("GPU", (7, 5))])
    'mixed_float16'
    """
    devices = list(devices)
    if not devices:
        return "float32"

    def rank(device):
        kind, capability = device
        kind = (kind or "").upper()
        if kind == "TPU":
            return 2
        if kind == "GPU" and capability is not None:
            if tuple(capability) >= (8, 0):
                return 2
            if tuple(capability) >= (7, 0):
                return 1
        return 0

    return POLICIES[min(rank(d) for d in devices)]


def strategy_devices(strategy):
    """`(device_type, compute_capability)` of this worker's replica devices."""
    found = []
    for name in strategy.extended.worker_devices:
        spec = tf.DeviceSpec.from_string(name)
        kind = _distribute.device_type(name)
        capability = None
        if kind == "GPU":
            gpus = tf.config.list_physical_devices("GPU")
            index = spec.device_index or 0
            if index < len(gpus):
                details = tf.config.experimental.get_device_details(gpus[index])
                capability = details.get("compute_capability")
        found.append((kind, capability))
    return found


def resolve(precision, strategy=None):
    """`precision` as a Keras policy name ("auto" resolved for `strategy`).

    Raises:
        ValueError: For an unknown name.
    """
    check_precision(precision)
    if precision in (None, "float32"):
        return "float32"
    if precision == "auto":
        strategy = strategy or tf.distribute.get_strategy()
        return auto_precision(strategy_devices(strategy))
    return precision


def check_precision(precision):
    """Returns `precision` if it is a name `HeteroModel` and
    `set_precision` take (one of `POLICIES`, `"auto"` or None).

    Raises:
        ValueError: Naming the value and the accepted ones.
    """
    if precision is None or precision == "auto" or precision in POLICIES:
        return precision
    raise ValueError(
        "Invalid value for argument `precision`. Received: "
        f"precision={precision!r}. Expected one of "
        f"{(*POLICIES, 'auto')} or None."
    )


def set_precision(precision, strategy=None):
    """Sets Keras' global dtype policy; build the model after this.

    Layers take their compute dtype when they are created, so call this
    before building the model and pass the same `precision` to
    `kh.HeteroModel` (which then scales the loss for float16).

    Args:
        precision: `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"` or
            `"auto"` (see the module docstring for the rule).
        strategy: The strategy whose devices "auto" looks at. Defaults to
            the current one.

    Returns:
        The policy name that was set.

    Raises:
        ValueError: For an unknown `precision`.

    Example:

    >>> set_precision("auto")  # on a CPU-only machine
    'float32'
    """
    policy = resolve(precision, strategy)
    keras.mixed_precision.set_global_policy(policy)
    return policy


def compute_dtypes(model):
    """The set of compute dtypes of the model's layers (names)."""
    dtypes = set()
    for layer in _compat.all_layers(model):
        dtype = getattr(layer, "compute_dtype", None)
        if dtype is not None:
            dtypes.add(tf.as_dtype(dtype).name)
    return dtypes


def check_model(model, policy):
    """Raises if the model's layers do not compute in `policy`'s dtype.

    Returns:
        Whether the loss must be scaled (float16 compute).
    """
    dtypes = compute_dtypes(model)
    wanted = {
        "float32": "float32",
        "mixed_float16": "float16",
        "mixed_bfloat16": "bfloat16",
    }[policy]
    if policy != "float32" and wanted not in dtypes:
        raise ValueError(
            f"precision={policy!r}, but no layer of the model computes in "
            f"{wanted} (found {sorted(dtypes) or 'no layers'}). Layers take "
            "their dtype when they are created: call "
            f"`kh.set_precision({policy!r})` (or "
            f"`keras.mixed_precision.set_global_policy({policy!r})`) before "
            "building the model."
        )
    return "float16" in dtypes
