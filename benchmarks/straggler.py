"""StragglerDetector: detection delay, false flags and overhead (SIMULATED).

Replicas are MirroredStrategy logical CPUs slowed by
`kh.testing.SimulatedSpeed`; all figures are simulated. Three measurements:

1. Steps to flag: two replicas of equal speed; at step 30 replica 1 becomes
   1.2x, 1.5x or 2x slower; we print how many steps later the detector's
   event names it (default `threshold=0.7`, and `0.9` for comparison; a
   1.2x slowdown scores 0.83 and is, by design, not a straggler at 0.7).
2. False flags: four replicas, no real slowdown, every replica's speed
   drawn anew each step uniformly within +-20%; events over `--jitter-steps`
   steps of a real fit, and over 100,000 steps of the pure scoring core
   (`kh.straggler`'s numpy functions, whose decisions the callback's
   `Scorer` reproduces exactly) on the same noise.
3. Overhead: the same fit without the detector, again without (to show
   the run-to-run noise) and with it, alternating in one process; median
   step time ratio, and the detector's own time per step (time spent
   inside its callbacks) as a share of the step.

Run: `python benchmarks/straggler.py` (about 4 minutes on 2 cores).
"""

import argparse
import datetime
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import straggler  # noqa: E402

SECONDS_PER_ROW = 0.001
GLOBAL_BATCH = 32


def build(strategy, replicas):
    from keras_hetero import keras

    with strategy.scope():
        inputs = keras.Input((16,))
        slow = kh.testing.SimulatedSpeed([SECONDS_PER_ROW] * replicas)
        hidden = keras.layers.Dense(32, activation="relu")(slow(inputs))
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
    return model, slow


def data(strategy, steps):
    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(GLOBAL_BATCH * steps, 16))
    x = x.astype("float32")
    examples = tf.data.Dataset.from_tensor_slices((x, x[:, :1]))
    return kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)


class _Speeds:
    """Callback factory: sets the layer's seconds per row before each step."""

    @staticmethod
    def make(layer, schedule):
        from keras_hetero import keras

        class SetSpeeds(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.step = 0

            def on_train_batch_begin(self, batch, logs=None):
                self.step += 1
                layer.seconds_per_row = schedule(self.step)

        return SetSpeeds()


def steps_to_flag(strategy, factor, threshold, at=30, steps=70):
    model, layer = build(strategy, 2)

    def schedule(step):
        slow = factor if step > at else 1.0
        return [SECONDS_PER_ROW, SECONDS_PER_ROW * slow]

    detector = kh.callbacks.StragglerDetector(threshold=threshold)
    model.fit(
        data(strategy, steps),
        verbose=0,
        callbacks=[_Speeds.make(layer, schedule), detector],
    )
    flags = [
        e.step - at
        for e in detector.events
        if e.kind == "straggler" and e.replica == 1 and e.step > at
    ]
    false = [e for e in detector.events if e.step <= at or e.replica != 1]
    return (flags[0] if flags else None), len(false)


def jitter(rng, replicas):
    return SECONDS_PER_ROW * rng.uniform(0.8, 1.2, size=replicas)


def false_flags_fit(strategy, steps):
    model, layer = build(strategy, 4)
    rng = np.random.default_rng(1)
    detector = kh.callbacks.StragglerDetector()
    model.fit(
        data(strategy, steps),
        verbose=0,
        callbacks=[
            _Speeds.make(layer, lambda step: jitter(rng, 4).tolist()),
            detector,
        ],
    )
    return len(detector.events)


def false_flags_core(steps, replicas=4):
    rng = np.random.default_rng(2)
    state = straggler.ScoreState.empty(replicas, 9)
    rows = np.full(replicas, GLOBAL_BATCH // replicas)
    events = 0
    for _ in range(steps):
        state = straggler.add_reading(state, rows, rows * jitter(rng, replicas))
        state, changes = straggler.evaluate(state, threshold=0.7, patience=3)
        events += len(changes)
    return events


class _Timed:
    """Wraps a callback, summing the seconds spent in its batch hooks."""

    @staticmethod
    def make(inner):
        from keras_hetero import keras

        class Timed(keras.callbacks.Callback):
            seconds = 0.0

            def set_model(self, model):
                super().set_model(model)
                inner.set_model(model)

            def on_train_begin(self, logs=None):
                inner.on_train_begin(logs)

            def on_train_end(self, logs=None):
                inner.on_train_end(logs)

            def on_epoch_end(self, epoch, logs=None):
                inner.on_epoch_end(epoch, logs)

            def on_train_batch_begin(self, batch, logs=None):
                start = time.perf_counter()
                inner.on_train_batch_begin(batch, logs)
                Timed.seconds += time.perf_counter() - start

            def on_train_batch_end(self, batch, logs=None):
                start = time.perf_counter()
                inner.on_train_batch_end(batch, logs)
                Timed.seconds += time.perf_counter() - start

        return Timed()


def overhead(strategy, rounds, steps):
    """Median step times: without, without again (the noise), with."""
    model, _ = build(strategy, 2)
    runs = ("without", "again", "with")
    medians = {run: [] for run in runs}
    inside = []
    for _ in range(rounds):
        for run in runs:
            timer = kh.testing.StepTimer()
            callbacks = [timer]
            if run == "with":
                detector = kh.callbacks.StragglerDetector()
                timed = _Timed.make(detector)
                callbacks.append(timed)
            model.fit(data(strategy, steps), verbose=0, callbacks=callbacks)
            medians[run].append(timer.median())
            if run == "with":
                inside.append(timed.seconds / steps)
    result = {run: float(np.median(medians[run])) for run in runs}
    result["inside"] = float(np.median(inside))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jitter-steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--overhead-steps", type=int, default=150)
    args = parser.parse_args()
    devices = kh.testing.logical_cpus(4)

    print(
        f"straggler benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on logical CPUs, global batch "
        f"{GLOBAL_BATCH}, SIMULATED speeds ({SECONDS_PER_ROW} s/row), "
        "StragglerDetector(window=9, patience=3)"
    )
    print()
    two = kh.testing.mirrored(devices[:2])
    print("| slowdown of replica 1 at step 30 | threshold | steps to flag |")
    print("|---|---:|---:|")
    for factor in (1.2, 1.5, 2.0):
        for threshold in (0.7, 0.9):
            flag, false = steps_to_flag(two, factor, threshold)
            text = "not flagged" if flag is None else str(flag)
            if false:
                text += f" ({false} other events)"
            print(f"| {factor}x (simulated) | {threshold} | {text} |")
    print()
    four = kh.testing.mirrored(devices[:4])
    fit_flags = false_flags_fit(four, args.jitter_steps)
    core_flags = false_flags_core(100_000)
    print("| no slowdown, +-20% jitter per replica and step | events |")
    print("|---|---:|")
    print(f"| fit, 4 replicas, {args.jitter_steps} steps | {fit_flags} |")
    print(f"| scoring core, 4 replicas, 100000 steps | {core_flags} |")
    print()
    times = overhead(two, args.rounds, args.overhead_steps)
    without = times["without"]
    print(
        "| step time without detector | without, 2nd series (noise) | with "
        "detector | ratio with / without | detector time per step | share "
        "of step |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {1000 * without:.2f} ms | {1000 * times['again']:.2f} ms "
        f"(ratio {times['again'] / without:.3f}) | "
        f"{1000 * times['with']:.2f} ms | {times['with'] / without:.3f} | "
        f"{1000 * times['inside']:.3f} ms | "
        f"{100 * times['inside'] / without:.2f}% |"
    )


if __name__ == "__main__":
    main()
