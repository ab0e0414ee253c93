"""Worker functions for tests/data/test_reproducibility.py (run by
`run_workers`).

Module-level (picklable); TensorFlow is imported only when called.
"""

ROWS = 48
GLOBAL_BATCH = 8


def shuffled_ids_mwms(kind, epochs=2, check=True):
    """Per epoch, the ids this worker's replica trained on, step by step,
    from examples shuffled by `kind`; or `("error", message)` if
    `kh.data.shard` refuses them. `check=False` turns the refusal off (to
    measure what it prevents)."""
    import importlib

    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh

    if not check:
        shard_module = importlib.import_module("keras_hetero.data.shard")
        shard_module._check_same_order_on_workers = lambda dataset: None
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    examples = tf.data.Dataset.range(ROWS)
    if kind == "unseeded":
        examples = examples.shuffle(ROWS)
    elif kind == "seeded_reshuffle":
        examples = examples.shuffle(ROWS, seed=7)
    try:
        dataset = kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)
    except ValueError as error:
        return ("error", str(error))
    seen = []
    for _ in range(epochs):
        epoch = []
        for batch in dataset.as_distributed_dataset():
            local = strategy.experimental_local_results(batch)
            epoch.append([int(i) for part in local for i in np.asarray(part)])
        seen.append(epoch)
    return seen


def random_map_values(kind, passes=2):
    """The values a `map` with a random op of `kind` gives through
    `kh.data.shard`, pass by pass (no strategy: one device)."""
    import numpy as np
    import tensorflow as tf

    import keras_hetero as kh

    examples = tf.data.Dataset.range(ROWS).map(lambda i: tf.cast(i, "float32"))
    if kind == "seeded_op":
        examples = examples.map(lambda x: x + tf.random.uniform([], seed=5))
    elif kind == "generator":
        generator = tf.random.Generator.from_seed(1)
        examples = examples.map(lambda x: x + generator.uniform([]))
    dataset = kh.data.shard(examples, GLOBAL_BATCH)
    return [
        np.concatenate(list(dataset.as_distributed_dataset())).tolist()
        for _ in range(passes)
    ]
