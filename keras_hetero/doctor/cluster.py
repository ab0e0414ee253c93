"""The cluster `TF_CONFIG` names: validated, reached, and (on request)
joined for one timed all-reduce.

Reachability: each task running the doctor listens on its own `TF_CONFIG`
address and connects to every other task's, retrying until the timeout; it
stops listening once it reached every other task and every other task
reached it (or at the timeout). So tasks that start the doctor within
`timeout` seconds of each other see each other, and a task that cannot
listen on its own address (in use, or not an address of this machine)
learns it first.

The collective check then starts `tf.distribute.MultiWorkerMirroredStrategy`
on the same addresses, compares a fingerprint of every worker's cluster in
one all-reduce, and times an all-reduce of `ALLREDUCE_BYTES`.
"""

import concurrent.futures
import hashlib
import json
import socket
import statistics
import threading
import time

import numpy as np
import tensorflow as tf

from keras_hetero import _distribute
from keras_hetero.doctor.report import ClusterReport
from keras_hetero.doctor.report import PeerReport

ALLREDUCE_BYTES = 1_000_000
ALLREDUCE_REPEATS = 5
_GREETING = b"keras-hetero doctor "
_RETRY_SECONDS = 0.2


def _split(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_reachable(tasks, own, timeout):
    """Listens on `own`'s address and connects to every other task's.

    Args:
        tasks: `(task, address)` pairs from `cluster_tasks`.
        own: This process's task.
        timeout: Seconds to wait for the other tasks.

    Returns:
        A tuple of `PeerReport`, one per other task.

    Raises:
        ConnectionError: If this task cannot listen on its own address, or
            naming every task that was not reached within `timeout`.
    """
    peers = [(task, address) for task, address in tasks if task != own]
    deadline = time.monotonic() + timeout
    # An evaluator outside the cluster has no address to listen on.
    address = dict(tasks).get(own)
    listener = None if address is None else _listen(own, address)
    greeted = set()
    stop = threading.Event()
    if listener is not None:
        acceptor = threading.Thread(
            target=_accept, args=(listener, greeted, stop), daemon=True
        )
        acceptor.start()
    with concurrent.futures.ThreadPoolExecutor(max(len(peers), 1)) as pool:
        reports = tuple(
            pool.map(
                lambda peer: _probe(*peer, own, deadline),
                peers,
            )
        )
    if listener is not None:
        # Listen on until the others reached this task too: one that
        # started later still finds it.
        others = {task for task, _ in peers}
        while not others <= greeted and time.monotonic() < deadline:
            time.sleep(_RETRY_SECONDS / 4)
        stop.set()
        acceptor.join()
        listener.close()
    unreachable = [peer for peer in reports if not peer.reachable]
    if unreachable:
        names = "; ".join(
            f"{peer.task} at {peer.address} ({peer.error})"
            for peer in unreachable
        )
        raise ConnectionError(
            f"TF_CONFIG names task(s) this task ({own}) could not reach "
            f"within {timeout:g} s: {names}. Run `keras-hetero doctor` on "
            "every task within that time of each other, and check the "
            "addresses, that the ports are open, and the firewall."
        )
    return reports


def _listen(own, address):
    host, port = _split(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=64)
    except OSError as error:
        raise ConnectionError(
            f"This task ({own}) cannot listen on its TF_CONFIG address "
            f"{address}: {error.strerror or error}. Is another process "
            "(a training job still running?) using the port, or is "
            "task.index wrong for this machine?"
        ) from None


def _accept(listener, greeted, stop):
    """Records the task each connecting doctor names, until `stop`."""
    listener.settimeout(_RETRY_SECONDS)
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            return
        with connection:
            connection.settimeout(1.0)
            message = b""
            try:
                # The prober closes first (its side keeps TIME_WAIT, not
                # this port, which the strategy's server binds next).
                while chunk := connection.recv(256):
                    message += chunk
            except OSError:
                pass
        if message.startswith(_GREETING):
            greeted.add(message[len(_GREETING) :].decode().strip())


def _probe(task, address, own, deadline):
    """Connects to `address` until it answers or `deadline` passes."""
    host, port = _split(address)
    error = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        start = time.perf_counter()
        try:
            with socket.create_connection(
                (host, port), timeout=max(min(remaining, 2.0), 0.05)
            ) as connection:
                seconds = time.perf_counter() - start
                connection.sendall(_GREETING + own.encode() + b"\n")
            return PeerReport(task, address, True, connect_seconds=seconds)
        except OSError as failure:
            error = failure.strerror or str(failure) or type(failure).__name__
        if time.monotonic() + _RETRY_SECONDS > deadline:
            return PeerReport(task, address, False, error=error)
        time.sleep(_RETRY_SECONDS)


def start_collective(timeout):
    """`MultiWorkerMirroredStrategy` over `TF_CONFIG`'s cluster.

    Raises:
        RuntimeError: If TensorFlow already ran an op in this process
            (collectives are configured at program start).
    """
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout
    )
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=options
        )
    except RuntimeError as error:
        raise RuntimeError(
            "`collective=True` starts MultiWorkerMirroredStrategy, which "
            "must happen before TensorFlow runs its first op in the process "
            f"(TensorFlow: {error}). Run `keras-hetero doctor --collective`, "
            "or call kh.doctor(collective=True) at the start of a script."
        ) from None


def time_allreduce(strategy, tasks, timeout):
    """Compares the workers' clusters and times an all-reduce of
    `ALLREDUCE_BYTES` across them.

    Args:
        strategy: The `MultiWorkerMirroredStrategy`.
        tasks: `(task, address)` pairs from `cluster_tasks` (every worker
            contributes a fingerprint of its own).
        timeout: Seconds each collective may take (for the message).

    Returns:
        `(median seconds, agree)`.

    Raises:
        TimeoutError: If a collective did not complete.
    """
    task = _distribute.env_task()
    # 40 bits: exact in float64, also summed over many replicas.
    digest = hashlib.sha256(json.dumps(sorted(tasks)).encode()).digest()
    fingerprint = float(int.from_bytes(digest[:5], "big"))
    slots = np.zeros([task.num_workers], np.float64)
    slots[task.worker_index] = fingerprint
    payload = np.ones([ALLREDUCE_BYTES // 4], np.float32)
    allreduce = _allreduce_function(strategy)
    try:
        # The first all-reduce also forms the workers' group.
        gathered = _sum_over_workers(strategy, allreduce, slots)
        timings = []
        for run in range(ALLREDUCE_REPEATS + 1):
            start = time.perf_counter()
            _sum_over_workers(strategy, allreduce, payload)
            if run:
                timings.append(time.perf_counter() - start)
    except tf.errors.OpError as error:
        raise TimeoutError(
            f"The all-reduce across the {task.num_workers} workers did not "
            f"complete within {timeout:g} s ({type(error).__name__}: "
            f"{error.message.splitlines()[0]}). Do all workers run "
            "`keras-hetero doctor --collective` with the same cluster in "
            "TF_CONFIG?"
        ) from None
    agree = bool(np.allclose(gathered, fingerprint, rtol=1e-12, atol=0))
    return statistics.median(timings), agree


def gather_speeds(strategy, speeds):
    """Every worker's replica speeds, in global replica order.

    Args:
        strategy: The `MultiWorkerMirroredStrategy`.
        speeds: This worker's speed per local replica device.

    Returns:
        A list of floats, one per global replica.
    """
    task = _distribute.env_task()
    local = len(speeds)
    slots = np.zeros([task.num_workers * local], np.float64)
    start = task.worker_index * local
    slots[start : start + local] = speeds
    allreduce = _allreduce_function(strategy)
    summed = _sum_over_workers(strategy, allreduce, slots)
    _part(strategy, allreduce)
    return [float(value) for value in summed]


def _part(strategy, allreduce):
    """One last all-reduce, so that no worker leaves before every peer has
    received its part of the previous one.

    A worker's all-reduce can complete while a peer still fetches a buffer
    from it (`RecvBuf`); a worker that then exits makes the peer's
    collective fail with "Socket closed" (seen in CI). Finishing this one
    proves every peer entered it, so finished the previous one. This one
    may itself fail on a peer that already left, after the results are
    final: that failure is ignored.
    """
    try:
        _sum_over_workers(strategy, allreduce, np.zeros([1], np.float64))
    except (
        tf.errors.UnavailableError,
        tf.errors.AbortedError,
        tf.errors.CancelledError,
    ):
        pass


def _allreduce_function(strategy):
    @tf.function
    def allreduce(value):
        def replica():
            context = tf.distribute.get_replica_context()
            # Made inside the replica: a captured host tensor has no
            # device to all-reduce from.
            return context.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.identity(value)
            )

        return strategy.run(replica)

    return allreduce


def _sum_over_workers(strategy, allreduce, array):
    """`array` summed over the workers (each worker's local replicas add it
    once each, so it is divided by their count first), as numpy: the host
    copy waits for the collective."""
    local = len(strategy.extended.worker_devices)
    summed = allreduce(array / np.asarray(local, array.dtype))
    return strategy.experimental_local_results(summed)[0].numpy()


def cluster_report(tasks, own, peers, **collective):
    """The `ClusterReport` of `tasks` as seen from `own`."""
    task = _distribute.env_task()
    return ClusterReport(
        task=own,
        address=dict(tasks).get(own),
        worker_index=task.worker_index,
        num_workers=task.num_workers,
        peers=peers,
        **collective,
    )
