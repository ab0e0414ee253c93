"""Precision policies for mixed hardware: `kh.set_precision` and the rule
behind `precision="auto"`.

Every replica runs the same graph with the same variables, so a job has one
precision. "auto" picks the fastest one that every device of the job runs
well, from each device's description (`keras_hetero.devices.describe`;
under MultiWorkerMirroredStrategy every worker's, exchanged, so all workers
pick the same):

- all devices run bfloat16 fast: GPUs of compute capability >= 8.0
  (Ampere and newer) or TPUs: `"mixed_bfloat16"` (no loss scaling needed);
- all are GPUs of compute capability >= 7.0 (Volta, Turing): `"mixed_float16"`
  (HeteroModel scales the loss);
- anything else (a CPU, an older GPU, an unknown device): `"float32"`.
"""

import tensorflow as tf

from keras_hetero import _agreement
from keras_hetero import _compat
from keras_hetero import devices as devices_lib
from keras_hetero._checks import check_choice
from keras_hetero._compat import keras

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


def auto_precision(devices):
    """The policy "auto" picks for `devices`.

    Args:
        devices: The job's replica devices: `DeviceDescription`s (what
            `keras_hetero.devices.describe` returns; `kh.doctor`'s
            `DeviceReport`s work too), or
            `(device_type, compute_capability)` pairs such as
            `("GPU", (8, 0))`, `("CPU", None)`, `("TPU", None)`.

    Returns:
        `"float32"`, `"mixed_float16"` or `"mixed_bfloat16"`.

    Example:

    >>> auto_precision([("GPU", (8, 6)), ("GPU", (7, 5))])
    'mixed_float16'
    """
    devices = list(devices)
    if not devices:
        return "float32"
    return POLICIES[min(_rank(device) for device in devices)]


def _rank(device):
    """2: runs bfloat16 fast; 1: float16 (a GPU of cc >= 7.0); 0: neither."""
    if hasattr(device, "bfloat16"):  # a description or a doctor's report
        kind, capability = device.kind, device.compute_capability
        bfloat16 = device.bfloat16
    else:
        kind, capability = device
        kind = (kind or "").upper()
        bfloat16 = kind == "TPU" or (
            kind == "GPU"
            and capability is not None
            and tuple(capability) >= (8, 0)
        )
    if bfloat16:
        return 2
    if kind == "GPU" and capability is not None and tuple(capability) >= (7, 0):
        return 1
    return 0


def resolve(precision, strategy=None, settings=None):
    """`precision` as a Keras policy name ("auto" resolved for `strategy`).

    Under MultiWorkerMirroredStrategy across workers, every worker must
    call this (as `compile` and `set_precision` do): the workers exchange
    their device descriptions, `precision` and `settings` in one
    all-gather, so "auto" resolves from ALL workers' devices and every
    worker gets the same policy.

    Args:
        precision: A name `check_precision` accepts.
        strategy: The job's strategy. Defaults to the current one.
        settings: More `{name: JSON value}` that must match between the
            workers (e.g. the model's compute dtypes). Defaults to `None`.

    Raises:
        ValueError: For an unknown name, or (on every worker) if the
            workers were given different `precision`s or `settings`.
    """
    check_precision(precision)
    strategy = strategy or tf.distribute.get_strategy()
    if _agreement.needs_exchange(strategy):
        record = {
            "devices": [
                d.to_dict() for d in devices_lib.describe_replicas(strategy)
            ],
            "settings": {"precision": precision, **(settings or {})},
        }
        records = _agreement.exchange(strategy, record)
        _agreement.check_settings(records, "the precision policy")
        devices = [
            devices_lib.DeviceDescription.from_dict(d)
            for worker in records
            for d in worker["devices"]
        ]
    elif precision == "auto":
        devices = devices_lib.describe_replicas(strategy)
    if precision in (None, "float32"):
        return "float32"
    if precision == "auto":
        return auto_precision(devices)
    return precision


def check_precision(precision):
    """Returns `precision` if it is a name `HeteroModel` and
    `set_precision` take (one of `POLICIES`, `"auto"` or None).

    Raises:
        ValueError: Naming the value and the accepted ones.
    """
    return check_choice(
        "precision",
        precision,
        (None, "auto", *POLICIES),
        f"one of {(*POLICIES, 'auto')} or None",
    )


def set_precision(precision, strategy=None):
    """Sets Keras' global dtype policy; build the model after this.

    Layers take their compute dtype when they are created, so call this
    before building the model and pass the same `precision` to
    `kh.HeteroModel` (which then scales the loss for float16).

    Args:
        precision: `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"` or
            `"auto"` (see the module docstring for the rule).
        strategy: The strategy whose devices "auto" looks at (under
            MultiWorkerMirroredStrategy, every worker's: call this on every
            worker, inside the scope or with `strategy=`). Defaults to the
            current one.

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
