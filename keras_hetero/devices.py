"""What a device is: one description that every decision reads.

`describe(name)` says what kind of device a TensorFlow device name is, its
model name, compute capability, memory and whether it runs bfloat16 fast.
`precision="auto"`, `kh.doctor` and `kh.placement.profile` all read it, so
a test that makes a worker describe its devices as another machine's
(`kh.testing.emulated_fleet`, through `EMULATE_ENV`) exercises the same
code path a real GPU of that kind takes.
"""

import dataclasses
import json
import os

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute

# A TEST SEAM, not a user setting: JSON naming the device every replica
# device of this process is described as (a `FLEET` name or a dict of
# `DeviceDescription` fields), or a list of them, one per worker (by global
# worker index), so one value serves every worker of a job. Set it with
# `kh.testing.emulated_fleet`.
EMULATE_ENV = "KERAS_HETERO_EMULATE_DEVICES"


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What one device is.

    Attributes:
        name: The TensorFlow device name (as `tf.device` takes it).
        kind: `"CPU"`, `"GPU"`, `"TPU"`, ...
        model: The device's model name (`"Tesla T4"`), or `"host CPU"`.
        compute_capability: A GPU's `(major, minor)`, else None.
        memory_bytes: Memory TensorFlow may allocate on the device (a CPU:
            the host's), or None if unknown.
        bfloat16: Whether the device computes in bfloat16 at full speed
            (GPUs of compute capability 8.0 or more, TPUs).
        emulated: Whether `EMULATE_ENV` made this description (a test).
    """

    name: str
    kind: str
    model: str
    compute_capability: tuple = None
    memory_bytes: int = None
    bfloat16: bool = False
    emulated: bool = False

    def to_dict(self):
        """The description as plain JSON values."""
        values = dataclasses.asdict(self)
        if self.compute_capability is not None:
            values["compute_capability"] = list(self.compute_capability)
        return values

    @classmethod
    def from_dict(cls, values):
        """The description `to_dict` gave."""
        values = dict(values)
        if values.get("compute_capability") is not None:
            values["compute_capability"] = tuple(values["compute_capability"])
        return cls(**values)


_GIB = 1 << 30

# Named fleet entries for `EMULATE_ENV` (`kh.testing.emulated_fleet`).
FLEET = {
    "H100": dict(
        kind="GPU",
        model="NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        memory_bytes=80 * _GIB,
        bfloat16=True,
    ),
    "A100": dict(
        kind="GPU",
        model="A100-SXM4-80GB",
        compute_capability=(8, 0),
        memory_bytes=80 * _GIB,
        bfloat16=True,
    ),
    "V100": dict(
        kind="GPU",
        model="Tesla V100-SXM2-16GB",
        compute_capability=(7, 0),
        memory_bytes=16 * _GIB,
        bfloat16=False,
    ),
    "T4": dict(
        kind="GPU",
        model="Tesla T4",
        compute_capability=(7, 5),
        memory_bytes=16 * _GIB,
        bfloat16=False,
    ),
    "CPU": dict(kind="CPU", model="host CPU", bfloat16=False),
}


def describe(name, cpu_memory_bytes=None):
    """A `DeviceDescription` of device `name` of this process.

    Args:
        name: A full logical device name, e.g. `"/device:GPU:0"`.
        cpu_memory_bytes: A CPU's memory (the host's), if the caller knows
            it better (e.g. a cgroup limit). Defaults to `None`: the
            machine's physical memory.

    Returns:
        A `DeviceDescription`; the emulated one if `EMULATE_ENV` is set.

    Example:

    >>> describe("/device:CPU:0").kind
    'CPU'
    """
    emulated = emulated_entry()
    if emulated is not None:
        return DeviceDescription(name=name, emulated=True, **emulated)
    kind = _distribute.device_type(name)
    if kind == "CPU":
        return DeviceDescription(
            name=name,
            kind=kind,
            model="host CPU",
            memory_bytes=cpu_memory_bytes or physical_memory(),
        )
    if kind != "GPU":
        return DeviceDescription(
            name=name, kind=kind, model=kind, bfloat16=kind == "TPU"
        )
    index = tf.DeviceSpec.from_string(name).device_index or 0
    logical = _logical_gpus()
    physical, memory = logical[index] if index < len(logical) else (None, None)
    details = {}
    if physical is not None:
        details = tf.config.experimental.get_device_details(physical) or {}
    capability = details.get("compute_capability")
    capability = None if capability is None else tuple(capability)
    if memory is None:
        memory = _compat.gpu_memory_limit(index)
    return DeviceDescription(
        name=name,
        kind=kind,
        model=details.get("device_name") or "GPU",
        compute_capability=capability,
        memory_bytes=memory,
        bfloat16=capability is not None and capability >= (8, 0),
    )


def free_memory(name, memory_bytes):
    """Bytes an accelerator can still give a model: its `memory_bytes`
    less what TensorFlow holds on it now (as far as TensorFlow says).

    Args:
        name: The device's TensorFlow name.
        memory_bytes: Its memory (`DeviceDescription.memory_bytes`), or
            None if unknown.

    Returns:
        An int, or None if `memory_bytes` is None.
    """
    if memory_bytes is None:
        return None
    try:
        used = tf.config.experimental.get_memory_info(name)["current"]
    except (ValueError, RuntimeError, tf.errors.OpError):
        used = 0  # a device that does not count its memory
    return max(0, int(memory_bytes) - int(used))


def describe_replicas(strategy):
    """A `DeviceDescription` of each of this process's replica devices of
    `strategy` (under MultiWorkerMirroredStrategy: this worker's only)."""
    if _distribute.is_multi_worker(strategy):
        names = strategy.extended.worker_devices
    else:
        # Handles the default strategy (no `worker_devices`) too.
        names = _distribute.global_replica_devices(strategy)
    return [describe(name) for name in names]


def emulated_entry(environ=None):
    """The fleet entry `EMULATE_ENV` gives this process, or None.

    Args:
        environ: The environment to read. Defaults to `os.environ`.

    Returns:
        A dict of `DeviceDescription` fields (all but `name` and
        `emulated`), or None if `EMULATE_ENV` is unset.

    Raises:
        ValueError: If `EMULATE_ENV` is not JSON naming fleet entries, or a
            list has no entry for this worker.
    """
    text = (os.environ if environ is None else environ).get(EMULATE_ENV)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = text  # a bare fleet name
    if isinstance(value, list):
        index = _distribute.env_task(environ).worker_index
        if index >= len(value):
            raise ValueError(
                f"{EMULATE_ENV}={text!r} names {len(value)} device(s), one "
                f"per worker, but this is worker {index}."
            )
        value = value[index]
    return fleet_entry(value)


def fleet_entry(entry):
    """`entry` (a `FLEET` name or a dict of `DeviceDescription` fields) as
    a complete dict of those fields but `name` and `emulated`.

    Raises:
        ValueError: For an unknown name or field, or a missing `kind`.
    """
    if isinstance(entry, str) and entry in FLEET:
        entry = FLEET[entry]
    fields = {"kind", "model", "compute_capability", "memory_bytes", "bfloat16"}
    if (
        not isinstance(entry, dict)
        or not set(entry) <= fields
        or "kind" not in entry
    ):
        raise ValueError(
            "Invalid emulated device. Received: "
            f"{entry!r}. Expected one of {sorted(FLEET)} or a dict with "
            f"`kind` and any of {sorted(fields - {'kind'})}."
        )
    capability = entry.get("compute_capability")
    return dict(
        kind=str(entry["kind"]).upper(),
        model=entry.get("model", str(entry["kind"])),
        compute_capability=None if capability is None else tuple(capability),
        memory_bytes=entry.get("memory_bytes"),
        bfloat16=bool(entry.get("bfloat16", False)),
    )


def _logical_gpus():
    """`(physical device, memory limit in bytes or None)` per logical GPU,
    in logical order (a physical GPU may be split into several)."""
    logical = []
    for physical in tf.config.list_physical_devices("GPU"):
        configs = tf.config.get_logical_device_configuration(physical)
        if not configs:
            logical.append((physical, None))
            continue
        for config in configs:
            limit = getattr(config, "memory_limit", None)
            logical.append((physical, None if limit is None else limit << 20))
    return logical


def physical_memory():
    """The host's physical memory in bytes, or None where the system does
    not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
