"""HeteroModel vs stock keras.Model step time, equal shares.

The same model and data under MirroredStrategy on `--replicas` logical CPUs
of this process, or under MultiWorkerMirroredStrategy with `--workers`
worker processes (one logical CPU each, TF_CONFIG on 127.0.0.1). The models
run alternately in one process (several rounds) and we report the median
step time of each and their ratio. An A/A row (a second stock model against
the first) shows the noise. Target: ratio <= 1.03 (W=256), <= 1.05 (W=64).

`--profile` adds HeteroModel variants with one piece of its step switched
off (benchmark-only patches applied while the step is traced,
benchmarks/_step_variants.py), side by side in the same run: what each
piece costs per step. Step times are medians over all rounds; the ratio is
the median of the rounds' ratios (each round's runs are close in time, so a
change of load moves both).

Each row also has the process's CPU time per step (`StepTimer.cpu_seconds`:
every thread of the process, so the input pipeline's work too; mean per
fit, median over rounds) and its ratio to stock's, median of the rounds.
It is a second view of where the work goes, not a steadier measure: TF's
thread pools spin while they wait and that counts as CPU, so its A/A rows
moved as much as the wall time's on a shared machine (docs/benchmarks.md,
2026-12-03). Under `--workers` both are worker 0's.

Run: `python benchmarks/overhead.py` (Mirrored, 2 replicas),
`--replicas 4`, `--workers 2`, `--spe 1 8`, `--profile`, `--profile
before replayed` (only the variants whose names contain those words).
"""

import contextlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
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

import keras_hetero as kh  # noqa: E402


def build(model_class, strategy, width, steps_per_execution):
    return compiled_model(
        "mlp",
        model_class,
        strategy,
        width=width,
        steps_per_execution=steps_per_execution,
        metrics=["accuracy"],
    )


def measure(strategy, width, rounds, steps_per_execution, profile, steps):
    """Median seconds per step of each run, alternating fits."""
    import tensorflow as tf

    batch = equal_split_batch(strategy.num_replicas_in_sync)
    examples = tf.data.Dataset.from_tensor_slices(
        examples_of("mlp", batch * steps)
    )
    batched = examples.batch(batch)
    sharded = kh.data.shard(examples, batch, strategy=strategy)
    k = steps_per_execution
    stock_class, bare = kh.keras.Model, None
    if not stock_runs(strategy, k):
        # The baseline is HeteroModel's bare step instead.
        stock_class, bare = kh.HeteroModel, all_off
    runs = {
        "stock": (build(stock_class, strategy, width, k), batched, bare),
        "stock (A/A)": (
            build(stock_class, strategy, width, k),
            batched,
            bare,
        ),
        "HeteroModel": (
            build(kh.HeteroModel, strategy, width, k),
            sharded,
            None,
        ),
    }
    if profile is not None:
        for name, (patch, source) in PROFILE.items():
            if profile and not any(part in name for part in profile):
                continue
            data = {
                "shared": sharded,
                "own": kh.data.shard(examples, batch, strategy=strategy),
                "keras": batched,
            }[source]
            runs[f"HeteroModel, {name}"] = (
                build(kh.HeteroModel, strategy, width, k),
                data,
                patch,
            )
    if "HeteroModel, input replayed from memory" in runs:
        # Its baseline: stock with its batches replayed from memory too.
        runs["stock, input replayed from memory"] = (
            build(stock_class, strategy, width, k),
            batched.cache(),
            bare,
        )
    for model, data, patch in runs.values():  # warm-up: tracing
        with patch() if patch else contextlib.nullcontext():
            model.fit(data, epochs=1, verbose=0, shuffle=False)
    seconds = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    ratios = {name: [] for name in runs}
    cpu_ratios = {name: [] for name in runs}
    for number in range(rounds):
        medians, means = {}, {}
        for name in round_order(runs, number):
            model, data, _ = runs[name]
            timer = kh.testing.StepTimer()
            model.fit(
                data, epochs=1, verbose=0, shuffle=False, callbacks=[timer]
            )
            # One batch-end callback per execution of k steps.
            step_seconds = np.asarray(timer.seconds) / k
            seconds[name].extend(step_seconds)
            medians[name] = np.median(step_seconds)
            # CPU: the mean, all the work (the input pipeline's comes in
            # bursts that a median would leave out).
            means[name] = np.sum(timer.cpu_seconds) / (k * len(step_seconds))
            cpu[name].append(means[name])
        for name in runs:
            ratios[name].append(medians[name] / medians["stock"])
            cpu_ratios[name].append(means[name] / means["stock"])
    # The ratio is the median over rounds of each round's ratio: the runs of
    # one round are close in time, so a change of the machine's load (other
    # jobs) moves both.
    return {
        name: (
            float(np.median(seconds[name])),
            float(np.median(ratios[name])),
            float(np.median(cpu[name])),
            float(np.median(cpu_ratios[name])),
            quartiles(ratios[name]),
        )
        for name in runs
    }


def table(strategy, widths, rounds, spes, profile, steps):
    """Markdown rows: one per (W, k, run), ratio to the stock run."""
    lines = [
        "| W | k | run | step (ms) | extra (ms) | "
        "ratio to stock (median of rounds) | rounds' ratios, quartiles | "
        "CPU per step (ms) | CPU ratio to stock |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for width in widths:
        for k in spes:
            medians = measure(strategy, width, rounds, k, profile, steps)
            stock = medians["stock"][0]
            for name, (value, ratio, cpu, cpu_ratio, spread) in medians.items():
                if name == "stock":
                    continue
                lines.append(
                    f"| {width} | {k} | {name} | {1000 * value:.2f} | "
                    f"{1000 * (value - stock):.2f} | {ratio:.3f} | "
                    f"{spread[0]:.3f}-{spread[1]:.3f} | "
                    f"{1000 * cpu:.2f} | {cpu_ratio:.3f} |"
                )
    return lines


def _mwms_worker(*table_args):
    return table(mwms_strategy(), *table_args)


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="hidden widths W of the MLP to measure",
    )
    parser.add_argument(
        "--spe",
        type=int,
        nargs="+",
        default=[1],
        help="steps_per_execution values k to measure",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--replicas", type=int, default=2)
    group.add_argument("--workers", type=int, default=0)
    parser.add_argument(
        "--profile",
        nargs="*",
        metavar="PART",
        help="add the profile variants (those whose name contains a PART, "
        "if any are given)",
    )
    parser.add_argument("--steps", type=int, default=40, help="steps per fit")
    args = parse_args(parser, rounds=2, widths=[64], steps=4)
    print(
        header(
            "overhead benchmark",
            f"{where(args.workers, args.replicas)}, equal shares, global "
            f"batch {equal_split_batch(args.workers or args.replicas)}, "
            f"{args.rounds} alternating rounds of {args.steps} steps, MLP "
            "64-W-W-10",
        )
    )
    print()
    table_args = (args.widths, args.rounds, args.spe, args.profile, args.steps)
    lines = lines_on(
        args.workers, args.replicas, table, table_args, _mwms_worker
    )
    if kh.FLAVOUR != "tf-keras" and (args.workers or max(args.spe) > 1):
        print(
            "stock Keras 3 cannot fit under MultiWorkerMirroredStrategy, nor "
            "with steps_per_execution > 1 under MirroredStrategy: in those "
            'rows "stock" is HeteroModel with the four pieces of --profile '
            "switched off (no clocks, no telemetry record, local metrics "
            "read, Keras' input split)"
        )
        print()
    print("\n".join(lines))
    print()
    print(load_at_end())


if __name__ == "__main__":
    main()
