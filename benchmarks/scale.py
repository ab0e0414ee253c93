"""The callbacks' decision cores from 8 to 4,096 replicas (simulated
readings).

No devices and no training: each step, the per-replica readings the
callbacks would get from `model.step_stats` (rows from the share schedule,
compute seconds from a simulated cluster) go through the same pure cores
the callbacks run, in the same order:

- `StragglerDetector`: its `ClockCheck`, the straggler `Scorer`
  (`relative_threshold=0.15`: devices differ 1 : 3 by design) and the
  communication tracker;
- `ShardRebalancer` (defaults: a decision every 10 steps over a window of
  10 readings, 2 warm-up steps, changes 4 batches ahead): its own
  `ClockCheck`, the speed window and the share decision;
- the dataset's share schedule (the rows of each global batch, and the
  changes);
- `ElasticCheckpoint`: its due check every step (the Young/Daly interval)
  and the callbacks' state it would save (JSON), built when the worker
  fails.

The cluster: workers of 8 replicas (fewer below 32 replicas), each worker
of one GPU generation, speeds 1 : 1.5 : 3 in turn; 64 rows per replica per
step on average; every reading with 3% log-normal jitter; 0.1% of the
readings stalled 2-10x, and 0.5% of the steps 1.2-2x slower for every
replica at once. At 40% of the run some replicas (1 in 128, at least one)
become 1.5x slower; at 70% the last worker fails and the job goes on
without it, restarted from its checkpoint: with fewer replicas, the
callbacks' state starts afresh, as `ElasticCheckpoint` does.

Tables: host milliseconds per step of each core and of all together;
false alarms (events on replicas that never slowed) and detection delay;
steps until the shares are within 2% of capacity (half the L1 distance
between the shares and the speeds' proportions: the fraction of each
batch's rows on the wrong replicas); planner time (`kh.placement.plan`
and `plan_layout`) at 8, 64 and 256 devices, stopped after
`--planner-seconds`.

Host times are medians over the steps of one process (the machine's load
shows in them; compare the rows of one run), wall-clock, and for all the
callbacks together also the training thread's CPU time (which leaves out
what other processes took). Run: `python benchmarks/scale.py` (about 6
minutes, most of it the planner); `--smoke`: 8 and 64 replicas, 120 steps,
the planner at 8 devices.
"""

import collections
import functools
import json
import signal
import time

import numpy as np
from _harness import header
from _harness import markdown_table
from _harness import parse_args
from _harness import smoke_parser

from keras_hetero.balancing import core as rebalance
from keras_hetero.checkpointing.schedule import young_daly_interval
from keras_hetero.data.shares import ShareSchedule
from keras_hetero.stragglers import communication
from keras_hetero.stragglers import scoring
from keras_hetero.training.clock_check import ClockCheck

GENERATIONS = (1.0, 1.5, 3.0)  # relative speed of three GPU generations
SECONDS_PER_ROW = 0.004  # of a speed-1.0 replica
ROWS_PER_REPLICA = 64
JITTER = 0.03
STALLS = 0.001, (2.0, 10.0)  # per reading: probability, factor range
JOB_STALLS = 0.005, (1.2, 2.0)  # per step, every replica at once
SLOWDOWN = 1.5
OUTSIDE_SECONDS = 0.02  # per step outside compute (collective, input)

# The callbacks' settings (their defaults, but the relative threshold).
THRESHOLD = 0.7
RELATIVE_THRESHOLD = 0.15
PATIENCE = 3
SCORE_WINDOW = 9
EVERY_N_STEPS = 10
SPEED_WINDOW = 10
WARMUP_STEPS = 2
LAG = 4
MTBF_SECONDS = 4 * 365 * 86400.0  # one replica's, for the interval


class Cluster:
    """Per-replica compute seconds for given rows: speeds, jitter, stalls.

    Args:
        replicas: Replicas in the job.
        seed: Seeds the jitter and the stalls.
    """

    def __init__(self, replicas, seed=0):
        self.per_worker = min(8, max(replicas // 4, 1))
        workers = replicas // self.per_worker
        generation = np.arange(workers) % len(GENERATIONS)
        speed = np.asarray(GENERATIONS)[generation]
        self.seconds_per_row = np.repeat(
            SECONDS_PER_ROW / speed, self.per_worker
        )
        self.rng = np.random.default_rng(seed)

    @property
    def replicas(self):
        return len(self.seconds_per_row)

    def capacity(self):
        """Each replica's fraction of the job's rows per second."""
        speed = 1.0 / self.seconds_per_row
        return speed / speed.sum()

    def slow_down(self, replicas):
        self.seconds_per_row[replicas] *= SLOWDOWN

    def lose_last_worker(self):
        self.seconds_per_row = self.seconds_per_row[: -self.per_worker]

    def read(self, rows):
        """`(compute_seconds, call_seconds)` of one step."""
        size = self.replicas
        factor = np.exp(JITTER * self.rng.standard_normal(size))
        probability, (low, high) = STALLS
        stalled = self.rng.random(size) < probability
        factor[stalled] *= self.rng.uniform(low, high, stalled.sum())
        probability, (low, high) = JOB_STALLS
        if self.rng.random() < probability:
            factor *= self.rng.uniform(low, high)
        seconds = rows * self.seconds_per_row * factor
        outside = OUTSIDE_SECONDS * np.exp(JITTER * self.rng.standard_normal())
        return seconds, float(seconds.max() + outside)


class Cores:
    """The callbacks' pure cores for one job, fed as the callbacks feed
    them; each call timed.

    Args:
        replicas: Replicas in the job.
    """

    def __init__(self, replicas):
        devices = [
            f"/job:worker/task:{i // 8}/device:GPU:{i % 8}"
            for i in range(replicas)
        ]
        self.global_batch_size = ROWS_PER_REPLICA * replicas
        # StragglerDetector
        self.detector_clock = ClockCheck(devices)
        self.scorer = scoring.Scorer(replicas, SCORE_WINDOW)
        self.tracker = communication.CommunicationTracker(
            SCORE_WINDOW, PATIENCE, scoring.MIN_EXCESS_SECONDS
        )
        # ShardRebalancer
        self.rebalancer_clock = ClockCheck(devices)
        self.speeds = rebalance.SpeedWindow.empty(replicas, SPEED_WINDOW)
        self.since_decision = 0
        self.share_changes = 0
        # The dataset's share schedule
        self.schedule = ShareSchedule(np.full(replicas, 1.0 / replicas))
        # ElasticCheckpoint: seconds since the last save, a save's cost
        self.since_save = 0.0
        self.save_cost = 10.0
        self.replicas = replicas
        self.steps = 0
        self.seconds = collections.defaultdict(list)  # core -> per step
        # Per step, all the callbacks' cores: wall and this thread's CPU
        # seconds (the CPU time leaves out what other processes took).
        self.totals = []
        self.cpu_totals = []
        self.decision_seconds = []
        self.saves = []  # (seconds to build the state, bytes)

    def _timed(self, core, function, *args, **kwargs):
        started = time.perf_counter()
        result = function(*args, **kwargs)
        self.seconds[core].append(time.perf_counter() - started)
        return result

    def rows(self):
        """The rows of the next global batch, by the share schedule."""
        bounds = self._timed(
            "schedule",
            self.schedule.next_bounds,
            self.steps,
            self.global_batch_size,
        )
        return np.diff(bounds)

    def step(self, rows, seconds, call_seconds):
        """One train batch end; returns the straggler changes."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        self.steps += 1
        changes = self._detector(rows, seconds, call_seconds)
        self._rebalancer(rows, seconds)
        self._timed("checkpoint", self._checkpoint_due, call_seconds)
        self.totals.append(time.perf_counter() - started)
        self.cpu_totals.append(time.thread_time() - cpu_started)
        return changes

    def _detector(self, rows, seconds, call_seconds):
        findings, masked = self._timed(
            "detector clock", self._check_clock, rows, seconds
        )
        if any(finding.blind for finding in findings):
            self.scorer = scoring.Scorer(len(rows), SCORE_WINDOW)
        changes = self._timed(
            "scorer",
            self.scorer.step,
            rows,
            masked,
            threshold=THRESHOLD,
            patience=PATIENCE,
            relative_threshold=RELATIVE_THRESHOLD,
        )
        self._timed("communication", self._communication, masked, call_seconds)
        return changes

    def _check_clock(self, rows, seconds):
        findings = self.detector_clock.add(rows, seconds)
        return findings, self.detector_clock.masked(seconds)

    def _communication(self, seconds, call_seconds):
        if np.isfinite(seconds).any():
            compute = np.fmax.reduce(seconds)
            self.tracker.step(self.steps, call_seconds, compute, 1)

    def _rebalancer(self, rows, seconds):
        if self.steps <= WARMUP_STEPS:
            return
        self._timed(
            "rebalancer clock", self.rebalancer_clock.add, rows, seconds
        )
        self.speeds = self._timed(
            "rebalancer window", self.speeds.add, rows, seconds
        )
        self.since_decision += 1
        if self.since_decision < EVERY_N_STEPS:
            return
        self.since_decision = 0
        started = time.perf_counter()
        speeds = rebalance.SpeedWindow(
            np.where(
                self.rebalancer_clock.usable(), self.speeds.readings, np.nan
            )
        )
        shares = rebalance.decide(
            speeds, self.schedule.latest(), self.global_batch_size
        )
        if shares is not None:
            self.schedule.set_shares(shares, at=(0, self.steps + LAG))
            self.share_changes += 1
        self.decision_seconds.append(time.perf_counter() - started)

    def _checkpoint_due(self, call_seconds):
        self.since_save += call_seconds
        interval = young_daly_interval(
            self.save_cost, MTBF_SECONDS / self.replicas
        )
        if self.since_save >= interval:
            self.since_save = 0.0

    def save(self, repeats=5):
        """Builds the callbacks' part of a checkpoint `repeats` times."""
        for _ in range(repeats):
            started = time.perf_counter()
            saved = json.dumps(self.state())
            self.saves.append((time.perf_counter() - started, len(saved)))

    def state(self):
        """The callbacks' part of a checkpoint (as their `get_state`)."""
        return {
            "rebalancer": {
                "readings": self.speeds.readings.tolist(),
                "steps": self.steps,
                "since_decision": self.since_decision,
            },
            "straggler": {
                "scores": self.scorer.state().to_dict(),
                "steps": self.steps,
                "communication": self.tracker.state(),
            },
            "shares": self.schedule.latest().tolist(),
        }


def simulate(replicas, steps, seed=0):
    """Runs one job; returns its measurements (a dict)."""
    cluster = Cluster(replicas, seed)
    slow_at, fail_at = int(0.4 * steps), int(0.7 * steps)
    survivors = replicas - cluster.per_worker
    slowed = np.unique(
        np.linspace(0, survivors - 1, max(1, replicas // 128)).astype(int)
    )
    cores = Cores(replicas)
    jobs = [cores]
    events = []
    distance = []  # per step: half the L1 distance shares - capacity
    slowed_rows = []  # per step: the slowed replicas' rows, and capacity
    for step in range(steps):
        if step == slow_at:
            cluster.slow_down(slowed)
        if step == fail_at:
            cores.save()
            cluster.lose_last_worker()
            cores = Cores(cluster.replicas)
            jobs.append(cores)
        rows = cores.rows()
        seconds, call_seconds = cluster.read(rows)
        for replica, kind, _, _ in cores.step(rows, seconds, call_seconds):
            events.append((step, replica, kind))
        capacity = cluster.capacity()
        shares = rows / rows.sum()
        distance.append(0.5 * np.abs(shares - capacity).sum())
        slowed_rows.append(
            (rows[slowed].sum(), capacity[slowed].sum() * rows.sum())
        )
    flags = {
        replica: step
        for step, replica, kind in reversed(events)
        if kind == "straggler" and replica in slowed and step >= slow_at
    }
    false_alarms = [
        event
        for event in events
        if event[1] not in slowed or event[0] < slow_at
    ]
    delays = [flags[r] - slow_at + 1 for r in slowed if r in flags]
    rows = cores.rows()
    actual = np.max(rows * cluster.seconds_per_row)
    ideal = cores.global_batch_size / np.sum(1.0 / cluster.seconds_per_row)
    return {
        "replicas": replicas,
        "jobs": jobs,
        "slowed": len(slowed),
        "flagged": len(flags),
        "delays": delays,
        "false_alarms": false_alarms,
        "converged": [
            _first_within(distance, 0, slow_at),
            _first_within(_excess(slowed_rows, slow_at), slow_at, fail_at, 0.1),
            _first_within(distance, fail_at, steps),
        ],
        "efficiency": ideal / actual,
        "share_changes": sum(job.share_changes for job in jobs),
    }


def _excess(slowed_rows, start):
    """Per step: the part of the slowed replicas' rows beyond their new
    capacity still left, of what they had beyond it at `start`."""
    before = slowed_rows[start][0]
    return [
        abs(rows - capacity) / (before - capacity)
        for rows, capacity in slowed_rows
    ]


def _first_within(errors, start, end, limit=0.02):
    """Steps from `start` to the first step from which `errors` stay
    within `limit` until `end` (None: never)."""
    errors = np.asarray(errors[start:end])
    outside = np.flatnonzero(errors > limit)
    if not len(outside):
        return 0
    if outside[-1] == len(errors) - 1:
        return None
    return int(outside[-1] + 1)


def cost_rows(results):
    """Host ms per step: median per core, and all cores together."""
    table = []
    skip = 20  # the windows filling
    for result in results:
        cores = result["jobs"][0]
        median = {
            core: 1000 * np.median(seconds[skip:])
            for core, seconds in cores.seconds.items()
        }
        totals = 1000 * np.asarray(cores.totals[skip:])
        cpu = 1000 * np.asarray(cores.cpu_totals[skip:])
        build = 1000 * np.median([seconds for seconds, _ in cores.saves])
        size = max(size for _, size in cores.saves) / 1024
        table.append(
            [
                result["replicas"],
                *(
                    f"{median[core]:.3f}"
                    for core in (
                        "scorer",
                        "detector clock",
                        "communication",
                        "rebalancer clock",
                        "rebalancer window",
                    )
                ),
                f"{1000 * np.median(cores.decision_seconds):.3f}",
                f"{median['checkpoint']:.3f}",
                f"{np.median(totals):.3f}",
                f"{_amortised(totals):.3f}",
                f"{_amortised(cpu):.3f}",
                f"{median['schedule']:.3f}",
                f"{size:.0f} KB, {build:.1f} ms",
            ]
        )
    return table


def _amortised(per_step):
    """The cost per step with the work done 1 step in 10 (the share
    decision, each ClockCheck's noise check), robust to the machine's
    load: that work comes at fixed places in a 10-step cycle, so the
    median at each place, averaged over the 10."""
    return np.mean([np.median(per_step[place::10]) for place in range(10)])


def decision_rows(results):
    table = []
    for result in results:
        delays = result["delays"]
        table.append(
            [
                result["replicas"],
                len(result["false_alarms"]),
                f"{result['flagged']} of {result['slowed']}",
                f"{int(np.median(delays))} / {max(delays)}" if delays else "-",
                *(
                    "never" if steps is None else steps
                    for steps in result["converged"]
                ),
                f"{100 * result['efficiency']:.1f}%",
                result["share_changes"],
            ]
        )
    return table


class _OutOfTime(Exception):
    pass


def _stop(signum, frame):
    raise _OutOfTime


def planner_rows(device_counts, limit_seconds, layers=64):
    """Seconds of `plan` (its default search, and the given order) and
    `plan_layout`, on a chain of `layers` Dense layers over workers of 8
    devices, speeds 1 : 1.5 : 3 by worker; stopped after `limit_seconds`."""
    import keras_hetero as kh
    from keras_hetero import keras

    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(64, name=f"dense_{i}") for i in range(layers)]
    )
    costs = {f"dense_{i}": 0.001 * (1 + i % 5) for i in range(layers)}
    table = []
    signal.signal(signal.SIGALRM, _stop)
    for count in device_counts:
        per_worker = min(8, count)
        speeds = [GENERATIONS[(d // per_worker) % 3] for d in range(count)]
        devices = [
            f"/job:worker/task:{d // per_worker}/device:GPU:{d % per_worker}"
            for d in range(count)
        ]
        cluster = [
            [
                (f"/device:GPU:{g}", GENERATIONS[w % 3])
                for g in range(per_worker)
            ]
            for w in range(count // per_worker)
        ]
        plan = functools.partial(
            kh.placement.plan,
            model,
            devices,
            device_speeds=speeds,
            layer_costs=costs,
        )
        calls = [
            plan,
            functools.partial(plan, keep_order=True),
            functools.partial(
                kh.placement.plan_layout,
                model,
                cluster,
                batch_size=ROWS_PER_REPLICA * count,
                layer_costs=costs,
            ),
        ]
        row = [count]
        for call in calls:
            started = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, limit_seconds)
            try:
                call()
                row.append(f"{time.perf_counter() - started:.2f}")
            except _OutOfTime:
                row.append(f"> {limit_seconds:g} (stopped)")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        table.append(row)
    return table


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[8, 64, 256, 1024, 4096],
        help="job sizes to simulate",
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--planner-devices", type=int, nargs="+", default=[8, 64, 256]
    )
    parser.add_argument(
        "--planner-seconds",
        type=float,
        default=60.0,
        help="each planner call is stopped after this long",
    )
    args = parse_args(parser, replicas=[8, 64], steps=120, planner_devices=[8])
    sizes, steps = args.replicas, args.steps
    print(
        header(
            "Decision cores at scale (simulated readings)",
            f"{steps} steps per job",
        )
    )
    results = [simulate(replicas, steps) for replicas in sizes]
    print(
        "\nHost ms per step (simulated readings): medians over the steps; "
        '"per step" includes the work done 1 step in 10; "CPU": the '
        "training thread's CPU time, without what other processes took\n"
    )
    print(
        markdown_table(
            [
                "replicas",
                "scorer",
                "detector ClockCheck",
                "communication",
                "rebalancer ClockCheck",
                "speed window",
                "share decision (1 step in 10)",
                "checkpoint due",
                "all callbacks: median step",
                "all callbacks: per step",
                "all callbacks: CPU per step",
                "share schedule (input)",
                "callbacks' saved state",
            ],
            cost_rows(results),
        )
    )
    print(
        f"\nDecisions over {steps} steps (simulated readings): 1.5x "
        f"slowdown at step {int(0.4 * steps)}, the last worker lost at "
        f"step {int(0.7 * steps)}\n"
    )
    print(
        markdown_table(
            [
                "replicas",
                "false alarms",
                "slowed replicas flagged",
                "steps to flag, median / max",
                "steps to shares within 2% of capacity",
                "steps to shed 90% of the slowed replicas' excess rows",
                "steps to shares within 2% after the restart",
                "step time vs ideal at the end",
                "share changes",
            ],
            decision_rows(results),
        )
    )
    counts = args.planner_devices
    print(
        "\nPlanner seconds, 64 layers (stopped after "
        f"{args.planner_seconds:g} s)\n"
    )
    print(
        markdown_table(
            [
                "devices",
                "plan (searched order)",
                "plan (keep_order=True)",
                "plan_layout",
            ],
            planner_rows(counts, args.planner_seconds),
        )
    )


if __name__ == "__main__":
    main()
