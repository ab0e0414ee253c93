"""What `kh.doctor()` found, as frozen values: `DoctorReport` and its parts.

`DoctorReport.table()` is the terminal view (`keras-hetero doctor`),
`DoctorReport.to_json()` the machine one (`keras-hetero doctor --json`).
The decisions drawn from the measurements (`suggest_shares`,
`clock_verdict`) are pure functions, testable without TensorFlow; the
rows a device holds are `keras_hetero.balancing.memory.rows_that_fit`'s,
the estimate `ShardRebalancer(max_rows="auto")` caps shares with.
"""

import dataclasses
import json
import math

import numpy as np

from keras_hetero.balancing import core
from keras_hetero.training import clock_check

# The same thresholds as the online trust check during `fit`.
CLOCK_TRUST_THRESHOLD = clock_check.TRUST_FRACTION
MIN_JUDGED_SECONDS = clock_check.MIN_JUDGED_SECONDS


@dataclasses.dataclass(frozen=True)
class HostReport:
    """The machine this process runs on.

    Attributes:
        hostname: The host's name.
        cpu_model: The CPU model (from /proc/cpuinfo), or None if unknown.
        cpu_count: The machine's logical cores (`os.cpu_count()`).
        usable_cores: Cores this process may run on (its affinity,
            `os.sched_getaffinity`).
        cpu_quota: Cores' worth of CPU time a cgroup quota allows this
            process (the tightest along its cgroup path), or None without
            a quota.
        memory_bytes: Memory this process may use: the machine's, or its
            cgroup limit if lower; None if unknown.
        available_memory_bytes: Of that, free now (MemAvailable, or the
            cgroup limit minus its usage if lower); None if unknown.
    """

    hostname: str
    cpu_model: str
    cpu_count: int
    usable_cores: int
    cpu_quota: float = None
    memory_bytes: int = None
    available_memory_bytes: int = None


@dataclasses.dataclass(frozen=True)
class DeviceReport:
    """One local device and how fast it is alone.

    Attributes:
        name: The TensorFlow device name (as `tf.device` takes it).
        kind: `"CPU"`, `"GPU"`, `"TPU"`, ...
        description: The GPU's name, or `"host CPU"`.
        compute_capability: A GPU's `(major, minor)`, else None.
        memory_bytes: Memory TensorFlow may allocate on the device (a CPU:
            the host's), or None if unknown.
        matmul_size: `n` of the `n x n` float32 matmul that timed it.
        flops: Its float32 matmul rate in FLOP/s, host-synchronised (each
            run ends with a host copy of its result).
        relative_speed: `flops` over the fastest device's (fastest = 1.0).
        step_seconds: With a model: seconds of one step's forward pass,
            loss and gradients on this device alone, host-synchronised
            (minus the host's round trip to the device); else None.
        clock_seconds: With a model: what `HeteroModel`'s in-step clock
            (`model.step_stats.compute_seconds`) read for the same work
            under `OneDeviceStrategy` (the least over steps); else None.
        clock_trusted: Whether `clock_seconds` sees this device's work
            (False: it reads under half of `step_seconds`); None without a
            model or when the step is too short to judge.
        max_rows: With a model: an ESTIMATE of the rows per step the device
            holds (weights, gradients, optimizer state and activations);
            else None.
        notes: Findings in words.
        bfloat16: Whether the device computes in bfloat16 at full speed.
    """

    name: str
    kind: str
    description: str
    compute_capability: tuple = None
    memory_bytes: int = None
    matmul_size: int = 0
    flops: float = math.nan
    relative_speed: float = math.nan
    step_seconds: float = None
    clock_seconds: float = None
    clock_trusted: bool = None
    max_rows: int = None
    notes: tuple = ()
    bfloat16: bool = False


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """The model the step timings used.

    Attributes:
        name: The model's name.
        batch_size: Rows of the timed batch.
        state_bytes: Bytes of weights, gradients and optimizer state.
        activation_bytes_per_row: ESTIMATED bytes per row for activations
            (twice the layers' outputs: kept for the backward pass, and
            their gradients), or None if the layers' outputs are unknown.
    """

    name: str
    batch_size: int
    state_bytes: int
    activation_bytes_per_row: int = None


@dataclasses.dataclass(frozen=True)
class PeerReport:
    """Whether this process reached one task of the cluster.

    Attributes:
        task: `"worker:1"`, `"chief:0"`, ... as in `TF_CONFIG`.
        address: Its `"host:port"`.
        reachable: Whether a TCP connection succeeded within the timeout.
        connect_seconds: Seconds the successful connection took, or None.
        error: The last connection error, or None.
    """

    task: str
    address: str
    reachable: bool
    connect_seconds: float = None
    error: str = None


@dataclasses.dataclass(frozen=True)
class ClusterReport:
    """The cluster `TF_CONFIG` names and what was checked of it.

    Attributes:
        task: This process's task, e.g. `"worker:0"`.
        address: This task's `"host:port"` (None for an evaluator).
        worker_index: This worker's index in global replica order.
        num_workers: Chief and worker tasks.
        peers: One `PeerReport` per other task.
        allreduce_bytes: The all-reduced tensor's bytes (`collective=True`),
            else None.
        allreduce_seconds: Median seconds of one all-reduce of it across
            the workers (host-synchronised), else None.
        agree: Whether every worker's `TF_CONFIG` names the same cluster
            (`collective=True`), else None.
        replica_devices: `collective=True`: the devices of every replica of
            `MultiWorkerMirroredStrategy`, in global replica order.
        suggested_shares: `collective=True`: shares for `kh.data.shard`
            under that strategy, one per global replica, proportional to
            each replica device's measured speed.
    """

    task: str
    address: str
    worker_index: int
    num_workers: int
    peers: tuple = ()
    allreduce_bytes: int = None
    allreduce_seconds: float = None
    agree: bool = None
    replica_devices: tuple = None
    suggested_shares: tuple = None

    @property
    def allreduce_megabytes_per_second(self):
        """`allreduce_bytes / allreduce_seconds` in MB/s, or None."""
        if not self.allreduce_seconds:
            return None
        return self.allreduce_bytes / self.allreduce_seconds / 1e6


@dataclasses.dataclass(frozen=True)
class DoctorReport:
    """What `kh.doctor()` found: devices, speeds, clock trust, cluster.

    Attributes:
        host: A `HostReport` of this machine.
        devices: One `DeviceReport` per local device, in the order timed.
        suggested_shares: Shares for `kh.data.shard` over `devices` (in
            that order), proportional to their measured speed (see
            `shares_basis`).
        shares_basis: What the shares follow: `"matmul"` (float32 matmul
            FLOP/s) or `"model step"` (rows per second of the model's step).
        precision: What `precision="auto"` picks for `devices`.
        model: A `ModelReport` if a model was timed, else None.
        cluster: A `ClusterReport` under `TF_CONFIG`, else None.
        versions: `(name, version)` pairs: TensorFlow, Keras and the flavour.
    """

    host: HostReport
    devices: tuple
    suggested_shares: tuple
    shares_basis: str
    precision: str
    model: ModelReport = None
    cluster: ClusterReport = None
    versions: tuple = ()

    def to_dict(self):
        """The report as plain Python values (NaN as None; `versions` a
        dict)."""
        plain = _plain(dataclasses.asdict(self))
        plain["versions"] = dict(self.versions)
        return plain

    def to_json(self, indent=2):
        """The report as a JSON string (`keras-hetero doctor --json`).

        Args:
            indent: As for `json.dumps`. Defaults to `2`.

        Returns:
            A JSON object with the keys `host`, `devices`,
            `suggested_shares`, `shares_basis`, `precision`, `model`,
            `cluster` and `versions`.
        """
        return json.dumps(self.to_dict(), indent=indent)

    def table(self):
        """The report as text for a terminal (`keras-hetero doctor`)."""
        return _table(self)

    def __str__(self):
        return self.table()


def suggest_shares(speeds):
    """Shares proportional to `speeds`, rounded to 4 decimals, summing to 1.

    Args:
        speeds: One positive speed per device (any unit).

    Returns:
        A tuple of floats; equal shares if no speed is positive and finite.

    Example:

    >>> suggest_shares([3.0, 1.0])
    (0.75, 0.25)
    """
    if not speeds:
        return ()
    # The rebalancer's rule (`balancing.core.balanced_shares`), unbounded:
    # a device without a positive, finite speed gets no share.
    seconds_per_row = np.array(
        [
            1.0 / s if s is not None and math.isfinite(s) and s > 0 else np.nan
            for s in speeds
        ]
    )
    if np.isnan(seconds_per_row).all():
        seconds_per_row[:] = 1.0
    exact = core.balanced_shares(seconds_per_row, np.zeros(len(speeds)), 1)
    shares = [round(float(s), 4) for s in exact]
    # The rounding remainder goes to the largest share, so they sum to 1.
    largest = max(range(len(shares)), key=shares.__getitem__)
    shares[largest] = round(1.0 - sum(shares) + shares[largest], 4)
    return tuple(shares)


def clock_verdict(clock_seconds, step_seconds):
    """Whether an in-step clock reading is trusted, and why not.

    Args:
        clock_seconds: What the in-step clock read for a step's compute.
        step_seconds: The host-synchronised seconds of the same work.

    Returns:
        `(trusted, note)`: `trusted` is True, False (the clock reads under
        `CLOCK_TRUST_THRESHOLD` of the host-synchronised time: it does not
        see the device's work) or None (nothing to judge); `note` says why
        (None when trusted).
    """
    if clock_seconds is None or step_seconds is None:
        return None, None
    if not math.isfinite(clock_seconds):
        return None, (
            "the in-step clock took no readings (an XLA-compiled step is "
            "not timed)"
        )
    if step_seconds < MIN_JUDGED_SECONDS:
        return None, (
            f"the step's compute took {step_seconds * 1e3:.2f} ms, too "
            "short to judge the clock; time a larger batch"
        )
    ratio = clock_seconds / step_seconds
    if ratio < CLOCK_TRUST_THRESHOLD:
        return False, (
            "clock does not see this device's work: the in-step clock "
            f"read {clock_seconds * 1e3:.2f} ms, {ratio:.0%} of the "
            f"host-synchronised {step_seconds * 1e3:.2f} ms; "
            "ShardRebalancer and StragglerDetector would misjudge it"
        )
    return True, None


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _table(report):
    versions = dict(report.versions)
    lines = [
        "keras-hetero doctor: "
        + ", ".join(f"{name} {version}" for name, version in versions.items())
    ]
    lines.append(_host_line(report.host))
    if report.model is not None:
        model = report.model
        activations = (
            "unknown"
            if model.activation_bytes_per_row is None
            else _bytes(model.activation_bytes_per_row)
        )
        lines.append(
            f"model {model.name}: batch {model.batch_size}, state "
            f"{_bytes(model.state_bytes)}, activations ~{activations} per "
            "row (estimate)"
        )
    lines.append("")
    header = ("device", "kind", "description", "memory", "GFLOP/s", "speed")
    if report.model is not None:
        header += ("step ms", "clock ms", "clock", "max rows*")
    rows = [header]
    for device in report.devices:
        row = (
            _short_name(device.name),
            device.kind,
            device.description,
            _bytes(device.memory_bytes),
            f"{device.flops / 1e9:.1f}",
            f"{device.relative_speed:.2f}",
        )
        if report.model is not None:
            row += (
                _milliseconds(device.step_seconds),
                _milliseconds(device.clock_seconds),
                {True: "ok", False: "NO", None: "?"}[device.clock_trusted],
                "-" if device.max_rows is None else str(device.max_rows),
            )
        rows.append(row)
    lines.extend(_columns(rows))
    if report.model is not None:
        lines.append(
            "* estimate from weights, gradients, optimizer state and "
            "layer outputs"
        )
    lines.append("")
    shares = ", ".join(f"{share:g}" for share in report.suggested_shares)
    lines.append(
        f"suggested shares ({report.shares_basis}): "
        f"kh.data.shard(..., shares=[{shares}])"
    )
    lines.append(f'precision="auto" picks: {report.precision}')
    if report.cluster is not None:
        lines.append("")
        lines.extend(_cluster_lines(report.cluster))
    notes = [
        f"{_short_name(device.name)}: {note}"
        for device in report.devices
        for note in device.notes
    ]
    if notes:
        lines.append("")
        lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)


def _host_line(host):
    quota = (
        "no CPU quota"
        if host.cpu_quota is None
        else f"CPU quota {host.cpu_quota:g} cores"
    )
    memory = _bytes(host.memory_bytes)
    if host.available_memory_bytes is not None:
        memory += f" ({_bytes(host.available_memory_bytes)} available)"
    line = (
        f"host {host.hostname}: {host.cpu_count} cores ({host.usable_cores} "
        f"usable, {quota}), memory {memory}"
    )
    if host.cpu_model:
        line += f", {host.cpu_model}"
    return line


def _cluster_lines(cluster):
    lines = [
        f"cluster (TF_CONFIG): this task {cluster.task} at "
        f"{cluster.address}, worker {cluster.worker_index} of "
        f"{cluster.num_workers}"
    ]
    for peer in cluster.peers:
        state = (
            f"reachable ({peer.connect_seconds * 1e3:.1f} ms)"
            if peer.reachable
            else f"NOT reachable: {peer.error}"
        )
        lines.append(f"  {peer.task} at {peer.address}: {state}")
    if cluster.allreduce_seconds is not None:
        lines.append(
            f"all-reduce of {cluster.allreduce_bytes / 1e6:g} MB across "
            f"{cluster.num_workers} workers: "
            f"{cluster.allreduce_seconds * 1e3:.2f} ms "
            f"({cluster.allreduce_megabytes_per_second:.0f} MB/s)"
        )
    if cluster.agree is not None:
        lines.append(
            "all workers name the same cluster"
            if cluster.agree
            else "workers name DIFFERENT clusters in their TF_CONFIG"
        )
    if cluster.suggested_shares is not None:
        shares = ", ".join(f"{share:g}" for share in cluster.suggested_shares)
        lines.append(
            "suggested shares for MultiWorkerMirroredStrategy's "
            f"{len(cluster.suggested_shares)} replicas: [{shares}]"
        )
    return lines


def _columns(rows):
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(width) if i < 3 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]


def _short_name(name):
    """`/device:CPU:1` of `/job:.../task:0/device:CPU:1` (the table lists
    this task's devices only)."""
    index = name.find("/device:")
    return name if index < 0 else name[index:]


def _bytes(count):
    if count is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _milliseconds(seconds):
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds * 1e3:.2f}"
