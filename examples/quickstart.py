"""Main demo: uneven work for unequal devices, with exact training math.

Three replicas on logical CPUs are made SIMULATED-slow with
`kh.testing.SimulatedSpeed` (relative speeds 1 : 2 : 4). Stock Keras gives
each replica the same rows, so every step waits for the slowest.
`kh.HeteroModel` with `ShardRebalancer` measures each replica's seconds per
row (`model.step_stats`) and splits the global batch in proportion to speed,
while computing exactly the single-device update. In its third epoch
replica 1 is SIMULATED to slow down 10x (a throttled or shared device):
`StragglerDetector` flags it and the rebalancer moves its rows. An
`ElasticCheckpoint` saves every 10 steps meanwhile, and `RunReport` and
`HeteroTensorBoard` record everything.

Run: `make demo` (or `python examples/quickstart.py [--out DIR]`). About a
minute on 2 CPU cores.
"""

import argparse
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import keras  # noqa: E402

DEVICES = kh.testing.logical_cpus(3)
SECONDS_PER_ROW = [0.008, 0.004, 0.002]  # simulated: speeds 1 : 2 : 4
SLOWED = [0.008, 0.04, 0.002]  # simulated: replica 1 10x slower
GLOBAL_BATCH = 42
STEPS_PER_EPOCH = 30
ROWS = GLOBAL_BATCH * STEPS_PER_EPOCH


def make_examples():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y))


def build(model_class):
    inputs = keras.Input((8,))
    slow = kh.testing.SimulatedSpeed(SECONDS_PER_ROW)(inputs)
    hidden = keras.layers.Dense(16, activation="relu")(slow)
    model = model_class(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def ideal(seconds_per_row):
    """Rows per second if every replica were busy all the time."""
    return sum(1.0 / seconds for seconds in seconds_per_row)


class SlowDown(keras.callbacks.Callback):
    """SIMULATES a device slowing down from epoch `epoch` on."""

    def __init__(self, layer, epoch, seconds_per_row):
        super().__init__()
        self.layer, self.epoch = layer, epoch
        self.seconds_per_row = seconds_per_row

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.layer.seconds_per_row = self.seconds_per_row


def stock_run(strategy, examples):
    with strategy.scope():
        model = build(keras.Model)
    timer = kh.testing.StepTimer()
    model.fit(
        examples.batch(GLOBAL_BATCH),
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[timer],
    )
    return GLOBAL_BATCH / timer.median()


def hetero_run(strategy, examples, out):
    with strategy.scope():
        model = build(kh.HeteroModel)
    data = kh.data.shard(examples, GLOBAL_BATCH, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=5)
    detector = kh.callbacks.StragglerDetector(
        # These devices differ 4x by design (relative scores down to 0.25):
        # flag a replica 5x slower than the best one, or 2x slower than its
        # own past.
        relative_threshold=0.2,
        threshold=0.5,
        action="rebalance",
        rebalancer=rebalancer,
    )
    checkpoint = kh.callbacks.ElasticCheckpoint(
        os.path.join(out, "checkpoints"), save_every=10
    )
    report = kh.callbacks.RunReport(os.path.join(out, "report"))
    board = kh.callbacks.HeteroTensorBoard(
        os.path.join(out, "tensorboard"), update_freq=10
    )
    slowdown = SlowDown(model.layers[1], epoch=2, seconds_per_row=SLOWED)
    model.fit(
        data,
        epochs=3,
        verbose=0,
        callbacks=[slowdown, rebalancer, detector, checkpoint, report, board],
    )
    return model, data, report


def epoch_summary(records, epoch):
    """`(samples/s, straggler events, % of the time saves blocked)` of one
    epoch of the run report's records; samples/s from the median step."""
    first, last = epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH
    in_epoch = (records.steps > first) & (records.steps <= last)
    seconds = records.step_seconds[in_epoch]
    events = [
        e
        for e in records.events
        if e.kind == "straggler" and first < e.step <= last
    ]
    blocked = sum(
        blocking
        for step, blocking, _ in records.checkpoints
        if first < step <= last
    )
    rate = GLOBAL_BATCH / np.nanmedian(seconds)
    return rate, len(events), 100 * blocked / np.nansum(seconds)


def single_device_gap(strategy, examples, weights, shares):
    """Max weight difference of HeteroModel vs one device, 5 batches."""
    few = examples.take(GLOBAL_BATCH * 5)
    reference = build(keras.Model)
    reference.layers[1].seconds_per_row = 0.0
    reference.set_weights(weights)
    with strategy.scope():
        check = build(kh.HeteroModel)
    check.set_weights(weights)
    check.fit(
        kh.data.shard(few, GLOBAL_BATCH, strategy=strategy, shares=shares),
        epochs=1,
        verbose=0,
    )
    reference.fit(few.batch(GLOBAL_BATCH), epochs=1, verbose=0, shuffle=False)
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(check.get_weights(), reference.get_weights())
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=os.path.join(tempfile.gettempdir(), "keras-hetero-quickstart"),
        help="directory for the report, TensorBoard logs and checkpoints",
    )
    out = parser.parse_args().out
    for old in ("checkpoints", "tensorboard", "report"):
        shutil.rmtree(os.path.join(out, old), ignore_errors=True)
    examples = make_examples()
    strategy = tf.distribute.MirroredStrategy(DEVICES)

    stock_rate = stock_run(strategy, examples)
    model, data, report = hetero_run(strategy, examples, out)
    weights = model.get_weights()
    records = report.records
    flagged = [e for e in records.events if e.kind == "straggler"]

    print()
    print("keras-hetero demo: 3 replicas, SIMULATED speeds 1 : 2 : 4")
    print(
        f"{'setup':<46}{'samples/s':>10}{'% of ideal':>11}"
        f"{'stragglers':>11}{'ckpt':>7}"
    )
    rows = [("stock keras.Model, equal split", stock_rate, "-", "-")]
    for epoch, name in (
        (1, "kh.HeteroModel + callbacks, epoch 2"),
        (2, "  epoch 3, replica 1 SIMULATED 10x slower"),
    ):
        rate, events, blocked = epoch_summary(records, epoch)
        rows.append((name, rate, str(events), f"{blocked:.1f}%"))
    for (name, rate, stragglers, ckpt), speeds in zip(
        rows, (SECONDS_PER_ROW, SECONDS_PER_ROW, SLOWED)
    ):
        share = 100 * rate / ideal(speeds)
        print(
            f"{name:<46}{rate:>10.0f}{share:>10.0f}%{stragglers:>11}{ckpt:>7}"
        )
    print(
        f"(ideal = sum of replica speeds: {ideal(SECONDS_PER_ROW):.0f} rows/s,"
        f" {ideal(SLOWED):.0f} after the slowdown; simulated)"
    )
    print("stragglers = StragglerDetector events; ckpt = share of the time")
    print("training waited for async ElasticCheckpoint saves (every 10 steps)")
    for event in flagged:
        print(
            f"straggler: replica {event.replica} at step {event.step} "
            f"(relative score {event.relative_score:.2f}, individual "
            f"{event.individual_score:.2f})"
        )
    print(f"final shares: {np.round(data.shares, 3)}  rows: {data.rows}")
    gap = single_device_gap(strategy, examples, weights, data.shares)
    print(f"max |weight difference| vs single-device training: {gap:.1e}")
    print(f"run report: {report.files.html}")
    print(f"            {report.files.png}")
    print(
        f"TensorBoard: tensorboard --logdir {os.path.join(out, 'tensorboard')}"
    )


if __name__ == "__main__":
    main()
