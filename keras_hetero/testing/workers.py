"""`run_workers`: real worker processes with TF_CONFIG on loopback ports."""

import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback

from keras_hetero.launcher import free_ports


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


def _child(target, args, index, cluster, result_path, output_path, environ):
    _take_over(environ, output_path)
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}}
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
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


def run_workers(target, num_workers, timeout=120, args=(), check=True):
    """Runs `target(*args)` in `num_workers` processes forming one TF cluster.

    Each process gets `TF_CONFIG` for a worker of a cluster on free
    127.0.0.1 ports, its stdout and stderr captured, and the caller's
    environment as it is at the call. All processes are killed when
    `timeout` seconds pass. Workers fork from a forkserver that has imported
    TensorFlow, Keras and keras_hetero once (about 7 s of CPU saved per
    worker); if a variable read at import time (`TF_USE_LEGACY_KERAS`,
    `KERAS_BACKEND`, ...) changed since that server started, they are
    spawned fresh instead.

    Args:
        target: A picklable (module-level) function; its return value must be
            picklable too.
        num_workers: How many worker processes.
        timeout: Seconds until all workers are killed. Defaults to `120`.
        args: Positional arguments for `target`. Defaults to `()`.
        check: Raise `WorkerError` if any worker fails or times out.
            Defaults to `True`.

    Returns:
        A list of `WorkerResult`, one per worker, by task index.

    Raises:
        ValueError: If `num_workers` is not a positive integer.
        WorkerError: If `check` and a worker exited non-zero or timed out.

    Example:

    >>> results = run_workers(my_training_function, 2)  # doctest: +SKIP
    >>> [r.exit_code for r in results]  # doctest: +SKIP
    [0, 0]
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int):
        raise ValueError(
            f"Invalid value for argument `num_workers`. Received: "
            f"num_workers={num_workers!r}. Expected a positive integer."
        )
    if num_workers < 1:
        raise ValueError(
            f"Invalid value for argument `num_workers`. Received: "
            f"num_workers={num_workers!r}. Expected a positive integer."
        )
    context = _context()
    environ = dict(os.environ)
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
            args=(target, tuple(args), index, cluster, *paths, environ),
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
