"""Gradient compression: bytes on the wire, step time and loss parity.

MirroredStrategy on 2 logical CPUs, an MLP of about 0.4 M parameters, global
batch 64 split 0.75 / 0.25 (uneven on purpose), SGD with momentum. For each
`gradient_compression` (None, "fp16", "bf16") the same model from the same
initial weights trains on the same data:

- bytes per step on the wire: what each replica contributes to the gradient
  all-reduce, computed from the gradient tensors sent (their element counts
  times the wire dtype's size, plus the float32 telemetry vector);
- step time: median over the timed steps, rounds alternating in one process,
  as a ratio to no compression;
- loss parity: final training loss after `--steps` steps, and its relative
  difference from no compression.

On one machine the "wire" is memory, so the step-time column shows the cost
of the casts, not the saving a network or PCIe link would see; the bytes
column is what a real link would carry.

Run: `python benchmarks/precision.py` (about 2 minutes on 2 cores).
"""

import datetime
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import _compat  # noqa: E402
from keras_hetero.training import aggregation  # noqa: E402

GLOBAL_BATCH = 64
FEATURES = 256
CLASSES = 10


def build(strategy, compression, seed=0):
    from keras_hetero import keras

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(512, activation="relu")(inputs)
        hidden = keras.layers.Dense(512, activation="relu")(hidden)
        outputs = keras.layers.Dense(CLASSES)(hidden)
        model = kh.HeteroModel(
            inputs, outputs, gradient_compression=compression
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.02, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def data(strategy, steps):
    import tensorflow as tf

    rng = np.random.default_rng(1)
    x = rng.normal(size=(GLOBAL_BATCH * steps, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int64")
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    return kh.data.shard(
        examples, GLOBAL_BATCH, strategy=strategy, shares=[0.75, 0.25]
    )


def _optimizer_variables(model):
    found = model.optimizer.variables
    return list(found() if callable(found) else found)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_args(parser, steps=4, rounds=1)
    strategy = kh.testing.mirrored(kh.testing.logical_cpus(2))
    settings = (None, "fp16", "bf16")
    models = {name: build(strategy, name) for name in settings}
    initial = models[None].get_weights()
    # Every run starts from the same weights and optimizer state (its
    # iterations, momentum and learning rate as built).
    for model in models.values():
        _compat.build_optimizer(model)
    fresh = {
        name: [np.array(v.numpy()) for v in _optimizer_variables(model)]
        for name, model in models.items()
    }
    medians = {name: [] for name in settings}
    losses = {}
    for _ in range(args.rounds):
        for name in settings:
            model = models[name]
            model.set_weights(initial)
            for variable, value in zip(
                _optimizer_variables(model), fresh[name]
            ):
                variable.assign(value)
            timer = kh.testing.StepTimer()
            history = model.fit(
                data(strategy, args.steps), verbose=0, callbacks=[timer]
            )
            medians[name].append(timer.median())
            losses[name] = history.history["loss"][-1]
    variables = models[None].trainable_variables
    replicas = strategy.num_replicas_in_sync
    print(
        f"precision benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on 2 logical CPUs, "
        f"{sum(int(np.prod(v.shape)) for v in variables):,} parameters, "
        f"global batch {GLOBAL_BATCH} split 0.75/0.25, {args.steps} steps, "
        f"{args.rounds} alternating rounds"
    )
    print()
    print(
        "| gradient_compression | bytes per step on the wire (per replica) "
        "| bytes vs none | step time | step ratio vs none | final loss | "
        "loss vs none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_bytes = aggregation.wire_bytes(variables, None, replicas)
    base_time = float(np.median(medians[None]))
    for name in settings:
        sent = aggregation.wire_bytes(variables, name, replicas)
        step = float(np.median(medians[name]))
        difference = (losses[name] - losses[None]) / losses[None]
        print(
            f"| {name or 'none'} | {sent:,} | {sent / base_bytes:.3f} | "
            f"{1000 * step:.1f} ms | {step / base_time:.3f} | "
            f"{losses[name]:.6f} | {100 * difference:+.4f}% |"
        )


if __name__ == "__main__":
    main()
