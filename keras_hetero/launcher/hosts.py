"""`keras-hetero run --nnodes ...`: this host's part of a multi-host job.

Every host runs the same command with its own `--node-rank`. The launcher
with rank 0 also serves the rendezvous (`rendezvous.py`); every launcher,
rank 0's included, joins it over TCP, starts the workers it is given with
`TF_CONFIG` and `CUDA_VISIBLE_DEVICES`, stops them when told, and reports
their exit codes. If it loses the rendezvous (rank 0's host or the network
is gone), it stops its workers and joins again, for up to `rdzv_timeout`
seconds.
"""

import hashlib
import importlib.metadata
import os
import queue
import signal
import socket
import sys
import threading
import time

from keras_hetero._checks import check_int
from keras_hetero.launcher import addresses
from keras_hetero.launcher import devices as device_lists
from keras_hetero.launcher import etcd
from keras_hetero.launcher import group
from keras_hetero.launcher import policy
from keras_hetero.launcher import ports as port_ranges
from keras_hetero.launcher import rendezvous
from keras_hetero.launcher.group import Attempt
from keras_hetero.launcher.group import LaunchResult
from keras_hetero.launcher.group import _say
from keras_hetero.launcher.ports import free_ports


def launch_host(
    command,
    *,
    nnodes,
    node_rank,
    rdzv_endpoint,
    rdzv_token=None,
    rdzv_bind=None,
    rdzv_timeout=300.0,
    rdzv_last_call=10.0,
    workers_per_host=1,
    devices_per_host=None,
    max_restarts=3,
    grace_seconds=30.0,
    env=None,
    output=None,
    worker_ports=None,
    advertise_address=None,
    warm=True,
    rdzv_backend="tcp",
    rdzv_id=None,
):
    """Runs this host's part of a multi-host job (`keras-hetero run
    --nnodes ...`).

    Call it with the same `command` on every host, each with its own
    `node_rank`. Rank 0's call serves the rendezvous at `rdzv_endpoint`
    (listening on `rdzv_bind`); every call joins it, and once enough hosts
    are in, each starts its workers. Workers are numbered host by host in
    rank order: worker 0 (the chief) is rank 0's first. Each worker gets
    `TF_CONFIG` for the whole group, `KERAS_HETERO_RESTART` (the attempt),
    `KERAS_HETERO_NUM_WORKERS`, and `CUDA_VISIBLE_DEVICES` when the host
    has GPUs. When a worker fails or a host is lost, every host stops its
    workers and the group starts again (with the hosts that are left, if
    at least the minimum of `nnodes`); a host that joins while a group
    runs is let in by restarting the group. Training resumes where it was
    if the script uses `kh.callbacks.ElasticCheckpoint`.

    Args:
        command: The worker command, e.g. `[sys.executable, "train.py"]`.
        nnodes: Hosts in the job: `N`, or `"MIN:MAX"` for a group that
            continues with as few as MIN hosts and takes up to MAX.
        node_rank: This host's rank, in `[0, MAX)`. With the default
            backend rank 0 serves the rendezvous and is needed for the
            whole job (not with `rdzv_backend="etcd"`).
        rdzv_endpoint: `"HOST:PORT"` of the rendezvous: an address of rank
            0's host that every host can reach.
        rdzv_token: The shared secret, the same on every host. Defaults to
            None (read `KERAS_HETERO_RDZV_TOKEN`).
        rdzv_bind: Rank 0 only: the local address the rendezvous listens
            on, e.g. the endpoint's address or `"0.0.0.0"`. Defaults to
            None: the endpoint's host if it is a loopback address (a job on
            one machine); for any other endpoint it must be given.
        rdzv_timeout: Seconds to wait for the hosts (for `MIN` of them), at
            the start and after a host is lost; also how long a host tries
            to (re)join. Defaults to `300.0`.
        rdzv_last_call: Seconds without a new host before a group starts
            with fewer than MAX hosts, or restarts to admit a new one.
            Defaults to `10.0`.
        workers_per_host: Workers on this host: an int (they share its
            GPUs evenly) or `"auto"` (one per GPU, one without GPUs).
            Defaults to `1`.
        devices_per_host: The number of GPUs to assume on this host instead
            of discovering them (`nvidia-smi -L`); 0 for none. Defaults to
            None (discover).
        max_restarts: Restarts after failures, >= 0 (restarts that admit a
            host do not count). Defaults to `3`.
        grace_seconds: How long stopped workers get to exit before
            SIGKILL (after a worker died, 0.5 s at most:
            `policy.stop_grace`). Defaults to `30.0`.
        env: Extra environment variables for the workers. Defaults to None.
        output: A text stream for the prefixed worker output and the
            launcher's lines. Defaults to `sys.stdout`.
        worker_ports: A port range `"A-B"` (or a `range`) this host's
            workers listen on: for each attempt they take the first ports
            of the range free on this host, so restarted workers get the
            same ports back. Hosts that share an address need disjoint
            ranges. Defaults to None (any free ports, new ones on each
            attempt).
        advertise_address: The address this host publishes for its
            workers in `TF_CONFIG`: an IP address of this host or an
            interface name (its IPv4 address), e.g. the fast network's.
            Defaults to None (the address this host reached the rendezvous
            from).
        warm: Restart this host's workers in warm spares (see `launch`).
            Defaults to `True`.
        rdzv_backend: `"tcp"`: rank 0's launcher serves the rendezvous
            (losing its host ends the job). `"etcd"`: `rdzv_endpoint` is
            an etcd cluster's client address(es); whichever launcher holds
            the role in etcd serves the rendezvous, so any host, rank 0's
            included, can be lost and come back (`etcd.py`). Defaults to
            `"tcp"`.
        rdzv_id: With `"etcd"`: the job's id, the same on every host and
            new for each job. Defaults to None.

    Returns:
        A `LaunchResult`: the job's exit code (the same on every host) and
        the attempts this host saw end.

    Raises:
        ValueError: For a bad argument (named): e.g. a `worker_ports` range
            smaller than this host's workers, an `advertise_address` not of
            this host, a GPU count `workers_per_host` does not divide; a
            port already in use, or a job the rendezvous refused (another
            script, other arguments or versions than rank 0's, a wrong
            token).
        ConnectionError: With `rdzv_backend="etcd"`, if etcd cannot be
            reached at the start (naming its address and why).
        TimeoutError: If too few hosts joined within `rdzv_timeout` (the
            message names the missing ranks), or this host could not reach
            the rendezvous.

    Example:

    >>> launch_host([sys.executable, "train.py"], nnodes=2, node_rank=0,
    ...             rdzv_endpoint="10.0.0.1:29400",
    ...             rdzv_bind="10.0.0.1")  # doctest: +SKIP
    """
    group.check_command(command)
    min_hosts, max_hosts = policy.parse_nnodes(nnodes)
    check_int(
        "node_rank",
        node_rank,
        0,
        maximum=max_hosts - 1,
        expected=f"an integer in [0, {max_hosts - 1}] (--nnodes {nnodes})",
    )
    if rdzv_backend not in ("tcp", "etcd"):
        raise ValueError(
            "Invalid value for argument `rdzv_backend`. Received: "
            f"rdzv_backend={rdzv_backend!r}. Expected 'tcp' (rank 0 serves "
            "the rendezvous) or 'etcd'."
        )
    if rdzv_backend == "tcp":
        host, port = policy.parse_endpoint(rdzv_endpoint)
        if rdzv_id is not None:
            raise ValueError(
                f"Invalid value for argument `rdzv_id`. Received: rdzv_id="
                f"{rdzv_id!r} with rdzv_backend='tcp'. Expected it only "
                "with --rdzv-backend etcd (the job's name in etcd)."
            )
    group.check_seconds(
        rdzv_timeout=rdzv_timeout,
        rdzv_last_call=rdzv_last_call,
        grace_seconds=grace_seconds,
    )
    check_int("max_restarts", max_restarts, 0)
    environ = dict(os.environ)
    environ.update(env or {})
    gpus = device_lists.host_gpus(devices_per_host, environ)
    slots = device_lists.worker_devices(workers_per_host, gpus)
    if worker_ports is not None:
        worker_ports = port_ranges.parse_port_range(worker_ports)
        port_ranges.check_port_range(worker_ports, len(slots))
    if advertise_address is not None:
        advertise_address = addresses.advertise_address(advertise_address)
    token = rendezvous.read_token(rdzv_token)
    output = output or sys.stdout
    job = job_description(command, slots, environ)

    def make_server(bind, port, state=None):
        return rendezvous.RendezvousServer(
            bind,
            port,
            token,
            min_hosts=min_hosts,
            max_hosts=max_hosts,
            job=job,
            timeout=float(rdzv_timeout),
            last_call=float(rdzv_last_call),
            max_restarts=max_restarts,
            grace_seconds=float(grace_seconds),
            output=output,
            rank=node_rank,
            state=state,
            record=seat.role.record if seat is not None else None,
        )

    server = seat = endpoint = None
    if rdzv_backend == "etcd":
        seat = etcd.Seat(
            rdzv_endpoint,
            rdzv_id,
            rdzv_bind,
            rdzv_timeout,
            make_server,
            output,
        )
    else:
        endpoint = (host, port)
        if node_rank == 0:
            server = make_server(
                _bind_address(rdzv_bind, rdzv_endpoint, host), port
            )
            server.start()
    agent = _Agent(
        command,
        node_rank,
        endpoint,
        token,
        slots,
        job,
        float(rdzv_timeout),
        group._Group(output, grace_seconds, warm=warm),
        env or {},
        output,
        server,
        advertise_address,
        worker_ports,
        seat,
    )
    try:
        with group.signals_to(agent.interrupt):
            return agent.run()
    finally:
        agent.workers.close_spares()
        if server is not None:
            server.close()
        if seat is not None:
            seat.close()


def _bind_address(rdzv_bind, rdzv_endpoint, host):
    """Where rank 0's rendezvous listens: `rdzv_bind`, or loopback for a
    loopback endpoint (any other endpoint needs `rdzv_bind`)."""
    if rdzv_bind is not None:
        return rdzv_bind
    if not policy.is_loopback(host):
        raise ValueError(
            "Invalid value for argument `rdzv_bind`. Received: "
            f"rdzv_bind=None with rdzv_endpoint={rdzv_endpoint!r}. "
            "The rendezvous listens on loopback unless told "
            f"otherwise; for other hosts to reach {host}, pass "
            f"--rdzv-bind {host} (that address on this host) or "
            "--rdzv-bind 0.0.0.0 (every interface)."
        )
    return "::1" if ":" in host else "127.0.0.1"


def job_description(command, slots, environ=None):
    """What every host of a job must agree on (`policy.JOB_FIELDS`).

    The script is compared by file name and content digest (its directory
    may differ between hosts), the arguments as given, and the versions of
    Python, keras-hetero, TensorFlow and the Keras flavour the workers will
    import (read from package metadata, without importing them).

    Args:
        command: The worker command; `command[1]` is the script if it is a
            file.
        slots: This host's `CUDA_VISIBLE_DEVICES` per worker.
        environ: The workers' environment. Defaults to `os.environ`.

    Returns:
        A dict of JSON values.
    """
    environ = os.environ if environ is None else environ
    script, arguments = None, list(command[1:])
    if len(command) > 1 and os.path.isfile(command[1]):
        with open(command[1], "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        script = f"{os.path.basename(command[1])} (sha256 {digest}...)"
        arguments = list(command[2:])
    legacy = environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")
    keras = "tf-keras" if legacy else "keras"
    kinds = sorted({policy.devices_per_worker(s) for s in slots})
    return {
        "script": script,
        "arguments": arguments,
        "python": "{}.{}".format(*sys.version_info[:2]),
        "keras_hetero": _version("keras-hetero"),
        "tensorflow": _version("tensorflow", "tensorflow-cpu", "tf-nightly"),
        "keras": f"{keras} {_version(keras)}",
        "devices_per_worker": kinds[0] if len(kinds) == 1 else kinds,
    }


def _version(*names):
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


class _Agent:
    """This host's launcher: joins the rendezvous and runs what it says."""

    def __init__(
        self,
        command,
        rank,
        endpoint,
        token,
        slots,
        job,
        timeout,
        workers,
        env,
        output,
        server,
        advertise_address=None,
        port_range=None,
        seat=None,
    ):
        self.command, self.rank = list(command), rank
        self.endpoint, self.token = endpoint, token
        self.slots, self.job, self.timeout = slots, job, timeout
        self.workers, self.env = workers, env
        self.output, self.server, self.seat = output, server, seat
        self.where = (
            "{}:{}".format(*endpoint)
            if seat is None
            else f"etcd {','.join(seat.urls)}"
        )
        self.attempts = []
        self.interrupted = None
        self.address = self.advertise_address = advertise_address
        self.port_range = port_range
        self._round = None  # the round whose workers run here
        self._reported_failure = False
        self._specs = []
        self._codes = {}  # round -> this host's exit codes

    def interrupt(self, number, frame):
        # Only flags: the loops stop the workers (and print, outside the
        # signal handler, which may have interrupted a print).
        if self.interrupted is not None:
            self.workers._kill_all()  # a second signal: no more grace
            return
        self.interrupted = number

    def run(self):
        while True:
            channel = self._join()
            if channel is None:
                return self._interrupted()
            if isinstance(channel, dict):  # ended before this host joined
                result = self._handle(None, channel)
                if isinstance(result, TimeoutError):
                    raise result
                return result
            result = self._follow(channel)
            if isinstance(result, TimeoutError):
                raise result
            if result is not None:
                return result
            _say(
                self.output,
                "[launcher] lost the rendezvous at "
                + "{}:{}".format(*self.endpoint)
                + "; joining "
                f"again (for up to {self.timeout:g} s)",
            )

    def _interrupted(self):
        """Stops this host's workers (and, on rank 0, the job on every
        host) after SIGINT or SIGTERM."""
        _say(
            self.output,
            f"[launcher] got {signal.Signals(self.interrupted).name}; "
            "stopping workers",
        )
        self._stop_workers()
        if self.seat is not None:
            self.seat.leave()  # the others go on without this host
        elif self.server is not None:
            self.server.shutdown(
                128 + self.interrupted,
                f"host rank 0's launcher got "
                f"{signal.Signals(self.interrupted).name}",
            )
        return LaunchResult(128 + self.interrupted, tuple(self.attempts))

    # --- joining -----------------------------------------------------------

    def _join(self):
        """A channel this host joined the rendezvous on; None if
        interrupted meanwhile."""
        deadline = time.monotonic() + self.timeout
        while self.interrupted is None:
            try:
                channel = self._try_join()
            except rendezvous.RendezvousRefused as error:
                raise rendezvous.RendezvousRefused(
                    f"Host rank {self.rank}: {error}."
                ) from None
            except (OSError, rendezvous.RendezvousError) as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Host rank {self.rank} could not join the "
                        f"rendezvous at {self.where} within "
                        f"{self.timeout:g} s ({error}). "
                        + (
                            "The launcher with --node-rank 0 serves it: is "
                            "it running, with --rdzv-bind set for other "
                            "hosts to reach it?"
                            if self.seat is None
                            else "Is etcd up, and can the hosts reach each "
                            "other (--rdzv-bind)?"
                        )
                    ) from None
                time.sleep(0.5)
                continue
            if isinstance(channel, (rendezvous.Channel, dict)):
                return channel
            message, retry = channel
            if not retry:
                raise ValueError(message)
            if time.monotonic() > deadline:
                raise TimeoutError(message)
            time.sleep(1.0)
        return None

    def _try_join(self):
        """A joined `Channel`, `(message, retry)` if refused, or the job's
        `done` message if it ended (etcd)."""
        if self.seat is not None:
            found = self.seat.locate()
            if isinstance(found, dict):
                return found
            self.endpoint = found
        sock = socket.create_connection(self.endpoint, timeout=5)
        channel = rendezvous.Channel(sock)
        try:
            sock.settimeout(rendezvous.HANDSHAKE_SECONDS)
            rendezvous.client_handshake(channel, self.token)
            # Workers publish the chosen address, else the one that
            # reached the rendezvous (other hosts likely reach it too).
            reached_from = sock.getsockname()[0]
            self.address = self.advertise_address or reached_from
            channel.send(
                {
                    "type": "join",
                    "rank": self.rank,
                    "address": self.address,
                    "slots": self.slots,
                    "job": self.job,
                    "hostname": socket.gethostname(),
                }
            )
            reply = channel.receive()
            sock.settimeout(None)
        except BaseException:
            channel.close()
            raise
        if reply is not None and reply["type"] == "welcome":
            devices = (
                ""
                if self.slots == [None] * len(self.slots)
                else f" (CUDA_VISIBLE_DEVICES {self.slots})"
            )
            _say(
                self.output,
                f"[launcher] host rank {self.rank} joined the rendezvous at "
                + "{}:{}".format(*self.endpoint)
                + f" from {reached_from}"
                + (
                    f" (workers at {self.address})"
                    if self.address != reached_from
                    else ""
                )
                + f" with {len(self.slots)} worker(s){devices}",
            )
            return channel
        channel.close()
        if reply is None:
            raise rendezvous.RendezvousError("the rendezvous hung up")
        return str(reply.get("message")), bool(reply.get("retry"))

    # --- following the rendezvous -----------------------------------------

    def _follow(self, channel):
        """Runs rounds as told until the job ends (returns its
        `LaunchResult`, or the `TimeoutError` to raise) or the rendezvous
        is lost (returns None)."""
        inbox = queue.Queue()
        beating = threading.Event()
        beating.set()

        def read():
            try:
                while True:
                    message = channel.receive()
                    inbox.put(message)
                    if message is None:
                        return
            except (OSError, rendezvous.RendezvousError):
                inbox.put(None)

        def beat():
            while beating.is_set():
                try:
                    channel.send({"type": "heartbeat"})
                except OSError:
                    return
                time.sleep(rendezvous.HEARTBEAT_SECONDS)

        for target in (read, beat):
            threading.Thread(target=target, daemon=True).start()
        heard = time.monotonic()
        try:
            while True:
                if self.interrupted is not None:
                    return self._interrupted()
                if self.seat is not None:
                    self.seat.check()
                try:
                    message = inbox.get(timeout=0.05)
                except queue.Empty:
                    message = False
                now = time.monotonic()
                if message is None or (
                    message is False
                    and now - heard > rendezvous.HEARTBEAT_TIMEOUT
                ):
                    self._stop_workers()
                    return None
                try:
                    if message:
                        heard = now
                        result = self._handle(channel, message)
                        if result is not None:
                            return result
                    self._poll_workers(channel)
                except OSError:  # the rendezvous went away mid-send
                    self._stop_workers()
                    return None
        finally:
            beating.clear()
            channel.close()

    def _handle(self, channel, message):
        kind = message["type"]
        if kind == "prepare":
            ports = (
                free_ports(len(self.slots), self.address)
                if self.port_range is None
                else port_ranges.ports_in_range(
                    len(self.slots), self.port_range, self.address
                )
            )
            channel.send(
                {"type": "ports", "round": message["round"], "ports": ports}
            )
        elif kind == "start":
            self._start(message)
        elif kind == "stop":
            if self._round == message["round"]:
                self.workers.ended("the rendezvous stopped the group")
                self._stop_workers(message.get("grace"))
            channel.send(
                {
                    "type": "finished",
                    "round": message["round"],
                    "codes": self._codes.get(message["round"], []),
                }
            )
        elif kind == "ended":
            self.attempts.append(
                Attempt(
                    **{
                        field: tuple(value)
                        if isinstance(value, list)
                        else value
                        for field, value in message["attempt"].items()
                    }
                )
            )
        elif kind == "done":
            self._stop_workers()
            text = message.get("message")
            if message.get("kind") == "timeout":
                return TimeoutError(text)  # raised by `run`, not in `_follow`
            serving = self.server or (self.seat and self.seat.server)
            if text and not serving:  # else the server said it
                _say(self.output, f"[launcher] {text}")
            return LaunchResult(int(message["exit_code"]), tuple(self.attempts))
        return None

    def _start(self, message):
        restart, cluster = message["round"], message["cluster"]
        self._specs = message["workers"]
        workers = []
        for spec in self._specs:
            env = group.worker_env(self.env, cluster, spec["index"], restart)
            if spec["devices"] is not None:
                env["CUDA_VISIBLE_DEVICES"] = spec["devices"]
            workers.append((spec["index"], list(self.command), env))
        self.workers.start(workers, restart)
        self._round, self._reported_failure = restart, False
        _say(
            self.output,
            f"[launcher] attempt {restart}: {len(cluster)} worker(s) on host "
            f"rank(s) {sorted(set(message['hosts']))}; here worker(s) "
            f"{[s['index'] for s in self._specs]}",
        )

    def _poll_workers(self, channel):
        if self._round is None:
            return
        codes = self.workers.poll()
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and not self._reported_failure:
            self._reported_failure = True
            self.workers.ended(
                f"worker {self._specs[failed[0]]['index']} failed"
            )
            channel.send(
                {
                    "type": "failed",
                    "round": self._round,
                    "worker": self._specs[failed[0]]["index"],
                    "code": codes[failed[0]],
                }
            )
        if all(c is not None for c in codes):
            self._codes[self._round] = self.workers.reap()
            channel.send(
                {
                    "type": "finished",
                    "round": self._round,
                    "codes": self._codes[self._round],
                }
            )
            self._round = None

    def _stop_workers(self, grace_seconds=None):
        """Stops this host's workers: SIGTERM, then SIGKILL after
        `grace_seconds` (the group's grace if None)."""
        if self._round is None:
            return
        self.workers._terminate_all(grace_seconds)
        self._codes[self._round] = self.workers.reap()
        self._round = None
