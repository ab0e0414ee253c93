"""`run_workers`: real worker processes with TF_CONFIG on loopback ports,
optionally pinned to cores and under CPU quotas (real unequal devices)."""

import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import uuid

from keras_hetero._checks import check_choice
from keras_hetero._checks import check_int
from keras_hetero.launcher import free_ports
from keras_hetero.testing import cpu_quota


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """What one worker process did.

    Attributes:
        index: The worker's task index.
        exit_code: The process exit code (negative: killed by that signal).
        value: What the target returned (None if it failed).
        output: The worker's captured stdout and stderr.
    """

    index: int
    exit_code: int
    value: object
    output: str


class WorkerError(RuntimeError):
    """A worker failed or timed out; `results` holds every worker's result."""

    def __init__(self, message, results):
        super().__init__(message)
        self.results = results


def cluster_config(num_workers, ports=None):
    """The `TF_CONFIG` cluster dict for `num_workers` workers on loopback."""
    ports = ports or free_ports(num_workers)
    return {"worker": [f"127.0.0.1:{port}" for port in ports]}


# Read once, when TensorFlow or Keras is imported: a preloaded process can
# serve a worker only if these are what the caller has now.
_IMPORT_TIME_ENV = (
    "TF_USE_LEGACY_KERAS",
    "KERAS_BACKEND",
    "TF_CPP_MIN_LOG_LEVEL",
    "TF_ENABLE_ONEDNN_OPTS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONPATH",
)
_server = {}  # the forkserver context and the environment it started with


def _context():
    """A forkserver with TensorFlow, Keras, keras_hetero imported, or spawn.

    Importing TensorFlow and Keras costs each fresh process about 7 s of CPU
    (measured on this 2-core machine); a forkserver pays that once and forks
    every worker from the imported state. Nothing TensorFlow runs there before
    the fork (no eager context, no thread pool), which is what makes forking
    safe. The forkserver keeps the environment it started with, so when a
    variable read at import time has changed since, workers are spawned.
    """
    environment = {name: os.environ.get(name) for name in _IMPORT_TIME_ENV}
    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["keras_hetero"])
        _server.update(context=context, environment=environment)
    if _server["environment"] == environment:
        return _server["context"]
    return multiprocessing.get_context("spawn")


def _take_over(environ, output_path):
    """In a forked or spawned child: the caller's environment `environ`, and
    stdout and stderr (file descriptors too) to `output_path`."""
    os.environ.clear()
    os.environ.update(environ)
    with open(output_path, "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _place(placement):
    """In a child, before TensorFlow starts: its cores and its CPU quota."""
    cores, group, throttle = placement
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if group is None:
        return
    os.environ[cpu_quota.GROUP_ENV] = group
    if throttle == "process":
        cpu_quota.CpuQuota.attach(group).add_process(os.getpid())
    else:
        # Intra-op threads have no usable name; with one, kernels run in
        # the `tf_Compute` threads the worker moves into its group.
        os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")


def _child(
    target,
    args,
    index,
    cluster,
    result_path,
    output_path,
    environ,
    placement,
):
    _take_over(environ, output_path)
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}}
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        _place(placement)
        value = target(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    import pickle

    with open(result_path, "wb") as result:
        pickle.dump(value, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(
    target,
    num_workers,
    timeout=120,
    args=(),
    check=True,
    *,
    cpu_quotas=None,
    cores=None,
    throttle="process",
):
    """Runs `target(*args)` in `num_workers` processes forming one TF cluster.

    Each process gets `TF_CONFIG` for a worker of a cluster on free
    127.0.0.1 ports, its stdout and stderr captured, and the caller's
    environment as it is at the call. All processes are killed when
    `timeout` seconds pass. Workers fork from a forkserver that has imported
    TensorFlow, Keras and keras_hetero once (about 7 s of CPU saved per
    worker); if a variable read at import time (`TF_USE_LEGACY_KERAS`,
    `KERAS_BACKEND`, ...) changed since that server started, they are
    spawned fresh instead.

    Real unequal devices (Linux, root; see `kh.testing.CpuQuota`): with
    `cpu_quotas`, each worker runs in a cgroup of its own that caps it at a
    fraction of one core, and `cores` pins workers to cores. Each worker
    finds its group's directory in `KH_CPU_QUOTA_GROUP`, to change its own
    quota (`kh.testing.ThrottleAt`) or, with `throttle="compute"`, to move
    its TensorFlow kernel threads there (`kh.testing.ThrottleCompute`).
    The groups made here are removed when the workers end, also when one
    crashes or the call is left by an exception. Without `cores` a quota
    still caps a worker's CPU time, but the worker may use any core; with
    more workers than cores, `"auto"` shares cores (3 workers on 2 cores:
    workers 0 and 2 both on core 0, each at about half its speed when both
    compute, on top of their quotas).

    Args:
        target: A picklable (module-level) function; its return value must be
            picklable too.
        num_workers: How many worker processes.
        timeout: Seconds until all workers are killed. Defaults to `120`.
        args: Positional arguments for `target`. Defaults to `()`.
        check: Raise `WorkerError` if any worker fails or times out.
            Defaults to `True`.
        cpu_quotas: One cap per worker: a fraction of one core (e.g.
            `0.4`); `None` or >= 1 for no cap (the worker still gets a group,
            so its quota can change later); or a `CpuQuota` the caller made
            (and removes), e.g. to `set` it from this process while the
            workers run. Defaults to `None`: no groups.
        cores: Pinning: `None` (none), `"auto"` (worker `i` on the `i`-th
            core this process may use, round robin), or one entry per
            worker, a core index or a list of them. Defaults to `None`.
        throttle: What a quota caps: `"process"` (the whole worker, a slow
            host) or `"compute"` (only TensorFlow's kernel threads, which
            the worker moves into its group itself, e.g. with
            `kh.testing.ThrottleCompute`; a slow accelerator).
            Defaults to `"process"`.

    Returns:
        A list of `WorkerResult`, one per worker, by task index.

    Raises:
        ValueError: If `num_workers` is not a positive integer, or
            `cpu_quotas`, `cores` or `throttle` is invalid.
        RuntimeError: If `cpu_quotas` is given and no cgroup can be made
            here (see `kh.testing.cpu_quota_available`).
        WorkerError: If `check` and a worker exited non-zero or timed out.

    Example:

    >>> results = run_workers(my_training_function, 2)  # doctest: +SKIP
    >>> [r.exit_code for r in results]  # doctest: +SKIP
    [0, 0]
    >>> # Worker 1 at 0.3 of worker 0's core, each on its own core:
    >>> run_workers(  # doctest: +SKIP
    ...     my_training_function, 2, cpu_quotas=[1.0, 0.3], cores="auto"
    ... )
    """
    num_workers = check_int(
        "num_workers", num_workers, expected="a positive integer"
    )
    core_sets = _core_sets(cores, num_workers)
    check_choice(
        "throttle",
        throttle,
        ("process", "compute"),
        expected='"process" or "compute"',
    )
    context = _context()
    environ = dict(os.environ)
    made = []  # the groups this call makes, and removes
    try:
        groups = _groups(cpu_quotas, num_workers, throttle, made)
        return _run(
            context,
            environ,
            target,
            num_workers,
            timeout,
            args,
            check,
            [(c, g, throttle) for c, g in zip(core_sets, groups)],
        )
    finally:
        for group in made:
            group.remove()


def _run(
    context, environ, target, num_workers, timeout, args, check, placements
):
    cluster = cluster_config(num_workers)
    workdir = tempfile.mkdtemp(prefix="kh-workers-")
    processes = []
    for index in range(num_workers):
        paths = (
            os.path.join(workdir, f"result-{index}.pkl"),
            os.path.join(workdir, f"output-{index}.txt"),
        )
        process = context.Process(
            target=_child,
            args=(
                target,
                tuple(args),
                index,
                cluster,
                *paths,
                environ,
                placements[index],
            ),
            daemon=True,
        )
        process.start()
        processes.append((process, paths))
    deadline = time.monotonic() + timeout
    timed_out = False
    for process, _ in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            timed_out = True
            break
    if timed_out:
        for process, _ in processes:
            if process.is_alive():
                process.kill()
        for process, _ in processes:
            process.join()
    results = [
        _collect(index, process, paths)
        for index, (process, paths) in enumerate(processes)
    ]
    failed = [r for r in results if r.exit_code != 0]
    if check and (timed_out or failed):
        summary = "\n".join(
            f"--- worker {r.index} (exit {r.exit_code}) ---\n"
            + r.output[-3000:]
            for r in results
        )
        reason = f"timed out after {timeout}s" if timed_out else "failed"
        raise WorkerError(f"Workers {reason}:\n{summary}", results)
    return results


def _core_sets(cores, num_workers):
    """Each worker's cores (a sorted list), or None for no pinning."""
    if cores is None:
        return [None] * num_workers
    available = sorted(os.sched_getaffinity(0))
    if isinstance(cores, str) and cores == "auto":
        return [[available[i % len(available)]] for i in range(num_workers)]
    sets = None
    if _is_sequence(cores) and len(cores) == num_workers:
        sets = [[entry] if _is_core(entry) else entry for entry in cores]
    if sets is None or not all(
        _is_sequence(entry)
        and entry
        and all(_is_core(core) and core in available for core in entry)
        for entry in sets
    ):
        raise ValueError(
            "Invalid value for argument `cores`. Received: "
            f'cores={cores!r}. Expected None, "auto", or one entry per '
            f"worker ({num_workers}): a core index or a list of them, of "
            f"the cores this process may use ({available})."
        )
    return [sorted(set(entry)) for entry in sets]


def _is_sequence(value):
    return isinstance(value, (list, tuple))


def _is_core(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _groups(cpu_quotas, num_workers, throttle, made):
    """Each worker's group path (or None); appends the groups it makes to
    `made`."""
    if cpu_quotas is None:
        return [None] * num_workers
    if not _is_sequence(cpu_quotas) or len(cpu_quotas) != num_workers:
        raise ValueError(
            "Invalid value for argument `cpu_quotas`. Received: "
            f"cpu_quotas={cpu_quotas!r}. Expected a list with one entry per "
            f"worker ({num_workers})."
        )
    for entry in cpu_quotas:
        if not isinstance(entry, cpu_quota.CpuQuota):
            cpu_quota.checked_fraction(entry, "cpu_quotas", cpu_quotas)
        elif throttle == "compute" and not entry.takes_threads:
            raise ValueError(
                "Invalid value for argument `cpu_quotas`. Received: "
                f"{entry!r} with throttle='compute'. Expected a group that "
                "takes single threads (cgroup v2: `threads=True`)."
            )
    run = uuid.uuid4().hex[:8]
    paths = []
    for index, entry in enumerate(cpu_quotas):
        if not isinstance(entry, cpu_quota.CpuQuota):
            entry = cpu_quota.CpuQuota(
                f"kh-workers-{run}-{index}",
                entry,
                threads=throttle == "compute",
            )
            made.append(entry)
        paths.append(entry.path)
    return paths


def _collect(index, process, paths):
    import pickle

    result_path, output_path = paths
    value = None
    if process.exitcode == 0 and os.path.exists(result_path):
        with open(result_path, "rb") as result:
            value = pickle.load(result)
    output = ""
    if os.path.exists(output_path):
        with open(output_path, errors="replace") as text:
            output = text.read()
    return WorkerResult(index, process.exitcode, value, output)
