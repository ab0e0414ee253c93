"""Uniform vs rebalanced shares on SIMULATED unequal devices.

Every replica is slowed by `kh.testing.SimulatedSpeed` (seconds per row;
speed = 1 / that), under MirroredStrategy (logical CPUs of this process) and
under MultiWorkerMirroredStrategy (one worker process per replica, TF_CONFIG
on 127.0.0.1). For each case the same model trains with equal shares and with
`ShardRebalancer`; we print samples/s (median step time over the last
`--tail` steps), % of the ideal, and for the slow-down case the steps after the
change until the 5-step median rate first reaches 95% of the new ideal, and
95% of the rate the rebalanced run settles at (convergence, whatever the
fixed per-step cost of the strategy).

The ideal is measured, not assumed: each replica's simulated device trains
alone (one device, the whole global batch) and the ideal is the sum of those
solo rows/s. The time scale is chosen so a perfectly balanced step takes
`--step-ms` of simulated work; all figures are simulated.

The fixed per-step cost of each strategy and replica count is measured
apart from the imbalance: an A/A run with EQUAL simulated speeds and equal
shares has nothing to balance, so its step time beyond the ideal is the
fixed part (collectives, host loop). Each rebalanced rate is reported as a
fraction of the raw ideal and of the ideal with that fixed cost added to
its step ("ideal minus fixed").

Run: `python benchmarks/rebalance.py` (about 12 minutes on 2 cores;
`--strategies mirrored` for half of that; `--strategies mwms --cases
1:2,1:4,1:1:2:4` for the MWMS rows only).
"""

import datetime
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

GLOBAL_BATCH = 96
ROLLING = 5  # steps in the rolling median of "steps to 95%"


def train(strategy, seconds, steps, rebalance, slowdown):
    """Step times (s) of one fit; `slowdown` = (step, replica, factor)."""
    import tensorflow as tf

    from keras_hetero import keras

    with strategy.scope():
        inputs = keras.Input((16,))
        slow = kh.testing.SimulatedSpeed(list(seconds))
        hidden = keras.layers.Dense(32, activation="relu")(slow(inputs))
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * steps, 16)).astype("float32")
    examples = tf.data.Dataset.from_tensor_slices((x, x[:, :1]))
    data = kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)
    timer = kh.testing.StepTimer()
    callbacks = [timer]
    if rebalance:
        callbacks.append(
            kh.callbacks.ShardRebalancer(data, every_n_steps=5, window=5)
        )
    if slowdown:
        callbacks.append(_SlowDown(slow, *slowdown))
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return np.asarray(timer.seconds)


def _SlowDown(layer, at, replica, factor):
    from keras_hetero import keras

    class SlowDown(keras.callbacks.Callback):
        """Makes replica `replica` `factor` times slower after step `at`."""

        def on_train_begin(self, logs=None):
            self.step = 0

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step == at:
                seconds = list(layer.seconds_per_row)
                seconds[replica] *= factor
                layer.seconds_per_row = seconds

    return SlowDown()


def _mwms_worker(seconds, steps, rebalance, slowdown):
    kh.testing.logical_cpus(1)
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return train(strategy, seconds, steps, rebalance, slowdown)


def run(kind, devices, seconds, steps, rebalance, slowdown):
    if kind == "mirrored":
        strategy = kh.testing.mirrored(devices[: len(seconds)])
        return train(strategy, seconds, steps, rebalance, slowdown)
    results = kh.testing.run_workers(
        _mwms_worker,
        len(seconds),
        timeout=900,
        args=(list(seconds), steps, rebalance, slowdown),
    )
    return results[0].value


def solo_rate(devices, seconds_per_row, cache, steps=10):
    """Rows/s of one simulated device training alone on the global batch."""
    if seconds_per_row not in cache:
        strategy = kh.testing.mirrored(devices[:1])
        times = train(strategy, [seconds_per_row], steps, False, None)
        cache[seconds_per_row] = GLOBAL_BATCH / float(np.median(times[2:]))
    return cache[seconds_per_row]


def steps_to_target(times, target):
    """Steps until the rolling median rate first reaches `target` rows/s."""
    for end in range(ROLLING, len(times) + 1):
        rate = GLOBAL_BATCH / np.median(times[end - ROLLING : end])
        if rate >= target:
            return end
    return None


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tail", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=150.0)
    parser.add_argument(
        "--strategies",
        default="mirrored,mwms",
        help="comma-separated: mirrored, mwms",
    )
    parser.add_argument(
        "--cases",
        default="",
        help='comma-separated speed cases, e.g. "1:2,1:4" (default: all)',
    )
    args = parse_args(
        parser,
        steps=10,
        tail=5,
        step_ms=10.0,
        strategies="mirrored",
        cases="1:2",
    )
    devices = kh.testing.logical_cpus(4)
    step = args.step_ms / 1000.0
    print(
        f"rebalance benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, global batch {GLOBAL_BATCH}, SIMULATED speeds "
        f"(balanced step = {args.step_ms:.0f} ms of simulated work), "
        f"ShardRebalancer(every_n_steps=5, window=5), median of the last "
        f"{args.tail} steps"
    )
    print()
    print(
        "| strategy | speeds | ideal samples/s (measured solo sum) | "
        "uniform samples/s | uniform % ideal | rebalanced samples/s | "
        "rebalanced % ideal | fixed cost per step (ms, A/A) | "
        "rebalanced % (ideal minus fixed) | rebalanced: steps after the "
        "change to 95% of ideal / to 95% of its own steady rate |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    # (name, speeds before, slowdown (step, replica, factor) or None)
    cases = [
        ("1:2", [1, 2], None),
        ("1:4", [1, 4], None),
        ("1:1:2:4", [1, 1, 2, 4], None),
        ("1:1, replica 1 2x slower at step 100", [1, 1], (100, 1, 2.0)),
    ]
    if args.cases:
        chosen = args.cases.split(",")
        cases = [case for case in cases if case[0] in chosen]
    solo = {}
    fixed = {}  # (kind, replicas) -> seconds per step beyond the ideal

    def fixed_cost(kind, label, replicas):
        """The A/A run: equal speeds, equal shares, so no imbalance."""
        if (kind, replicas) not in fixed:
            unit = step * replicas / GLOBAL_BATCH
            seconds = [unit] * replicas
            ideal = replicas * solo_rate(devices, unit, solo)
            times = run(kind, devices, seconds, args.steps, False, None)
            measured = float(np.median(times[-args.tail :]))
            fixed[(kind, replicas)] = measured - GLOBAL_BATCH / ideal
            rate = GLOBAL_BATCH / measured
            name = ":".join(["1"] * replicas) + " (A/A: equal speeds)"
            print(
                f"| {label} | {name} | {ideal:.0f} | {rate:.0f} | "
                f"{100 * rate / ideal:.0f}% | - | - | "
                f"{1000 * fixed[(kind, replicas)]:.1f} | - | - |",
                flush=True,
            )
        return fixed[(kind, replicas)]

    for kind in args.strategies.split(","):
        label = {"mirrored": "Mirrored", "mwms": "MWMS"}[kind]
        for name, speeds, slowdown in cases:
            overhead = fixed_cost(kind, label, len(speeds))
            after = np.asarray(speeds, np.float64)
            steps = args.steps
            if slowdown:
                after[slowdown[1]] /= slowdown[2]
                steps = slowdown[0] + args.steps
            # Slowest device's seconds per row, so that a balanced step
            # (after any slow-down) takes `step` seconds.
            unit = step * after.sum() / GLOBAL_BATCH
            seconds = [unit / s for s in speeds]
            ideal = sum(
                solo_rate(devices, unit / s, solo) for s in after.tolist()
            )
            # The ideal rate with the strategy's fixed per-step cost added.
            reachable = GLOBAL_BATCH / (GLOBAL_BATCH / ideal + overhead)
            row = [label, name, f"{ideal:.0f}"]
            reached = []
            for rebalance in (False, True):
                times = run(kind, devices, seconds, steps, rebalance, slowdown)
                rate = GLOBAL_BATCH / float(np.median(times[-args.tail :]))
                row += [f"{rate:.0f}", f"{100 * rate / ideal:.0f}%"]
                if slowdown and rebalance:
                    # Timer entry i is the step ending batch i + 2.
                    after_change = times[slowdown[0] - 1 :]
                    for target in (0.95 * ideal, 0.95 * rate):
                        hit = steps_to_target(after_change, target)
                        reached.append("never" if hit is None else str(hit))
            row += [f"{1000 * overhead:.1f}", f"{100 * rate / reachable:.0f}%"]
            row.append(" / ".join(reached) if slowdown else "-")
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
