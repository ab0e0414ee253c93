"""`kh.doctor()` and `keras-hetero doctor`: what to run first on a new
cluster.

It lists this process's devices (kind, name, memory; the host's cores,
affinity, cgroup CPU quota and memory), times each device alone on a float32
matmul (host-synchronised), and suggests initial `shares` for
`kh.data.shard` and what `precision="auto"` picks. Given a model, it times
the model's step on each device alone and checks that `HeteroModel`'s
in-step clock sees each device's work (the "trust check"), and estimates
the rows per step each device holds. Under `TF_CONFIG` it checks that every
task of the cluster is reachable and, with `collective=True`, that the
workers agree on the cluster and how long an all-reduce takes.

The package: `report` (the frozen result values and the pure decisions),
`host` (/proc and cgroups), `devices` (listing and matmul timing),
`model_check` (the model's step and the trust check), `cluster`
(`TF_CONFIG`, reachability, the collective).
"""

import dataclasses
import math
import sys
import types

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero import precision as precision_lib
from keras_hetero._checks import check_positive
from keras_hetero.balancing import memory as memory_lib
from keras_hetero.doctor import cluster as cluster_lib
from keras_hetero.doctor import devices as devices_lib
from keras_hetero.doctor import host as host_lib
from keras_hetero.doctor import model_check
from keras_hetero.doctor.report import ClusterReport
from keras_hetero.doctor.report import DeviceReport
from keras_hetero.doctor.report import DoctorReport
from keras_hetero.doctor.report import HostReport
from keras_hetero.doctor.report import ModelReport
from keras_hetero.doctor.report import PeerReport
from keras_hetero.doctor.report import clock_verdict
from keras_hetero.doctor.report import suggest_shares

__all__ = [
    "ClusterReport",
    "DeviceReport",
    "DoctorReport",
    "HostReport",
    "ModelReport",
    "PeerReport",
    "doctor",
]


def doctor(
    model=None, batch=None, devices=None, collective=False, timeout=10.0
):
    """Checks this machine (and its cluster) for keras-hetero training.

    Lists the local devices and the host's cores, CPU quota and memory;
    times each device alone on a float32 matmul sized to take about 20 ms,
    host-synchronised (the result is copied to the host, so asynchronous
    accelerators are timed to completion); suggests `shares` for
    `kh.data.shard` proportional to the measured speeds, and says what
    `precision="auto"` picks for these devices.

    With `model`, also times one step of it (forward pass, loss and
    gradients of `batch`) on each device alone, host-synchronised, and
    compares that with what `HeteroModel`'s in-step clock
    (`model.step_stats.compute_seconds`) reads for the same step under
    `tf.distribute.OneDeviceStrategy`: a clock reading under half the
    host's time does not see the device's work, and the device is flagged
    (`DeviceReport.clock_trusted` False). The shares then follow the
    model's rows per second, and `max_rows` estimates the rows per step
    each device's memory holds.

    Under `TF_CONFIG` every task of the cluster is checked for
    reachability: each task running the doctor listens on its own address
    and connects to the others', so run it on every task within `timeout`
    seconds. With `collective=True` the workers also form
    `tf.distribute.MultiWorkerMirroredStrategy`, compare their clusters and
    time an all-reduce of 1 MB; this must be the first TensorFlow work of
    the process (`keras-hetero doctor --collective` is).

    Args:
        model: A compiled `keras.Model`, or the path of a saved `.keras`
            model, to time on each device (copied; unchanged). Defaults to
            `None`.
        batch: With `model`: `(x, y)` or `(x, y, sample_weight)` of one
            batch, or an int: that many rows of random data shaped like the
            model's inputs. Defaults to `None` (32 random rows).
        devices: Device names to check (`"CPU:0"`, `"GPU"`, full names).
            Defaults to `None` (all of this process's devices).
        collective: Whether to join the cluster and time an all-reduce.
            Defaults to `False`.
        timeout: Seconds to wait for the other tasks and for each
            collective. Defaults to `10.0`.

    Returns:
        A `kh.DoctorReport`; `print(report)` shows its table,
        `report.to_json()` the same as JSON.

    Raises:
        ValueError: For a bad argument, or a malformed `TF_CONFIG` (the
            message names the bad value).
        TypeError: If `model` or `devices` has the wrong type.
        ConnectionError: If a task of the cluster is not reachable within
            `timeout` (naming its address), or this task cannot listen on
            its own address.
        TimeoutError: If the all-reduce does not complete within `timeout`.
        RuntimeError: If `collective=True` comes after TensorFlow ran ops
            in this process.

    Example:

    >>> report = kh.doctor()  # doctest: +SKIP
    >>> report.suggested_shares  # doctest: +SKIP
    (0.5, 0.5)
    >>> print(report.table())  # doctest: +SKIP
    """
    timeout = check_positive(
        "timeout", timeout, expected="a positive number of seconds"
    )
    if batch is not None and model is None:
        raise ValueError(
            "Invalid value for argument `batch`. Received: a batch with "
            "model=None. Pass the model to time too (model=...)."
        )
    if model is not None:
        model_check.check(model)
    parsed = _distribute.cluster_tasks()
    if collective:
        _check_collective(parsed)
    # The cluster first: MultiWorkerMirroredStrategy must start before
    # TensorFlow runs its first op in the process.
    peers, strategy, collective_facts = (), None, {}
    if parsed is not None:
        tasks, own = parsed
        peers = cluster_lib.check_reachable(tasks, own, timeout)
    if collective:
        strategy = cluster_lib.start_collective(timeout)
        seconds, agree = cluster_lib.time_allreduce(strategy, tasks, timeout)
        collective_facts = dict(
            allreduce_bytes=cluster_lib.ALLREDUCE_BYTES,
            allreduce_seconds=seconds,
            agree=agree,
        )

    host = host_lib.host_report()
    task = None if parsed is None else _distribute.env_task().device_job
    found = _timed_devices(devices_lib.local_devices(devices, task), host)
    model_report = None
    speeds, basis = [d.flops for d in found], "matmul"
    if model is not None:
        found, model_report = _check_model(model, batch, found, host)
        steps = [d.step_seconds for d in found]
        if all(seconds > 0 for seconds in steps):
            speeds = [model_report.batch_size / seconds for seconds in steps]
            basis = "model step"

    cluster = None
    if parsed is not None:
        if strategy is not None:
            names = [device.name for device in found]
            collective_facts.update(_global_shares(strategy, names, speeds))
        cluster = cluster_lib.cluster_report(
            tasks, own, peers, **collective_facts
        )
    return DoctorReport(
        host=host,
        devices=tuple(found),
        suggested_shares=suggest_shares(speeds),
        shares_basis=basis,
        precision=precision_lib.auto_precision(found),
        model=model_report,
        cluster=cluster,
        versions=(
            ("TensorFlow", tf.__version__),
            ("Keras", _compat.keras.__version__),
            ("flavour", _compat.FLAVOUR),
        ),
    )


def _timed_devices(names, host):
    """A `DeviceReport` per device, with its matmul speed."""
    timings = devices_lib.time_matmuls(names)
    relative = devices_lib.relative_speeds([flops for flops, _ in timings])
    return [
        _replace(
            devices_lib.describe(name, host),
            flops=flops,
            matmul_size=size,
            relative_speed=speed,
        )
        for name, (flops, size), speed in zip(names, timings, relative)
    ]


def _check_collective(parsed):
    if parsed is None:
        raise ValueError(
            "Invalid value for argument `collective`. Received: "
            "collective=True without TF_CONFIG. The collective check joins "
            "the cluster TF_CONFIG names; set it on every worker."
        )
    _, own = parsed
    if own.split(":")[0] not in ("chief", "worker"):
        raise ValueError(
            "Invalid value for argument `collective`. Received: "
            f"collective=True on task {own!r}. Only chief and worker tasks "
            "take part in MultiWorkerMirroredStrategy's all-reduce."
        )


def _replace(device, **changes):
    return dataclasses.replace(device, **changes)


def _check_model(model, batch, found, host):
    """Times `model` on every device: `(device reports, ModelReport)`."""
    loaded = model_check.load(model)
    arrays, rows = model_check.batch_arrays(loaded, batch)
    cpus = sum(device.kind == "CPU" for device in found)
    checked = []
    for device in found:
        timing = model_check.time_step(loaded, arrays, device.name)
        trusted, note = clock_verdict(timing.clock_seconds, timing.step_seconds)
        memory = devices_lib.available_memory(device, host, cpus)
        checked.append(
            _replace(
                device,
                step_seconds=timing.step_seconds,
                clock_seconds=timing.clock_seconds,
                clock_trusted=trusted,
                max_rows=memory_lib.rows_that_fit(
                    memory, timing.state_bytes, timing.activation_bytes_per_row
                ),
                notes=device.notes + ((note,) if note else ()),
            )
        )
    # The model's sizes are the same on every device: the last timing's.
    report = ModelReport(
        name=loaded.name,
        batch_size=rows,
        state_bytes=timing.state_bytes,
        activation_bytes_per_row=timing.activation_bytes_per_row,
    )
    return checked, report


def _global_shares(strategy, names, speeds):
    """Shares per global replica of `strategy`, from every worker's speeds
    of its replica devices (gathered in one all-reduce)."""
    local = []
    for replica in strategy.extended.worker_devices:
        matches = [
            speed
            for name, speed in zip(names, speeds)
            if _distribute.device_matches(replica, name)
        ]
        local.append(matches[0] if matches else float("nan"))
    # Every worker takes part, also one whose replica devices were not
    # timed (its NaN makes the shares unknown everywhere).
    gathered = cluster_lib.gather_speeds(strategy, local)
    facts = {
        "replica_devices": tuple(_distribute.global_replica_devices(strategy))
    }
    if all(math.isfinite(speed) and speed > 0 for speed in gathered):
        facts["suggested_shares"] = suggest_shares(gathered)
    return facts


class _CallablePackage(types.ModuleType):
    """This package, callable as its `doctor` function.

    `kh.doctor` is the function, loaded when first used. Python binds each
    package on its parent when it is first imported, so a script that
    imports a module of this package first (`from keras_hetero.doctor import
    report`) finds the package under `kh.doctor`: calling it runs the
    function, so `kh.doctor(...)` works in either order.
    """

    def __call__(self, *args, **kwargs):
        return doctor(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
