"""Facts about this machine: cores, affinity, cgroup CPU quota, memory.

Read from /proc and /sys only (no TensorFlow), so they are right before
TensorFlow starts and testable on fake files.
"""

import os
import socket

from keras_hetero import devices
from keras_hetero.doctor.report import HostReport

# cgroup v1 reports "no limit" as a huge page-aligned number.
_NO_MEMORY_LIMIT = 2**62


def host_report(proc="/proc", cgroup_root="/sys/fs/cgroup"):
    """A `HostReport` of this machine and this process's cgroups.

    Args:
        proc: Where procfs is mounted. Defaults to `"/proc"`.
        cgroup_root: Where the cgroup hierarchies are mounted. Defaults to
            `"/sys/fs/cgroup"`.

    Returns:
        A `HostReport`.
    """
    cgroups = _read(os.path.join(proc, "self", "cgroup")) or ""
    meminfo = _meminfo(_read(os.path.join(proc, "meminfo")) or "")
    memory = meminfo.get("MemTotal")
    available = meminfo.get("MemAvailable")
    if memory is None:
        memory = devices.physical_memory()
    limit, usage = cgroup_memory(cgroups, cgroup_root)
    if limit is not None:
        memory = limit if memory is None else min(memory, limit)
        if usage is not None:
            free = max(0, limit - usage)
            available = free if available is None else min(available, free)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return HostReport(
        hostname=socket.gethostname(),
        cpu_model=_cpu_model(_read(os.path.join(proc, "cpuinfo")) or ""),
        cpu_count=os.cpu_count() or usable,
        usable_cores=usable,
        cpu_quota=cgroup_cpu_quota(cgroups, cgroup_root),
        memory_bytes=memory,
        available_memory_bytes=available,
    )


def cgroup_cpu_quota(cgroups, cgroup_root="/sys/fs/cgroup"):
    """Cores' worth of CPU time this process's cgroups allow, or None.

    The tightest quota along the cgroup's path (a parent's quota limits its
    children too): cgroup v1 `cpu.cfs_quota_us / cpu.cfs_period_us` (-1:
    none), cgroup v2 `cpu.max` (`"max 100000"`: none).

    Args:
        cgroups: The text of /proc/self/cgroup.
        cgroup_root: Where the cgroup hierarchies are mounted. Defaults to
            `"/sys/fs/cgroup"`.

    Returns:
        A float (e.g. `0.5` for half a core), or None without a quota.
    """
    quotas = []
    for directory, version in _cgroup_directories(cgroups, "cpu", cgroup_root):
        if version == 1:
            quota = _read_int(os.path.join(directory, "cpu.cfs_quota_us"))
            period = _read_int(os.path.join(directory, "cpu.cfs_period_us"))
        else:
            text = _read(os.path.join(directory, "cpu.max"))
            parts = (text or "max").split()
            quota = None if parts[0] == "max" else int(parts[0])
            period = int(parts[1]) if len(parts) > 1 else 100_000
        if quota is not None and quota > 0 and period:
            quotas.append(quota / period)
    return min(quotas) if quotas else None


def cgroup_memory(cgroups, cgroup_root="/sys/fs/cgroup"):
    """This process's cgroup memory limit and its cgroup's usage, in bytes.

    The limit is the tightest along the cgroup's path; the usage is that of
    the process's own cgroup.

    Args:
        cgroups: The text of /proc/self/cgroup.
        cgroup_root: Where the cgroup hierarchies are mounted. Defaults to
            `"/sys/fs/cgroup"`.

    Returns:
        `(limit, usage)`, each an int or None (no limit, unknown).
    """
    limits = []
    usage = None
    for depth, (directory, version) in enumerate(
        _cgroup_directories(cgroups, "memory", cgroup_root)
    ):
        if version == 1:
            limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
            used = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
        else:
            limit = _read_int(os.path.join(directory, "memory.max"))
            used = _read_int(os.path.join(directory, "memory.current"))
        if limit is not None and limit < _NO_MEMORY_LIMIT:
            limits.append(limit)
        if depth == 0:
            usage = used
    return (min(limits) if limits else None), usage


def _cgroup_directories(cgroups, controller, cgroup_root):
    """`(directory, version)` of the cgroup holding `controller` for this
    process, then its ancestors up to the mount's root.

    cgroup v1 (a line `N:cpu,cpuacct:/path`) is preferred; else v2 (the line
    `0::/path`). In a container the path may name the host's hierarchy,
    which the container sees as its mount's root: then only the root.
    """
    version_two = None
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            version_two = path
            continue
        names = controllers.split(",")
        if controller in names:
            mounts = [os.path.join(cgroup_root, controllers)]
            mounts.append(os.path.join(cgroup_root, controller))
            for mount in mounts:
                if os.path.isdir(mount):
                    return _ancestors(mount, path, version=1)
            return []
    if version_two is None:
        return []
    for mount in (cgroup_root, os.path.join(cgroup_root, "unified")):
        if os.path.exists(os.path.join(mount, "cgroup.controllers")):
            return _ancestors(mount, version_two, version=2)
    return []


def _ancestors(mount, path, version):
    parts = [part for part in path.split("/") if part]
    leaf = os.path.join(mount, *parts)
    if not os.path.isdir(leaf):
        return [(mount, version)]
    directories = []
    while parts:
        directories.append((os.path.join(mount, *parts), version))
        parts.pop()
    directories.append((mount, version))
    return directories


def _meminfo(text):
    """/proc/meminfo's `kB` values in bytes, by name."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
            values[name] = int(fields[0]) * scale
    return values


def _cpu_model(text):
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "Model", "cpu model"):
            return value.strip() or None
    return None


def _read(path):
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def _read_int(path):
    text = _read(path)
    try:
        return int(text.strip()) if text else None
    except ValueError:  # "max" in cgroup v2
        return None
