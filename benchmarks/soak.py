"""Soak: a 2-worker job under `keras-hetero run` while a worker or a host
is killed every 20 to 60 seconds; restarts, steps lost, goodput and
whether the final weights equal an uninterrupted run.

Not part of `make bench` (it runs for `--minutes`, 30 by default). The
job is two "hosts" on this machine: two launchers, `--nnodes 1:2`, ranks 0
and 1, one worker each, the rendezvous on a free loopback port. The
training script (`_soak_train.py`) is deterministic (fixed seed, generated
examples through `kh.data.shard`, an MLP) and saves an `ElasticCheckpoint`
every `--save-every` steps. Every uniform(`--every MIN MAX`) seconds
(seeded by `--seed`) the soak SIGKILLs either

- a worker (a child process of either launcher, picked at random): the
  group restarts on the same hosts; or, with probability `--host-share`
  while rank 1 is up,
- a host: rank 1's launcher and its worker. The group restarts on rank 0
  alone (1:2 lets it), rank 1's launcher is started again after
  `--host-down` seconds, and the group restarts once more to take it back.

With `--etcd` the rendezvous lives in a throwaway etcd (`.ci/etcd/start.sh`,
Debian's etcd-server) and the launchers run `--rdzv-backend etcd`: a host
kill then takes either rank's host (rank 0's too, which may be the one
serving the rendezvous), while the other is up.

When the time is up the soak writes a stop step a little ahead of the
training to a file every worker reads at every step, so the job ends by
itself at that step. Then it runs the same script without the launcher or
kills, on one CPU device, for the same number of steps, and compares the
final weights.

Columns: kills by kind; restarts (attempts after the first, whatever
caused them: a killed worker, a lost host, a host let back in); steps (the
job's last step); steps lost (steps trained again after a resume: over the
attempts, the step an attempt reached minus the step the next one resumed
from); goodput (the summed step times of the steps that count, each the
time from the step's start to its end on worker 0, over the wall time from
the launchers' start to the job's end: startup, compilation, restarts,
checkpoint saves and lost steps all count against it); the exactly-once
ledger (`kh.testing.read_ledger` over every worker's record of the example
ids each step trained, the attempts merged): examples missing from or
trained twice in an epoch, over the finished epochs (the last one, cut by
the stop, is checked for repeats only); and whether the final weights
equal the uninterrupted run's (`np.allclose`, rtol 1e-5), with the largest
absolute difference. A ledger that is not exactly once fails the soak
(exit 1) after the table.

    python benchmarks/soak.py [--minutes 30] [--every 20 60] [--seed 0]
        [--etcd]
"""

import contextlib
import glob
import json
import os
import pathlib
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from _harness import header
from _harness import load_at_end
from _harness import markdown_table
from _harness import parse_args
from _harness import smoke_parser
from _soak_train import ROWS

from keras_hetero import testing
from keras_hetero.launcher import timing

TRAIN = str(pathlib.Path(__file__).resolve().parent / "_soak_train.py")
ETCD = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "etcd"
# Between the job's end and the launchers' exit, and for the reference
# run beyond its expected length.
SLACK_SECONDS = 300
# How far ahead of worker 0's last recorded step the job stops.
STOP_AHEAD = 50


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _children(pid):
    """The live child processes of `pid` (the launcher's workers)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.split("/")[2]))
    return found


def _is_spare(pid):
    """Whether `pid` is a launcher's warm spare (`launcher.warm`) that no
    worker took yet (it waits reading its stdin)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"warm.main()" not in f.read():
                return False
        return os.readlink(f"/proc/{pid}/fd/0").startswith("pipe:")
    except OSError:
        return False


def _kill(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _records(out):
    """{attempt: [(step, seconds), ...]} of worker 0's step records."""
    attempts = {}
    for path in glob.glob(os.path.join(out, "attempt*.jsonl")):
        number = int(os.path.basename(path)[len("attempt") : -len(".jsonl")])
        with open(path) as f:
            rows = []
            for line in f:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    rows.append((record["step"], record["seconds"]))
        attempts[number] = rows
    return attempts


def _last_step(out):
    steps = [s for rows in _records(out).values() for s, _ in rows]
    return max(steps, default=0)


def _accounting(attempts):
    """(restarts, steps lost, seconds of the steps that count, last step).

    Attempt k counts from the step it resumed from (its first step - 1) to
    the step the next attempt with steps resumed from; what it trained
    beyond that is lost.
    """
    restarts = max(attempts, default=0)
    trained = [rows for _, rows in sorted(attempts.items()) if rows]
    resumed = [rows[0][0] - 1 for rows in trained]
    lost, useful, counted = 0, 0.0, set()
    for index, rows in enumerate(trained):
        last = resumed[index + 1] if index + 1 < len(trained) else np.inf
        reached = max(step for step, _ in rows)
        if index + 1 < len(trained):
            lost += max(0, reached - resumed[index + 1])
        for step, seconds in rows:
            if resumed[index] < step <= last and step not in counted:
                counted.add(step)
                useful += seconds
    final = max(counted, default=0)
    if counted != set(range(1, final + 1)):
        raise RuntimeError(
            f"The committed steps are not 1 to {final}: "
            f"{sorted(set(range(1, final + 1)) - counted)[:10]} missing."
        )
    return restarts, lost, useful, final


class _Job:
    """The two launchers (ranks 0 and 1) of one soak run."""

    def __init__(self, folder, args):
        self.folder, self.args = folder, args
        self.out = os.path.join(folder, "out")
        self.stop_file = os.path.join(folder, "stop")
        self.port = _free_port()
        self.env = {
            **os.environ,
            "KERAS_HETERO_RDZV_TOKEN": secrets.token_hex(16),
            "TF_CPP_MIN_LOG_LEVEL": "2",
        }
        self.env.pop("TF_CONFIG", None)
        self.launchers = {}
        self.logs = []
        self.rendezvous = [
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
        ]
        if args.etcd:
            url = subprocess.run(
                ["bash", str(ETCD / "start.sh"), self.etcd_dir, "127.0.0.1",
                 str(_free_port())],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()  # fmt: skip
            self.rendezvous = [
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                url,
                "--rdzv-id",
                f"soak-{secrets.token_hex(4)}",
            ]

    @property
    def etcd_dir(self):
        return os.path.join(self.folder, "etcd")

    def start(self, rank):
        args = self.args
        log = open(
            os.path.join(self.folder, f"rank{rank}-{len(self.logs)}.log"), "w"
        )
        self.logs.append(log)
        command = [
            sys.executable,
            "-m",
            "keras_hetero.run",
            "--nnodes",
            "1:2",
            "--node-rank",
            str(rank),
            *self.rendezvous,
            "--rdzv-last-call",
            "3",
            "--rdzv-timeout",
            "120",
            "--max-restarts",
            "10000",
            "--grace-seconds",
            "5",
            *(["--no-warm"] if args.no_warm else []),
            TRAIN,
            "--out",
            self.out,
            "--ckpt",
            os.path.join(self.folder, "ckpt"),
            "--stop-file",
            self.stop_file,
            "--save-every",
            str(args.save_every),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--rows",
            str(args.rows),
        ]
        self.launchers[rank] = subprocess.Popen(
            command,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def up(self, rank):
        launcher = self.launchers.get(rank)
        return launcher is not None and launcher.poll() is None

    def workers(self):
        """The launchers' workers (not their warm spares)."""
        return [
            pid
            for rank in self.launchers
            if self.up(rank)
            for pid in _children(self.launchers[rank].pid)
            if not _is_spare(pid)
        ]

    def kill_host(self, rank):
        launcher = self.launchers.pop(rank)
        workers = _children(launcher.pid)
        _kill(launcher.pid)
        for pid in workers:
            _kill(pid)
        launcher.wait(timeout=30)

    def close(self):
        for launcher in self.launchers.values():
            workers = _children(launcher.pid)
            _kill(launcher.pid)
            for pid in workers:
                _kill(pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=30)
        for log in self.logs:
            log.close()
        if self.args.etcd:
            subprocess.run(["bash", str(ETCD / "stop.sh"), self.etcd_dir])

    def attempts(self):
        """The attempt the launchers started last (0 for the first)."""
        found = []
        for log in self.logs:
            with open(log.name) as f:
                found += re.findall(r"\[launcher\] attempt (\d+):", f.read())
        return max((int(number) for number in found), default=0)

    def restart_phases(self):
        """`{"warm" | "cold": {phase: [seconds, ...]}}` over the restarts
        (attempts after the first) as each host's launcher timed them
        (`launcher.timing`): warm where every worker there ran in a warm
        spare (`launcher.warm`)."""
        phases = {"warm": {}, "cold": {}}
        for log in self.logs:
            with open(log.name) as f:
                for line in f:
                    parsed = timing.parse(line)
                    if parsed is None or parsed[0] == 0:
                        continue
                    warm = timing.warm_workers(line)
                    kind = "warm" if warm and warm[0] == warm[1] else "cold"
                    for name, seconds in parsed[1].items():
                        phases[kind].setdefault(name, []).append(seconds)
        return phases

    def tail(self, lines=40):
        text = []
        for log in self.logs:
            with open(log.name) as f:
                text.append(
                    f"--- {log.name}\n" + "".join(f.readlines()[-lines:])
                )
        return "\n".join(text)


def _check_not_crash_looping(job, kills):
    """Raises if the job restarted far more often than it was killed."""
    if job.attempts() > 3 * (kills["worker"] + kills["host"]) + 3:
        raise RuntimeError("The job restarts without kills:\n" + job.tail())


def _soak(job, args, rng):
    """Runs the job with kills for `args.minutes`, stops it; returns the
    kills by kind and the wall seconds."""
    kills = {"worker": 0, "host": 0}
    started = time.monotonic()
    job.start(0)
    job.start(1)
    deadline = started + args.minutes * 60
    next_kill = started + rng.uniform(*args.every)
    host_back = None  # (rank, when)
    # Hosts a kill may take: rank 1's; with etcd either, while both are up.
    killable = (0, 1) if args.etcd else (1,)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = time.monotonic()
        # Killed hosts are out of `job.launchers` until started again.
        for rank in list(job.launchers):
            if not job.up(rank):
                raise RuntimeError(
                    f"Rank {rank}'s launcher exited during the soak:\n"
                    + job.tail()
                )
        _check_not_crash_looping(job, kills)
        if host_back is not None and now >= host_back[1]:
            job.start(host_back[0])
            host_back = None
        if now < next_kill:
            continue
        if host_back is None and rng.random() < args.host_share:
            rank = rng.choice(killable)
            job.kill_host(rank)
            kills["host"] += 1
            host_back = (rank, now + args.host_down)
        else:
            workers = job.workers()
            if not workers:
                continue  # between attempts: kill when a worker is up
            _kill(rng.choice(sorted(workers)))
            kills["worker"] += 1
        next_kill = now + rng.uniform(*args.every)
    # The workers are in lockstep (a collective every step) and read the
    # file at every step, so all of them read it before they get there.
    stop = _last_step(job.out) + STOP_AHEAD
    with open(job.stop_file + ".tmp", "w") as f:
        f.write(str(stop))
    os.replace(job.stop_file + ".tmp", job.stop_file)
    stop_by = time.monotonic() + SLACK_SECONDS
    # With etcd every launcher learns the end (a late one from etcd); with
    # the default backend rank 0's ends the job, and a rank 1 started after
    # that finds no rendezvous (the soak kills it).
    waited = [r for r in job.launchers if args.etcd or r == 0]
    while any(job.launchers[r].poll() is None for r in waited):
        # A job whose every attempt dies at its start fails here, not
        # after the slack.
        _check_not_crash_looping(job, kills)
        if time.monotonic() > stop_by:
            raise RuntimeError("The job did not stop:\n" + job.tail())
        time.sleep(0.5)
    wall = time.monotonic() - started
    for rank in waited:
        launcher = job.launchers[rank]
        if launcher.returncode != 0:
            raise RuntimeError(
                f"Rank {rank}'s launcher exited {launcher.returncode}:\n"
                + job.tail()
            )
    return kills, wall


def _weights(path):
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _reference(folder, args, steps, timeout):
    out = os.path.join(folder, "reference")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_CONFIG", None)
    env.pop("KERAS_HETERO_RESTART", None)
    subprocess.run(
        [
            sys.executable,
            TRAIN,
            "--out",
            out,
            "--stop-at",
            str(steps),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--rows",
            str(args.rows),
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    return _weights(os.path.join(out, "final.npz"))


def run(args):
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(prefix="kh-soak-")
    job = _Job(folder, args)
    try:
        kills, wall = _soak(job, args, rng)
        job.close()
        phases = job.restart_phases()
        restarts, lost, useful, steps = _accounting(_records(job.out))
        ledger = testing.read_ledger(
            os.path.join(job.out, "ledger"), ids=range(args.rows)
        )
        final = _weights(os.path.join(job.out, "final.npz"))
        # The reference trains the committed steps once, on one process;
        # a step there costs less than under the launcher.
        reference = _reference(
            folder, args, steps, timeout=useful + SLACK_SECONDS
        )
        equal = all(
            np.allclose(a, b, rtol=1e-5) for a, b in zip(final, reference)
        )
        largest = max(
            float(np.max(np.abs(a - b))) for a, b in zip(final, reference)
        )
    finally:
        job.close()
        shutil.rmtree(folder, ignore_errors=True)
    phase_rows = []
    for name in phases["warm"].keys() | phases["cold"].keys():
        row = [name]
        for kind in ("warm", "cold"):
            seconds = phases[kind].get(name, [])
            if not seconds:
                row += [0, "", ""]
                continue
            median, most = np.median(seconds), max(seconds)
            row += [len(seconds), f"{median:.2f}", f"{most:.2f}"]
        phase_rows.append(row)
    phase_rows.sort(key=lambda row: timing.PHASES.index(row[0]))
    return (
        phase_rows,
        [
            f"{args.minutes:g}",
            f"{kills['worker'] + kills['host']} "
            f"({kills['worker']}/{kills['host']})",
            restarts,
            steps,
            lost,
            f"{100 * useful / wall:.0f}% ({useful:.0f} of {wall:.0f} s)",
            _ledger_cell(ledger),
            f"{'yes' if equal else 'no'} (max abs diff {largest:.1e})",
        ],
        ledger,
    )


def _ledger_cell(ledger):
    missing, duplicated, _ = ledger.counts()
    return f"{missing} / {duplicated} ({len(ledger.finished)} epochs)"


def _print_phases(phase_rows):
    print(
        "Restart phases, seconds from when each host's launcher saw the "
        "attempt end (a worker failed, or the rendezvous stopped the "
        "group); each phase when the host's slowest worker reached it; warm: "
        "the host's workers ran in warm spares:"
    )
    print(
        markdown_table(
            [
                "phase",
                "warm: timed",
                "median s",
                "max s",
                "cold: timed",
                "median s",
                "max s",
            ],
            phase_rows,
        )
    )


def main():
    parser = smoke_parser(__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument(
        "--every",
        type=float,
        nargs=2,
        default=[20.0, 60.0],
        metavar=("MIN", "MAX"),
        help="seconds between kills, drawn uniformly",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--host-share",
        type=float,
        default=0.3,
        help="chance that a kill takes rank 1's host (launcher and "
        "worker) rather than a worker",
    )
    parser.add_argument(
        "--host-down",
        type=float,
        default=5.0,
        help="seconds before a killed host's launcher is started again",
    )
    parser.add_argument(
        "--etcd",
        action="store_true",
        help="the rendezvous in a local etcd (--rdzv-backend etcd): host "
        "kills take either host, rank 0's included",
    )
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument(
        "--no-warm",
        action="store_true",
        help="restart workers as new processes (keras-hetero run --no-warm)",
    )
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--rows", type=int, default=ROWS, help="examples per epoch"
    )
    # One worker kill 10 to 12 s in, then the job stops.
    args = parse_args(
        parser,
        minutes=0.25,
        every=[10.0, 12.0],
        host_share=0.0,
        save_every=10,
        width=32,
        batch=64,
        rows=64 * 20,  # 20 steps per epoch: the ledger sees whole epochs
    )
    # SIGTERM as Ctrl-C: the soak's `finally` kills the job, removes its
    # folder.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(
        header(
            "Soak: kills under keras-hetero run",
            f"2 hosts on 127.0.0.1 (--nnodes 1:2, 1 worker each), MLP width "
            f"{args.width}, {args.rows} examples in global batches of "
            f"{args.batch}, checkpoint every "
            f"{args.save_every} steps, a kill every {args.every[0]:g}-"
            f"{args.every[1]:g} s (seed {args.seed}, host share "
            f"{args.host_share:g}), restarts "
            f"{'cold (--no-warm)' if args.no_warm else 'warm'}, rendezvous "
            f"{'in etcd (any host killed)' if args.etcd else 'on rank 0'}",
        ),
        flush=True,
    )
    phase_rows, row, ledger = run(args)
    print()
    if phase_rows:
        _print_phases(phase_rows)
    else:
        print("No restarts.")
    print()
    print(
        markdown_table(
            [
                "minutes",
                "kills (workers/hosts)",
                "restarts",
                "steps",
                "steps lost",
                "goodput",
                "ledger: missing / duplicated",
                "final weights equal uninterrupted",
            ],
            [row],
        )
    )
    print(load_at_end())
    try:
        ledger.assert_exactly_once()
    except AssertionError as error:
        sys.exit(f"The ledger is not exactly once:\n{error}")


if __name__ == "__main__":
    main()
