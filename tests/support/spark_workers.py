"""The training function that `tests/spark/test_spark.py` runs through
`kh.spark.run`.

Runs in the worker process each Spark barrier task starts (the checkout is
on the executors' `PYTHONPATH`): the suite's small HeteroModel
(`tests.support.helpers`) on the Parquet files Spark wrote, read with
`kh.data.from_arrow`, under MultiWorkerMirroredStrategy from the task's
`TF_CONFIG`.
"""

import json
import os

EPOCHS = 2


def train(data_path, checkpoint_dir=None, fault_at=None):
    """Returns this worker's final weights, history, attempt and the first
    global step the attempt trained.

    With `checkpoint_dir`, a `kh.callbacks.ElasticCheckpoint` every 2 steps
    resumes a restarted stage. With `fault_at`, worker 1 of attempt 0 kills
    its Spark task (the Python worker that started this process) after that
    global step, then itself.
    """
    import signal

    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    attempt = int(os.environ["KERAS_HETERO_RESTART"])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = helpers.hetero_model()
    examples = kh.data.from_arrow(
        data_path,
        "features",
        label="label",
        shapes={"features": (helpers.FEATURES,), "label": (1,)},
    )
    data = kh.data.shard(examples, helpers.GLOBAL_BATCH, strategy=strategy)

    class Fault(keras.callbacks.Callback):
        first_step = None  # the first global step this attempt trained

        def on_train_batch_begin(self, batch, logs=None):
            if self.first_step is None:
                step = int(self.model.optimizer.iterations.numpy())
                self.first_step = step + 1

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if attempt == 0 and index == 1 and step == fault_at:
                os.kill(os.getppid(), signal.SIGKILL)
                os._exit(1)

    fault = Fault()
    callbacks = [fault]
    if checkpoint_dir is not None:
        callbacks.append(
            kh.callbacks.ElasticCheckpoint(
                checkpoint_dir, save_every=2, async_save=False
            )
        )
    history = model.fit(data, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    return {
        "attempt": attempt,
        "first_step": fault.first_step,
        "flavour": kh.FLAVOUR,
        "num_replicas": data.num_replicas,
        "history": history.history,
        "weights": model.get_weights(),
    }
