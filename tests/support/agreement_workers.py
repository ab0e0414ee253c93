"""Worker functions for tests/training/test_agreement.py (run by
`kh.testing.run_workers`; module-level, TensorFlow imported when called)."""


def resolve_auto_precision():
    """`kh.set_precision("auto")` and `HeteroModel(precision="auto")` on
    this worker's (emulated) devices, then an epoch of training."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import devices
    from keras_hetero import precision
    from keras_hetero.training import state
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        policy = kh.set_precision("auto")
        model = helpers.compile_model(
            kh.HeteroModel(*helpers.layers(), precision="auto")
        )
    dataset = kh.data.shard(
        helpers.examples(rows=2 * helpers.GLOBAL_BATCH),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
    )
    history = model.fit(dataset, epochs=1, verbose=0)
    return {
        "set_precision": policy,
        "compute_dtypes": sorted(precision.compute_dtypes(model)),
        "loss_scaling": state.run_state(model).loss_scale is not None,
        "loss": history.history["loss"],
        "devices": [d.model for d in devices.describe_replicas(strategy)],
    }


def exchange_milliseconds(repeats=20):
    """Milliseconds of each of `repeats` exchanges of a `fit` check's
    record (after one warm-up)."""
    import time

    import tensorflow as tf

    from keras_hetero import _agreement
    from keras_hetero.training import agreement
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = helpers.hetero_model()
    dataset = helpers.examples()
    record = {"settings": agreement.fingerprint(model, dataset, {})}
    _agreement.exchange(strategy, record)
    found = []
    for _ in range(repeats):
        start = time.perf_counter()
        agreement.check_fit(model, dataset, {})
        found.append(1000 * (time.perf_counter() - start))
    return found


def mismatched_fits(settings=None):
    """Fits that differ between the workers in one setting each; returns,
    per setting (all, or those named in `settings`), the error `fit`
    raised here (None if it trained)."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero import _compat
    from keras_hetero import _distribute
    from tests.support import helpers

    worker = _distribute.env_task().worker_index
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def shard(global_batch=helpers.GLOBAL_BATCH, features=None, **kwargs):
        examples = helpers.examples()
        if features is not None:
            examples = examples.map(lambda x, y: (x[:features], y))
        return kh.data.shard(
            examples, global_batch, strategy=strategy, **kwargs
        )

    with strategy.scope():
        model = helpers.hetero_model()
        # Built at its first step: its weights' shapes follow the input.
        lazy = helpers.compile_model(
            kh.HeteroSequential(helpers.seeded_layers())
        )
    cases = {
        "steps_per_execution": (model, shard),
        "global batch size": (model, lambda: shard(32 * (1 + worker))),
        "shuffle seed": (model, lambda: shard(shuffle=True, seed=1 + worker)),
        "examples": (lazy, lambda: shard(features=5 - worker)),
        # Settings edited on one host: a rebalancing interval, a callback
        # only one worker has.
        "ShardRebalancer.every_n_steps": (model, shard),
        "callbacks": (model, shard),
    }
    callbacks = {
        "ShardRebalancer.every_n_steps": lambda: [
            kh.callbacks.ShardRebalancer(every_n_steps=5 * (1 + worker))
        ],
        "callbacks": lambda: [kh.callbacks.StragglerDetector()] * worker,
    }
    errors = {}
    compiled_steps_per_execution = None
    for setting, (fitted, dataset) in cases.items():
        if settings is not None and setting not in settings:
            continue
        if setting == "steps_per_execution":
            helpers.compile_model(model, steps_per_execution=1 + worker)
            compiled_steps_per_execution = _compat.steps_per_execution(model)
        try:
            fitted.fit(
                dataset(),
                epochs=1,
                verbose=0,
                callbacks=callbacks.get(setting, list)(),
            )
            errors[setting] = None
        except ValueError as error:
            errors[setting] = str(error)
        if setting == "steps_per_execution":
            helpers.compile_model(model)
    return {
        "errors": errors,
        "built": lazy.built,
        "steps_per_execution": compiled_steps_per_execution,
    }
