"""`keras-hetero run`: start N local workers, restart the group on failure.

Each worker is `python SCRIPT ARGS` with `TF_CONFIG` naming a cluster of
`workers` tasks on free 127.0.0.1 ports (or on `--advertise-address`, with
ports from `--worker-ports A-B`), `CUDA_VISIBLE_DEVICES` set to its share
of the machine's GPUs (N workers split them evenly, as `--workers-per-host
N` does), and these variables:

- `KERAS_HETERO_RESTART`: how many times the group was restarted (0 first);
- `KERAS_HETERO_NUM_WORKERS`: workers in this attempt;
- `KERAS_HETERO_HANG_REPORT`: a file where `StragglerDetector`'s hang
  watchdog writes which workers it found missing (see `min_workers`).

Every output line is prefixed with `[worker i]`. When a worker exits with a
non-zero status, the others are stopped (SIGTERM, then SIGKILL after
`policy.PEER_STOP_SECONDS`: they wait in a collective that cannot finish;
after `grace_seconds` if the worker wrote a hang report, for the others to
write theirs) and the group starts again on new ports (the same ones
with `--worker-ports`), up to `max_restarts` times: with the same number
of workers, or, with `min_workers`, with the survivors (but not fewer
than `min_workers`). The survivors are those the others' hang reports do
not name: after a cut link, every worker exits and the one the others
name stays out (its host too, with `hosts=`); without reports, the group
keeps its first workers.
Training continues where it was if the script uses
`kh.callbacks.ElasticCheckpoint`. Ctrl-C (SIGINT) or SIGTERM to the launcher
sends SIGTERM to every worker (ElasticCheckpoint saves and stops), waits
`grace_seconds`, kills what is left, and exits 130 (SIGINT) or 143.
Each attempt's start is timed and logged once its workers trained a step
(`timing`: peers stopped, processes started, imported, in fit, restored,
first step).
"""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from keras_hetero import _phases
from keras_hetero._checks import check_int
from keras_hetero._environment import HANG_REPORT_ENV
from keras_hetero._environment import NUM_WORKERS_ENV
from keras_hetero._environment import PHASES_ENV
from keras_hetero._environment import RESTART_ENV
from keras_hetero.launcher import addresses
from keras_hetero.launcher import devices
from keras_hetero.launcher import policy
from keras_hetero.launcher import ports as port_ranges
from keras_hetero.launcher import timing
from keras_hetero.launcher import warm as warm_workers
from keras_hetero.launcher.ports import free_ports


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One start of the worker group.

    Attributes:
        workers: How many workers it had.
        exit_codes: Each worker's exit status (negative: killed by signal).
        failed: Indices of the workers that failed first.
        hosts: The host index of each worker (`hosts=`), else
            `range(workers)`.
        lost: Workers the others' hang reports named missing (a majority
            of the other reporters named each), in worker indices.
    """

    workers: int
    exit_codes: tuple
    failed: tuple
    hosts: tuple = ()
    lost: tuple = ()


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What `launch` did.

    Attributes:
        exit_code: 0 on success, else the first failing worker's status
            (128 + signal number for a signal), or 130 / 143 when the
            launcher itself was interrupted.
        attempts: One `Attempt` per start of the group.
    """

    exit_code: int
    attempts: tuple


def launch(
    command,
    workers,
    *,
    max_restarts=3,
    min_workers=None,
    grace_seconds=30.0,
    env=None,
    output=None,
    hosts=None,
    backoff_seconds=0.0,
    max_backoff_seconds=60.0,
    worker_ports=None,
    advertise_address=None,
    devices_per_host=None,
    warm=True,
):
    """Runs `command` as `workers` local TF workers, restarting on failure.

    The workers split this machine's GPUs evenly (`CUDA_VISIBLE_DEVICES`,
    consecutive GPUs; on a machine without GPUs the variable is left as
    it is). A restart with fewer workers (`min_workers`) keeps each
    worker's GPUs.

    Args:
        command: The worker command, a list such as
            `[sys.executable, "train.py", "--epochs", "3"]`.
        workers: Workers to start, >= 1.
        max_restarts: Restarts after failures before giving up, >= 0.
            Defaults to `3`.
        min_workers: If set, a restart keeps only the survivors (failed
            workers are not replaced) but at least this many: the workers
            the others' hang reports name stay out (with `hosts=`, their
            hosts too), else the group keeps its first workers. Defaults
            to None (always `workers`).
        grace_seconds: How long stopped workers get to exit before SIGKILL
            (after a worker died without a hang report, 0.5 s at most:
            `policy.stop_grace`). Defaults to `30.0`.
        env: Extra environment variables for the workers. Defaults to None.
        output: A text stream for the prefixed worker output. Defaults to
            `sys.stdout`.
        hosts: Where the workers run: None for this machine's network
            (`127.0.0.1`, free ports), or an object with
            `addresses(count, restart)` (the `"ip:port"` of each worker in
            `TF_CONFIG`) and `command(index, command)` (the command that
            runs `command` on host `index`, e.g. `ssh HOST ...` or `ip
            netns exec NS ...`), such as `kh.testing.NetworkHosts`; with
            `addresses_of(host_indices, restart)` too, a restart can leave
            out a lost worker's host. Defaults to None.
        backoff_seconds: Wait before the first restart; each further
            restart of an attempt that failed within
            `backoff_seconds * 2 ** k` seconds of its start waits twice as
            long (so a flapping link cannot cause a restart storm), up to
            `max_backoff_seconds`. Defaults to `0.0` (restart at once).
        max_backoff_seconds: The longest wait between restarts. Defaults to
            `60.0`.
        worker_ports: A port range `"A-B"` (or a `range`) the workers
            listen on: worker i takes the i-th port of the range free at
            the start of each attempt, so a restarted group gets the same
            ports back. For firewalls that open only those. Defaults to
            None (any free ports, new ones on each attempt).
        advertise_address: The address in `TF_CONFIG`: an IP address of
            this machine or an interface name (e.g. `"ib0"`, its IPv4
            address). Defaults to None (`127.0.0.1`).
        devices_per_host: Assume this many GPUs (numbered from 0) instead
            of discovering them (`nvidia-smi -L`, or the launcher's own
            `CUDA_VISIBLE_DEVICES`); 0 leaves `CUDA_VISIBLE_DEVICES` alone,
            so every worker sees every GPU. Defaults to None (discover).
        warm: Restart workers in warm spares, processes that imported
            TensorFlow, Keras and keras_hetero while the previous attempt
            ran (`launcher.warm`: one idle process per worker; a command
            that is not `python SCRIPT|-m MODULE ...` starts cold anyway).
            Defaults to `True`.

    Returns:
        A `LaunchResult`.

    Raises:
        ValueError: For `workers` < 1, `max_restarts` < 0, `min_workers`
            outside [1, workers], an empty `command`, a negative
            `backoff_seconds` or `max_backoff_seconds`, `hosts` without
            `addresses` and `command` methods (or with `worker_ports`,
            `advertise_address` or `devices_per_host`), a GPU count that
            `workers` does not divide, a `worker_ports` range with fewer
            ports than `workers` (or fewer free), or an `advertise_address`
            that is not this machine's.

    Example:

    >>> result = launch([sys.executable, "train.py"], 2)  # doctest: +SKIP
    >>> result.exit_code  # doctest: +SKIP
    0
    """
    _check_launch(command, workers, max_restarts, min_workers, hosts)
    check_seconds(
        backoff_seconds=backoff_seconds,
        max_backoff_seconds=max_backoff_seconds,
    )
    slots, address, worker_ports = _network(
        workers,
        hosts,
        env,
        worker_ports=worker_ports,
        advertise_address=advertise_address,
        devices_per_host=devices_per_host,
    )
    output = output or sys.stdout
    group = _Group(
        output, grace_seconds, hosts, address, worker_ports, slots, warm
    )
    with signals_to(group.interrupt):
        try:
            return _run_attempts(
                group,
                command,
                workers,
                env or {},
                max_restarts=max_restarts,
                min_workers=min_workers,
                backoff=(float(backoff_seconds), float(max_backoff_seconds)),
            )
        finally:
            group.close_spares()


@contextlib.contextmanager
def signals_to(handler):
    """Within the block, SIGINT and SIGTERM call `handler(number, frame)`
    (on the main thread; Python installs handlers nowhere else); the
    previous handlers are restored after it."""
    previous = (
        {
            number: signal.signal(number, handler)
            for number in (signal.SIGINT, signal.SIGTERM)
        }
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def check_command(command):
    """Raises `ValueError` for an empty worker command."""
    if not command:
        raise ValueError(
            "Invalid value for argument `command`. Received: command="
            f"{command!r}. Expected the worker command, e.g. "
            '[sys.executable, "train.py"].'
        )


def _check_launch(command, workers, max_restarts, min_workers, hosts):
    """`launch`'s checks of its counts, command and `hosts`."""
    check_int("workers", workers, 1)
    check_int("max_restarts", max_restarts, 0)
    if min_workers is not None:
        check_int("min_workers", min_workers, 1)
        if min_workers > workers:
            raise ValueError(
                "Invalid value for argument `min_workers`. Received: "
                f"min_workers={min_workers!r}. Expected at most "
                f"workers={workers}."
            )
    check_command(command)
    if hosts is not None and not (
        callable(getattr(hosts, "addresses", None))
        and callable(getattr(hosts, "command", None))
    ):
        raise ValueError(
            "Invalid value for argument `hosts`. Received: "
            f"hosts={hosts!r}. Expected None or an object with "
            "`addresses(count, restart)` and `command(index, command)` "
            "methods (e.g. kh.testing.NetworkHosts)."
        )


def _network(workers, hosts, env, **local):
    """`(slots, address, port_range)` of a group: each worker's GPUs, the
    address in `TF_CONFIG` and the workers' ports, from this machine's
    settings `local` (`worker_ports`, `advertise_address`,
    `devices_per_host`), which a `hosts` object replaces."""
    if hosts is not None:
        for name, value in local.items():
            if value is not None:
                raise ValueError(
                    f"Invalid value for argument `{name}`. Received: "
                    f"{name}={value!r} with hosts={hosts!r}. Expected None: "
                    "the `hosts` object gives the workers' addresses."
                )
        return [None] * workers, None, None
    environ = {**os.environ, **(env or {})}
    slots = devices.worker_devices(
        workers,
        devices.host_gpus(local["devices_per_host"], environ),
        name="workers",
    )
    advertise = local["advertise_address"]
    address = (
        "127.0.0.1"
        if advertise is None
        else addresses.advertise_address(advertise)
    )
    ports = local["worker_ports"]
    if ports is not None:
        ports = port_ranges.parse_port_range(ports)
        port_ranges.check_port_range(ports, workers)
    return slots, address, ports


def _run_attempts(
    group, command, workers, env, *, max_restarts, min_workers, backoff
):
    """Runs `group`'s attempts until one succeeds, it is interrupted or no
    restart is left; returns the `LaunchResult`. `backoff`: the first and
    the longest wait between restarts, in seconds."""
    output, hosts = group.output, group.hosts
    attempts = []
    live = list(range(workers))  # the host of each worker
    delay = backoff[0]
    for restart in range(max_restarts + 1):
        count = len(live)
        started = time.monotonic()
        codes, failed, reports = group.run_attempt(command, live, restart, env)
        lasted = time.monotonic() - started
        lost = lost_workers(reports, count)
        attempts.append(
            Attempt(
                count, tuple(codes), tuple(failed), tuple(live), tuple(lost)
            )
        )
        if group.interrupted is not None:
            return LaunchResult(128 + group.interrupted, tuple(attempts))
        if not failed:
            return LaunchResult(0, tuple(attempts))
        status = _status(codes[failed[0]])
        _say(
            output,
            f"[launcher] worker(s) {list(failed)} failed (exit "
            f"{[codes[i] for i in failed]}) in attempt {restart}",
        )
        if restart == max_restarts:
            _say(output, f"[launcher] no restarts left; exit {status}")
            return LaunchResult(status, tuple(attempts))
        if min_workers is not None:
            live = _survivors(live, failed, lost, min_workers, hosts)
            if lost:
                _say(
                    output,
                    f"[launcher] the others' hang reports name worker(s) "
                    f"{lost} missing"
                    + (
                        f"; continuing on hosts {live}"
                        if hosts is not None
                        else ""
                    ),
                )
        if delay > 0:
            _say(
                output,
                f"[launcher] attempt {restart} lasted {lasted:.1f}s; "
                f"waiting {delay:.1f}s before restarting",
            )
            group.wait(delay)
            if group.interrupted is not None:
                return LaunchResult(128 + group.interrupted, tuple(attempts))
            # An attempt that failed soon after starting doubles the wait
            # (a flapping link); one that ran long resets it.
            quick = lasted < max(delay * 4, 1.0)
            delay = min(delay * 2, backoff[1]) if quick else backoff[0]
        _say(output, f"[launcher] restarting with {len(live)} worker(s)")
    raise AssertionError("unreachable")


class _Group:
    def __init__(
        self,
        output,
        grace_seconds,
        hosts=None,
        address="127.0.0.1",
        port_range=None,
        slots=None,
        warm=True,
    ):
        self.output = output
        self.hosts = hosts
        self.address, self.port_range = address, port_range
        self.slots = slots  # each worker's CUDA_VISIBLE_DEVICES, or None
        self.grace_seconds = grace_seconds
        self.interrupted = None
        self.processes = []
        self._readers = []
        # Restart timing (`timing`): the launch, then when this host saw
        # the running attempt end and when its workers had all exited.
        self.began = time.time()
        self._ended = None  # (wall time, what happened)
        self._stopped_at = None
        self.timing = None
        # Warm workers (`warm`): spares for the next attempt, started once
        # this one is up; what this attempt's workers were started with.
        self.warm = warm
        self._lower_priority = warm and warm_workers.can_lower_priority()
        self._spares, self._pending = [], []

    def interrupt(self, number, frame):
        if self.interrupted is not None:
            self._kill_all()  # a second signal: no more grace
            return
        self.interrupted = number
        _say(
            self.output,
            f"[launcher] got {signal.Signals(number).name}; stopping workers",
        )
        self._terminate_all()

    def wait(self, seconds):
        deadline = time.monotonic() + seconds
        while self.interrupted is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def run_attempt(self, command, live, restart, extra_env):
        count = len(live)
        if self.hosts is None:
            ports = (
                free_ports(count, self.address)
                if self.port_range is None
                else port_ranges.ports_in_range(
                    count, self.port_range, self.address
                )
            )
            ip = f"[{self.address}]" if ":" in self.address else self.address
            addresses = [f"{ip}:{port}" for port in ports]
            where = f"on ports {ports}"
            if self.address != "127.0.0.1":
                where = f"on {self.address} ports {ports}"
        else:
            addresses = list(_addresses(self.hosts, live, restart))
            where = f"at {addresses}"
        if self.slots and any(s is not None for s in self.slots):
            gpus = [self.slots[host] for host in live]
            where += f" (CUDA_VISIBLE_DEVICES {gpus})"
        reports = tempfile.mkdtemp(prefix="keras_hetero_hang_")
        workers = []
        for index in range(count):
            env = worker_env(extra_env, addresses, index, restart)
            env[HANG_REPORT_ENV] = os.path.join(reports, f"worker{index}.json")
            if self.slots and self.slots[live[index]] is not None:
                env["CUDA_VISIBLE_DEVICES"] = self.slots[live[index]]
            argv = list(command)
            if self.hosts is not None:
                argv = list(self.hosts.command(live[index], argv))
            workers.append((index, argv, env))
        self.start(workers, restart)
        _say(
            self.output,
            f"[launcher] attempt {restart}: {count} worker(s) {where}",
        )
        failed = []
        while True:
            codes = self.poll()
            failed = [
                i for i, c in enumerate(codes) if c is not None and c != 0
            ]
            if failed or all(c is not None for c in codes):
                break
            if self.interrupted is not None:
                break
            time.sleep(0.05)
        if self.interrupted is not None:
            self.ended(
                f"the launcher's {signal.Signals(self.interrupted).name}"
            )
            self._terminate_all()
        elif failed:
            self.ended(f"worker(s) {failed} failed")
            # A worker that died leaves the others waiting in a collective
            # that cannot finish: they stop at once (a hang report's
            # writer gives the others time to write theirs).
            self._terminate_all(
                policy.stop_grace(
                    [codes[i] for i in failed], self.grace_seconds
                )
            )
        codes = self.reap()
        return codes, failed, _read_reports(reports, count)

    def start(self, workers, attempt):
        """Starts `workers`, a list of `(index, argv, env)`, as attempt
        `attempt`; their output lines are prefixed with `[worker index]`,
        and their start is timed (`timing`)."""
        if self.timing is not None:
            self.timing.close()
        origin, why = self._ended or (self.began, "the launch")
        self.timing = timing.AttemptTiming(
            attempt,
            origin,
            why,
            self._stopped_at if self._ended else None,
            [index for index, _, _ in workers],
        )
        self._ended = self._stopped_at = None
        self.processes, self._readers = [], []
        # This attempt's workers that may get a spare for the next.
        self._pending = [
            worker
            for worker in workers
            if self.warm and warm_workers.spare_command(worker[1]) is not None
        ]
        for index, argv, env in workers:
            env[PHASES_ENV] = self.timing.paths[index]
            process = self._take_spare(index, argv, env)
            self.timing.warm += process is not None
            process = process or subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # our signals only, not the tty's
            )
            self.processes.append(process)
            reader = threading.Thread(
                target=self._relay, args=(index, process), daemon=True
            )
            reader.start()
            self._readers.append(reader)
        self.close_spares()  # those no worker of this attempt could use

    def _take_spare(self, index, argv, env):
        """Worker `index` as a warm spare's process, or None."""
        for spare in list(self._spares):
            if not spare.serves(argv, env):
                continue
            self._spares.remove(spare)
            process = spare.take(argv, env)
            if process is not None:
                return process
            self.warm = False
            _say(
                self.output,
                f"[launcher] worker {index}'s warm spare had exited "
                f"({spare.process.returncode}); starting workers cold from "
                f"now on. It printed: {spare.output()}",
            )
            spare.close()
        return None

    def poll(self):
        """Each worker's exit status, None while it runs (and the
        attempt's phases logged once its workers trained a step; the
        spares for the next attempt started)."""
        if self.timing is not None:
            self.timing.check(lambda line: _say(self.output, line))
            # The spares import once the attempt is up: during a restart
            # they would compete with the workers' start, when every
            # second counts (measured: benchmarks/RESULTS.md, "Warm
            # workers").
            if self.timing.logged and self._pending:
                self._start_spares()
        return [p.poll() for p in self.processes]

    def _start_spares(self):
        """Once the attempt is up: a spare for each of its workers that
        imported keras_hetero (with what it imported with; a worker that
        never did gets none: no import to save)."""
        pending, self._pending = self._pending, []
        if not self.warm:
            return
        for index, argv, env in pending:
            imported = _phases.import_env(self.timing.paths[index])
            if imported is not None:
                self._spares.append(
                    warm_workers.Spare(
                        argv, env, imported, self._lower_priority
                    )
                )

    def close_spares(self):
        """Stops the spares no worker took."""
        for spare in self._spares:
            spare.close()
        self._spares = []

    def ended(self, why):
        """Notes that this host saw the running attempt end now, because
        of `why` (the next attempt's phases count from here)."""
        if self._ended is None:
            self._ended = (time.time(), why)

    def reap(self):
        """Waits for every worker; returns their exit statuses."""
        codes = [p.wait() for p in self.processes]
        self._stopped_at = time.time()
        if self.warm and warm_workers.REFUSED_EXIT_CODE in codes:
            self.warm = False
            self.close_spares()
            _say(
                self.output,
                "[launcher] a warm worker's script changed how TensorFlow "
                "or Keras is imported (its output says which variable): "
                "workers start cold from now on",
            )
        if self._ended is None:
            self._ended = (self._stopped_at, "the workers exited")
        for reader in self._readers:
            reader.join(timeout=5)
        if self.timing is not None:
            self.timing.log(lambda line: _say(self.output, line), ended=True)
            self.timing.close()
        return codes

    def _relay(self, index, process):
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            _say(self.output, f"[worker {index}] {line}")
        process.stdout.close()

    def _terminate_all(self, grace_seconds=None):
        """SIGTERM to every worker, SIGKILL to those still running after
        `grace_seconds` (the group's grace if None)."""
        if grace_seconds is None:
            grace_seconds = self.grace_seconds
        for process in self.processes:
            _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_all()

    def _kill_all(self):
        for process in self.processes:
            _signal(process, signal.SIGKILL)


def _signal(process, number):
    if process.poll() is None:
        try:
            process.send_signal(number)
        except ProcessLookupError:
            pass


_OUTPUT_LOCK = threading.Lock()


def _say(output, line):
    with _OUTPUT_LOCK:
        output.write(line + "\n")
        output.flush()


def _status(code):
    return 128 - code if code < 0 else code


def check_seconds(**values):
    """Raises a `ValueError` naming the first of `values` (argument name:
    value) that is not a number of seconds >= 0."""
    for name, value in values.items():
        if isinstance(value, bool) or not (
            isinstance(value, (int, float)) and value >= 0
        ):
            raise ValueError(
                f"Invalid value for argument `{name}`. Received: "
                f"{name}={value!r}. Expected seconds >= 0."
            )


def worker_env(extra_env, addresses, index, restart):
    """A worker's environment: this process's, `extra_env`, `TF_CONFIG`
    for task `index` of a cluster of `addresses`, and the restart count."""
    env = dict(os.environ)
    env.update(extra_env)
    env["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": list(addresses)},
            "task": {"type": "worker", "index": index},
        }
    )
    env[RESTART_ENV] = str(restart)
    env[NUM_WORKERS_ENV] = str(len(addresses))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _addresses(hosts, live, restart):
    """The `TF_CONFIG` addresses of the workers on hosts `live`."""
    if callable(getattr(hosts, "addresses_of", None)):
        return hosts.addresses_of(list(live), restart)
    return hosts.addresses(len(live), restart)


def _read_reports(directory, count):
    """{worker: [missing workers]} from the hang reports written in
    `directory` (then removed)."""
    reports = {}
    for index in range(count):
        path = os.path.join(directory, f"worker{index}.json")
        try:
            with open(path) as f:
                reports[index] = [int(w) for w in json.load(f)["missing"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no report (or half written): no vote
        try:
            os.remove(path)
        except OSError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass
    return reports


def lost_workers(reports, workers=None):
    """The workers a majority of the OTHER reporters name missing.

    After a cut link every worker that can still report does: the
    survivors name the cut-off worker, and it names all the others (it
    reaches no one). With three or more workers, a reporter that finds
    every other worker missing is taken to be the isolated one: its report
    has no vote, and it is lost if another reporter names it. With two
    workers each names the other, which tells the sides apart no more than
    no report: none is lost (unless only one of them reported).

    Args:
        reports: `{worker: [workers it found missing]}`.
        workers: How many workers the attempt had. Defaults to the
            number of reporters.

    Returns:
        The lost workers, sorted; empty when the reports do not agree.

    Example:

    >>> lost_workers({0: [2], 1: [2], 2: [0, 1]})
    [2]
    >>> lost_workers({2: [1], 1: [0, 2]}, workers=3)
    [1]
    >>> lost_workers({0: [1], 1: [0]})
    []
    """
    workers = len(reports) if workers is None else workers
    isolated = {
        r
        for r, named in reports.items()
        if workers >= 3 and set(named) >= set(range(workers)) - {r}
    }
    voters = {r: named for r, named in reports.items() if r not in isolated}
    lost = []
    for worker in sorted({w for named in reports.values() for w in named}):
        others = [r for r in voters if r != worker]
        votes = sum(worker in voters[r] for r in others)
        if others and 2 * votes > len(others):
            lost.append(worker)
    # Everyone named by a majority (two workers naming each other): no
    # information about which side is cut.
    if len(lost) >= len(reports) and len(reports) > 1:
        return []
    return lost


def _survivors(live, failed, lost, min_workers, hosts):
    """The hosts of the next attempt under `min_workers`: the first
    `len(live) - len(lost or failed)` (at least `min_workers`), the lost
    workers' hosts last (left out when the hosts can be picked)."""
    count = max(min_workers, len(live) - len(lost or failed))
    if hosts is None or not callable(getattr(hosts, "addresses_of", None)):
        return list(range(count))  # local, or hosts 0..count-1 only
    kept = [host for index, host in enumerate(live) if index not in lost]
    return (kept + [host for host in live if host not in kept])[:count]
