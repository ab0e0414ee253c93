"""The command line: `keras-hetero run ...` and `python -m keras_hetero.run
...`, both calling `kh.launcher.launch`."""

import argparse
import sys

from keras_hetero.launcher import group


def main(argv=None):
    """`keras-hetero run` / `python -m keras_hetero.run`."""
    parser = argparse.ArgumentParser(
        prog="keras-hetero",
        description="Launch keras-hetero training on local workers.",
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
    args = parser.parse_args(argv)
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
