"""Logical CPU devices, so multi-replica code runs on one CPU."""

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero._checks import check_int


def logical_cpus(n):
    """Splits the host CPU into `n` logical devices and returns their names.

    Must run before TensorFlow initialises its devices (before the first op).
    Calling it again with the same `n` is fine. Also raises TensorFlow's
    inter-op thread pool to at least `n + 2` threads, so that replicas slowed
    by `SimulatedSpeed` sleep concurrently, as real devices would work.

    Args:
        n: How many logical CPU devices, at least 1.

    Returns:
        The device names, e.g. `["/device:CPU:0", "/device:CPU:1"]`.

    Raises:
        ValueError: If `n` is not a positive integer.
        RuntimeError: If TensorFlow already initialised a different number of
            CPU devices.

    Example:

    >>> logical_cpus(2)
    ['/device:CPU:0', '/device:CPU:1']
    """
    check_int("n", n, expected="a positive integer")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * n
        )
        # Each replica's SimulatedSpeed sleep blocks one inter-op thread; on a
        # 2-core machine TF's default pool (one per core) would run only two
        # replicas' sleeps at a time instead of all n.
        threads = tf.config.threading.get_inter_op_parallelism_threads()
        if threads < n + 2:
            tf.config.threading.set_inter_op_parallelism_threads(n + 2)
    except RuntimeError:
        existing = tf.config.list_logical_devices("CPU")
        if len(existing) != n:
            raise RuntimeError(
                f"logical_cpus({n}): TensorFlow already initialised "
                f"{len(existing)} CPU device(s); call logical_cpus before any "
                "TensorFlow op runs (e.g. at the top of the script or in a "
                "pytest conftest)."
            ) from None
    return [f"/device:CPU:{i}" for i in range(n)]


_KEY_BASES = iter(range(10_000, 10_000_000, 10_000))


def mirrored(devices):
    """A MirroredStrategy whose collective keys cannot clash with another's.

    Every `tf.distribute.MirroredStrategy` numbers its collective groups from
    the same base, so two live instances over different device counts in one
    process collide ("joining a group with size 4, but that group has size
    2"). Real jobs have one strategy per process; tests and benchmarks that
    create several should use this.

    Args:
        devices: Device names, as for `tf.distribute.MirroredStrategy`.

    Returns:
        A `tf.distribute.MirroredStrategy` over `devices`.

    Example:

    >>> strategy = mirrored(logical_cpus(2))
    >>> strategy.num_replicas_in_sync
    2
    """
    return _compat.mirrored_strategy(devices, next(_KEY_BASES))


def local_collective(devices):
    """A MultiWorkerMirroredStrategy over this process's `devices`, with
    collective keys that cannot clash with another strategy's (as
    `mirrored`).

    Its replicas all-reduce with the collective ops workers use
    (`CollectiveReduceV2`, ordered by a token), where a MirroredStrategy
    may reduce otherwise: for tests of the collectives' graph. Not
    exported; a real job makes `tf.distribute.MultiWorkerMirroredStrategy()`.

    Args:
        devices: Device names of this process, e.g. `logical_cpus(2)`.

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`, one replica per device.

    Example:

    >>> strategy = local_collective(logical_cpus(2))
    >>> strategy.num_replicas_in_sync
    2
    """
    return _compat.local_collective_strategy(devices, next(_KEY_BASES))
