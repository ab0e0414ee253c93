"""One keras-hetero training job, run by `keras-hetero run` or by Ray Train.

`train(config)` is the Ray training function (`TensorflowTrainer`) and, run
as a script (`python ray_workers.py CONFIG_JSON`), the launcher's worker:
HeteroModel over 80 examples, global batch 8 (10 steps per epoch), with
ShardRebalancer and StragglerDetector on replicas simulated at different
speeds, and an ElasticCheckpoint (`kh.ray.ElasticCheckpoint` under Ray).
Keeps an exactly-once ledger in `<out>` (`kh.testing.Ledger`: per train
step, the example ids this worker trained on); attempt 1 is any start that
resumed from a checkpoint. Worker 0 writes the final weights and what the
callbacks saw.

Config keys: `out` (required), `mode` ("ray" or "launcher"), `ckpt`
(launcher), `epochs` (2), `save_every` (2), `fault_at` (0: worker 1 kills
itself with SIGKILL after this step of attempt 0), `stop_after` (0).
"""

import json
import os
import pathlib
import signal
import sys

ROWS, BATCH = 80, 8
SECONDS_PER_ROW = [0.0005, 0.004]  # simulated: replica 1 is 8x slower


def train(config):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if config.get("mode", "ray") == "ray":
        import ray.train

        import keras_hetero.ray

        attempt = 0 if ray.train.get_checkpoint() is None else 1
        checkpoint = keras_hetero.ray.ElasticCheckpoint(
            save_every=config.get("save_every", 2)
        )
    else:
        attempt = int(os.environ.get("KERAS_HETERO_RESTART", "0"))
        checkpoint = kh.callbacks.ElasticCheckpoint(
            config["ckpt"], save_every=config.get("save_every", 2)
        )
    ledger = kh.testing.Ledger(config["out"], attempt=attempt, worker=task)
    keras.utils.set_random_seed(1)
    low_communication = {}
    if config.get("sync_every"):
        low_communication = dict(
            low_communication=kh.LowCommunication(config["sync_every"]),
            momentum=0.9,
        )
    with strategy.scope():
        model = helpers.id_model(
            ledger, list(SECONDS_PER_ROW), **low_communication
        )
    out = config["out"]
    os.makedirs(out, exist_ok=True)
    prefix = os.path.join(out, f"attempt{attempt}-worker{task}")
    if attempt == 0 and task == 0:
        np.savez(prefix + "-initial.npz", *model.get_weights())
    fault_at, stop_after = config.get("fault_at", 0), config.get("stop_after")

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if attempt == 0 and task == 1 and step == fault_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == stop_after:
                self.model.stop_training = True

    data = kh.data.shard(helpers.id_examples(ROWS), BATCH, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    detector = kh.callbacks.StragglerDetector(patience=2, window=3)
    model.fit(
        data,
        epochs=config.get("epochs", 2),
        verbose=0,
        # Low-communication results depend on which replica trains which
        # rows: the measured (timing-dependent) shares would differ between
        # two runs, so those runs keep equal shares.
        callbacks=[
            ledger,  # first: a step is in it before a checkpoint holds it
            *([] if config.get("sync_every") else [rebalancer]),
            detector,
            checkpoint,
            Fault(),
        ],
    )
    if task == 0:
        np.savez(prefix + "-final.npz", *model.get_weights())
        with open(prefix + "-callbacks.json", "w") as f:
            json.dump(
                {
                    "num_replicas": data.num_replicas,
                    "changes": [
                        [float(s) for s in shares]
                        for _, _, shares in rebalancer.changes
                    ],
                    "stragglers": sorted(
                        {
                            e.replica
                            for e in detector.events
                            if e.kind == "straggler"
                        }
                    ),
                    "flavour": kh.FLAVOUR,
                },
                f,
            )


if __name__ == "__main__":
    # The repository, for `tests.support`.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    train(json.loads(sys.argv[1]))
