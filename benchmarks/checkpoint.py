"""ElasticCheckpoint overhead, save cost and restore time.

MirroredStrategy over two logical CPUs, an MLP of about 2.4 M parameters
(plus Adam slots: about 29 MB per checkpoint), and a step slowed by
`kh.testing.SimulatedSpeed` to `--step-ms` of SIMULATED device work, so the
ratio reflects a device-bound job rather than this 2-core CPU. Configurations
run alternately in one process (several rounds); we report the median step
time of each, its ratio to no checkpointing, the number of saves, the time a
save blocks training, the background write time, and the restore time.

Run: `python benchmarks/checkpoint.py` (about 5 minutes on 2 cores). "none
(A/A)" repeats "none": the noise between two identical runs. "local copy":
every save also written to `local_directory` (the same disk here).
"""

import datetime
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

GLOBAL_BATCH = 64


def build(strategy, step_seconds, width):
    from keras_hetero import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((256,))
        slow = kh.testing.SimulatedSpeed(step_seconds / (GLOBAL_BATCH / 2))
        hidden = keras.layers.Dense(width, activation="relu")(slow(inputs))
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
        model = kh.HeteroModel(inputs, keras.layers.Dense(10)(hidden))
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def data(strategy, steps):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * steps, 256)).astype("float32")
    y = rng.integers(0, 10, size=(GLOBAL_BATCH * steps,))
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    return kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--mtbf", default="10m")
    parser.add_argument(
        "--width", type=int, default=1024, help="hidden width of the MLP"
    )
    # 12 steps: the "every 10 steps" runs save once.
    args = parse_args(parser, steps=12, rounds=1, step_ms=5.0, width=64)
    devices = kh.testing.logical_cpus(2)
    strategy = kh.testing.mirrored(devices)
    model = build(strategy, args.step_ms / 1000.0, args.width)
    configs = [
        ("none", None),
        ("none (A/A)", None),
        ("async, auto", dict(save_every="auto", async_save=True)),
        ("sync, auto", dict(save_every="auto", async_save=False)),
        ("async, every 10 steps", dict(save_every=10, async_save=True)),
        ("sync, every 10 steps", dict(save_every=10, async_save=False)),
        (
            "async, every 10 steps, local copy",
            dict(save_every=10, async_save=True, local_directory=True),
        ),
    ]
    medians = {name: [] for name, _ in configs}
    saves = {name: [] for name, _ in configs}
    intervals = {}
    root = tempfile.mkdtemp(prefix="kh-ckpt-bench-")
    try:
        for _ in range(args.rounds):
            for name, kwargs in configs:
                timer = kh.testing.StepTimer()
                callbacks = [timer]
                if kwargs is not None:
                    directory = os.path.join(root, name.replace(" ", ""))
                    shutil.rmtree(directory, ignore_errors=True)
                    shutil.rmtree(directory + "-local", ignore_errors=True)
                    if kwargs.get("local_directory"):
                        kwargs = {
                            **kwargs,
                            "local_directory": directory + "-local",
                        }
                    ckpt = kh.callbacks.ElasticCheckpoint(
                        directory, mtbf=args.mtbf, keep=2, **kwargs
                    )
                    callbacks.append(ckpt)
                model.fit(
                    data(strategy, args.steps), verbose=0, callbacks=callbacks
                )
                medians[name].append(float(np.mean(timer.seconds)))
                if kwargs is not None:
                    saves[name] += ckpt.saves
                    intervals[name] = ckpt.interval
        restore = _restore_seconds(strategy, args, root)
        restore_local = _restore_seconds(strategy, args, root, local=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size_mb = (
        sum(int(np.prod(v.shape)) * 4 for v in model.variables) * 3 / 1e6
    )  # weights + two Adam slots
    print(
        f"checkpoint benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on 2 logical CPUs, "
        f"{size_mb:.0f} MB per checkpoint, SIMULATED {args.step_ms:.0f} ms "
        f"device step, {args.steps} steps x {args.rounds} rounds, "
        f"mtbf {args.mtbf}; mean step time incl. saves"
    )
    print()
    print(
        "| checkpointing | mean step | ratio vs none | saves per run | "
        "blocks training per save | write per save | auto interval |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = float(np.median(medians["none"]))
    for name, kwargs in configs:
        step = float(np.median(medians[name]))
        row = [name, f"{1000 * step:.1f} ms", f"{step / base:.3f}"]
        if kwargs is None:
            row += ["-", "-", "-", "-"]
        else:
            done = saves[name]
            blocking = [b for _, b, _ in done if b is not None]
            writes = [w for _, _, w in done if w is not None]
            interval = intervals[name]
            row += [
                f"{len(done) / args.rounds:.1f}",
                f"{1000 * np.median(blocking):.0f} ms",
                f"{1000 * np.median(writes):.0f} ms" if writes else "-",
                "-" if kwargs["save_every"] != "auto" else f"{interval:.0f} s",
            ]
        print("| " + " | ".join(row) + " |")
    print()
    print(
        f"restore (newest valid checkpoint into a fresh model): {restore}; "
        f"from the local copy, the shared directory removed: {restore_local}"
    )


def _restore_seconds(strategy, args, root, local=False):
    directory = os.path.join(root, "restore")
    local_directory = os.path.join(root, "restore-local") if local else None
    shutil.rmtree(directory, ignore_errors=True)
    model = build(strategy, 0.0, args.width)
    model.fit(
        data(strategy, 3),
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(
                directory, save_every=1, local_directory=local_directory
            )
        ],
    )
    if local:
        shutil.rmtree(directory)  # from the local copy alone
    fresh = build(strategy, 0.0, args.width)
    ckpt = kh.callbacks.ElasticCheckpoint(
        directory, save_every=100, local_directory=local_directory
    )
    started = time.perf_counter()
    # What `fit` does before its first step (the HeteroCallback protocol).
    context = kh.callbacks.FitContext(
        model=fresh, input=data(strategy, 3), callbacks=[ckpt], fit_kwargs={}
    )
    undo = ckpt.prepare_fit(context)
    seconds = time.perf_counter() - started
    undo()
    return f"{1000 * seconds:.0f} ms"


if __name__ == "__main__":
    main()
