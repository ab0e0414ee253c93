"""StragglerDetector: detection delay, false alarms and overhead.

Replicas are MirroredStrategy logical CPUs. Four measurements:

1. Steps to flag (SIMULATED): two replicas of equal speed slowed by
   `kh.testing.SimulatedSpeed`; at step 30 replica 1 becomes 1.2x, 1.5x or
   2x slower; we print how many steps later the detector's event names it
   (default `threshold=0.7`, and `0.9` for comparison; a 1.2x slowdown
   scores 0.83 and is, by design, not a straggler at 0.7). Once on the
   machine as it is, once under CPU load (see 2).
2. False alarms under load (real devices, no simulation): two EQUAL
   logical CPUs train real models (an MNIST-tutorial-sized conv net, an
   MLP with steps of about 3 ms, a tiny model with sub-millisecond steps)
   for `--alarm-epochs` x `--alarm-steps` steps each, while `--load`
   busy-loop subprocesses (`python -c "while True: pass"`, each keeping
   one of the 2 cores busy) run alongside. We count the detector's events
   with its defaults, and replay the recorded per-step telemetry through
   the rule before the noise floor (the scores alone) to show what it
   flagged.
3. False flags on synthetic jitter (SIMULATED): four replicas, every
   replica's speed drawn anew each step uniformly within +-20%; events over
   `--jitter-steps` steps of a real fit, and over 100,000 steps of the pure
   scoring core (`kh.straggler`'s numpy functions, whose decisions the
   callback's `Scorer` reproduces exactly) on the same noise.
4. Overhead (SIMULATED speeds): the same fit without the detector, again
   without (to show the run-to-run noise) and with it, alternating in one
   process; median step time ratio, and the detector's own time per step
   (time spent inside its callbacks) as a share of the step.

Run: `python benchmarks/straggler.py` (about 9 minutes on 2 cores).
"""

import contextlib
import datetime
import logging
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero.stragglers import scoring as straggler  # noqa: E402

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
    """`(steps from the slowdown to its event or None, other events)`."""
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


@contextlib.contextmanager
def cpu_load(processes):
    """Busy-loop subprocesses for the duration; each keeps one core busy."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(processes)
    ]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def alarm_model(kind, strategy):
    """`(model, examples, global batch)` of one workload, real speeds."""
    import tensorflow as tf

    from keras_hetero import keras

    rng = np.random.default_rng(0)
    with strategy.scope():
        if kind == "conv":  # the TensorFlow distributed-training tutorial's
            batch = 128
            inputs = keras.Input((28, 28, 1))
            hidden = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
            hidden = keras.layers.MaxPooling2D()(hidden)
            hidden = keras.layers.Flatten()(hidden)
            hidden = keras.layers.Dense(64, activation="relu")(hidden)
            outputs = keras.layers.Dense(10)(hidden)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            x = rng.normal(size=(batch * 64, 28, 28, 1)).astype("float32")
            y = rng.integers(0, 10, size=(batch * 64,))
        else:
            batch = 128 if kind == "mlp" else 16
            width = 512 if kind == "mlp" else 8
            inputs = keras.Input((32,))
            hidden = keras.layers.Dense(width, activation="relu")(inputs)
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
            outputs = keras.layers.Dense(1)(hidden)
            loss = "mse"
            x = rng.normal(size=(batch * 64, 32)).astype("float32")
            y = x[:, :1]
        model = kh.HeteroModel(inputs, outputs)
        model.compile(optimizer="adam", loss=loss)
    return model, tf.data.Dataset.from_tensor_slices((x, y)), batch


class _Recorder:
    """Callback factory: keeps every step's rows and compute seconds."""

    @staticmethod
    def make():
        from keras_hetero import keras

        class Record(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.rows, self.seconds = [], []

            def on_train_batch_end(self, batch, logs=None):
                stats = self.model.step_stats
                self.rows.append(stats.rows)
                self.seconds.append(stats.compute_seconds)

        return Record()


def scores_alone(rows, seconds, threshold=0.7, patience=3, window=9):
    """Events of the rule before the noise floor, on recorded telemetry.

    A replica was flagged after `patience` evaluations with its relative
    score or its own-baseline individual score (not divided by the least
    slowed replica's) below `threshold`, and recovered after `patience`
    without; the baseline is the one `kh.straggler` keeps.
    """
    replicas = len(rows[0])
    state = straggler.ScoreState.empty(replicas, window)
    below = np.zeros(replicas, int)
    above = np.zeros(replicas, int)
    flagged = np.zeros(replicas, bool)
    events = 0
    for step_rows, step_seconds in zip(rows, seconds):
        state = straggler.add_reading(state, step_rows, step_seconds)
        if state.seen >= window:
            cost = straggler.current_costs(state)
            low = (np.fmin.reduce(cost) / cost < threshold) | (
                state.baseline / cost < threshold
            )
            below = np.where(low, below + 1, 0)
            above = np.where(low, 0, above + 1)
            change = np.where(flagged, above >= patience, below >= patience)
            events += int(change.sum())
            flagged ^= change
        state, _ = straggler.evaluate(
            state, threshold=threshold, patience=patience
        )
    return events


def false_alarms(strategy, kind, epochs, steps):
    """`(events, events by the scores alone, median step ms)` of one fit."""
    model, examples, batch = alarm_model(kind, strategy)
    examples = examples.repeat().take(batch * steps)
    data = kh.data.shard(examples, batch, strategy=strategy)
    detector = kh.callbacks.StragglerDetector()
    recorder = _Recorder.make()
    model.fit(data, epochs=epochs, verbose=0, callbacks=[recorder, detector])
    step_ms = 1000 * float(np.median(np.max(recorder.seconds, axis=1)))
    alone = scores_alone(recorder.rows, recorder.seconds)
    return len(detector.events), alone, step_ms


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
    parser = smoke_parser(__doc__)
    parser.add_argument("--jitter-steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--overhead-steps", type=int, default=150)
    parser.add_argument("--load", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alarm-epochs", type=int, default=3)
    parser.add_argument("--alarm-steps", type=int, default=400)
    args = parse_args(
        parser,
        jitter_steps=20,
        rounds=1,
        overhead_steps=10,
        repeats=1,
        alarm_epochs=1,
        alarm_steps=10,
        load=0,  # the "under load" runs without a busy loop: no core taken
    )
    # The smoke run: one slowdown and one threshold, a short scoring core.
    factors = (2.0,) if args.smoke else (1.2, 1.5, 2.0)
    thresholds = (0.7,) if args.smoke else (0.7, 0.9)
    core_steps = 1000 if args.smoke else 100_000
    # The tables count the events; their log lines would only interleave.
    logging.getLogger("keras_hetero").setLevel(logging.ERROR)
    devices = kh.testing.logical_cpus(4)
    load = (
        f'{args.load} busy-loop subprocess(es) (`python -c "while True: pass"`)'
    )

    print(
        f"straggler benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on logical CPUs of "
        f"{os.cpu_count()} cores, StragglerDetector defaults (window=9, "
        f"patience=3, min_excess_seconds={straggler.MIN_EXCESS_SECONDS})"
    )
    print()
    two = kh.testing.mirrored(devices[:2])
    print(
        f"Global batch {GLOBAL_BATCH}, SIMULATED speeds "
        f"({SECONDS_PER_ROW} s/row, {GLOBAL_BATCH // 2} rows per replica); "
        f"under load: {load}."
    )
    print()
    print(
        "| slowdown of replica 1 at step 30 | threshold | steps to flag "
        f"({args.repeats} runs) | steps to flag, under load ({args.repeats} "
        "runs) |"
    )
    print("|---|---:|---:|---:|")
    for factor in factors:
        for threshold in thresholds:
            texts = []
            for loaded in (0, args.load):
                runs = []
                for _ in range(args.repeats):
                    with cpu_load(loaded):
                        flag, false = steps_to_flag(two, factor, threshold)
                    text = "-" if flag is None else str(flag)
                    if false:
                        text += f" ({false} other events)"
                    runs.append(text)
                texts.append(", ".join(runs))
            print(
                f"| {factor}x (simulated) | {threshold} | {texts[0]} | "
                f"{texts[1]} |"
            )
    print()
    print("(- = not flagged within 40 steps)")
    print()
    steps = args.alarm_epochs * args.alarm_steps
    print(
        f"Two EQUAL replicas, real speeds, {args.alarm_epochs} epochs x "
        f"{args.alarm_steps} steps; load: {load}."
    )
    print()
    print(
        "| model (real, not simulated) | load | steps | median step | "
        "events (defaults) | events by the scores alone (before) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    names = {
        "conv": "MNIST-tutorial conv net, global batch 128",
        "mlp": "MLP 32-512-512-1, global batch 128",
        "tiny": "MLP 32-8-8-1, global batch 16",
    }
    for kind in ("conv", "mlp", "tiny"):
        for loaded in (0, args.load):
            with cpu_load(loaded):
                events, alone, step_ms = false_alarms(
                    two, kind, args.alarm_epochs, args.alarm_steps
                )
            print(
                f"| {names[kind]} | {'busy loop' if loaded else 'none'} | "
                f"{steps} | {step_ms:.2f} ms | {events} | {alone} |"
            )
    print()
    four = kh.testing.mirrored(devices[:4])
    fit_flags = false_flags_fit(four, args.jitter_steps)
    core_flags = false_flags_core(core_steps)
    print("| no slowdown, +-20% jitter per replica and step | events |")
    print("|---|---:|")
    print(f"| fit, 4 replicas, {args.jitter_steps} steps | {fit_flags} |")
    print(f"| scoring core, 4 replicas, {core_steps} steps | {core_flags} |")
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
