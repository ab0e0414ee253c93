"""Helpers for tests and benchmarks: logical devices, worker processes, and
simulated slow devices, and worker hosts in network namespaces whose links
a test can cut, flap and slow (`NetworkHosts`, root only). Everything here
is simulation; say so wherever a figure comes from it."""

from keras_hetero.testing.devices import logical_cpus
from keras_hetero.testing.devices import mirrored
from keras_hetero.testing.network import NetworkHosts
from keras_hetero.testing.network import network_available
from keras_hetero.testing.simulated_speed import SimulatedSpeed
from keras_hetero.testing.step_timer import StepTimer
from keras_hetero.testing.workers import WorkerError
from keras_hetero.testing.workers import WorkerResult
from keras_hetero.testing.workers import free_ports
from keras_hetero.testing.workers import run_workers

__all__ = [
    "NetworkHosts",
    "SimulatedSpeed",
    "StepTimer",
    "WorkerError",
    "WorkerResult",
    "free_ports",
    "logical_cpus",
    "mirrored",
    "network_available",
    "run_workers",
]
