"""tf.distribute internals TensorFlow has no public way to ask (each unchanged
in TF 2.19-2.21)."""


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
