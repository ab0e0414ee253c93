"""Shared pieces of the benchmarks: the command line, models, synthetic
data, strategies, alternating rounds and tables.

Three model kinds, each small enough for a 2-core machine and each a shape
users train: an MLP, a small ResNet on CIFAR-shaped images and a small
Transformer encoder on token sequences. The data is generated (no dataset
downloads); labels are 10 classes.

Every script reads its command line with `smoke_parser` and `parse_args`,
so each has `--smoke`: tiny sizes, one or two rounds, the same tables, in
seconds. `make bench-smoke` runs them all (as CI does), so a script that no
longer runs fails there rather than when someone next measures; its figures
mean nothing.
"""

import argparse
import datetime
import os
import time

import numpy as np

MODELS = ("mlp", "resnet", "transformer")
# Global batch per model: steps of tens of milliseconds on one core.
GLOBAL_BATCH = {"mlp": 1024, "resnet": 64, "transformer": 128}
# The per-step cost benchmarks' MLP batch (overhead.py, interleaved.py,
# step_ops.py, split_pipeline.py): steps of a few milliseconds, where the
# host's work per step shows.
STEP_COST_BATCH = 256


def smoke_parser(description):
    """An `argparse.ArgumentParser` with `--smoke`; read it with
    `parse_args`, which applies the script's smoke sizes."""
    result = argparse.ArgumentParser(description=description)
    result.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes and few rounds, in seconds: checks that the script "
        "runs (make bench-smoke); its figures mean nothing",
    )
    return result


def parse_args(parser, **smoke):
    """The command line's arguments; under `--smoke` the `smoke` values
    replace the defaults (options given on the command line still win, so
    `--smoke --workers 2` smoke-tests the multi-worker path)."""
    known, _ = parser.parse_known_args()
    if known.smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args()


def build_model(kind, model_class, *, width=256):
    """An uncompiled `kind` model made with `model_class(inputs, outputs)`
    (`kh.HeteroModel` or the flavour's `keras.Model`), under the caller's
    strategy scope."""
    from keras_hetero import keras

    layers = keras.layers
    if kind == "mlp":
        inputs = keras.Input((64,))
        hidden = layers.Dense(width, activation="relu")(inputs)
        hidden = layers.Dense(width, activation="relu")(hidden)
        outputs = layers.Dense(10)(hidden)
    elif kind == "resnet":
        # Two residual stages (16 and 32 filters), CIFAR-shaped input.
        inputs = keras.Input((32, 32, 3))
        hidden = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
        for filters, stride in ((16, 1), (32, 2)):
            shortcut = hidden
            hidden = layers.Conv2D(
                filters, 3, strides=stride, padding="same", activation="relu"
            )(hidden)
            hidden = layers.Conv2D(filters, 3, padding="same")(hidden)
            if stride != 1 or shortcut.shape[-1] != filters:
                shortcut = layers.Conv2D(filters, 1, strides=stride)(shortcut)
            hidden = layers.Activation("relu")(layers.Add()([hidden, shortcut]))
        hidden = layers.GlobalAveragePooling2D()(hidden)
        outputs = layers.Dense(10)(hidden)
    elif kind == "transformer":
        # One encoder block: 32 tokens, 64 dimensions, 4 heads.
        inputs = keras.Input((32,), dtype="int32")
        hidden = layers.Embedding(1000, 64)(inputs)
        attended = layers.MultiHeadAttention(num_heads=4, key_dim=16)(
            hidden, hidden
        )
        hidden = layers.LayerNormalization()(layers.Add()([hidden, attended]))
        forward = layers.Dense(128, activation="relu")(hidden)
        forward = layers.Dense(64)(forward)
        hidden = layers.LayerNormalization()(layers.Add()([hidden, forward]))
        hidden = layers.GlobalAveragePooling1D()(hidden)
        outputs = layers.Dense(10)(hidden)
    else:
        raise ValueError(
            f"Invalid value for argument `kind`. Received: kind={kind!r}. "
            f"Expected one of {MODELS}."
        )
    return model_class(inputs, outputs)


def compile_model(model, steps_per_execution=1, metrics=None):
    from keras_hetero import keras

    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
        steps_per_execution=steps_per_execution,
    )
    return model


def compiled_model(
    kind,
    model_class,
    strategy,
    *,
    width=256,
    steps_per_execution=1,
    metrics=None,
):
    """`build_model` and `compile_model` under `strategy`'s scope."""
    with strategy.scope():
        model = build_model(kind, model_class, width=width)
        return compile_model(model, steps_per_execution, metrics)


def examples(kind, rows, seed=0):
    """`(x, y)` numpy arrays of `rows` synthetic examples for `kind`."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size=rows).astype("int32")
    if kind == "mlp":
        x = rng.normal(size=(rows, 64)).astype("float32")
    elif kind == "resnet":
        x = rng.random((rows, 32, 32, 3), dtype=np.float32)
    elif kind == "transformer":
        x = rng.integers(0, 1000, size=(rows, 32)).astype("int32")
    else:
        raise ValueError(f"Unknown model kind {kind!r}; expected {MODELS}.")
    return x, y


def equal_split_batch(replicas, batch=STEP_COST_BATCH):
    """`batch`, or the multiple of `replicas` below it: stock Keras 3 needs
    a global batch that splits equally."""
    return batch - batch % replicas


def stock_runs(strategy, steps_per_execution):
    """Whether stock `keras.Model.fit` works here (docs/strategies.md).

    Stock Keras 3 cannot fit under MultiWorkerMirroredStrategy, nor with
    `steps_per_execution > 1` under any strategy with several replicas.
    """
    import tensorflow as tf

    import keras_hetero as kh

    return kh.FLAVOUR == "tf-keras" or not (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        or steps_per_execution > 1
    )


def where(workers, replicas):
    """The strategy, as the tables' titles name it."""
    if workers:
        return (
            f"MultiWorkerMirroredStrategy, {workers} worker processes "
            "(1 logical CPU each, 127.0.0.1)"
        )
    return f"MirroredStrategy on {replicas} logical CPUs"


def mwms_strategy():
    """In a worker process: one logical CPU, MultiWorkerMirroredStrategy."""
    import keras_hetero as kh

    kh.testing.logical_cpus(1)
    import tensorflow as tf

    return tf.distribute.MultiWorkerMirroredStrategy()


def lines_on(workers, replicas, table, args, worker, timeout=590):
    """`table(strategy, *args)`'s lines: with `workers`, worker 0's
    `worker(*args)` in that many worker processes (which build their
    strategy with `mwms_strategy`, and are stopped after `timeout`
    seconds); else under MirroredStrategy on `replicas` logical CPUs of
    this process."""
    import keras_hetero as kh

    if workers:
        results = kh.testing.run_workers(
            worker, workers, timeout=timeout, args=args
        )
        return results[0].value
    devices = kh.testing.logical_cpus(replicas)
    return table(kh.testing.mirrored(devices), *args)


def bare_allreduce_seconds(sizes, repeats, warmup=3):
    """In each of the workers (`kh.testing.run_workers`; MultiWorkerMirrored
    with TensorFlow's own thread pools): the median seconds of a bare
    all-reduce between them of each of `sizes` float32 values
    (a `tf.function` of one `ReplicaContext.all_reduce` and its read-back):
    the collective's own cost, with no model around it."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    @tf.function(reduce_retracing=True)
    def allreduce(value):
        def replica():
            context = tf.distribute.get_replica_context()
            return context.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.identity(value)
            )

        return strategy.run(replica)

    medians = []
    for size in sizes:
        value = np.ones([size], np.float32)
        seconds = []
        for _ in range(repeats + warmup):
            start = time.perf_counter()
            strategy.experimental_local_results(allreduce(value))[0].numpy()
            seconds.append(time.perf_counter() - start)
        medians.append(float(np.median(seconds[warmup:])))
    # The last collective's peer may still be reading from this worker:
    # leaving at once can reset its connection ("Socket closed").
    time.sleep(1.0)
    return medians


def round_order(names, number):
    """The runs of round `number` in turn: every other round reversed, so
    no run keeps the position after another (a bias of its own)."""
    return list(names) if number % 2 == 0 else list(names)[::-1]


def quartiles(values):
    """The 25th and 75th percentiles of `values`: the spread of the rounds'
    ratios to the baseline. A difference between two rows smaller than
    this is not resolved by the run (the A/A row shows it for stock)."""
    return tuple(float(q) for q in np.percentile(values, [25, 75]))


def header(title, details):
    """The first line every benchmark prints: what, when, on what."""
    import keras_hetero as kh

    load = os.getloadavg()[0]
    return (
        f"{title}, {datetime.date.today()}, Keras flavour {kh.FLAVOUR}, "
        f"{details}, load average at start {load:.1f} on "
        f"{os.cpu_count()} cores"
    )


def load_at_end():
    """The last line of a benchmark's output."""
    return f"load average at end {os.getloadavg()[0]:.1f}"


def markdown_table(columns, rows):
    """A markdown table, numeric columns (by the first row) right-aligned."""
    aligns = ["---:" if _numeric(cell) else "---" for cell in rows[0]]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(aligns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def _numeric(cell):
    try:
        float(str(cell).rstrip("%x").replace(",", ""))
    except ValueError:
        return False
    return True
