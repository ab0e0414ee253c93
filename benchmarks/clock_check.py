"""Host cost of the readings' self-check (`ClockCheck.add`) per step, from 8
to 4,096 replicas: every step, and the steps where every replica's rows
change (a share change) or its test of that change is due.

Pure numpy on synthetic readings (a fixed cost and a cost per row, 5%
jitter; at step 100 half the replicas' rows go down and half up): no
TensorFlow, no devices. Run: `python benchmarks/clock_check.py`
(`--smoke`: 8 and 64 replicas).
"""

import time

import numpy as np
from _harness import markdown_table
from _harness import parse_args
from _harness import smoke_parser

from keras_hetero.training.clock_check import ClockCheck


def measure(replicas, steps=200):
    check = ClockCheck([f"/gpu:{i}" for i in range(replicas)])
    rng = np.random.default_rng(0)
    seconds_taken = []
    for step in range(steps):
        rows = np.full(replicas, 16.0)
        if step >= steps // 2:
            rows = np.where(np.arange(replicas) % 2, 8.0, 24.0)
        seconds = (0.001 + rows * 1e-4) * (1 + 0.05 * rng.standard_normal())
        started = time.perf_counter()
        findings = check.add(rows, seconds)
        seconds_taken.append(time.perf_counter() - started)
        assert not findings, findings
    steady = np.asarray(seconds_taken[20:])
    return 1000 * np.median(steady), 1000 * steady.max()


def main():
    parser = smoke_parser(__doc__)
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[8, 64, 256, 1024, 4096]
    )
    args = parse_args(parser, replicas=[8, 64])
    rows = []
    for replicas in args.replicas:
        median, worst = measure(replicas)
        rows.append([replicas, f"{median:.3f}", f"{worst:.2f}"])
    print(
        markdown_table(
            ["replicas", "ms per step (median)", "ms, slowest step"], rows
        )
    )


if __name__ == "__main__":
    main()
