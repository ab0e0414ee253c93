"""Preempted mid-epoch, resumed exactly: ElasticCheckpoint on
scikit-learn's handwritten digits.

A job on two logical CPUs gets SIGTERM in the middle of an epoch, as a
preempted spot machine or `scancel` would send. `ElasticCheckpoint` saves at
the next step boundary and stops `fit`. A fresh model with the same callback
then continues at the first global batch it had not trained: every example
of the interrupted epoch is used exactly once, and the final weights equal
those of a run that was never interrupted.

Run: `python examples/digits_checkpoint.py` (about 30 s on 2 CPU cores).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _digits import accuracy  # noqa: E402
from _digits import compile_for_digits  # noqa: E402
from _digits import examples  # noqa: E402
from _digits import layers  # noqa: E402
from _digits import load  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(2)
GLOBAL_BATCH = 48  # 30 global batches per epoch


class Preemption(keras.callbacks.Callback):
    """Sends this process SIGTERM after train step `at_step`."""

    def __init__(self, at_step):
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.step_stats.step == self.at_step:
            print(f"SIGTERM after step {self.at_step} (epoch 1, mid-epoch)")
            os.kill(os.getpid(), signal.SIGTERM)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--preempt-at-step", type=int, default=40)
    parser.add_argument("--directory", default=None)
    args = parser.parse_args(argv)
    directory = args.directory or os.path.join(tempfile.mkdtemp(), "run1")

    x_train, y_train, x_test, y_test = load()
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    initial_weights = None

    def build():
        nonlocal initial_weights
        with strategy.scope():
            inputs = keras.Input((64,))
            model = compile_for_digits(kh.HeteroModel(inputs, layers(inputs)))
        if initial_weights is None:
            initial_weights = model.get_weights()
        model.set_weights(initial_weights)
        return model

    data = kh.data.shard(
        examples(x_train, y_train), GLOBAL_BATCH, strategy=strategy
    )

    # The reference: the same training, never interrupted.
    reference = build()
    reference.fit(data, epochs=args.epochs, verbose=0)

    # The job that gets preempted. exit_on_signal=False keeps this process
    # alive after the save (by default it exits with status 143, which
    # schedulers and `keras-hetero run` treat as "restart me").
    preempted = build()
    preempted.fit(
        data,
        epochs=args.epochs,
        verbose=0,
        callbacks=[
            Preemption(args.preempt_at_step),
            kh.callbacks.ElasticCheckpoint(
                directory, save_every=10, exit_on_signal=False
            ),
        ],
    )

    # The restarted job: the same code, the same directory.
    model = build()
    checkpoint = kh.callbacks.ElasticCheckpoint(directory, save_every=10)
    history = model.fit(
        data, epochs=args.epochs, verbose=0, callbacks=[checkpoint]
    )
    step = int(os.path.basename(checkpoint.restored_from).split("-")[-1])
    epoch, batch = divmod(step, data.num_batches)
    print(f"resumed at step {step} (epoch {epoch}, global batch {batch})")
    print(f"epochs trained after the restart: {len(history.history['loss'])}")
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), reference.get_weights())
    )
    print(f"max |weight difference| vs the uninterrupted run: {gap:.1e}")
    print(f"held-out accuracy: {accuracy(model, x_test, y_test):.3f}")


if __name__ == "__main__":
    main()
