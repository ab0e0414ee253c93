"""Rebalancing and straggler detection on REAL unequal devices (CPU quotas).

No simulation: MultiWorkerMirroredStrategy worker processes on 127.0.0.1,
each pinned to a core (`kh.testing.run_workers(cores="auto")`) and capped at
a fraction of it by a Linux cgroup CPU quota (`kh.testing.CpuQuota`; root).
`--throttle process` caps the whole worker (a slow host: its collective and
gRPC threads too); `--throttle compute` only TensorFlow's kernel threads (a
slow accelerator on a normal host).

Rebalance table: for each model (an MLP, a small ResNet on 32x32x3 images,
a small Transformer encoder) and each capacity mix (2 workers 1:2 and 1:4,
3 workers 1:2:4, and the A/A pair 1:1 with nothing to balance), samples/s of
HeteroModel with equal shares, HeteroModel with `ShardRebalancer`, and,
under tf-keras, stock `keras.Model` (stock Keras 3 cannot fit under
MultiWorkerMirroredStrategy). Rates are steady state: the median step time
of the last `--tail` steps of one epoch (the epoch boundary excluded). The
ideal is measured: each worker's quota and core alone, one process training
the whole global batch; ideal = the sum of those rates.

Input table (`--tables input`): the rebalanced pair of `--input-model`
(the ResNet by default) on capacities 1:2, its input from memory (twice:
the A/A row) and from files, each worker reading only its own blocks
(`kh.data.shard(reads="own")`): Parquet through `kh.data.from_arrow`, and
indexed TFRecords through `kh.data.from_tfrecords` parsed in `map_fn`
(float32 pixels, as in memory; memory holds the same rows). Rounds
alternate the sources. Then, in the
benchmark's own process (both cores, no quota): each input pipeline alone
(`kh.data.shard` over the source, a whole pass consumed by
`Dataset.reduce`, no model) in rows/s, against the same model trained
alone in one process on input from memory: above 1, the input delivers
rows faster than the model trains them.

Straggler table: two equal workers (no cap) train for `--straggler-steps`
steps; before step `--drop-at` worker 1's quota drops to `--drop-to` of its
core (`kh.testing.ThrottleAt`). We report the steps from the drop to
`StragglerDetector`'s event naming worker 1's replica, and every other event
(false alarms), with its defaults.

Run as root: `python benchmarks/real_devices.py` (Keras 3), then with
`TF_USE_LEGACY_KERAS=1`; `--models mlp --cases 1:2` for one row; `--smoke`
runs one tiny case of each table in seconds.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import GLOBAL_BATCH  # noqa: E402
from _harness import MODELS  # noqa: E402
from _harness import build_model  # noqa: E402
from _harness import compile_model  # noqa: E402
from _harness import examples  # noqa: E402
from _harness import header  # noqa: E402
from _harness import markdown_table  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import smoke_parser  # noqa: E402

import keras_hetero as kh  # noqa: E402

# name -> each worker's cap (a fraction of its core); cores round robin.
CASES = {
    "1:1 (A/A)": [1.0, 1.0],
    "1:2": [1.0, 0.5],
    "1:4": [1.0, 0.25],
    "1:2:4 (3 workers)": [0.5, 1.0, 0.25],  # cores 0, 1, 0
}
DISTINCT_BATCHES = 8  # the input repeats this many distinct global batches
# The straggler table's MLP: compute-bound steps (tens of ms per worker), so
# a quota drop slows the worker's compute. (With steps of a millisecond or
# two the capped worker computes within its quota while it waits for the
# collective, and nothing is slower: no straggler to find.)
STRAGGLER_BATCH = 8192


def _task_index():
    return json.loads(os.environ.get("TF_CONFIG", "{}"))["task"]["index"]


def _train(
    model_kind,
    mode,
    steps,
    throttle,
    callbacks=(),
    global_batch=None,
    source=None,
):
    """One fit of `steps` steps on this worker; returns what worker 0 keeps.

    `mode`: "equal" / "rebalanced" (HeteroModel on `kh.data.shard`) or
    "stock" (the flavour's keras.Model on `dataset.batch`). `source`:
    None (memory) or `(kind, directory)` of files read with reads="own".
    """
    import tensorflow as tf

    from keras_hetero import keras

    global_batch = global_batch or GLOBAL_BATCH[model_kind]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = examples(model_kind, global_batch * DISTINCT_BATCHES)
    repeats = -(-steps // DISTINCT_BATCHES)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat(repeats)
    model_class = keras.Model if mode == "stock" else kh.HeteroModel
    with strategy.scope():
        model = compile_model(build_model(model_kind, model_class))
    timer = kh.testing.StepTimer()
    callbacks = [timer, *callbacks]
    if throttle == "compute":
        callbacks.append(kh.testing.ThrottleCompute())
    if mode == "stock":
        data = dataset.batch(global_batch, drop_remainder=True)
    else:
        if source is None:
            data = kh.data.shard(dataset, global_batch, strategy=strategy)
        else:
            data = _file_input(source, global_batch, strategy)
        if mode == "rebalanced":
            callbacks.append(
                kh.callbacks.ShardRebalancer(data, every_n_steps=5, window=5)
            )
    model.fit(
        data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks
    )
    shares = None if mode == "stock" else np.asarray(data.shares).tolist()
    return {"seconds": timer.seconds, "shares": shares}


# The input table's sources: name -> files read with reads="own" (None:
# memory). Rows of `_train`'s model kind, written by `write_files`.
SOURCES = {
    "memory": "memory",
    "memory (A/A)": "memory",
    'Parquet, reads="own"': "parquet",
    'indexed TFRecords, reads="own"': "tfrecord",
}


def write_files(model_kind, rows, directory):
    """`examples(model_kind, rows)` as Parquet and as indexed TFRecords
    (files of about 1,000 rows; row groups and blocks of 128)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    x, y = examples(model_kind, rows)
    flat = x.reshape(rows, -1)
    for kind in ("parquet", "tfrecord"):
        os.makedirs(os.path.join(directory, kind), exist_ok=True)
    for number, part in enumerate(
        np.array_split(np.arange(rows), rows // 1000)
    ):
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(
                    pa.array(flat[part].ravel()), flat.shape[1]
                ),
                "y": y[part],
            }
        )
        name = f"part-{number:05d}"
        pq.write_table(
            table,
            os.path.join(directory, "parquet", name + ".parquet"),
            row_group_size=128,
        )
        path = os.path.join(directory, "tfrecord", name + ".tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for row in part:
                features = {
                    "x": tf.train.Feature(
                        float_list=tf.train.FloatList(value=flat[row])
                    ),
                    "y": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[y[row]])
                    ),
                }
                writer.write(
                    tf.train.Example(
                        features=tf.train.Features(feature=features)
                    ).SerializeToString()
                )
    kh.data.index_tfrecords(os.path.join(directory, "tfrecord"))
    return x.shape[1:]


def _file_input(source, global_batch, strategy):
    """`kh.data.shard(reads="own")` over `source = (kind, directory,
    example shape)`; kind "memory": the same rows from numpy arrays
    (`directory` is `[model kind, rows]`)."""
    import tensorflow as tf

    kind, directory, shape = source
    shape = tuple(shape)
    if kind == "memory":
        x, y = examples(*directory)
        return kh.data.shard(
            tf.data.Dataset.from_tensor_slices((x, y)),
            global_batch,
            strategy=strategy,
        )
    if kind == "parquet":
        examples_ = kh.data.from_arrow(
            directory, "x", label="y", shapes={"x": shape}
        )
        map_fn = None
    else:
        examples_ = kh.data.from_tfrecords(directory, records_per_block=128)
        size = int(np.prod(shape))

        def map_fn(records):
            parsed = tf.io.parse_example(
                records,
                {
                    "x": tf.io.FixedLenFeature([size], tf.float32),
                    "y": tf.io.FixedLenFeature([], tf.int64),
                },
            )
            x = tf.reshape(parsed["x"], (-1, *shape))
            return x, tf.cast(parsed["y"], tf.int32)

    return kh.data.shard(
        examples_, global_batch, strategy=strategy, reads="own", map_fn=map_fn
    )


def _source(kind, directory, model_kind, rows, shape):
    """`_train`'s `source` for an input table source of kind `kind`."""
    if kind == "memory":
        return (kind, [model_kind, rows], list(shape))
    return (kind, os.path.join(directory, kind), list(shape))


def _pipeline_alone(make_data, rounds):
    """Rows/s of the input pipeline `make_data()` (a HeteroDataset under
    the default strategy) alone, no model: the median over `rounds` runs
    of five passes, each consumed by `Dataset.reduce` (no Python per
    batch)."""
    import time

    import tensorflow as tf

    rates = []
    for _ in range(rounds):
        data = make_data()
        # One batch first (the files in the page cache, as in training),
        # then five passes: one pass's start (an iterator, the first
        # blocks) is amortized, not the rate.
        batches = data.as_distributed_dataset(repeat=True)
        first = iter(batches.take(1))
        next(first)
        batches = batches.skip(1).take(5 * data.num_batches)
        started = time.perf_counter()
        rows = batches.reduce(
            tf.constant(0, tf.int64),
            lambda total, batch: total + tf.shape(batch[1], tf.int64)[0],
        )
        rates.append(int(rows) / (time.perf_counter() - started))
    return float(np.median(rates))


def _model_alone(model_kind, steps, tail):
    """Samples/s of `model_kind` trained alone in this process (all its
    cores, input from memory): the median of the last `tail` steps."""
    import tensorflow as tf

    global_batch = GLOBAL_BATCH[model_kind]
    x, y = examples(model_kind, global_batch * steps)
    model = compile_model(build_model(model_kind, kh.HeteroModel))
    timer = kh.testing.StepTimer()
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices((x, y)), global_batch
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[timer])
    return global_batch / float(np.median(timer.seconds[-tail:]))


def _rebalance_worker(model_kind, mode, steps, throttle, source=None):
    return _train(model_kind, mode, steps, throttle, source=source)


def _rate(result, global_batch, tail):
    return global_batch / float(np.median(result["seconds"][-tail:]))


def _run(model_kind, mode, quotas, steps, throttle, timeout):
    results = kh.testing.run_workers(
        _rebalance_worker,
        len(quotas),
        timeout=timeout,
        args=(model_kind, mode, steps, throttle),
        cpu_quotas=list(quotas),
        cores="auto",
        throttle=throttle,
    )
    return results[0].value


def rebalance_table(models, cases, steps, tail, throttle, timeout):
    stock = kh.FLAVOUR != "keras3"
    columns = [
        "model",
        "capacities",
        "ideal samples/s (sum alone)",
        "equal shares",
        "rebalanced",
        "rebalanced / ideal",
        "rebalanced / equal",
        "stock keras.Model",
        "final shares",
    ]
    rows = []
    for model_kind in models:
        global_batch = GLOBAL_BATCH[model_kind]
        alone = {}
        for name in cases:
            quotas = CASES[name]
            cores = [i % os.cpu_count() for i in range(len(quotas))]
            ideal = 0.0
            for quota, core in zip(quotas, cores):
                if (quota, core) not in alone:
                    results = kh.testing.run_workers(
                        _rebalance_worker,
                        1,
                        timeout=timeout,
                        args=(model_kind, "equal", steps, throttle),
                        cpu_quotas=[quota],
                        cores=[core],
                        throttle=throttle,
                    )
                    alone[(quota, core)] = _rate(
                        results[0].value, global_batch, tail
                    )
                ideal += alone[(quota, core)]
            equal = _run(model_kind, "equal", quotas, steps, throttle, timeout)
            balanced = _run(
                model_kind, "rebalanced", quotas, steps, throttle, timeout
            )
            equal_rate = _rate(equal, global_batch, tail)
            balanced_rate = _rate(balanced, global_batch, tail)
            stock_cell = "n/a (fails)"
            if stock:
                stock_rate = _rate(
                    _run(model_kind, "stock", quotas, steps, throttle, timeout),
                    global_batch,
                    tail,
                )
                stock_cell = f"{stock_rate:.0f}"
            rows.append(
                [
                    model_kind,
                    name,
                    f"{ideal:.0f}",
                    f"{equal_rate:.0f}",
                    f"{balanced_rate:.0f}",
                    f"{balanced_rate / ideal:.0%}",
                    f"{balanced_rate / equal_rate:.2f}x",
                    stock_cell,
                    " ".join(f"{s:.3f}" for s in balanced["shares"]),
                ]
            )
            print(markdown_table(columns, rows[-1:]).splitlines()[-1])
            sys.stdout.flush()
    return markdown_table(columns, rows)


def input_table(model_kind, steps, tail, throttle, timeout, rounds):
    """The input table (see the module's docstring): rounds alternating
    the sources; medians per source."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="real_devices_input")
    try:
        return _input_table(
            model_kind, steps, tail, throttle, timeout, rounds, directory
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _input_table(model_kind, steps, tail, throttle, timeout, rounds, directory):
    global_batch = GLOBAL_BATCH[model_kind]
    quotas = CASES["1:2"]
    rows = (steps + 1) * global_batch
    shape = write_files(model_kind, rows, directory)
    rates = {name: [] for name in SOURCES}
    for _ in range(rounds):
        for name, kind in SOURCES.items():
            source = _source(kind, directory, model_kind, rows, shape)
            results = kh.testing.run_workers(
                _rebalance_worker,
                len(quotas),
                timeout=timeout,
                args=(model_kind, "rebalanced", steps, throttle, source),
                cpu_quotas=list(quotas),
                cores="auto",
                throttle=throttle,
            )
            rate = _rate(results[0].value, global_batch, tail)
            rates[name].append(rate)
            print(f"  {name}: {rate:.0f} samples/s", flush=True)
    # In this process, after the pairs: each pipeline alone, and the model
    # alone on one process with the whole machine.
    import tensorflow as tf

    makers = {}
    for name, kind in SOURCES.items():
        if name != "memory (A/A)":
            source = _source(kind, directory, model_kind, rows, shape)
            makers[name] = lambda source=source: _file_input(
                source, global_batch, tf.distribute.get_strategy()
            )
    model_rate = _model_alone(model_kind, steps, tail)
    print(
        f"  {model_kind} alone in one process: {model_rate:.0f} samples/s",
        flush=True,
    )
    memory = float(np.median(rates["memory"]))
    columns = [
        "input",
        "rebalanced pair, samples/s (median)",
        "vs memory",
        "pipeline alone, rows/s",
        f"pipeline alone / {model_kind} alone",
    ]
    rows = []
    for name, found in rates.items():
        alone = ""
        if name in makers:
            alone = _pipeline_alone(makers[name], rounds)
        rows.append(
            [
                name,
                f"{np.median(found):.0f}",
                f"{np.median(found) / memory:.3f}",
                f"{alone:.0f}" if alone else "",
                f"{alone / model_rate:.1f}x" if alone else "",
            ]
        )
    return markdown_table(columns, rows)


def _straggler_worker(model_kind, steps, drop_at, drop_to, global_batch):
    detector = kh.callbacks.StragglerDetector()
    callbacks = [detector]
    if _task_index() == 1:
        callbacks.append(kh.testing.ThrottleAt(drop_at, drop_to))
    _train(
        model_kind,
        "equal",
        steps,
        "process",
        callbacks=callbacks,
        global_batch=global_batch,
    )
    return {
        "events": [(e.step, e.replica, e.kind) for e in detector.events],
        "findings": [(f.replica, f.sign) for f in detector.clock_findings],
    }


def straggler_table(model_kind, steps, drop_at, drop_to, timeout, runs):
    columns = [
        "model",
        "run",
        "steps",
        "drop at step",
        "worker 1's cap after",
        "steps to flag worker 1",
        "false events",
        "clock findings",
    ]
    rows = []
    for run in range(runs):
        results = kh.testing.run_workers(
            _straggler_worker,
            2,
            timeout=timeout,
            args=(model_kind, steps, drop_at, drop_to, STRAGGLER_BATCH),
            cpu_quotas=[None, None],
            cores="auto",
        )
        value = results[0].value
        flagged = [
            step
            for step, replica, kind in value["events"]
            if replica == 1 and kind == "straggler" and step > drop_at
        ]
        false = [
            event
            for event in value["events"]
            if not (event[1] == 1 and event[0] > drop_at)
        ]
        rows.append(
            [
                model_kind,
                run + 1,
                steps,
                drop_at,
                drop_to,
                flagged[0] - drop_at if flagged else "never",
                len(false),
                len(value["findings"]),
            ]
        )
        print(markdown_table(columns, rows[-1:]).splitlines()[-1], flush=True)
    return markdown_table(columns, rows)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), choices=list(CASES)
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tail", type=int, default=30)
    parser.add_argument(
        "--throttle", choices=("process", "compute"), default="process"
    )
    parser.add_argument("--straggler-steps", type=int, default=1200)
    parser.add_argument("--drop-at", type=int, default=600)
    parser.add_argument("--drop-to", type=float, default=0.5)
    parser.add_argument("--straggler-runs", type=int, default=2)
    parser.add_argument(
        "--tables", nargs="+", default=["rebalance", "straggler", "input"]
    )
    parser.add_argument("--input-model", default="resnet", choices=MODELS)
    parser.add_argument("--input-rounds", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900)
    # The smoke run: one tiny case of each table.
    args = parse_args(
        parser,
        models=["mlp"],
        cases=["1:2"],
        steps=8,
        tail=4,
        straggler_steps=30,
        drop_at=15,
        straggler_runs=1,
        input_model="mlp",
        input_rounds=1,
    )
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        print(f"real_devices.py needs CPU quotas: {reason}")
        return 0 if args.smoke else 1
    print(
        header(
            "real unequal devices (CPU quotas, no simulation)",
            f"MultiWorkerMirroredStrategy workers on 127.0.0.1, each pinned "
            f"to a core, throttle={args.throttle}",
        )
    )
    if "rebalance" in args.tables:
        print(
            f"\nRebalancing: steady-state samples/s, median of the last "
            f"{args.tail} of {args.steps} steps; global batch "
            + ", ".join(f"{m} {GLOBAL_BATCH[m]}" for m in args.models)
            + "\n"
        )
        table = rebalance_table(
            args.models,
            args.cases,
            args.steps,
            args.tail,
            args.throttle,
            args.timeout,
        )
        print("\n" + table)
    if "straggler" in args.tables:
        print(
            f"\nStraggler detection: MLP, global batch {STRAGGLER_BATCH}, 2 "
            f"equal workers, worker 1 capped at {args.drop_to} of its core "
            f"before step {args.drop_at}\n"
        )
        table = straggler_table(
            "mlp",
            args.straggler_steps,
            args.drop_at,
            args.drop_to,
            args.timeout,
            args.straggler_runs,
        )
        print("\n" + table)
    if "input" in args.tables:
        print(
            f"\nInput: {args.input_model} (global batch "
            f"{GLOBAL_BATCH[args.input_model]}), capacities 1:2, rebalanced; "
            f"{args.input_rounds} rounds alternating the sources; median of "
            f"the last {args.tail} of {args.steps} steps\n"
        )
        table = input_table(
            args.input_model,
            args.steps,
            args.tail,
            args.throttle,
            args.timeout,
            args.input_rounds,
        )
        print("\n" + table)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
