"""Facts about a `tf.distribute.Strategy` that several boxes need."""

import contextlib
import threading

import tensorflow as tf


def is_parameter_server(strategy):
    return isinstance(
        strategy,
        (
            tf.distribute.experimental.ParameterServerStrategy,
            tf.compat.v1.distribute.experimental.ParameterServerStrategy,
        ),
    )


def is_multi_worker(strategy):
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


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
        return strategy.extended._num_workers
    if not is_multi_worker(strategy):
        return 1
    cluster = strategy.cluster_resolver.cluster_spec().as_dict()
    return len(cluster.get("worker", [])) + len(cluster.get("chief", []))


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
    existing = {
        _device_key(device.name) for device in tf.config.list_logical_devices()
    }
    return any(
        _device_key(device) not in existing
        for device in getattr(strategy.extended, "worker_devices", ())
    )


def _device_key(name):
    spec = tf.DeviceSpec.from_string(name)
    return (spec.device_type or "CPU").upper(), spec.device_index or 0


def cpu_replicas(strategy):
    """True if the strategy has several replicas and this worker's are CPUs."""
    if strategy.num_replicas_in_sync < 2:
        return False
    devices = getattr(strategy.extended, "worker_devices", ())
    return any(
        (tf.DeviceSpec.from_string(device).device_type or "CPU").upper()
        == "CPU"
        for device in devices
    )


def broadcast_from_first_replica(strategy, value):
    """The int `value` of the first global replica's process, everywhere.

    One SUM all-reduce in which only replica 0 contributes, under
    multi-worker strategies (every worker must call it); elsewhere there is
    one process and `value` is returned as is.
    """
    if not is_multi_worker(strategy):
        return int(value)

    def first_only():
        context = tf.distribute.get_replica_context()
        is_first = tf.equal(context.replica_id_in_sync_group, 0)
        mine = tf.where(is_first, tf.constant(value, tf.int64), 0)
        return context.all_reduce(tf.distribute.ReduceOp.SUM, mine)

    result = tf.function(lambda: strategy.run(first_only))()
    return int(strategy.experimental_local_results(result)[0].numpy())
