"""Functions that run inside worker processes started by `run_workers`.

They are module-level (picklable) and import TensorFlow only when called.
"""


def train_mwms(
    shares,
    epochs=2,
    sample_weights=False,
    regularizer=False,
    steps_per_execution=1,
    bucket_bytes=None,
):
    """Fit / evaluate / predict a HeteroModel under MultiWorkerMirrored."""
    import tensorflow as tf

    import keras_hetero as kh
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = helpers.hetero_model(
            regularizer=regularizer,
            steps_per_execution=steps_per_execution,
            bucket_bytes=bucket_bytes,
        )
    dataset = kh.data.shard(
        helpers.examples(sample_weights=sample_weights),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    with _ReduceCounter(strategy) as reduces:
        history = model.fit(dataset, epochs=epochs, verbose=0)
    stats = model.step_stats
    evaluation = model.evaluate(
        kh.data.shard(
            helpers.examples(sample_weights=sample_weights),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=shares,
        ),
        return_dict=True,
        verbose=0,
    )
    x, _, _, _ = helpers.arrays()
    predictions = model.predict(x, batch_size=helpers.GLOBAL_BATCH, verbose=0)
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "evaluation": evaluation,
        "predictions": predictions,
        "rows": stats.rows,
        "devices": stats.devices,
        "num_replicas": strategy.num_replicas_in_sync,
        "input_reduces_in_fit": sum(i for i, _ in reduces),
    }


class _ReduceCounter:
    """Counts `strategy.reduce` calls while active, as `(input_lib?,
    metrics?)` pairs: the input's per-step "does every worker have data"
    check (a cross-worker reduction made by tf.distribute's input_lib), or
    a tf-keras metric result read in a merge_call."""

    def __init__(self, strategy):
        self.cls = type(strategy)
        self.reduces = []

    def __enter__(self):
        import traceback

        reduce = self.original = self.cls.reduce
        reduces = self.reduces

        def counted(strategy, *args, **kwargs):
            stack = "".join(traceback.format_stack(limit=40))
            reduces.append(("input_lib" in stack, "metrics_utils" in stack))
            return reduce(strategy, *args, **kwargs)

        self.cls.reduce = counted
        return reduces

    def __exit__(self, *exc):
        self.cls.reduce = self.original


def unknown_length_mwms(shares, steps_per_execution):
    """Fit on examples of unknown length; the weights and steps taken."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import _compat
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = helpers.hetero_model(steps_per_execution=steps_per_execution)
    examples = helpers.examples().filter(lambda x, y: True)
    data = kh.data.shard(
        examples, helpers.GLOBAL_BATCH, strategy=strategy, shares=shares
    )
    # tf-keras needs the epoch length of an unknown-length input.
    kwargs = {"steps_per_epoch": 5} if _compat.IS_LEGACY else {}
    model.fit(data, epochs=2, verbose=0, **kwargs)
    return {
        "weights": model.get_weights(),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def seen_ids_mwms(shares, epochs=1):
    """The example ids each replica of this worker received, per step."""
    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    _, _, _, ids = helpers.arrays()
    examples = tf.data.Dataset.from_tensor_slices(ids)
    dataset = kh.data.shard(
        examples, helpers.GLOBAL_BATCH, strategy=strategy, shares=shares
    )
    seen = []
    for _ in range(epochs):
        for batch in dataset.as_distributed_dataset():
            local = strategy.experimental_local_results(batch)
            seen.append([np.asarray(part).tolist() for part in local])
    return seen


def pss_server(cluster, job, index):
    """A ParameterServerStrategy worker or ps server; runs until killed."""
    import os

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster),
        job_name=job,
        task_index=index,
        protocol="grpc",
        start=True,
    )
    server.join()


def rebalance_mwms(rows):
    """2-worker fit with ShardRebalancer; returns ids seen, decisions, row
    caps and how many warnings said a cap held a replica."""
    import logging

    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    seen = []
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = helpers.id_model(seen, [0.004, 0.0005])
    initial = model.get_weights()
    data = kh.data.shard(helpers.id_examples(rows), 24, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    held = helpers.LogCount("is held at")
    logging.getLogger("keras_hetero").addHandler(held)
    model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])
    return {
        "caps": rebalancer.row_caps,
        "held": held.count,
        "seen": seen,
        "changes": [
            (step, list(start), [round(float(v), 12) for v in shares])
            for step, start, shares in rebalancer.changes
        ],
        "shares": data.shares,
        "initial": initial,
        "weights": model.get_weights(),
    }


def hang_mwms():
    """Worker 1 stalls 8 s before step 6; the watchdog (3 s) reports it."""
    import json
    import os
    import time

    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = helpers.hetero_model()

    class Stall(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if task == 1 and batch == 5:
                time.sleep(8)

    detector = kh.callbacks.StragglerDetector(hang_timeout=3)
    data = kh.data.shard(helpers.examples(rows=160), 16, strategy=strategy)
    model.fit(data, epochs=1, verbose=0, callbacks=[Stall(), detector])
    return {
        "hangs": detector.hangs,
        "steps": int(model.optimizer.iterations.numpy()),
    }


def poisoned_mwms():
    """Worker 1's replica gets an inf gradient at step 3 (float16)."""
    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from keras_hetero.training import state
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    armed = [False]
    with strategy.scope():
        model = helpers.poisoned_model(armed)
    probe = {"snapshot": lambda: helpers.replica_state(strategy, model)}
    data = kh.data.shard(helpers.examples(), 16, strategy=strategy)
    model.fit(data, verbose=0, callbacks=[helpers.Arm(armed, 3, probe)])
    return {
        "unchanged": all(
            np.array_equal(a, b)
            for a, b in zip(probe["before"], probe["after"])
        ),
        "moved_next": any(
            not np.array_equal(a, b)
            for a, b in zip(probe["after"], probe["next"])
        ),
        "finite": all(np.all(np.isfinite(v)) for v in probe["next"]),
        "scales": (probe["scale_before"], probe["scale_after"]),
        "iterations": int(model.optimizer.iterations.numpy()),
        "skipped": int(state.run_state(model).loss_scale.skipped.numpy()),
    }


def observe_mwms(out):
    """2-worker fit with HeteroTensorBoard and RunReport writing to `out`."""
    import os

    import tensorflow as tf

    import keras_hetero as kh
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = helpers.hetero_model()
    data = kh.data.shard(helpers.examples(), 8, strategy=strategy)
    board = kh.callbacks.HeteroTensorBoard(
        os.path.join(out, "logs"), update_freq=2
    )
    report = kh.callbacks.RunReport(os.path.join(out, "report"))
    model.fit(data, epochs=1, verbose=0, callbacks=[board, report])
    return {
        "report": None if report.files is None else report.files.html,
        "rows": model.step_stats.rows.tolist(),
    }


# The array fit of `arrays_mwms`, which tests/data/test_arrays.py repeats on one
# device as the reference: one place, so the two cannot drift apart.
ARRAYS_FIT = dict(
    batch_size=24, epochs=2, shuffle=False, validation_split=0.25, verbose=0
)


def arrays_mwms(rows):
    """Numpy input under MultiWorkerMirrored: a fit in order with sample
    weights, validation_split and ShardRebalancer(), evaluate, predict; a
    shuffled fit; a shuffled kh.data.shard without seed. The workers' random
    states differ on purpose for the shuffled parts."""
    import json
    import os

    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y, weights, ids = helpers.arrays(rows)
    inputs = {"x": x, "id": ids}
    seen = []
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = helpers.id_model(seen, [0.004, 0.0005])
    initial = model.get_weights()
    rebalancer = kh.callbacks.ShardRebalancer(
        every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    history = model.fit(
        inputs, y, sample_weight=weights, callbacks=[rebalancer], **ARRAYS_FIT
    )
    result = {
        "initial": initial,
        "weights": model.get_weights(),
        "history": history.history,
        "changes": len(rebalancer.changes),
        "shares": rebalancer.dataset.shares,
        "evaluate": model.evaluate(
            inputs,
            y,
            sample_weight=weights,
            batch_size=10,
            return_dict=True,
            verbose=0,
        ),
        "predict": model.predict(inputs, batch_size=7, verbose=0),
    }

    np.random.seed(task)
    tf.random.set_seed(task)
    steps = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.clear()

        def on_train_batch_end(self, batch, logs=None):
            steps.append(sorted(seen))

    shuffled = kh.callbacks.ShardRebalancer(
        every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(
        inputs,
        y,
        batch_size=24,
        epochs=2,
        verbose=0,
        callbacks=[shuffled, Steps()],
    )
    result["shuffled_steps"] = steps
    result["seed"] = shuffled.dataset.seed

    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices(ids),
        24,
        strategy=strategy,
        shares=[0.3, 0.7],
        shuffle=10,
    )
    local = []
    for _ in range(2):
        for batch in data.as_distributed_dataset():
            local.append(
                [
                    np.asarray(part).tolist()
                    for part in strategy.experimental_local_results(batch)
                ]
            )
    result["shard_steps"] = local
    return result


def low_communication_mwms(shares, sync_every, outer_sgd_1=False, spe=1):
    """Low-communication training under MultiWorkerMirrored (one replica per
    worker): the weights, evaluation and the round telemetry."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from keras_hetero.training import runtime
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    outer = keras.optimizers.SGD(1.0) if outer_sgd_1 else None
    mode = kh.LowCommunication(sync_every, outer_optimizer=outer)
    with strategy.scope():
        model = kh.HeteroModel(*helpers.layers(), low_communication=mode)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=spe,
        )
        model.set_weights(helpers.initial_weights())

    def data():
        return kh.data.shard(
            helpers.examples(),
            helpers.GLOBAL_BATCH,
            strategy=strategy,
            shares=shares,
        )

    with _ReduceCounter(strategy) as reduces:
        model.fit(data(), epochs=2, verbose=0)
    stats = model.step_stats
    evaluation = model.evaluate(data(), return_dict=True, verbose=0)
    return {
        "input_reduces_in_fit": sum(i for i, _ in reduces),
        "metric_reduces_in_fit": sum(m for _, m in reduces),
        "weights": model.get_weights(),
        "evaluation": evaluation,
        "rows": stats.rows,
        "steps": stats.measured_steps,
        "synchronisations": int(
            runtime.local_training(model).synchronisations.numpy()
        ),
    }


def low_communication_rebalance_mwms(rebalance):
    """Low-communication training on SIMULATED speeds 1 : 3 (worker 1 slow),
    with or without a ShardRebalancer: final shares and the waits at the
    synchronisations of the second half."""
    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        slow = kh.testing.SimulatedSpeed([0.0005, 0.0015])(inputs)
        model = kh.HeteroModel(
            inputs,
            keras.layers.Dense(1)(slow),
            low_communication=kh.LowCommunication(4),
        )
        model.compile(optimizer="sgd", loss="mse")
    data = kh.data.shard(helpers.examples(rows=32 * 48), 32, strategy=strategy)
    waits = []

    class Waits(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stats = self.model.step_stats
            if stats.measured_steps:
                waits.append(stats.wait_seconds.tolist())

    callbacks = [Waits()]
    if rebalance:
        callbacks.append(
            kh.callbacks.ShardRebalancer(
                data, every_n_steps=4, warmup_steps=4, window=8
            )
        )
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    return {
        "shares": [float(s) for s in data.shares],
        "waits": np.mean(waits[len(waits) // 2 :], axis=0).tolist(),
    }


def stop_together_mwms(directory, signalled, at_step, steps_per_execution):
    """2 workers; worker `signalled` alone gets SIGTERM after step `at_step`
    (its ElasticCheckpoint's handler, from a callback), the other never.
    Then, in the same processes, a fresh model resumes from `directory` and
    trains to the end."""
    import json
    import os
    import signal

    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import checkpointing
    from keras_hetero._compat import keras
    from tests.support import helpers

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    class Signal(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if task == signalled and step == at_step:
                os.kill(os.getpid(), signal.SIGTERM)

    def fit(callbacks):
        with strategy.scope():
            model = helpers.hetero_model(
                steps_per_execution=steps_per_execution
            )
        data = kh.data.shard(
            helpers.examples(), helpers.GLOBAL_BATCH, strategy=strategy
        )
        ckpt = kh.callbacks.ElasticCheckpoint(directory, save_every=100)
        try:
            model.fit(data, epochs=2, verbose=0, callbacks=[ckpt, *callbacks])
            code = 0
        except SystemExit as exit:
            code = exit.code
        return model, ckpt, code

    model, ckpt, code = fit([Signal()])
    stopped = {
        "exit_code": code,
        "preempted": ckpt.preempted,
        "step": int(model.optimizer.iterations.numpy()),
        "latest": checkpointing.read_latest(directory),
    }
    model, ckpt, code = fit([])
    return {
        "stopped": stopped,
        "resumed_from": ckpt.restored_from,
        "exit_code": code,
        "weights": model.get_weights(),
    }


def epoch_boundaries_mwms(kind, steps_per_execution, rows):
    """Fits of 3 epochs on `kind` input ("tf.data": shuffled each pass;
    "shard": `kh.data.shard`, shuffled), HeteroModel as it is and with
    Keras' own epoch iterators (`keras_hetero.training.epochs` switched
    off); for each, the running id mean and square after every call, the
    weights, the distributed iterators made and the threads they were
    destroyed on."""
    import threading
    import weakref

    import tensorflow as tf
    from tensorflow.python.distribute import input_lib

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from keras_hetero.training import epochs
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, _, _, ids = helpers.arrays(rows)
    y = (ids / rows).astype("float32")[:, None]
    examples = tf.data.Dataset.from_tensor_slices((x, y))

    def fit():
        keras.utils.set_random_seed(11)
        if kind == "shard":
            data = kh.data.shard(
                examples, 16, strategy=strategy, shuffle=True, seed=4
            )
        else:
            data = examples.shuffle(rows, seed=3).batch(16)
        with strategy.scope():
            inputs = keras.Input((helpers.FEATURES,))
            hidden = keras.layers.Dense(4, activation="tanh")(inputs)
            model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
            wrapper = keras.metrics.MeanMetricWrapper
            model.compile(
                optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                loss="mse",
                metrics=[
                    wrapper(lambda t, p: t, name="id_mean"),
                    wrapper(lambda t, p: t * t, name="id_square"),
                ],
                steps_per_execution=steps_per_execution,
            )
        seen = []

        class Seen(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen.append([float(logs["id_mean"]), float(logs["id_square"])])

        made, destroyed_on = [], []
        classes = (
            input_lib.DistributedDataset,
            input_lib.DistributedDatasetsFromFunction,
        )
        originals = {cls: cls.__iter__ for cls in classes}

        def counting(make):
            def counted(dataset):
                iterator = make(dataset)
                made.append(1)
                weakref.finalize(
                    iterator,
                    lambda: destroyed_on.append(
                        threading.current_thread().name
                    ),
                )
                return iterator

            return counted

        for cls in classes:
            cls.__iter__ = counting(originals[cls])
        try:
            model.fit(data, epochs=3, verbose=0, callbacks=[Seen()])
        finally:
            for cls in classes:
                cls.__iter__ = originals[cls]
        return {
            "seen": seen,
            "weights": model.get_weights(),
            "made": len(made),
            "on_training_thread": destroyed_on.count(
                threading.main_thread().name
            ),
        }

    with epochs.keras_own_epoch_iterators():
        before = fit()
    return {"before": before, "after": fit()}
