"""The command line: `keras-hetero run ...` and `python -m keras_hetero.run
...`, both calling `kh.launcher.launch`; `keras-hetero doctor ...`, calling
`kh.doctor`."""

import argparse
import sys

from keras_hetero.launcher import group


def main(argv=None):
    """`keras-hetero run` / `python -m keras_hetero.run`, and
    `keras-hetero doctor`."""
    parser = argparse.ArgumentParser(
        prog="keras-hetero",
        description="Launch keras-hetero training on local workers, or "
        "check a machine and its cluster first (doctor).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="start N workers with TF_CONFIG on 127.0.0.1 and restart them "
        "on failure",
        description=group.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(run)
    doctor = commands.add_parser(
        "doctor",
        help="check this machine's devices, their speeds, the in-step "
        "clock, and the cluster in TF_CONFIG",
        description=_DOCTOR_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_doctor_arguments(doctor)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        if args.batch_size is not None and args.model is None:
            doctor.error("--batch-size needs --model")
        return _doctor_from_arguments(args)
    return _launch_from_arguments(args)


def run_main(argv=None):
    """`python -m keras_hetero.run ...` (the `run` arguments only)."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_hetero.run",
        description=group.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(parser)
    return _launch_from_arguments(parser.parse_args(argv))


def _add_run_arguments(parser):
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--min-workers", type=int, default=None)
    parser.add_argument("--grace-seconds", type=float, default=30.0)
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)


_DOCTOR_DESCRIPTION = """\
Lists this process's devices and the host's cores, CPU quota and memory;
times each device alone on a float32 matmul (host-synchronised); suggests
shares for kh.data.shard and what precision="auto" picks. With --model,
times the model's step on each device and checks that HeteroModel's
in-step clock sees each device's work. Under TF_CONFIG, checks that every
task of the cluster is reachable (run the doctor on every task within
--timeout seconds); with --collective, the workers also time an all-reduce.

Exit status: 0 when the checks ran, 2 for a bad argument or TF_CONFIG,
1 when a task is unreachable or the all-reduce fails.
"""


def _add_doctor_arguments(parser):
    parser.add_argument(
        "--json", action="store_true", help="print the report as JSON"
    )
    parser.add_argument(
        "--model", default=None, help="a saved, compiled .keras model to time"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows of random data per step of --model (default 32)",
    )
    parser.add_argument(
        "--collective",
        action="store_true",
        help="join the TF_CONFIG cluster and time a 1 MB all-reduce",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the other tasks (default 10)",
    )


def _doctor_from_arguments(args):
    # Here, not at the top: this module loads while keras_hetero does.
    from keras_hetero.doctor import doctor

    try:
        report = doctor(
            model=args.model,
            batch=args.batch_size,
            collective=args.collective,
            timeout=args.timeout,
        )
    except (ValueError, TypeError) as error:
        print(f"keras-hetero doctor: {error}", file=sys.stderr)
        return 2
    except (ConnectionError, TimeoutError) as error:
        # The cluster failed a check, not the arguments.
        print(f"keras-hetero doctor: {error}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report.table())
    return 0


def _launch_from_arguments(args):
    try:
        result = group.launch(
            [sys.executable, args.script, *args.script_args],
            args.workers,
            max_restarts=args.max_restarts,
            min_workers=args.min_workers,
            grace_seconds=args.grace_seconds,
        )
    except ValueError as error:
        print(f"keras-hetero: {error}", file=sys.stderr)
        return 2
    return result.exit_code
