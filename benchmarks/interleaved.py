"""HeteroModel vs stock keras.Model, the runs taking turns every few steps.

`overhead.py` alternates whole fits (rounds of 40 steps each), so a change of
the machine's speed between two fits lands in one run and not the other: on a
shared two-core host its A/A rounds spread by 5-20%, more than the few percent
to be measured. Here every run calls its own train function on its own input
iterator, as `fit` does each step (and reads the logs to the host, as `fit`
does for a Python callback), and the runs take turns every `--turn` steps
(stock, A/A, HeteroModel, ...): a change of speed reaches all of them within a
few milliseconds. The steps of one turn of every run form a block; each block
gives each run a ratio (its median step over stock's in the same block), and
the table gives the median of the blocks' ratios and their quartiles.

Two kinds of input. "live": stock iterates `dataset.batch(global)` through
Keras' split, HeteroModel a `kh.data.shard` dataset, as in `fit`. Each
pipeline refills its buffers in the background while the other runs step,
so a turn of several steps (the buffers hold about two) keeps most of a
pipeline's work inside its own turn. "replayed": each pipeline's output is
kept in memory after the warm-up and replayed (`overhead.py`'s "input
replayed from memory"): what is left is the step itself, the figure that
does not depend on how the logical CPU devices share the host's two cores
with the input pipeline. Both replays hold the replicas' batches, after
each split (stock's `rebatch`, HeteroModel's `kh.data.shard`).

Equal shares, global batch 256 (255 with 3 replicas), MLP 64-W-W-10, Adam,
`steps_per_execution=1`. Under MultiWorkerMirroredStrategy on Keras 3
"stock" is HeteroModel's bare step, as in `overhead.py` (stock Keras 3
cannot fit there). Run: `python benchmarks/interleaved.py` (Mirrored, 2
replicas), `--replicas 4`, `--workers 2`, `--widths 64 256 --blocks 40`,
`--models resnet transformer` (a small ResNet and a small Transformer
encoder beside the MLP, benchmarks/_harness.py), `--profile "per tensor"
divide` (overhead.py's variants of the step, on
replayed input; its variants on Keras' own split, "Keras' input split" and
"all four off", run live on stock's input, against live stock).
"""

import contextlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from _harness import GLOBAL_BATCH  # noqa: E402
from _harness import STEP_COST_BATCH  # noqa: E402
from _harness import compiled_model  # noqa: E402
from _harness import equal_split_batch  # noqa: E402
from _harness import examples as examples_of  # noqa: E402
from _harness import header  # noqa: E402
from _harness import lines_on  # noqa: E402
from _harness import load_at_end  # noqa: E402
from _harness import mwms_strategy  # noqa: E402
from _harness import parse_args  # noqa: E402
from _harness import quartiles  # noqa: E402
from _harness import round_order  # noqa: E402
from _harness import smoke_parser  # noqa: E402
from _harness import stock_runs  # noqa: E402
from _harness import where  # noqa: E402
from _step_variants import PROFILE  # noqa: E402
from _step_variants import all_off  # noqa: E402
from _step_variants import pipeline_then  # noqa: E402

import keras_hetero as kh  # noqa: E402


def _runs(strategy, width, steps, profile, distinct_batches):
    """name -> (model, distributed dataset, patch while tracing, baseline).

    `width`: the MLP's hidden width, or a model kind of `_harness` ("resnet",
    "transformer") at its own global batch. The input repeats
    `distinct_batches` global batches.
    """
    import tensorflow as tf

    replicas = strategy.num_replicas_in_sync
    kind = width if isinstance(width, str) else "mlp"
    full_batch = STEP_COST_BATCH if kind == "mlp" else GLOBAL_BATCH[kind]
    batch = equal_split_batch(replicas, full_batch)
    examples = tf.data.Dataset.from_tensor_slices(
        examples_of(kind, batch * distinct_batches)
    )
    # Inputs of known, finite length, as a user's epochs are: whether the
    # distributed iterator reads through an Optional (partial last batch)
    # depends on it, and that costs stock ops per step. tf-keras' `fit`
    # repeats a kh.data.shard dataset (its steps counted per epoch).
    passes = steps // distinct_batches + 2
    stock_class, bare = kh.keras.Model, None
    if not stock_runs(strategy, 1):
        stock_class, bare = kh.HeteroModel, all_off
    repeats = kh.FLAVOUR == "tf-keras"

    def stock_input(replayed=False):
        if not replayed:
            source = examples.repeat(passes).batch(batch)
            return strategy.experimental_distribute_dataset(source)
        # The first pass split into replicas' batches as Keras' split does
        # (`rebatch`, then each worker its own), kept in memory and
        # replayed: as in HeteroModel's replay, the split's work is not in
        # the step. (Until 2026-12-04 the global batches were replayed and
        # `rebatch` ran live in stock's "replayed" runs only.)
        per_replica = batch // strategy.num_replicas_in_sync

        def per_worker(context):
            return (
                examples.batch(batch)
                .rebatch(per_replica)
                .shard(context.num_input_pipelines, context.input_pipeline_id)
                .cache()
                .repeat(passes)
            )

        return strategy.distribute_datasets_from_function(per_worker)

    def hetero_input(replayed=False):
        if not replayed:
            data = kh.data.shard(
                examples.repeat(passes), batch, strategy=strategy
            )
            return data.as_distributed_dataset(repeat=repeats)
        # One pass split, kept in memory, then replayed.
        data = kh.data.shard(examples, batch, strategy=strategy)
        with pipeline_then(
            lambda dataset: dataset.cache().repeat(None if repeats else passes)
        ):
            return data.as_distributed_dataset()

    def model_of(model_class):
        return compiled_model(
            kind,
            model_class,
            strategy,
            width=width if kind == "mlp" else 256,
            metrics=["accuracy"],
        )

    def stock_model():
        return model_of(stock_class)

    def hetero_model():
        return model_of(kh.HeteroModel)

    runs = {
        "stock": (stock_model(), stock_input(), bare, "stock"),
        "stock (A/A)": (stock_model(), stock_input(), bare, "stock"),
        "HeteroModel": (hetero_model(), hetero_input(), None, "stock"),
        "stock, input replayed": (
            stock_model(),
            stock_input(replayed=True),
            bare,
            "stock, input replayed",
        ),
        "stock (A/A), input replayed": (
            stock_model(),
            stock_input(replayed=True),
            bare,
            "stock, input replayed",
        ),
        "HeteroModel, input replayed": (
            hetero_model(),
            hetero_input(replayed=True),
            None,
            "stock, input replayed",
        ),
    }
    # overhead.py's variants of the step itself (one piece switched off
    # or as before), on replayed input.
    # Those on Keras' own split ("Keras' input split", "all four off") run
    # live, beside stock on the same input: HeteroModel's step on stock's
    # pipeline, which separates the input's part of the live ratio.
    for name, (patch, source) in PROFILE.items():
        if not any(part in name for part in profile):
            continue
        if source == "shared":
            runs[f"HeteroModel, {name}, input replayed"] = (
                hetero_model(),
                hetero_input(replayed=True),
                patch,
                "stock, input replayed",
            )
        elif source == "keras" and stock_runs(strategy, 1):
            runs[f"HeteroModel, {name}"] = (
                hetero_model(),
                stock_input(),
                patch,
                "stock",
            )
    return runs


def _step(function, iterator):
    """Seconds of one train-function call, its logs read to the host."""
    started = time.perf_counter()
    logs = function(iterator)
    for value in logs.values():
        np.asarray(value)
    return time.perf_counter() - started


def measure(strategy, width, blocks, turn, profile=(), distinct_batches=64):
    """name -> (median step seconds, median block ratio, quartiles)."""
    steps = distinct_batches + 8 + blocks * turn
    runs = _runs(strategy, width, steps, profile, distinct_batches)
    functions, iterators = {}, {}
    for name, (model, data, patch, _) in runs.items():
        with patch() if patch else contextlib.nullcontext():
            # Builds the model and optimizer and traces the step.
            model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)
            functions[name] = model.make_train_function()
            iterators[name] = iter(data)
            for _ in range(distinct_batches + 2):  # fills the replays
                _step(functions[name], iterators[name])
    seconds = {name: [] for name in runs}
    ratios = {name: [] for name in runs}
    for number in range(blocks):
        block = {name: [] for name in runs}
        for name in round_order(runs, number):
            for _ in range(turn):
                block[name].append(_step(functions[name], iterators[name]))
        medians = {name: np.median(values) for name, values in block.items()}
        for name, (_, _, _, baseline) in runs.items():
            seconds[name].extend(block[name])
            ratios[name].append(medians[name] / medians[baseline])
    return {
        name: (
            float(np.median(seconds[name])),
            float(np.median(ratios[name])),
            quartiles(ratios[name]),
        )
        for name in runs
        if name != runs[name][3]
    }


def table(strategy, widths, blocks, turn, profile=(), distinct_batches=64):
    """Markdown rows: one per (W, run), ratio to its baseline's step."""
    lines = [
        "| W | run | step (ms) | ratio (median of blocks) | "
        "blocks' ratios, quartiles |",
        "|---:|---|---:|---:|---:|",
    ]
    for width in widths:
        for name, (step, ratio, spread) in measure(
            strategy, width, blocks, turn, profile, distinct_batches
        ).items():
            lines.append(
                f"| {width} | {name} | {1000 * step:.2f} | {ratio:.3f} | "
                f"{spread[0]:.3f}-{spread[1]:.3f} |"
            )
    return lines


def _mwms_worker(*table_args):
    return table(mwms_strategy(), *table_args)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument(
        "--turn", type=int, default=10, help="steps per run per turn"
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="*",
        default=[64, 256],
        help="hidden widths W of the MLP to measure",
    )
    parser.add_argument(
        "--profile",
        nargs="+",
        default=(),
        metavar="PART",
        help="add overhead.py's step variants whose names contain a PART "
        "(e.g. 'per tensor' divide), on replayed input; those on Keras' "
        "input split live, on stock's input",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=[],
        choices=["resnet", "transformer"],
        help="also these models of benchmarks/_harness.py (a small ResNet on "
        "32x32x3 images, a small Transformer encoder), each at its own "
        "global batch",
    )
    parser.add_argument(
        "--distinct-batches",
        type=int,
        default=64,
        help="distinct global batches; the input repeats them",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--replicas", type=int, default=2)
    group.add_argument("--workers", type=int, default=0)
    args = parse_args(parser, blocks=2, turn=2, widths=[64], distinct_batches=4)
    print(
        header(
            "interleaved step benchmark",
            f"{where(args.workers, args.replicas)}, equal shares, global "
            f"batch {equal_split_batch(args.workers or args.replicas)}, "
            f"{args.blocks} blocks of {args.turn} steps per run, MLP "
            "64-W-W-10"
            + "".join(
                f", {kind} (global batch {GLOBAL_BATCH[kind]})"
                for kind in args.models
            ),
        )
    )
    items = [*args.widths, *args.models]
    print()
    lines = lines_on(
        args.workers,
        args.replicas,
        table,
        (items, args.blocks, args.turn, args.profile, args.distinct_batches),
        _mwms_worker,
        # 300 blocks with 3 workers ran over the old fixed 590 s: about
        # 3 s per block and width covers MWMS steps of up to 30 ms.
        timeout=590 + 3 * args.blocks * len(items),
    )
    print("\n".join(lines))
    print()
    print(load_at_end())


if __name__ == "__main__":
    main()
