"""The training script `soak.py` runs under `keras-hetero run`.

Deterministic: a fixed seed, generated examples through `kh.data.shard`
(shuffled with a fixed seed), an MLP, plain SGD, `ElasticCheckpoint` every
`--save-every` steps. Under the launcher (`TF_CONFIG` set) it trains with
MultiWorkerMirroredStrategy; run directly, on one CPU device: the
uninterrupted reference.

It trains until the global step reaches the stop step: `--stop-at`, or the
number the soak writes to `--stop-file` when its time is up (every worker
reads the file at every step, and the soak writes a step far enough ahead
that all of them have read it before they get there, so they all stop at
the same step). Worker 0 appends one JSON line per step to
`<out>/attempt<KERAS_HETERO_RESTART>.jsonl` (the global step and the
seconds from the step's start to its end) and, at the end, saves the
weights to `<out>/final.npz`. Every worker keeps an exactly-once ledger
in `<out>/ledger/` (`kh.testing.Ledger`: the example ids each step
trained), which the soak reads at the end.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

ROWS = 64 * 1024  # --rows: one epoch is rows / --batch steps


def _stop_step(args):
    if args.stop_at:
        return args.stop_at
    try:
        with open(args.stop_file) as f:
            return int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--stop-at", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rows", type=int, default=ROWS)
    args = parser.parse_args()
    multi_worker = "TF_CONFIG" in os.environ
    kh.testing.logical_cpus(1)
    import tensorflow as tf

    if multi_worker:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        strategy = tf.distribute.MirroredStrategy(["CPU:0"])
        task = 0
    attempt = int(os.environ.get("KERAS_HETERO_RESTART", "0"))
    # float64: the rounding differences between all-reduce orders (two
    # workers, one, one device) stay far below the comparison's tolerance,
    # where a step lost or trained twice would not.
    keras.backend.set_floatx("float64")  # both flavours
    keras.utils.set_random_seed(1)
    # The ledger first among the callbacks: a step is in it before a
    # checkpoint holds it.
    ledger = kh.testing.Ledger(os.path.join(args.out, "ledger"))
    with strategy.scope():
        inputs = keras.Input((64,), name="x")
        ids = keras.Input((), dtype="int64", name="id")
        recorded = kh.testing.RecordIds(ledger)([inputs, ids])
        hidden = keras.layers.Dense(args.width, activation="relu")(recorded)
        hidden = keras.layers.Dense(args.width, activation="relu")(hidden)
        model = kh.HeteroModel(
            {"x": inputs, "id": ids}, keras.layers.Dense(10)(hidden)
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 64))
    # Labels a fixed linear map of x gives: a task the MLP learns, where
    # plain SGD converges (on random labels, with Adam, rounding
    # differences grow over thousands of steps).
    teacher = rng.normal(size=(64, 10))
    y = np.argmax(x @ teacher, axis=1).astype("int32")
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices(
            ({"x": x, "id": np.arange(args.rows)}, y)
        ),
        args.batch,
        strategy=strategy,
        shuffle=True,
        seed=0,
    )
    os.makedirs(args.out, exist_ok=True)
    records = None
    if task == 0:
        path = os.path.join(args.out, f"attempt{attempt}.jsonl")
        records = open(path, "a", buffering=1)

    class Soak(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if records is not None:
                seconds = time.perf_counter() - self.started
                records.write(
                    json.dumps({"step": step, "seconds": seconds}) + "\n"
                )
            stop = _stop_step(args)
            if stop and step >= stop:
                self.model.stop_training = True

    callbacks = [ledger, Soak()]
    if args.ckpt:
        callbacks.insert(
            1,
            kh.callbacks.ElasticCheckpoint(
                args.ckpt, save_every=args.save_every
            ),
        )
    # More epochs than any soak lasts: the stop step ends training.
    model.fit(data, epochs=100_000, verbose=0, callbacks=callbacks)
    if task == 0:
        np.savez(os.path.join(args.out, "final.npz"), *model.get_weights())
    step = int(model.optimizer.iterations.numpy())
    print(f"worker {task} done at step {step}", flush=True)


if __name__ == "__main__":
    main()
