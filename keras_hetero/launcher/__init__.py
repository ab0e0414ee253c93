"""`keras-hetero run`: start workers, restart the group on failure.

`launch` (in `group.py`) starts and restarts N workers on one machine;
`launch_host` (in `hosts.py`) is one host's part of a multi-host job
(`--nnodes`), whose rank-0 launcher serves the rendezvous
(`rendezvous.py`); `policy.py` holds its decisions as pure functions and
`devices.py` finds each host's GPUs and splits them among its workers
(`--workers`, `--workers-per-host`). `cli.py` is the command line
(`keras-hetero run`, `python -m keras_hetero.run`); `ports.py` finds free
ports (also for `kh.testing.run_workers`), or free ports of a range
(`--worker-ports`); `addresses.py` checks `--advertise-address`;
`timing.py` times each attempt's start and `warm.py` keeps the spares
restarted workers run in.
"""

from keras_hetero._environment import HANG_REPORT_ENV
from keras_hetero._environment import NUM_WORKERS_ENV
from keras_hetero._environment import RESTART_ENV
from keras_hetero.launcher.cli import main
from keras_hetero.launcher.group import Attempt
from keras_hetero.launcher.group import LaunchResult
from keras_hetero.launcher.group import launch
from keras_hetero.launcher.group import lost_workers
from keras_hetero.launcher.hosts import launch_host
from keras_hetero.launcher.ports import free_ports
from keras_hetero.launcher.rendezvous import TOKEN_ENV

__all__ = [
    "HANG_REPORT_ENV",
    "NUM_WORKERS_ENV",
    "RESTART_ENV",
    "main",
    "Attempt",
    "LaunchResult",
    "launch",
    "lost_workers",
    "launch_host",
    "free_ports",
    "TOKEN_ENV",
]
