"""tf.distribute internals TensorFlow has no public way to ask (each unchanged
in TF 2.19-2.21)."""

import contextlib


def in_multi_worker_mode(strategy):
    """Whether a MultiWorkerMirroredStrategy spans several workers (one
    whose TF_CONFIG names a single worker, or none, runs as one process);
    the strategy's private `extended._in_multi_worker_mode()`."""
    return strategy.extended._in_multi_worker_mode()


def parameter_server_num_workers(strategy):
    """The workers of a ParameterServerStrategy (its private
    `extended._num_workers`; the cluster resolver also counts tasks that
    are not workers)."""
    return strategy.extended._num_workers


def coordinator_workers(coordinator):
    """A `ClusterCoordinator`'s worker objects (private `_cluster.workers`),
    each with `worker_index` and `create_resource`."""
    return coordinator._cluster.workers


def per_worker_values(values):
    """A `PerWorkerValues` of one resource per worker, for
    `ClusterCoordinator.schedule` arguments (the class is not exported)."""
    from tensorflow.python.distribute.coordinator import values as lib

    return lib.PerWorkerValues(tuple(values))


def set_coordination_value(key, value):
    """Puts `key` in the coordination service's key-value store (running in
    every multi-worker job; `tf.distribute` has no public access).
    Raises if there is no coordination service."""
    from tensorflow.python.eager import context

    context.context().set_config_key_value(key, value)


def delete_coordination_value(key):
    """Removes `key` from the coordination service's store."""
    from tensorflow.python.eager import context

    context.context().delete_config_key_value(key)


def has_coordination_value(key, timeout_ms):
    """Whether `key` is in the coordination service's store (waits up to
    `timeout_ms`); False without a coordination service."""
    from tensorflow.python.eager import context

    try:
        context.context().get_config_key_value(key, timeout_in_ms=timeout_ms)
        return True
    except Exception:  # not there in time, or no coordination service
        return False


def get_coordination_value(key, timeout_ms):
    """The value of `key` in the coordination service's store, or None if
    it is not there within `timeout_ms` (or there is no service)."""
    from tensorflow.python.eager import context

    try:
        return context.context().get_config_key_value(
            key, timeout_in_ms=timeout_ms
        )
    except Exception:  # not there in time, unreachable, or no service
        return None


def configure_coordination_timeouts(heartbeat_ms, register_ms, shutdown_ms):
    """Configures TF's coordination service before a
    MultiWorkerMirroredStrategy exists: the strategy configures it only if
    `context.context().coordination_service` is None
    (collective_all_reduce_strategy.py, TF 2.21), with no way to pass its
    heartbeat, register or shutdown-barrier timeouts; we configure it the
    same way (service leader, coordinated jobs from TF_CONFIG) plus those.
    """
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.distribute.cluster_resolver import (
        TFConfigClusterResolver,
    )
    from tensorflow.python.eager import context

    cluster_spec = TFConfigClusterResolver().cluster_spec()
    jobs = [
        coordination_config_pb2.CoordinatedJob(
            name=job, num_tasks=cluster_spec.num_tasks(job)
        )
        for job in ("chief", "worker")
        if job in cluster_spec.jobs
    ]
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster_spec),
        coordinated_jobs=jobs,
        heartbeat_timeout_in_ms=heartbeat_ms,
        cluster_register_timeout_in_ms=register_ms,
        shutdown_barrier_timeout_in_ms=shutdown_ms,
    )


def gpu_memory_limit(index):
    """Bytes TensorFlow's allocator may use on logical GPU `index`, or None.

    `tensorflow.python.client.device_lib.list_local_devices` is the one
    TensorFlow API that reports a device's total memory
    (`tf.config.experimental.get_memory_info` reports only usage); it is
    internal, unchanged in TF 2.19-2.21. Memory is optional information:
    any failure gives None.
    """
    import tensorflow as tf
    from tensorflow.python.client import device_lib

    try:
        for device in device_lib.list_local_devices():
            spec = tf.DeviceSpec.from_string(device.name)
            if spec.device_type == "GPU" and spec.device_index == index:
                return int(device.memory_limit) or None
    except Exception:  # optional information, never fatal
        return None
    return None


def mirrored_strategy(devices, key_base):
    """A `tf.distribute.MirroredStrategy` over `devices` whose collective
    group keys start at `key_base` (`kh.testing.devices.mirrored`). Every
    MirroredStrategy numbers its groups from the private class attribute
    `_collective_key_base` (0; tensorflow/python/distribute/
    mirrored_strategy.py:283, read at construction, line 338, used at line
    375, TF 2.21) and has no public way to choose it: two live instances
    over different device counts in one process collide ("joining a group
    with size 4, but that group has size 2")."""
    import tensorflow as tf

    with _collective_key_base(tf.distribute.MirroredStrategy, key_base):
        return tf.distribute.MirroredStrategy(devices)


@contextlib.contextmanager
def _collective_key_base(strategy_class, key_base):
    """`strategy_class`'s private `_collective_key_base` set to `key_base`
    while a strategy is constructed (which reads it), then restored."""
    original = strategy_class._collective_key_base
    strategy_class._collective_key_base = key_base
    try:
        yield
    finally:
        strategy_class._collective_key_base = original


def local_collective_strategy(devices, key_base):
    """A MultiWorkerMirroredStrategy over this process's `devices` (e.g.
    logical CPUs), one replica each, all-reducing with the real collective
    ops as between workers; for tests of the collectives' graph
    (`kh.testing.devices.local_collective`). TensorFlow's own tests make it
    with the private classmethod `_from_local_devices`
    (tensorflow/python/distribute/collective_all_reduce_strategy.py:206, TF
    2.21); the public constructor takes one CPU per process. Its collective
    group keys start at `key_base` (the private class attribute
    `_collective_key_base`, read at construction, line 380): two
    strategies with the same keys in one process abort each other's
    collectives ("Shape mismatch in the collective instance")."""
    import tensorflow as tf

    strategy_class = tf.distribute.MultiWorkerMirroredStrategy
    with _collective_key_base(strategy_class, key_base):
        return strategy_class._from_local_devices(list(devices))
