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


def _child(target, args, index, cluster, result_path, output_path):
    with open(output_path, "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
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
    127.0.0.1 ports, its stdout and stderr captured. All processes are killed
    when `timeout` seconds pass.

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
    context = multiprocessing.get_context("spawn")
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
            args=(target, tuple(args), index, cluster, *paths),
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
