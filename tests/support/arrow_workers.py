"""Functions that run inside worker processes started by `run_workers` for
tests/data/test_arrow.py.

They are module-level (picklable) and import TensorFlow only when called.
"""


def fit_parquet_ids_mwms(directory, global_batch, reads="all"):
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
    data = kh.data.shard(examples, global_batch, strategy=strategy, reads=reads)
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
        "steps": _replica_rows_per_step(data),
        "read": data.reads_done,
    }


def _replica_rows_per_step(data):
    """Rows per replica of every global batch trained, epoch by epoch:
    a pass per epoch (Keras 3) or one pass numbered on (tf-keras)."""
    from keras_hetero.data import shares as shares_lib

    per_pass, batches = data.num_examples, data.num_batches
    if data.passes_started > 1:
        positions = [
            [(number, index) for index in range(batches)]
            for number in range(data.passes_started)
        ]
    else:
        total = data.position[1]
        positions = [
            [(0, index) for index in range(start, start + batches)]
            for start in range(0, total, batches)
        ]
    return [
        [
            shares_lib.rows_from_shares(
                data.shares_for_batch(position),
                min(
                    data.global_batch_size,
                    per_pass - step * data.global_batch_size,
                ),
            ).tolist()
            for step, position in enumerate(epoch)
        ]
        for epoch in positions
    ]


def parse_id_records(records):
    """`map_fn` for `write_id_tfrecords`' records: ({"x", "id"}, y)."""
    import tensorflow as tf

    from tests.support import helpers

    parsed = tf.io.parse_example(
        records,
        {
            "x": tf.io.FixedLenFeature([helpers.FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([1], tf.float32),
            "id": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    return {"x": parsed["x"], "id": parsed["id"]}, parsed["y"]


def write_id_tfrecords(directory, rows, files):
    """helpers.arrays(rows) as `files` TFRecord files of tf.train.Examples."""
    import os

    import numpy as np
    import tensorflow as tf

    from tests.support import helpers

    os.makedirs(directory, exist_ok=True)
    x, y, _, ids = helpers.arrays(rows)
    paths = []
    for number, part in enumerate(np.array_split(np.arange(rows), files)):
        path = os.path.join(directory, f"part-{number:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in part:
                feature = {
                    "x": tf.train.Feature(
                        float_list=tf.train.FloatList(value=x[row])
                    ),
                    "y": tf.train.Feature(
                        float_list=tf.train.FloatList(value=y[row])
                    ),
                    "id": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[ids[row]])
                    ),
                }
                example = tf.train.Example(
                    features=tf.train.Features(feature=feature)
                )
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def fit_tfrecord_ids_mwms(directory, global_batch, records_per_block):
    """2-worker fit from indexed TFRecords with reads="own" and moving
    shares (ShardRebalancer): ids seen, rows per step, reads."""
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
    records = kh.data.from_tfrecords(
        directory, records_per_block=records_per_block
    )
    data = kh.data.shard(
        records,
        global_batch,
        strategy=strategy,
        reads="own",
        map_fn=parse_id_records,
    )
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[rebalancer])
    return {
        "seen": seen,
        "changes": len(rebalancer.changes),
        "read": data.reads_done,
    }


def fit_service_ids_mwms(address, ledger_folder, rows, global_batch):
    """2-worker fit from a tf.data service with ShardRebalancer and an
    exactly-once ledger: decisions, weights, rows received per pass."""
    import tensorflow as tf

    import keras_hetero as kh
    from keras_hetero._compat import keras
    from tests.support import helpers

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ledger = kh.testing.Ledger(ledger_folder)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        # SIMULATED speeds: worker 0's replica is 8x slower per row.
        model = helpers.id_model(ledger, [0.004, 0.0005])
    initial = model.get_weights()
    data = kh.data.shard(
        helpers.id_examples(rows),
        global_batch,
        strategy=strategy,
        service=address,
    )
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=2, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[ledger, rebalancer])
    return {
        "changes": [
            (step, [round(float(v), 12) for v in shares])
            for step, _, shares in rebalancer.changes
        ],
        "initial": initial,
        "weights": model.get_weights(),
        "read": data.reads_done,
    }
