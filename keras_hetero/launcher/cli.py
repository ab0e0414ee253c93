"""The command line: `keras-hetero run ...` and `python -m keras_hetero.run
...`, both calling `kh.launcher.launch`; `keras-hetero doctor ...`, calling
`kh.doctor`."""

import argparse
import sys

from keras_hetero.launcher import group
from keras_hetero.launcher import hosts
from keras_hetero.launcher import rendezvous


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
        help="start N workers with TF_CONFIG on 127.0.0.1 (or on several "
        "hosts: --nnodes) and restart them on failure",
        description=_RUN_DESCRIPTION,
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
        description=_RUN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(parser)
    return _launch_from_arguments(parser.parse_args(argv))


_RUN_DESCRIPTION = (
    group.__doc__
    + """
Several hosts: run the same command on every host, each with its own
--node-rank; the launcher with --node-rank 0 serves the rendezvous. On two
machines, 10.0.0.1 being the first one's address:

    export KERAS_HETERO_RDZV_TOKEN=...   # the same secret on every host
    keras-hetero run --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 \\
        --rdzv-bind 10.0.0.1 --workers-per-host auto train.py
    keras-hetero run --nnodes 2 --node-rank 1 --rdzv-endpoint 10.0.0.1:29400 \\
        --workers-per-host auto train.py

So that any host, rank 0's included, can be lost and come back, keep the
rendezvous in etcd: --rdzv-backend etcd --rdzv-endpoint ETCD_HOST:2379
--rdzv-id JOB (the same on every host, new for each job).

Behind a firewall, or to use a fast network: --worker-ports 29500-29507
(the ports the workers listen on, the same after a restart) and
--advertise-address ib0 (the interface, or address, they publish), with
--workers or --nnodes.

See docs/launcher.md.
"""
)


def _add_run_arguments(parser):
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers on this machine (one host; not with --nnodes); "
        "they split its GPUs evenly (CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="with --workers: restart with the survivors, down to M",
    )
    parser.add_argument("--grace-seconds", type=float, default=30.0)
    parser.add_argument(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="start every worker as a new process (default: restarted "
        "workers run in spares that imported TensorFlow, Keras and "
        "keras_hetero while the previous attempt trained, one idle "
        "process per worker)",
    )
    parser.add_argument(
        "--worker-ports",
        default=None,
        metavar="A-B",
        help="the ports this host's workers listen on, for a firewall that "
        "opens only those: the first free ones of the range, the same "
        "again after a restart (default: any free ports, new on each "
        "attempt)",
    )
    parser.add_argument(
        "--advertise-address",
        default=None,
        metavar="ADDRESS|INTERFACE",
        help="the address this host's workers publish in TF_CONFIG: an IP "
        "address of this host or an interface name such as ib0 (default: "
        "127.0.0.1 with --workers; with --nnodes the address that reached "
        "the rendezvous)",
    )
    parser.add_argument(
        "--devices-per-host",
        type=int,
        default=None,
        metavar="N",
        help="assume N GPUs on this host instead of asking nvidia-smi (0: "
        "leave CUDA_VISIBLE_DEVICES alone, every worker sees every GPU; "
        "for tests and odd drivers)",
    )
    _add_hosts_arguments(
        parser.add_argument_group("several hosts (the same command on each)")
    )
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)


def _add_hosts_arguments(several):
    """`run`'s arguments of a job on several hosts."""
    several.add_argument(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help="hosts in the job: N, or MIN:MAX to continue with as few as "
        "MIN hosts and admit up to MAX",
    )
    several.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's rank in [0, MAX); rank 0 serves the rendezvous "
        "(not with --rdzv-backend etcd)",
    )
    several.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="the rendezvous: an address of rank 0's host that every host "
        "reaches; with --rdzv-backend etcd, etcd's client address(es)",
    )
    several.add_argument(
        "--rdzv-backend",
        default="tcp",
        choices=("tcp", "etcd"),
        help="tcp (default): rank 0's launcher serves the rendezvous, and "
        "losing its host ends the job; etcd: the launcher holding the role "
        "in etcd serves it, so any host can be lost and come back",
    )
    several.add_argument(
        "--rdzv-id",
        default=None,
        metavar="JOB",
        help="with --rdzv-backend etcd: the job's id, the same on every host "
        "and new for each job",
    )
    several.add_argument(
        "--rdzv-bind",
        default=None,
        metavar="ADDRESS",
        help="rank 0: the local address the rendezvous listens on (default: "
        "loopback, for a job on one machine)",
    )
    several.add_argument(
        "--rdzv-token-file",
        default=None,
        metavar="PATH",
        help="a file holding the shared secret (default: the "
        "KERAS_HETERO_RDZV_TOKEN environment variable)",
    )
    several.add_argument(
        "--rdzv-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the hosts (default 300)",
    )
    several.add_argument(
        "--rdzv-last-call",
        type=float,
        default=10.0,
        help="seconds without a new host before a group of fewer than MAX "
        "starts, or restarts to admit one (default 10)",
    )
    several.add_argument(
        "--workers-per-host",
        default=None,
        metavar="K|auto",
        help="workers on this host: K (sharing its GPUs evenly) or auto "
        "(one per GPU; one without GPUs); default 1",
    )


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


_HOST_FLAGS = (
    "node_rank",
    "rdzv_endpoint",
    "rdzv_bind",
    "rdzv_token_file",
    "rdzv_id",
    "workers_per_host",
)


def _launch_from_arguments(args):
    command = [sys.executable, args.script, *args.script_args]
    try:
        if args.nnodes is None:
            _check_single_host(args)
            result = group.launch(
                command,
                args.workers,
                max_restarts=args.max_restarts,
                min_workers=args.min_workers,
                grace_seconds=args.grace_seconds,
                worker_ports=args.worker_ports,
                advertise_address=args.advertise_address,
                devices_per_host=args.devices_per_host,
                warm=args.warm,
            )
        else:
            _check_multi_host(args)
            result = hosts.launch_host(
                command,
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                rdzv_endpoint=args.rdzv_endpoint,
                rdzv_token=rendezvous.read_token(
                    token_file=args.rdzv_token_file
                ),
                rdzv_bind=args.rdzv_bind,
                rdzv_timeout=args.rdzv_timeout,
                rdzv_last_call=args.rdzv_last_call,
                workers_per_host=args.workers_per_host or 1,
                devices_per_host=args.devices_per_host,
                max_restarts=args.max_restarts,
                grace_seconds=args.grace_seconds,
                worker_ports=args.worker_ports,
                advertise_address=args.advertise_address,
                warm=args.warm,
                rdzv_backend=args.rdzv_backend,
                rdzv_id=args.rdzv_id,
            )
    except ValueError as error:
        print(f"keras-hetero: {error}", file=sys.stderr)
        return 2
    except (TimeoutError, ConnectionError) as error:
        print(f"keras-hetero: {error}", file=sys.stderr)
        return 1
    return result.exit_code


def _check_single_host(args):
    if args.workers is None:
        raise ValueError(
            "keras-hetero run needs --workers N (this machine) or --nnodes "
            "N with --node-rank and --rdzv-endpoint (several hosts)."
        )
    given = [
        "--" + name.replace("_", "-")
        for name in _HOST_FLAGS
        if getattr(args, name) is not None
    ]
    if args.rdzv_backend != "tcp":
        given.append("--rdzv-backend")
    if given:
        raise ValueError(
            f"{', '.join(given)} need --nnodes (several hosts); with "
            "--workers the job runs on this machine only."
        )


def _check_multi_host(args):
    if args.workers is not None or args.min_workers is not None:
        raise ValueError(
            "--workers and --min-workers are for one machine; with --nnodes "
            "use --workers-per-host K|auto and --nnodes MIN:MAX."
        )
    missing = [
        flag
        for flag, value in (
            ("--node-rank", args.node_rank),
            ("--rdzv-endpoint", args.rdzv_endpoint),
        )
        if value is None
    ]
    if missing:
        raise ValueError(
            f"--nnodes needs {' and '.join(missing)} (the same command on "
            "every host, each with its own --node-rank)."
        )
