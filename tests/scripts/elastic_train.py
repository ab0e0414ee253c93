"""A training script for the ElasticCheckpoint / launcher tests.

Run by `keras-hetero run` (MultiWorkerMirroredStrategy from TF_CONFIG) or
directly (MirroredStrategy over two logical CPUs). Appends one JSON line per
train step to `<out>/attempt<restart>-worker<task>.jsonl` with the global
step and the example ids this worker's replicas trained on, and can kill or
signal itself at a given step of the first attempt.
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helpers  # noqa: E402
import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero._compat import keras  # noqa: E402

BATCH = 8
ROWS = 80  # 10 global batches per epoch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", default="2")
    parser.add_argument("--fault-at", type=int, default=0)
    parser.add_argument("--fault-worker", type=int, default=1)
    parser.add_argument("--fault", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--attempt", type=int, default=None)
    args = parser.parse_args()
    multi_worker = "TF_CONFIG" in os.environ
    if not multi_worker:
        kh.testing.logical_cpus(2)
    import tensorflow as tf

    if multi_worker:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
        task = 0
    restart = args.attempt
    if restart is None:
        restart = int(os.environ.get("KERAS_HETERO_RESTART", "0"))
    seen = []
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = helpers.id_model(seen, 0.0)
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, f"attempt{restart}-worker{task}")
    if restart == 0 and task == 0:
        np.savez(prefix + "-initial.npz", *model.get_weights())
    records = open(prefix + ".jsonl", "a", buffering=1)

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            records.write(json.dumps({"step": step, "ids": list(seen)}) + "\n")
            records.flush()
            os.fsync(records.fileno())
            seen.clear()
            if (
                restart == 0
                and task == args.fault_worker
                and step == args.fault_at
            ):
                number = getattr(signal, "SIG" + args.fault)
                os.kill(os.getpid(), number)

    class StopAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if step == args.stop_after:
                self.model.stop_training = True

    save_every = args.save_every
    save_every = int(save_every) if save_every.isdigit() else save_every
    ckpt = kh.callbacks.ElasticCheckpoint(args.ckpt, save_every=save_every)
    data = kh.data.shard(helpers.id_examples(ROWS), BATCH, strategy=strategy)
    callbacks = [ckpt, Record()]
    if args.stop_after:
        callbacks.append(StopAfter())
    model.fit(data, epochs=args.epochs, verbose=0, callbacks=callbacks)
    if task == 0:
        np.savez(prefix + "-final.npz", *model.get_weights())
    print(
        f"worker {task} done at step {int(model.optimizer.iterations.numpy())}"
    )


if __name__ == "__main__":
    main()
