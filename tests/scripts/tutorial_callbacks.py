"""TensorFlow's "Multi-worker training with Keras" tutorial, with HeteroModel.

Run by `keras-hetero run` (tests/training/test_keras_callbacks.py). The
tutorial's code path (TF_CONFIG, MultiWorkerMirroredStrategy,
`mnist_setup`-style dataset and CNN, `fit(..., steps_per_epoch=...)` with
Keras' own callbacks) on synthetic 8x8 "images"; the only change is the
model class. Each epoch is one pass over the examples in a fixed order, so a
resumed run sees the same batches as an uninterrupted one.

`--scenario tutorial`: BackupAndRestore, ModelCheckpoint, CSVLogger (and
TensorBoard if the `tensorboard` package is installed) under `--root`;
with `--fault-epoch`, worker `--fault-worker` kills itself (SIGKILL) after
batch 1 of that epoch in the launcher's first attempt.
`--scenario early_stopping`: uneven shares (`kh.data.shard`), validation
data, EarlyStopping, ReduceLROnPlateau and ModelCheckpoint(save_best_only=
True) on a model with (synchronized) BatchNormalization, whose moving
statistics tf-keras keeps sync-on-read: saving them is a collective.

Each worker writes `<out>/worker<i>.json` (what it saw) and
`<out>/worker<i>.npz` (its final weights).
"""

import argparse
import json
import os
import pathlib
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The repository, for `tests.support`.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import launcher  # noqa: E402
from keras_hetero._compat import keras  # noqa: E402

PER_WORKER_BATCH = 16
STEPS_PER_EPOCH = 4
SIDE = 8


def has_tensorboard():
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def mnist_dataset(batch_size, rows):
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(rows, SIDE, SIDE)).astype("float32")
    y = rng.integers(0, 10, size=(rows,)).astype("int64")
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(rows, seed=1, reshuffle_each_iteration=False)
        .repeat()
        .batch(batch_size)
    )


def build_and_compile_cnn_model():
    model = keras.Sequential(
        [
            keras.Input(shape=(SIDE, SIDE)),
            keras.layers.Reshape(target_shape=(SIDE, SIDE, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model = kh.HeteroModel.from_model(model)  # the only change
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        # Momentum: a restore must bring back optimizer slots too.
        optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        metrics=["accuracy"],
    )
    return model


class Record(keras.callbacks.Callback):
    """What this worker's fit did: epochs begun and learning rates."""

    def __init__(self, fault_epoch, fault):
        super().__init__()
        self.epochs, self.learning_rates = [], []
        self.fault_epoch, self.fault = fault_epoch, fault

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        rate = self.model.optimizer.learning_rate
        self.learning_rates.append(float(tf.convert_to_tensor(rate)))

    def on_train_batch_end(self, batch, logs=None):
        if self.fault and self.epochs[-1] == self.fault_epoch and batch == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def watch_writes(root, writes):
    """Records every Python-level file opened for writing under `root`.

    (h5py and TensorFlow's file system write from C; the tests check those
    files' owners in other ways.)
    """
    root = os.path.realpath(root)

    def hook(event, args):
        if event != "open" or not isinstance(args[0], (str, bytes)):
            return
        mode, flags = args[1], args[2]
        writing = (mode and any(c in mode for c in "wax+")) or (
            not mode and flags & (os.O_WRONLY | os.O_RDWR)
        )
        path = os.path.realpath(os.fsdecode(args[0]))
        if writing and path.startswith(root + os.sep):
            writes.append(path)

    sys.addaudithook(hook)


def tutorial(args, strategy, record):
    root = args.root
    os.makedirs(root, exist_ok=True)
    num_workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    global_batch_size = PER_WORKER_BATCH * num_workers
    multi_worker_dataset = mnist_dataset(
        global_batch_size, STEPS_PER_EPOCH * global_batch_size
    )
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    callbacks = [
        keras.callbacks.BackupAndRestore(backup_dir=args.backup_dir),
        keras.callbacks.ModelCheckpoint(
            os.path.join(root, "checkpoints", "{epoch}.keras")
        ),
        keras.callbacks.CSVLogger(os.path.join(root, "log.csv"), append=True),
        record,
    ]
    if has_tensorboard():
        callbacks.append(
            keras.callbacks.TensorBoard(os.path.join(root, "tensorboard"))
        )
    history = multi_worker_model.fit(
        multi_worker_dataset,
        epochs=args.epochs,
        steps_per_epoch=STEPS_PER_EPOCH,
        callbacks=callbacks,
        verbose=0,
    )
    return multi_worker_model, history


def early_stopping(args, strategy, record):
    from tests.support import helpers

    os.makedirs(args.root, exist_ok=True)
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        hidden = keras.layers.BatchNormalization(
            synchronized=True, momentum=0.5
        )(hidden)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    shares = [0.25, 0.75]
    x, y, _, _ = helpers.arrays(rows=96)

    def shard(rows):
        examples = tf.data.Dataset.from_tensor_slices((x[rows], y[rows]))
        return kh.data.shard(examples, 16, strategy=strategy, shares=shares)

    train, validation = shard(slice(0, 64)), shard(slice(64, 96))
    callbacks = [
        keras.callbacks.EarlyStopping(
            monitor="val_loss", min_delta=args.min_delta, patience=2
        ),
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=1, min_delta=0.03
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(args.root, "best.keras"),
            monitor="val_loss",
            save_best_only=True,
        ),
        record,
    ]
    history = model.fit(
        train,
        validation_data=validation,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=0,
    )
    return model, history


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="tutorial")
    parser.add_argument("--root", required=True)
    parser.add_argument("--backup-dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--fault-epoch", type=int, default=None)
    parser.add_argument("--fault-worker", type=int, default=1)
    parser.add_argument("--min-delta", type=float, default=0.0)
    args = parser.parse_args()
    args.backup_dir = args.backup_dir or os.path.join(args.root, "backup")
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    args.backup_dir = args.backup_dir.replace("{task}", str(task))
    writes = []
    watch_writes(args.root, writes)
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    first_attempt = os.environ.get(launcher.RESTART_ENV, "0") == "0"
    record = Record(
        args.fault_epoch,
        fault=args.fault_epoch is not None
        and task == args.fault_worker
        and first_attempt,
    )
    run = {"tutorial": tutorial, "early_stopping": early_stopping}
    model, history = run[args.scenario](args, strategy, record)
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, f"worker{task}")
    np.savez(prefix + ".npz", *model.get_weights())
    with open(prefix + ".json", "w") as f:
        json.dump(
            {
                "pid": os.getpid(),
                "epochs": record.epochs,
                "learning_rates": record.learning_rates,
                "history": {
                    name: [float(value) for value in values]
                    for name, values in history.history.items()
                },
                "writes": writes,
            },
            f,
        )


if __name__ == "__main__":
    main()
