"""What the coordinator process of a ParameterServerStrategy test runs.

Module-level functions (picklable for `spawn`); each builds the strategy
from the cluster, runs one scenario and returns plain data.
"""

import os


def run(task, cluster, queue, events, args):
    """Runs `task` and reports `("ok", value)` or `("error", text)`."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    try:
        queue.put(("ok", globals()[task](cluster, events, *args)))
    except BaseException as error:  # report, never hang the test
        import traceback

        queue.put(("error", f"{error!r}\n{traceback.format_exc()}"))


def _strategy(cluster):
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), rpc_layer="grpc"
    )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


def _batched(input_context):
    """Each worker's own repeated copy of the examples, in batches of 8."""
    from tests.support import helpers

    batch = input_context.get_per_replica_batch_size(8)
    return helpers.examples().shuffle(72, seed=1).batch(batch)


def _model(strategy, slow=None, steps_per_execution=1):
    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    with strategy.scope():
        inputs = keras.Input((helpers.FEATURES,))
        hidden = inputs
        if slow is not None:
            hidden = kh.testing.SimulatedSpeed(slow)(hidden)
        hidden = keras.layers.Dense(4, activation="tanh")(hidden)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    return model


def fit_evaluate_save(cluster, events, directory):
    """fit (2 epochs of 5 steps, then steps_per_execution=2), evaluate,
    save and load; per-worker telemetry."""
    import numpy as np

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from keras_hetero.training import state
    from tests.support import helpers

    strategy = _strategy(cluster)
    model = _model(strategy)
    before = model.evaluate(_batched, steps=9, return_dict=True, verbose=0)
    history = model.fit(_batched, epochs=2, steps_per_epoch=10, verbose=0)
    stats = model.step_stats
    per_worker = state.run_state(
        model
    ).parameter_server.telemetry.steps_per_worker
    evaluation = model.evaluate(_batched, steps=9, return_dict=True, verbose=0)
    as_list = model.evaluate(_batched, steps=2, verbose=0)
    x, _, _, _ = helpers.arrays(rows=8)
    path = os.path.join(directory, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    twice = _model(strategy, steps_per_execution=2)
    twice.fit(_batched, epochs=1, steps_per_epoch=6, verbose=0)
    return {
        "loss": history.history["loss"],
        "mae": history.history["mae"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "before": before,
        "evaluation": evaluation,
        "as_list": as_list,
        "devices": stats.devices,
        "steps_per_worker": per_worker.tolist(),
        "loaded_predictions": np.asarray(loaded(x)).tolist(),
        "model_predictions": np.asarray(model(x)).tolist(),
        "predict": model.predict(x, batch_size=3, verbose=0).tolist(),
        "loaded_type": type(loaded).__name__,
        "twice_iterations": int(twice.optimizer.iterations.numpy()),
        "flavour": kh.FLAVOUR,
    }


def sharded_input(cluster, events):
    """`kh.data.shard` (shuffled) as fit / evaluate input: one global batch
    per step, every global batch's rows once per pass of both workers."""
    import keras_hetero as kh
    from keras_hetero.training import state
    from tests.support import helpers

    strategy = _strategy(cluster)
    model = _model(strategy)

    def dataset():
        return kh.data.shard(
            helpers.examples(), 16, strategy=strategy, shuffle=True, seed=9
        )

    before = model.evaluate(dataset(), return_dict=True, verbose=0)
    history = model.fit(dataset(), epochs=3, verbose=0)
    telemetry = state.run_state(model).parameter_server.telemetry
    after = model.evaluate(dataset(), return_dict=True, verbose=0)
    return {
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "before": before["loss"],
        "after": after["loss"],
        "steps_per_worker": telemetry.steps_per_worker.tolist(),
        "rows": model.step_stats.rows.tolist(),
    }


def slow_worker(cluster, events):
    """Worker 1 is 20x slower (simulated): flagged, and does fewer steps."""
    import keras_hetero as kh
    from keras_hetero.training import state

    strategy = _strategy(cluster)
    model = _model(
        strategy,
        slow={"/job:worker/task:0": 0.0005, "/job:worker/task:1": 0.01},
    )
    detector = kh.callbacks.StragglerDetector(window=5, patience=2)
    model.fit(
        _batched, epochs=1, steps_per_epoch=60, verbose=0, callbacks=[detector]
    )
    telemetry = state.run_state(model).parameter_server.telemetry
    per_worker = telemetry.steps_per_worker
    return {
        "seconds_per_worker": telemetry.seconds_per_worker.tolist(),
        "events": [
            (e.kind, e.worker, e.replica, e.device, e.relative_score)
            for e in detector.events
        ],
        "steps_per_worker": per_worker.tolist(),
    }


def _fault_at_step_8(cluster, events, ask, steps_per_epoch, slow):
    """Two epochs; at step 8 puts `ask` and waits for the test's answer
    (the fault is in place), epoch 1 waits for the test's next message
    (the worker is back). Returns the model, its runner, the history and
    the per-worker steps at the fault and at epoch 0's end, with times."""
    import time

    from keras_hetero._compat import keras
    from keras_hetero.training import runtime

    strategy = _strategy(cluster)
    model = _model(strategy, slow=slow)
    marks = {}

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 7 and "fault" not in marks:
                events.put(ask)
                events.get(timeout=60)  # the fault is in place
                marks["fault"] = time.monotonic()
                marks["at_fault"] = runner.telemetry.steps_per_worker.copy()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                marks["epoch0_end"] = time.monotonic()
                marks["at_epoch0_end"] = (
                    runner.telemetry.steps_per_worker.copy()
                )

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                events.get(timeout=120)  # the worker is back
                time.sleep(3)  # the coordinator reconnects to it

    runner = runtime.parameter_server(model)
    history = model.fit(
        _batched,
        epochs=2,
        steps_per_epoch=steps_per_epoch,
        verbose=0,
        callbacks=[Fault()],
    )
    return model, runner.telemetry, history, marks


def _fault_result(model, telemetry, history):
    import numpy as np

    import keras_hetero as kh

    return {
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "steps_per_worker": telemetry.steps_per_worker.tolist(),
        "unattributed_steps": telemetry.unattributed_steps,
        "finite": bool(
            all(np.all(np.isfinite(w)) for w in model.get_weights())
        ),
        "flavour": kh.FLAVOUR,
    }


def killed_worker(cluster, events):
    """At step 8 asks the test to kill and restart worker 1; fit goes on,
    and in epoch 2 the restarted worker takes steps again."""
    model, telemetry, history, marks = _fault_at_step_8(
        cluster, events, "kill", steps_per_epoch=15, slow=0.001
    )
    result = _fault_result(model, telemetry, history)
    result["after_kill"] = (
        telemetry.steps_per_worker - marks["at_fault"]
    ).tolist()
    return result


def cut_worker(cluster, events):
    """At step 8 asks the test to cut worker 1's link (it stays cut while
    epoch 0 goes on); epoch 1 waits until the test restored it. Returns
    the per-worker steps and the seconds epoch 0 took after the cut."""
    model, telemetry, history, marks = _fault_at_step_8(
        cluster, events, "cut", steps_per_epoch=30, slow=0.002
    )
    result = _fault_result(model, telemetry, history)
    result["at_epoch0_end"] = marks["at_epoch0_end"].tolist()
    result["epoch0_after_cut"] = marks["epoch0_end"] - marks["fault"]
    return result


def checkpoint_resume(cluster, events, directory, steps_per_execution=1):
    """Stops after step 6 (the checkpoint saves it); a fresh model resumes
    there: epoch 0 step 6, the saved weights and optimizer step."""
    import numpy as np

    import keras_hetero as kh
    from keras_hetero._compat import keras

    strategy = _strategy(cluster)

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                self.model.stop_training = True

    first = _model(strategy, steps_per_execution=steps_per_execution)
    first.fit(
        _batched,
        epochs=2,
        steps_per_epoch=10,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(directory, save_every=4),
            StopAt(),
        ],
    )
    saved = [np.array(w) for w in first.get_weights()]
    restored = {}

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            restored["weights"] = [
                np.array(w) for w in self.model.get_weights()
            ]
            restored["iterations"] = int(
                self.model.optimizer.iterations.numpy()
            )

        def on_train_batch_begin(self, batch, logs=None):
            restored.setdefault("first_batch", batch)

        def on_epoch_begin(self, epoch, logs=None):
            restored.setdefault("first_epoch", epoch)

    second = _model(strategy, steps_per_execution=steps_per_execution)
    checkpoint = kh.callbacks.ElasticCheckpoint(directory, save_every=4)
    second.fit(
        _batched,
        epochs=2,
        steps_per_epoch=10,
        verbose=0,
        callbacks=[checkpoint, Probe()],
    )
    return {
        "same_weights": all(
            np.array_equal(a, b) for a, b in zip(saved, restored["weights"])
        ),
        "restored_iterations": restored["iterations"],
        "first_epoch": restored["first_epoch"],
        "first_batch": restored["first_batch"],
        "final_iterations": int(second.optimizer.iterations.numpy()),
        "restored_from": str(checkpoint.restored_from),
    }


def keras_callbacks_resume(cluster, events, directory):
    """Keras' BackupAndRestore, ModelCheckpoint and CSVLogger on the
    coordinator: a fit interrupted at epoch 2 (an error, as in Keras'
    BackupAndRestore example) and run again resumes at epoch 2."""
    import os

    from keras_hetero._compat import keras

    strategy = _strategy(cluster)
    begun = []

    class Interrupt(keras.callbacks.Callback):
        def __init__(self, at):
            super().__init__()
            self.at = at

        def on_epoch_begin(self, epoch, logs=None):
            begun.append(epoch)
            if epoch == self.at:
                raise RuntimeError("Interrupting!")

    def fit(interrupt_at):
        model = _model(strategy)
        callbacks = [
            keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
            keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "checkpoints", "{epoch}.keras")
            ),
            keras.callbacks.CSVLogger(
                os.path.join(directory, "log.csv"), append=True
            ),
            Interrupt(interrupt_at),
        ]
        model.fit(
            _batched,
            epochs=4,
            steps_per_epoch=5,
            verbose=0,
            callbacks=callbacks,
        )
        return model

    try:
        fit(interrupt_at=2)
    except RuntimeError:
        pass
    interrupted = list(begun)
    model = fit(interrupt_at=None)
    with open(os.path.join(directory, "log.csv")) as f:
        logged = [line.split(",")[0] for line in f.read().splitlines()[1:]]
    return {
        "interrupted": interrupted,
        "resumed": begun[len(interrupted) :],
        "iterations": int(model.optimizer.iterations.numpy()),
        "files": sorted(
            os.path.relpath(os.path.join(parent, name), directory)
            for parent, _, names in os.walk(directory)
            for name in names
        ),
        "logged_epochs": logged,
    }
