"""Ops one training step runs, after Grappler: stock vs HeteroModel.

Wall-time ratios on a shared 2-core machine move by 5-10% from run to run
(the A/A rows of benchmarks/overhead.py); this count does not move. It is
what TensorFlow's runtime executes for one step of the train function,
after Grappler's rewrites (constant folding, pruning, inlining), per
device, for the model and data of benchmarks/overhead.py under
MirroredStrategy on `--replicas` logical CPUs. Dataset, send/receive,
argument and constant nodes are left out. At small widths a CPU step is
mostly per-op cost, so the op count is a floor under the step's ratio;
the input pipeline's own work (benchmarks/split_pipeline.py) is not in it.

`--profile` adds the variants of `overhead.py --profile`, each with one
piece of HeteroModel's step switched off: the ops that piece costs.

The count comes from TensorFlow's run metadata (`context.
enable_run_metadata`, a TensorFlow internal used by this benchmark only):
the partition graphs of each function instantiated while it is on.

Run: `python benchmarks/step_ops.py`, `--replicas 4`, `--profile`.
"""

import collections
import contextlib
import datetime
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _harness import compiled_model  # noqa: E402
from _harness import equal_split_batch  # noqa: E402
from _harness import examples as examples_of  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402
from _step_variants import PROFILE  # noqa: E402

import keras_hetero as kh  # noqa: E402

WIDTH = 64  # the op count does not depend on the width
SKIPPED = {"_Recv", "_Send", "_HostRecv", "_HostSend", "_Arg", "_Retval"}
SKIPPED |= {"_DeviceArg", "_DeviceRetval", "NoOp", "Const", "_EagerConst"}


def _step_ops(model, data, patch):
    """`{op type: count}` and `{device: count}` of one train step."""
    from tensorflow.python.eager import context  # TF internal, see above

    class Metadata(kh.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            context.context().enable_run_metadata()

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.metadata = context.context().export_run_metadata()
                context.context().disable_run_metadata()

    recorder = Metadata()
    with patch() if patch else contextlib.nullcontext():
        model.fit(
            data,
            epochs=1,
            steps_per_epoch=2,
            verbose=0,
            shuffle=False,
            callbacks=[recorder],
        )
    kinds, devices = collections.Counter(), collections.Counter()
    for function in recorder.metadata.function_graphs:
        nodes = [n for g in function.partition_graphs for n in g.node]
        # The train function: the one that takes the next input.
        if not any(n.op.startswith("IteratorGetNext") for n in nodes):
            continue
        for node in nodes:
            if node.op in SKIPPED or node.op.endswith("Dataset"):
                continue
            kinds[node.op] += 1
            devices[node.device.rpartition("/")[2]] += 1
    return kinds, devices


def measure(strategy, profile):
    """Rows `(run, ops, ops by device, op types added or removed)`."""
    import tensorflow as tf

    batch = equal_split_batch(strategy.num_replicas_in_sync)
    examples = tf.data.Dataset.from_tensor_slices(examples_of("mlp", batch * 4))

    def shard():
        return kh.data.shard(examples, batch, strategy=strategy)

    runs = {
        "stock": (kh.keras.Model, lambda: examples.batch(batch), None),
        "HeteroModel": (kh.HeteroModel, shard, None),
    }
    if profile:
        for name, (patch, source) in PROFILE.items():
            data = (
                (lambda: examples.batch(batch)) if source == "keras" else shard
            )
            runs[f"HeteroModel, {name}"] = (kh.HeteroModel, data, patch)
    rows, stock = [], None
    for name, (model_class, data, patch) in runs.items():
        model = compiled_model(
            "mlp", model_class, strategy, width=WIDTH, metrics=["accuracy"]
        )
        kinds, devices = _step_ops(model, data(), patch)
        if stock is None:
            stock = kinds
        changed = {
            op: kinds[op] - stock[op]
            for op in sorted(set(kinds) | set(stock))
            if kinds[op] != stock[op]
        }
        rows.append((name, sum(kinds.values()), devices, changed))
    return rows


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    # Two steps per run already: the smoke run is the full one, with the
    # profile variants (whose patches of keras_hetero's internals it checks).
    args = parse_args(parser, profile=True)
    devices = kh.testing.logical_cpus(args.replicas)
    strategy = kh.testing.mirrored(devices)
    print(
        f"step ops benchmark, {datetime.date.today()}, Keras flavour "
        f"{kh.FLAVOUR}, MirroredStrategy on {args.replicas} logical CPUs, "
        f"MLP 64-{WIDTH}-{WIDTH}-10, Adam, one step after Grappler"
    )
    print()
    print(
        "| run | ops per step | ratio to stock | per device | "
        "op types +/- stock |"
    )
    print("|---|---:|---:|---|---|")
    rows = measure(strategy, args.profile)
    stock = rows[0][1]
    for name, total, devices, changed in rows:
        per_device = " / ".join(str(devices[d]) for d in sorted(devices))
        change = ", ".join(f"{op} {n:+d}" for op, n in changed.items())
        print(
            f"| {name} | {total} | {total / stock:.3f} | {per_device} | "
            f"{change or '-'} |"
        )


if __name__ == "__main__":
    main()
