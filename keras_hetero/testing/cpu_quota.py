"""Real unequal devices: worker processes with a CPU quota each (Linux
cgroups; test infrastructure, needs root).

`kh.testing.SimulatedSpeed` only simulates a slow device (it sleeps). Here a
device is really slower: a `CpuQuota` is a cgroup of the `cpu` controller
(cgroup v1's `cpu.cfs_quota_us`, or v2's `cpu.max`) that lets its members
run `fraction` of one core per period. Combined with pinning each worker to
its own core, `kh.testing.run_workers(..., cpu_quotas=[1.0, 0.3],
cores="auto")` runs a cluster whose worker 1 has 0.3 of worker 0's compute.

Two things can be capped:

- `throttle="process"`: the whole worker process (a slow host). It answers
  collectives late too, until its next CFS slice; the short default period
  (10 ms) keeps that small.
- `throttle="compute"`: only TensorFlow's kernel threads (named
  `tf_Compute`), a slow accelerator on a normal host. TensorFlow starts
  those threads when its runtime starts and more during the first step, so
  the worker moves them itself: `ThrottleCompute()` in `fit`'s callbacks
  (it looks for new ones after every batch), or `throttle_compute_threads()`
  after the first TensorFlow op. Intra-op threads have no usable name, so
  `run_workers` sets `TF_NUM_INTRAOP_THREADS=1` in such workers (unless
  set): kernels then run in the `tf_Compute` threads.

A quota can change while the job runs: `CpuQuota.set` from the test
process, or `ThrottleAt(step, fraction)` inside a worker (each worker finds
its group's directory in the `KH_CPU_QUOTA_GROUP` environment variable).
Groups are removed by `remove()`, the context manager, `run_workers` when
its workers end (also when one crashes) and, for any left, at interpreter
exit; a process still in a group is moved out first.

A quota is an upper bound: other load on a core can only lower what a
worker gets, and an uncapped worker on a busy core gets its fair share of
it. Compare workers measured in the same run (measured on a 2-core machine
at load 4-6 from other work: a 1.0 / 0.3 pair of pinned workers showed
1.3-2.3x the compute seconds per row, 3.4x unpinned, against a capacity
ratio of 3.3; an A/A pair 1.26x).

Groups are made at the top of the controller's hierarchy (e.g.
`/sys/fs/cgroup/cpu/<name>` for v1). Only cgroup v1 is verified on the
machine this was written on (its `cpu` controller is bound to v1); the v2
path follows the kernel's cgroup-v2 documentation (`cpu.max`, threaded
subgroups for single threads).
"""

import atexit
import errno
import math
import numbers
import os
import time
import uuid

from keras_hetero._checks import check_int
from keras_hetero._compat import keras

GROUP_ENV = "KH_CPU_QUOTA_GROUP"
"""The environment variable that holds a worker's group directory."""

COMPUTE_THREAD_NAME = "tf_Compute"

# The kernel refuses a quota below 1 ms per period, and periods outside
# [1 ms, 1 s].
_MIN_QUOTA_US = 1000
_MIN_PERIOD_US = 1000
_MAX_PERIOD_US = 1_000_000
# cgroup v2: single threads may only be moved within one process's
# threaded subtree, so a group for threads is a domain (holding the
# process, uncapped) with this threaded child (holding the capped threads).
_THREADED_CHILD = "threads"
_REMOVE_SECONDS = 2.0


def cpu_quota_available():
    """Whether `CpuQuota` can run here.

    Checks for root, a `cpu` controller (cgroup v1, or v2 with `cpu` in
    `cgroup.controllers`), and that a group can be made, capped and removed.

    Returns:
        `(True, "")`, or `(False, reason)` naming what is missing.

    Example:

    >>> available, reason = cpu_quota_available()  # doctest: +SKIP
    >>> if not available:  # doctest: +SKIP
    ...     pytest.skip(reason)
    """
    if not os.path.exists("/proc/self/mountinfo"):
        return False, "cgroups need Linux"
    if os.geteuid() != 0:
        return False, "cgroups need root (euid is not 0)"
    try:
        probe = CpuQuota(f"kh-probe-{uuid.uuid4().hex[:8]}", 0.5)
    except (OSError, RuntimeError) as error:
        return False, f"cannot make a cpu cgroup: {error}"
    try:
        probe.remove()
    except (OSError, RuntimeError) as error:
        return False, f"cannot remove a cpu cgroup: {error}"
    return True, ""


class CpuQuota:
    """One cgroup whose members run at most `fraction` of one core.

    Test infrastructure (root only): a real slow device, unlike the
    simulated `SimulatedSpeed`. The cap is a CFS bandwidth quota:
    `fraction * period_us` microseconds of CPU per `period_us`, enforced by
    the kernel for the group's processes or threads together. A capped
    process runs in bursts and then waits for its next period, so a short
    period (the 10 ms default) keeps its answers to collectives prompt.
    The quota is a fraction of ONE core: a value of 1 or more removes the
    cap (the members then run as fast as the cores they may use).

    Use it as a context manager, or call `remove()`; groups still present
    at interpreter exit are removed then.

    Args:
        name: The group's directory name (no `/`), unique on the machine.
        fraction: The cap, a fraction of one core in (0, 1), e.g. `0.4`;
            `None` or >= 1 for no cap. Defaults to `None`.
        period_us: The CFS period in microseconds, in [1000, 1000000]; the
            quota `fraction * period_us` must be at least 1000 (the
            kernel's minimum), so small fractions need a longer period.
            Defaults to `10000`.
        threads: cgroup v2 only: make the group for single threads
            (`add_threads`) instead of whole processes. cgroup v1 groups
            take both. Defaults to `False`.

    Attributes:
        name: The group's name.
        path: The group's directory (what `KH_CPU_QUOTA_GROUP` holds).
        period_us: The CFS period in microseconds.
        version: The cgroup version in use, 1 or 2.

    Raises:
        ValueError: For an invalid `name`, `fraction` or `period_us`, or a
            `name` already in use.
        RuntimeError: If no writable `cpu` controller is found (see
            `cpu_quota_available`).

    Example:

    >>> import subprocess, sys
    >>> with CpuQuota("kh-example", 0.25) as quota:  # doctest: +SKIP
    ...     burner = subprocess.Popen([sys.executable, "-c", "while 1: 0"])
    ...     quota.add_process(burner.pid)  # now at 1/4 of a core
    ...     quota.set(0.75)  # faster, while it runs
    ...     burner.kill()
    """

    def __init__(self, name, fraction=None, period_us=10_000, *, threads=False):
        if (
            not isinstance(name, str)
            or not name
            or "/" in name
            or name in (".", "..")
        ):
            raise ValueError(
                "Invalid value for argument `name`. Received: "
                f"name={name!r}. Expected a non-empty directory name "
                "without `/`."
            )
        check_int("period_us", period_us, _MIN_PERIOD_US, None, _MAX_PERIOD_US)
        fraction = checked_fraction(fraction, "fraction", fraction)
        _quota_us(fraction, period_us)
        version, mount = _cpu_controller()
        self.name = name
        self.path = os.path.join(mount, name)
        self.period_us = period_us
        self.version = version
        self._mount = mount
        self._threaded = version == 2 and bool(threads)
        self._owned = True
        try:
            os.mkdir(self.path)
        except FileExistsError:
            raise ValueError(
                "Invalid value for argument `name`. Received: "
                f"name={name!r}. A group of that name exists already "
                f"({self.path})."
            ) from None
        atexit.register(self.remove)
        try:
            self._configure()
            self.set(fraction)
        except BaseException:
            self.remove()
            raise

    @classmethod
    def attach(cls, path=None):
        """The group at `path`, made elsewhere (e.g. by `run_workers`).

        For code inside a worker: the object can `set` the quota and add
        threads or processes, but `remove()` leaves the group to its maker.

        Args:
            path: The group's directory. Defaults to `None`: the
                `KH_CPU_QUOTA_GROUP` environment variable.

        Returns:
            A `CpuQuota` for that group.

        Raises:
            RuntimeError: If `path` is None and `KH_CPU_QUOTA_GROUP` is not
                set, or `path` is not a group of the `cpu` controller.

        Example:

        >>> CpuQuota.attach().set(0.3)  # doctest: +SKIP
        """
        if path is None:
            path = os.environ.get(GROUP_ENV)
            if not path:
                raise RuntimeError(
                    f"`{GROUP_ENV}` is not set: this process was not started "
                    "with a CPU quota (`run_workers(..., cpu_quotas=...)`); "
                    "pass the group's path instead."
                )
        version, mount = _cpu_controller()
        path = os.path.abspath(path)
        if os.path.dirname(path) != mount or not os.path.isdir(path):
            raise RuntimeError(
                f"{path!r} is not a group directly under the cpu "
                f"controller's hierarchy ({mount})."
            )
        quota = cls.__new__(cls)
        quota.name = os.path.basename(path)
        quota.path = path
        quota.version = version
        quota._mount = mount
        quota._threaded = version == 2 and os.path.isdir(
            os.path.join(path, _THREADED_CHILD)
        )
        quota._owned = False
        quota.period_us = quota._read_limits()[1]
        return quota

    @property
    def takes_threads(self):
        """Whether `add_threads` works: cgroup v1, or v2 with `threads`."""
        return self.version == 1 or self._threaded

    @property
    def fraction(self):
        """The current cap as a fraction of one core (None: no cap), as the
        kernel has it (a change made elsewhere shows)."""
        quota_us, period_us = self._read_limits()
        return None if quota_us is None else quota_us / period_us

    def set(self, fraction):
        """Sets the cap; takes effect at once, also for running members.

        Args:
            fraction: A fraction of one core in (0, 1), e.g. `0.4`; `None`
                or >= 1 for no cap.

        Raises:
            ValueError: If `fraction` is not a number, is <= 0, or gives a
                quota below 1000 microseconds per period.
        """
        fraction = checked_fraction(fraction, "fraction", fraction)
        quota_us = _quota_us(fraction, self.period_us)
        if self.version == 1:
            value = -1 if quota_us is None else quota_us
            _write(self._capped_path("cpu.cfs_quota_us"), value)
        else:
            value = "max" if quota_us is None else quota_us
            _write(self._capped_path("cpu.max"), f"{value} {self.period_us}")

    def add_process(self, pid):
        """Caps process `pid` as a whole: all its threads, and those it
        makes later.

        Args:
            pid: The process id.
        """
        if not self._threaded:
            _write(os.path.join(self.path, "cgroup.procs"), pid)
            return
        self.add_threads(_thread_ids(pid))

    def add_threads(self, thread_ids):
        """Caps single threads (e.g. a process's `tf_Compute` threads);
        the process's other threads keep running uncapped.

        Threads that exit meanwhile are skipped.

        Args:
            thread_ids: Kernel thread ids (`/proc/<pid>/task/<tid>`).

        Raises:
            ValueError: On cgroup v2, for a group made without
                `threads=True`.
        """
        if self.version == 1:
            for thread_id in thread_ids:
                _write(os.path.join(self.path, "tasks"), thread_id, gone=True)
            return
        if not self._threaded:
            raise ValueError(
                f"Group {self.name!r} takes whole processes only: on cgroup "
                "v2, make it with `CpuQuota(..., threads=True)` to cap "
                "single threads."
            )
        inside = self.processes() | _read_ids(
            os.path.join(self.path, "cgroup.procs")
        )
        for thread_id in thread_ids:
            process_id = _process_of(thread_id)
            if process_id is None:
                continue
            if process_id not in inside:
                # Single threads move only within the process's threaded
                # subtree: the process joins the (uncapped) domain first.
                _write(os.path.join(self.path, "cgroup.procs"), process_id)
                inside.add(process_id)
            _write(self._capped_path("cgroup.threads"), thread_id, gone=True)

    def threads(self):
        """The ids of the threads the cap applies to now.

        Returns:
            A set of kernel thread ids.
        """
        name = "tasks" if self.version == 1 else "cgroup.threads"
        return _read_ids(self._capped_path(name))

    def processes(self):
        """The ids of the processes with a thread under the cap now.

        Returns:
            A set of process ids.
        """
        return _read_ids(self._capped_path("cgroup.procs"))

    def remove(self):
        """Removes the group if this object made it (not one `attach`ed).

        Processes or threads still in it are moved to the hierarchy's top
        group first (they keep running, uncapped). Safe to call twice.

        Raises:
            RuntimeError: If the group is still busy after 2 seconds.
        """
        if not self._owned:
            return
        paths = [self.path]
        if self._threaded:
            paths.insert(0, os.path.join(self.path, _THREADED_CHILD))
        deadline = time.monotonic() + _REMOVE_SECONDS
        for path in paths:
            while os.path.isdir(path):
                self._evacuate(path)
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    break
                except OSError as error:
                    if error.errno != errno.EBUSY:
                        raise
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"Cannot remove cgroup {path}: still busy."
                        ) from error
                    time.sleep(0.02)
        self._owned = False
        atexit.unregister(self.remove)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.remove()

    def __repr__(self):
        return (
            f"CpuQuota(name={self.name!r}, fraction={self.fraction!r}, "
            f"period_us={self.period_us})"
        )

    def _configure(self):
        if self.version == 1:
            _write(os.path.join(self.path, "cpu.cfs_period_us"), self.period_us)
            return
        _enable_cpu(self._mount)
        if self._threaded:
            child = os.path.join(self.path, _THREADED_CHILD)
            os.mkdir(child)
            _write(os.path.join(child, "cgroup.type"), "threaded")
            _enable_cpu(self.path)

    def _capped_path(self, name):
        if self._threaded:
            return os.path.join(self.path, _THREADED_CHILD, name)
        return os.path.join(self.path, name)

    def _read_limits(self):
        """`(quota_us or None, period_us)` as the kernel has them."""
        if self.version == 1:
            quota_us = int(_read(self._capped_path("cpu.cfs_quota_us")))
            period_us = int(_read(self._capped_path("cpu.cfs_period_us")))
            return (None if quota_us < 0 else quota_us), period_us
        quota, period = _read(self._capped_path("cpu.max")).split()
        return (None if quota == "max" else int(quota)), int(period)

    def _evacuate(self, path):
        """Moves everything in group `path` to the hierarchy's top group."""
        if self.version == 1:
            for thread_id in _read_ids(os.path.join(path, "tasks")):
                _write(os.path.join(self._mount, "tasks"), thread_id, gone=True)
            return
        for process_id in _read_ids(os.path.join(path, "cgroup.procs")):
            _write(
                os.path.join(self._mount, "cgroup.procs"), process_id, gone=True
            )


def throttle_compute_threads(group=None, pid=None):
    """Caps the TensorFlow kernel threads (`tf_Compute`) of a process.

    The "compute" throttle: a slow accelerator on a normal host. Call it
    after TensorFlow started its runtime (after the first op); the
    process's other threads (Python, input pipeline, gRPC) stay uncapped.
    TensorFlow starts more `tf_Compute` threads later (measured: during the
    first train step, for the input iterator), which this call does not
    see: in `fit`, use `ThrottleCompute`, which looks again after every
    batch. With more than one intra-op thread some kernels run outside
    `tf_Compute` threads (those have no usable name), so set
    `TF_NUM_INTRAOP_THREADS=1` before TensorFlow starts (`run_workers` does
    in "compute" mode).

    Args:
        group: A `CpuQuota` or a group's path. Defaults to `None`: the
            group in `KH_CPU_QUOTA_GROUP`.
        pid: The process. Defaults to `None`: this process.

    Returns:
        The sorted ids of the `tf_Compute` threads, all now in the group.

    Raises:
        RuntimeError: If the process has no `tf_Compute` thread yet, or a
            thread did not end up in the group.

    Example:

    >>> import tensorflow as tf  # doctest: +SKIP
    >>> tf.constant(1.0) + 1.0  # TensorFlow's runtime is up  # doctest: +SKIP
    >>> throttle_compute_threads()  # doctest: +SKIP
    [4242, 4243]
    """
    pid = os.getpid() if pid is None else pid
    thread_ids = _thread_ids(pid, COMPUTE_THREAD_NAME)
    if not thread_ids:
        raise RuntimeError(
            f"Process {pid} has no `{COMPUTE_THREAD_NAME}` thread yet: call "
            "this after TensorFlow has run its first op."
        )
    return _move_threads(_as_quota(group), pid, thread_ids)


class ThrottleCompute(keras.callbacks.Callback):
    """Caps this worker's TensorFlow kernel threads during `fit`.

    For workers started with `run_workers(..., throttle="compute")` (see
    `throttle_compute_threads`): moves the `tf_Compute` threads into the
    worker's group on train begin, and after every batch the ones started
    since (TensorFlow starts some during the first step, and with each new
    input iterator). Looking costs one listing of `/proc/self/task` per
    batch.

    Args:
        group: A `CpuQuota` or a group's path. Defaults to `None`: the
            group in `KH_CPU_QUOTA_GROUP`.

    Attributes:
        thread_ids: The ids of the threads moved in the last `fit` (some
            may have ended since).

    Raises:
        RuntimeError: After the first batch, if TensorFlow has no
            `tf_Compute` thread (a version that names its threads
            differently), or if a thread did not end up in the group.

    Example:

    >>> model.fit(data, callbacks=[ThrottleCompute()])  # doctest: +SKIP
    """

    def __init__(self, group=None):
        super().__init__()
        self.group = group
        self.thread_ids = []
        self._seen = set()

    def on_train_begin(self, logs=None):
        self.thread_ids = []
        self._seen = set()
        self._move_new_threads()

    def on_train_batch_end(self, batch, logs=None):
        self._move_new_threads()
        if not self.thread_ids:
            raise RuntimeError(
                f"No `{COMPUTE_THREAD_NAME}` thread in this process after a "
                "train step: this TensorFlow names its kernel threads "
                "differently; the compute throttle cannot find them."
            )

    def on_test_begin(self, logs=None):
        self._move_new_threads()

    def on_test_batch_end(self, batch, logs=None):
        self._move_new_threads()

    def _move_new_threads(self):
        pid = os.getpid()
        new = set(_thread_ids(pid)) - self._seen
        self._seen |= new
        compute = [
            thread_id
            for thread_id in sorted(new)
            if _thread_name(pid, thread_id) == COMPUTE_THREAD_NAME
        ]
        if compute:
            moved = _move_threads(_as_quota(self.group), pid, compute)
            self.thread_ids = sorted(set(self.thread_ids) | set(moved))


class ThrottleAt(keras.callbacks.Callback):
    """Changes this worker's CPU quota at a train step: a mid-run slowdown
    (or recovery) of a real device.

    Before train batch `step` (counted from 0 at each train begin, one per
    call of the batch callbacks: per execution with `steps_per_execution >
    1`) the group's quota becomes `fraction`; it stays so until changed
    again (also after `fit`). Needs root, like the group itself.

    Args:
        step: The batch before which the quota changes, an integer >= 0.
        fraction: The new cap: a fraction of one core in (0, 1); `None` or
            >= 1 for no cap.
        group: A `CpuQuota` or a group's path. Defaults to `None`: the
            group in `KH_CPU_QUOTA_GROUP`.

    Attributes:
        applied_at: `time.monotonic()` when the quota changed in the last
            `fit`, or None.

    Raises:
        ValueError: If `step` is not an integer >= 0 or `fraction` is not a
            valid cap.

    Example:

    >>> slow_down = ThrottleAt(20, 0.3)  # doctest: +SKIP
    >>> model.fit(data, epochs=2, callbacks=[slow_down])  # doctest: +SKIP
    """

    def __init__(self, step, fraction, group=None):
        super().__init__()
        check_int("step", step, 0)
        checked_fraction(fraction, "fraction", fraction)
        self.step = step
        self.fraction = fraction
        self.group = group
        self.applied_at = None

    def on_train_begin(self, logs=None):
        self._batches = 0
        self.applied_at = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._batches == self.step:
            _as_quota(self.group).set(self.fraction)
            self.applied_at = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1


def checked_fraction(value, argument, received):
    """`value` as a float in (0, 1), or None for no cap (`argument` and
    `received` name the argument and its whole value in the error)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"Invalid value for argument `{argument}`. Received: "
            f"{argument}={received!r}. Expected a fraction of one core > 0 "
            "(e.g. 0.4), or None or >= 1 for no cap."
        )
    return None if value >= 1 else float(value)


def _quota_us(fraction, period_us):
    """The quota in microseconds per period (None: no cap)."""
    if fraction is None:
        return None
    quota_us = round(fraction * period_us)
    if quota_us < _MIN_QUOTA_US:
        raise ValueError(
            "Invalid value for argument `fraction`. Received: "
            f"fraction={fraction!r}. With period_us={period_us} that is "
            f"{quota_us} us of CPU per period, below the kernel's minimum "
            f"of {_MIN_QUOTA_US} us: use a fraction >= "
            f"{_MIN_QUOTA_US / period_us:g} or a longer `period_us`."
        )
    return quota_us


def _cpu_controller():
    """`(version, mount point)` of the `cpu` controller's hierarchy.

    cgroup v1 first: a controller bound to a v1 hierarchy is absent from v2.
    """
    try:
        with open("/proc/self/mountinfo") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError as error:
        raise RuntimeError(f"cannot read the mount table: {error}") from None
    unified = []
    for line in lines:
        fields, _, tail = line.partition(" - ")
        mount = fields.split()[4].replace("\\040", " ")
        filesystem, _, options = tail.split()[:3]
        if filesystem == "cgroup" and "cpu" in options.split(","):
            return 1, mount
        if filesystem == "cgroup2":
            unified.append(mount)
    for mount in unified:
        try:
            controllers = _read(os.path.join(mount, "cgroup.controllers"))
        except OSError:
            continue
        if "cpu" in controllers.split():
            return 2, mount
    raise RuntimeError(
        "no cgroup `cpu` controller is mounted (cgroup v1 `cpu`, or v2 with "
        "`cpu` in cgroup.controllers)"
    )


def _enable_cpu(path):
    """cgroup v2: lets `path`'s children use the `cpu` controller."""
    control = os.path.join(path, "cgroup.subtree_control")
    if "cpu" not in _read(control).split():
        _write(control, "+cpu")


def _as_quota(group):
    if isinstance(group, CpuQuota):
        return group
    return CpuQuota.attach(group)


def _move_threads(quota, pid, thread_ids):
    """Moves threads of `pid` into `quota`'s group and checks they are
    there; returns the ids of those still alive."""
    quota.add_threads(thread_ids)
    alive = [t for t in thread_ids if os.path.exists(f"/proc/{pid}/task/{t}")]
    missing = set(alive) - quota.threads()
    if missing:
        raise RuntimeError(
            f"Threads {sorted(missing)} of process {pid} are not in cgroup "
            f"{quota.path} after being moved there."
        )
    return sorted(alive)


def _thread_ids(pid, name=None):
    """The ids of process `pid`'s threads (those called `name` only)."""
    try:
        entries = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    return sorted(
        int(entry)
        for entry in entries
        if name is None or _thread_name(pid, entry) == name
    )


def _thread_name(pid, thread_id):
    """A thread's name (`comm`), or None if it ended."""
    try:
        return _read(f"/proc/{pid}/task/{thread_id}/comm")
    except OSError:
        return None


def _process_of(thread_id):
    """The process (thread group) id of a thread, or None if it ended."""
    try:
        with open(f"/proc/{thread_id}/status") as status:
            for line in status:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _read(path):
    with open(path) as file:
        return file.read().strip()


def _read_ids(path):
    try:
        return {int(line) for line in _read(path).split()}
    except FileNotFoundError:
        return set()


def _write(path, value, gone=False):
    """Writes `value` to a cgroup file (`gone`: a thread or process that
    ended meanwhile is no error)."""
    try:
        with open(path, "w") as file:
            file.write(str(value))
    except ProcessLookupError:
        if not gone:
            raise
