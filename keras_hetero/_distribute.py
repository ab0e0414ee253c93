"""Strategy and cluster facts that several modules need: the strategy's
kind, replica devices and ids, the chief, worker counts, and the one
`TF_CONFIG` parser (`env_task`)."""

import contextlib
import dataclasses
import json
import os
import threading

import tensorflow as tf

from keras_hetero import _compat


@dataclasses.dataclass(frozen=True)
class EnvTask:
    """This process's task in the cluster `TF_CONFIG` names (read without a
    strategy: before one exists, or in a watchdog thread).

    Attributes:
        task_type: `"worker"`, `"chief"`, ..., or None without `TF_CONFIG`.
        task_index: The index within `task_type` (0 without `TF_CONFIG`).
        num_workers: Chief and worker tasks of the cluster (at least 1).
        has_chief: Whether the cluster has a `chief` task.
        addresses: The chief's and the workers' `"host:port"`, in global
            worker order (`worker_index`).
    """

    task_type: object = None
    task_index: int = 0
    num_workers: int = 1
    has_chief: bool = False
    addresses: tuple = ()

    @property
    def worker_index(self):
        """The global worker index: the chief first, then the workers (the
        order of MultiWorkerMirroredStrategy's replicas)."""
        if self.task_type == "worker" and self.has_chief:
            return self.task_index + 1
        return self.task_index

    @property
    def is_chief(self):
        """The `chief` task if the cluster has one, else worker 0."""
        if self.has_chief:
            return self.task_type == "chief"
        return self.task_index == 0

    @property
    def device_job(self):
        """`/job:TYPE/task:INDEX`, the prefix of this task's device names."""
        return f"/job:{self.task_type or 'worker'}/task:{self.task_index}"


# Task types that hold an address in the cluster, in TensorFlow's order.
_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def cluster_tasks(environ=None):
    """The tasks `TF_CONFIG` names, checked; None without `TF_CONFIG`.

    `_distribute.env_task` (the package's parser) takes `TF_CONFIG` that is
    not JSON as absent and trusts the rest, as a strategy's own error
    follows; here each bad value is named instead, before any connection.

    Args:
        environ: The environment to read. Defaults to `os.environ`.

    Returns:
        `(tasks, own)`: `tasks` lists `(task, address)` pairs such as
        `("worker:1", "127.0.0.1:2223")` in `_TASK_TYPES` order; `own` is
        this process's task (`"worker:0"`). Or None if `TF_CONFIG` is unset
        or empty.

    Raises:
        ValueError: Naming the bad value: `TF_CONFIG` that is not a JSON
            object with a cluster, a cluster entry that is not
            `"host:port"`, an address named twice, a task type missing from
            the cluster, an index out of range.
    """
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    if not text.strip():
        return None
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ValueError(
            f"TF_CONFIG is not valid JSON ({error}). Received: "
            f"TF_CONFIG={text!r}."
        ) from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            "TF_CONFIG has no cluster. Received: "
            f"TF_CONFIG={text!r}. Expected a JSON object like "
            '{"cluster": {"worker": ["host:port", ...]}, '
            '"task": {"type": "worker", "index": 0}}.'
        )
    return _tasks(cluster), _own_task(config.get("task") or {}, cluster)


def _tasks(cluster):
    tasks = []
    seen = {}
    for task_type in sorted(cluster, key=_task_order):
        addresses = cluster[task_type]
        if not isinstance(addresses, list):
            raise ValueError(
                f"TF_CONFIG cluster.{task_type} is not a list of "
                f"addresses. Received: {addresses!r}."
            )
        for index, address in enumerate(addresses):
            task = f"{task_type}:{index}"
            _check_address(f"cluster.{task_type}[{index}]", address)
            if address in seen:
                raise ValueError(
                    f"TF_CONFIG names the address {address} twice: for "
                    f"{seen[address]} and {task}. Each task needs its own "
                    "host:port."
                )
            seen[address] = task
            tasks.append((task, address))
    return tasks


def _own_task(task, cluster):
    task_type = task.get("type") if isinstance(task, dict) else None
    index = task.get("index", 0) if isinstance(task, dict) else None
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(
            f"TF_CONFIG task.index is not an integer. Received: task={task!r}."
        )
    if task_type == "evaluator" and task_type not in cluster:
        # TensorFlow's evaluator runs beside the cluster, not in it.
        return f"evaluator:{index}"
    if task_type not in cluster:
        raise ValueError(
            "TF_CONFIG task.type names no task type of the cluster. "
            f"Received: task={task!r}. Expected one of {sorted(cluster)}."
        )
    count = len(cluster[task_type])
    if not 0 <= index < count:
        raise ValueError(
            f"TF_CONFIG task.index is out of range. Received: "
            f"task={task!r}, but cluster.{task_type} has {count} "
            f"address(es) (indices 0 to {count - 1})."
        )
    return f"{task_type}:{index}"


def _task_order(task_type):
    if task_type in _TASK_TYPES:
        return (_TASK_TYPES.index(task_type), task_type)
    return (len(_TASK_TYPES), task_type)


def _check_address(where, address):
    text = address if isinstance(address, str) else ""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"TF_CONFIG {where} is not a 'host:port' address. Received: "
            f"{address!r}."
        )


def env_task(environ=None):
    """This process's `EnvTask`, parsed from `TF_CONFIG` (the one parser;
    `TF_CONFIG` that is not JSON counts as absent: TensorFlow's resolver
    rejects it with its own error where a strategy reads it)."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG")
    try:
        config = json.loads(text or "{}")
    except ValueError:
        config = {}
    if not isinstance(config, dict):
        config = {}
    cluster = config.get("cluster") or {}
    task = config.get("task") or {}
    workers = len(cluster.get("worker", [])) + len(cluster.get("chief", []))
    return EnvTask(
        task_type=task.get("type"),
        task_index=int(task.get("index", 0) or 0),
        num_workers=max(workers, 1),
        has_chief="chief" in cluster,
        addresses=tuple(cluster.get("chief", []))
        + tuple(cluster.get("worker", [])),
    )


def is_parameter_server(strategy):
    return isinstance(
        strategy,
        (
            tf.distribute.experimental.ParameterServerStrategy,
            tf.compat.v1.distribute.experimental.ParameterServerStrategy,
        ),
    )


def is_multi_worker(strategy):
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and _compat.in_multi_worker_mode(strategy)


def global_replica_devices(strategy):
    """Device names of all replicas in global replica order.

    Worker 0's replicas come first. Under MultiWorkerMirroredStrategy the
    other workers' names are derived from this worker's by task index (all
    workers of such a job have the same local devices).
    """
    if (
        strategy is tf.distribute.get_strategy()
        and not tf.distribute.has_strategy()
    ):
        # The default strategy runs where TensorFlow places ops by default.
        logical = tf.config.list_logical_devices("GPU") or (
            tf.config.list_logical_devices("CPU")
        )
        return [logical[0].name]
    local = list(strategy.extended.worker_devices)
    if not is_multi_worker(strategy):
        return local
    resolver = strategy.cluster_resolver
    num_workers = len(resolver.cluster_spec().as_dict().get("worker", []))
    num_workers += len(resolver.cluster_spec().as_dict().get("chief", []))
    names = []
    for task in range(num_workers):
        for device in local:
            spec = tf.DeviceSpec.from_string(device).replace(task=task)
            names.append(spec.to_string())
    return names


# Not thread-local: `strategy.run` traces the step in a replica thread.
_PS_WORKER = {"value": None}
_PS_LOCK = threading.Lock()


@contextlib.contextmanager
def parameter_server_worker(worker):
    """While tracing a ParameterServerStrategy closure:
    `parameter_server_worker_id()` is the index (an int32 tensor) of the
    worker that runs it."""
    with _PS_LOCK:
        previous, _PS_WORKER["value"] = _PS_WORKER["value"], worker
        try:
            yield
        finally:
            _PS_WORKER["value"] = previous


def parameter_server_worker_id():
    """The worker index tensor set by `parameter_server_worker`, or None."""
    return _PS_WORKER["value"]


def replica_id():
    """This replica's global index inside `strategy.run`.

    A Python int where the strategy knows it while tracing (all strategies
    keras_hetero supports), so no tensor from an outer graph is captured in
    Keras' nested `while`/`cond` of `steps_per_execution`. (Under
    ParameterServerStrategy each worker steps alone: always 0; see
    `parameter_server_worker_id` for which worker runs.)
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        return 0
    value = tf.get_static_value(context.replica_id_in_sync_group)
    return context.replica_id_in_sync_group if value is None else int(value)


def is_first_local_replica():
    """Whether this replica is the first of its worker's replicas.

    True outside a replica context and with one replica in sync; None where
    the replica's id is not known while tracing (then every replica should
    do what only the first needs to). Under MultiWorkerMirroredStrategy a
    worker's replicas are numbered `task * local + i` (TF's
    `CollectiveAllReduceExtended`), so the first has `id % local == 0`.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return True
    value = replica_id()
    if not isinstance(value, int):
        return None  # a tensor: not known while tracing
    local = len(getattr(context.strategy.extended, "worker_devices", ()))
    return value % max(local, 1) == 0


def is_chief(strategy):
    """Whether this process writes shared files (checkpoints) for the job.

    The `chief` task if the cluster has one, else worker 0; every process
    of a single-worker strategy; the coordinator under
    ParameterServerStrategy.
    """
    if is_parameter_server(strategy):
        return True  # the coordinator is the only process that runs `fit`
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not is_multi_worker(strategy):
        return True
    cluster = resolver.cluster_spec().as_dict()
    if "chief" in cluster:
        return resolver.task_type == "chief"
    return resolver.task_type in (None, "worker") and not resolver.task_id


def num_workers(strategy):
    """Worker processes in the job (1 unless multi-worker; under
    ParameterServerStrategy the workers, not the coordinator)."""
    if is_parameter_server(strategy):
        return _compat.parameter_server_num_workers(strategy)
    if not is_multi_worker(strategy):
        return 1
    cluster = strategy.cluster_resolver.cluster_spec().as_dict()
    return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


def device_type(device):
    """`"CPU"`, `"GPU"`, ... of a device name (CPU where it names none)."""
    return (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()


def device_matches(pattern, device):
    """Whether `device` is one that `pattern` names: every part the pattern
    gives (job, task, type, index) must match; parts it leaves out match
    anything (`"CPU:1"`, `"/job:worker/task:1"`, `"GPU"`).

    Args:
        pattern: A device name, with or without the leading `/device:`.
        device: A full device name.
    """
    wanted = tf.DeviceSpec.from_string(
        pattern if pattern.startswith("/") else "/device:" + pattern
    )
    spec = tf.DeviceSpec.from_string(device)
    return (
        (
            wanted.device_type is None
            or wanted.device_type.upper() == (spec.device_type or "").upper()
        )
        and (
            wanted.device_index is None
            or wanted.device_index == (spec.device_index or 0)
        )
        and (wanted.task is None or wanted.task == (spec.task or 0))
        and (wanted.job is None or wanted.job == spec.job)
    )


def is_local_device(device):
    """Whether this process has a device of `device`'s type and index (the
    job and task it may name are the strategy's: the same model runs on
    every worker)."""
    local = tf.DeviceSpec.from_string(device).replace(
        job=None, replica=None, task=None
    )
    return any(
        device_matches(local.to_string(), logical.name)
        for logical in tf.config.list_logical_devices()
    )


def replicas_on_missing_devices(strategy):
    """True if a local replica's device is not a device of this process.

    TensorFlow accepts such a strategy (`MirroredStrategy(["/cpu:1",
    "/cpu:2"])` on a host with only `/cpu:0`: tf-keras' own tests do this)
    and places the replicas' ops on an existing device, where its
    collective all-reduce in replica context never returns (measured on TF
    2.21, 2 and 4 replicas; a reduce in cross-replica context works).
    """
    if is_parameter_server(strategy) or strategy.num_replicas_in_sync < 2:
        return False
    return not all(
        is_local_device(device)
        for device in getattr(strategy.extended, "worker_devices", ())
    )


def cpu_replicas(strategy):
    """True if the strategy has several replicas and this worker's are CPUs."""
    if strategy.num_replicas_in_sync < 2:
        return False
    devices = getattr(strategy.extended, "worker_devices", ())
    return any(device_type(device) == "CPU" for device in devices)


def sum_over_workers(strategy, value):
    """The sum of every worker process's int `value`, everywhere.

    One SUM all-reduce in which each worker's first local replica
    contributes its process's value, under multi-worker strategies (every
    worker must call it); elsewhere `value` as is.
    """

    def first_local(replica):
        local = max(len(strategy.extended.worker_devices), 1)
        return tf.equal(replica % local, 0)

    return _sum_where(strategy, value, first_local)


def broadcast_from_first_replica(strategy, value):
    """The int `value` of the first global replica's process, everywhere.

    One SUM all-reduce in which only replica 0 contributes, under
    multi-worker strategies (every worker must call it); elsewhere there is
    one process and `value` is returned as is.
    """
    return _sum_where(strategy, value, lambda replica: tf.equal(replica, 0))


def _sum_where(strategy, value, contributes):
    """The SUM all-reduce of `value` over the global replicas for which
    `contributes(replica id)` holds (0 from the others); `value` itself
    outside multi-worker strategies."""
    if not is_multi_worker(strategy):
        return int(value)

    def some_replicas():
        context = tf.distribute.get_replica_context()
        mine = tf.where(
            contributes(context.replica_id_in_sync_group),
            tf.constant(value, tf.int64),
            tf.constant(0, tf.int64),
        )
        return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

    result = tf.function(lambda: strategy.run(some_replicas))()
    return int(strategy.experimental_local_results(result)[0].numpy())
