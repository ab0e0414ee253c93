"""Functions that run inside worker processes started by `run_workers` for
tests/data/test_arrow.py.

They are module-level (picklable) and import TensorFlow only when called.
"""


def fit_parquet_ids_mwms(directory, global_batch):
    """2-worker fit from Parquet with ShardRebalancer; ids seen, decisions."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    seen = []
    keras.utils.set_random_seed(3)
    with strategy.scope():
        # SIMULATED speeds: worker 0's replica is 8x slower per row.
        model = helpers.id_model(seen, [0.004, 0.0005])
    initial = model.get_weights()
    examples = kh.data.from_arrow(
        directory, ["x", "id"], label="y", shapes={"y": (1,)}, batch_rows=16
    )
    data = kh.data.shard(examples, global_batch, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])
    return {
        "seen": seen,
        "changes": [
            (step, list(start), [round(float(v), 12) for v in shares])
            for step, start, shares in rebalancer.changes
        ],
        "initial": initial,
        "weights": model.get_weights(),
    }
