"""Where a multi-worker step's fixed cost goes (MultiWorkerMirroredStrategy).

Two worker processes on 127.0.0.1, each pinned to its own core
(`kh.testing.run_workers(cores="auto")`, no quota: two equal workers), one
logical CPU each, train an MLP on an in-memory input. Every row is one run
of both workers; the figures are worker 0's:

- `step ms`: the median wall time of one step (between consecutive calls of
  Keras' train function, divided by `steps_per_execution`), the first
  `WARMUP` calls left out;
- `in call ms`: the part of it inside the train function (the step's graph:
  compute, collectives, the input's `get_next`); `host ms` the rest
  (Keras' loop, callbacks, logs);
- `collectives`: the cross-worker collective ops one step runs, by type,
  counted from TensorFlow's run metadata (`context.enable_run_metadata`, a
  TensorFlow internal used by this benchmark only) on a separate short fit;
- `fixed ms`: step ms minus the same model's step on one worker alone that
  trains its half of the global batch with no strategy (the `alone` row):
  what being two workers costs per step.

Variants: HeteroModel on `kh.data.shard` (every worker an element for every
step: no per-step "has data" check); HeteroModel on `dataset.batch` (Keras'
own distribution of the input, with tf.distribute's per-step check);
stock `keras.Model` on `dataset.batch` under tf-keras (stock Keras 3 cannot
fit under this strategy, docs/strategies.md); `steps_per_execution=4`;
`CommunicationOptions(bytes_per_pack=1 MiB)` (the gradients all-reduced
in packs of at most that size, several collectives after the backward
pass instead of one).
The second HeteroModel row repeats the first: the A/A spread. A last table
times a bare all-reduce of the gradients' size between the same two
workers: the collective's latency alone.

Run: `python benchmarks/multi_worker_step.py` (Keras 3), then with
`TF_USE_LEGACY_KERAS=1`; `--widths 64 1024`, `--steps 60`; `--smoke`.
"""

import collections
import functools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import bare_allreduce_seconds  # noqa: E402
from _harness import build_model  # noqa: E402
from _harness import compile_model  # noqa: E402
from _harness import examples  # noqa: E402
from _harness import header  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import markdown_table  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

GLOBAL_BATCH = 256
WARMUP = 3
# run name -> (model class, input, steps_per_execution, workers)
VARIANTS = {
    "alone (1 worker, half batch)": ("hetero", "batch", 1, 1),
    "HeteroModel, kh.data.shard": ("hetero", "shard", 1, 2),
    "HeteroModel, kh.data.shard (A/A)": ("hetero", "shard", 1, 2),
    "HeteroModel, dataset.batch": ("hetero", "batch", 1, 2),
    "stock keras.Model, dataset.batch": ("stock", "batch", 1, 2),
    "HeteroModel, kh.data.shard, steps_per_execution=4": (
        "hetero",
        "shard",
        4,
        2,
    ),
    "HeteroModel, kh.data.shard, bytes_per_pack=1 MiB": (
        "hetero-packs",
        "shard",
        1,
        2,
    ),
}
BYTES_PER_PACK = 1 << 20
COLLECTIVE_OPS = ("Collective", "Nccl")


class _CallTimer(kh.keras.callbacks.Callback):
    """Wraps the model's train function: when each call starts, how long
    it takes."""

    def on_train_begin(self, logs=None):
        self.starts, self.inside = [], []
        function = self.model.train_function

        def timed(iterator):
            start = time.perf_counter()
            result = function(iterator)
            self.starts.append(start)
            self.inside.append(time.perf_counter() - start)
            return result

        self.model.train_function = timed


class _Collectives(kh.keras.callbacks.Callback):
    """Collective ops of one train-function call, from the partition graphs
    TensorFlow records when it instantiates the functions of the first
    call."""

    def on_train_begin(self, logs=None):
        from tensorflow.python.eager import context  # TF internal, see above

        self.counts = collections.Counter()
        self.recording = True
        context.context().enable_run_metadata()

    def on_train_batch_end(self, batch, logs=None):
        from tensorflow.python.eager import context

        if not self.recording:
            return
        self.recording = False
        metadata = context.context().export_run_metadata()
        context.context().disable_run_metadata()
        for function in metadata.function_graphs:
            nodes = [n for g in function.partition_graphs for n in g.node]
            # The train function: the one that takes the next input. (The
            # others are eager collectives once per fit or epoch: Keras'
            # metric variables read or reset across workers.)
            if not any(n.op.startswith("IteratorGetNext") for n in nodes):
                continue
            for node in nodes:
                if node.op.startswith(COLLECTIVE_OPS):
                    self.counts[node.op] += 1


def _worker(model_kind, input_kind, steps_per_execution, width, steps):
    import tensorflow as tf

    from keras_hetero import keras

    kh.testing.logical_cpus(1)
    alone = input_kind == "alone"
    strategy = (
        tf.distribute.get_strategy()
        if alone
        else tf.distribute.MultiWorkerMirroredStrategy()
    )
    batch = GLOBAL_BATCH // 2 if alone else GLOBAL_BATCH
    x, y = examples("mlp", batch * 8)
    # Finite, as most users' inputs are: tf.distribute checks at every step
    # whether each worker still has data, unless the input says it does.
    passes = -(-(steps + 2) * steps_per_execution // 8) + 1
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat(passes)
    model_class = keras.Model if model_kind == "stock" else kh.HeteroModel
    if model_kind == "hetero-packs":
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=BYTES_PER_PACK
        )
        model_class = functools.partial(kh.HeteroModel, communication=options)
    with strategy.scope():
        model = compile_model(
            build_model("mlp", model_class, width=width), steps_per_execution
        )

    def data():
        if input_kind == "shard":
            return kh.data.shard(dataset, batch, strategy=strategy)
        return dataset.batch(batch, drop_remainder=True)

    # The count reads the train function's graph: with steps_per_execution
    # > 1 a loop, whose body's collectives run once per step, not per call.
    counter = _Collectives()
    model.fit(
        data(),
        epochs=1,
        steps_per_epoch=2 * steps_per_execution,
        verbose=0,
        callbacks=[counter] if steps_per_execution == 1 else [],
    )
    timer = _CallTimer()
    model.fit(
        data(),
        epochs=1,
        steps_per_epoch=steps * steps_per_execution,
        verbose=0,
        callbacks=[timer],
    )
    starts = np.asarray(timer.starts[WARMUP:])
    inside = np.asarray(timer.inside[WARMUP:-1])
    per_call = np.diff(starts)
    return {
        "step": float(np.median(per_call)) / steps_per_execution,
        "inside": float(np.median(inside)) / steps_per_execution,
        "collectives": dict(counter.counts)
        if steps_per_execution == 1
        else None,
        "weights": int(sum(np.prod(w.shape) for w in model.get_weights())),
    }


def _run(name, width, steps, timeout):
    model_kind, input_kind, steps_per_execution, workers = VARIANTS[name]
    if workers == 1:
        input_kind = "alone"
    results = kh.testing.run_workers(
        _worker,
        workers,
        timeout=timeout,
        args=(model_kind, input_kind, steps_per_execution, width, steps),
        cores="auto",
    )
    return results[0].value


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    args = parse_args(parser, widths=[16], steps=6, rounds=1)
    names = [
        name
        for name in VARIANTS
        if VARIANTS[name][0] != "stock" or kh.FLAVOUR == "tf-keras"
    ]
    print(
        header(
            "multi-worker step cost benchmark",
            f"MultiWorkerMirroredStrategy, 2 worker processes pinned to a "
            f"core each (no quota), global batch {GLOBAL_BATCH}, MLP "
            f"64-W-W-10, Adam, median of {args.steps} steps, best of "
            f"{args.rounds} rounds",
        )
    )
    for width in args.widths:
        results = {}
        for number in range(args.rounds):
            order = names if number % 2 == 0 else names[::-1]
            for name in order:
                result = _run(name, width, args.steps, args.timeout)
                kept = results.get(name)
                if kept is None or result["step"] < kept["step"]:
                    results[name] = result
        alone = results[names[0]]["step"]
        weights = results[names[0]]["weights"]
        print()
        print(f"width {width}: {weights:,} weights ({weights * 4:,} bytes)")
        print()
        rows = []
        for name in names:
            result = results[name]
            if result["collectives"] is None:
                collectives = "as with 1 (the same step in a loop)"
            else:
                collectives = ", ".join(
                    f"{op} {count:g}"
                    for op, count in sorted(result["collectives"].items())
                )
            fixed = (
                "-"
                if name == names[0]
                else f"{(result['step'] - alone) * 1e3:.2f}"
            )
            rows.append(
                (
                    name,
                    f"{result['step'] * 1e3:.2f}",
                    f"{result['inside'] * 1e3:.2f}",
                    f"{(result['step'] - result['inside']) * 1e3:.2f}",
                    fixed,
                    collectives or "-",
                )
            )
        print(
            markdown_table(
                [
                    "run",
                    "step ms",
                    "in call ms",
                    "host ms",
                    "fixed ms",
                    "collectives per step",
                ],
                rows,
            )
        )
        seconds = min(
            kh.testing.run_workers(
                bare_allreduce_seconds,
                2,
                timeout=args.timeout,
                args=([weights], 20),
                cores="auto",
            )[0].value[0]
            for _ in range(args.rounds)
        )
        print()
        print(
            f"bare all-reduce of {weights * 4:,} bytes between the two "
            f"workers: {seconds * 1e3:.2f} ms (median of 20)"
        )
    print()
    print(load_at_end())


if __name__ == "__main__":
    main()
