"""Helpers for tests and benchmarks: logical devices, worker processes,
simulated slow devices, real unequal devices, and worker hosts in network
namespaces whose links a test can cut, flap and slow (`NetworkHosts`, root
only).

`SimulatedSpeed` is simulation (a replica sleeps); say so wherever a figure
comes from it. The CPU quota harness is real: `run_workers(...,
cpu_quotas=..., cores=...)` pins worker processes to cores and caps each
with a Linux cgroup (`CpuQuota`, `ThrottleCompute`, `ThrottleAt`; root
only), so a capped worker really computes slower. `emulated_fleet` is a
test seam: workers describe their devices as a given fleet's (an "A100", a
"T4"), so cluster-wide decisions such as precision "auto" run as on that
fleet. `Ledger` records the example ids each train step trained, per
worker and attempt; `read_ledger` merges a restarted run's and checks every
epoch trained every example exactly once.
"""

from keras_hetero.testing.cpu_quota import CpuQuota
from keras_hetero.testing.cpu_quota import ThrottleAt
from keras_hetero.testing.cpu_quota import ThrottleCompute
from keras_hetero.testing.cpu_quota import cpu_quota_available
from keras_hetero.testing.cpu_quota import throttle_compute_threads
from keras_hetero.testing.devices import logical_cpus
from keras_hetero.testing.devices import mirrored
from keras_hetero.testing.fleet import emulated_fleet
from keras_hetero.testing.ledger import Ledger
from keras_hetero.testing.ledger import LedgerReport
from keras_hetero.testing.ledger import RecordIds
from keras_hetero.testing.ledger import ledger_key
from keras_hetero.testing.ledger import read_ledger
from keras_hetero.testing.network import NetworkHosts
from keras_hetero.testing.network import network_available
from keras_hetero.testing.simulated_speed import SimulatedSpeed
from keras_hetero.testing.step_timer import StepTimer
from keras_hetero.testing.workers import WorkerError
from keras_hetero.testing.workers import WorkerResult
from keras_hetero.testing.workers import free_ports
from keras_hetero.testing.workers import run_workers

__all__ = [
    "CpuQuota",
    "Ledger",
    "LedgerReport",
    "NetworkHosts",
    "RecordIds",
    "SimulatedSpeed",
    "StepTimer",
    "ThrottleAt",
    "ThrottleCompute",
    "WorkerError",
    "WorkerResult",
    "cpu_quota_available",
    "emulated_fleet",
    "free_ports",
    "ledger_key",
    "logical_cpus",
    "mirrored",
    "network_available",
    "read_ledger",
    "run_workers",
    "throttle_compute_threads",
]
