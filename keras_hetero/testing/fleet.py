"""An emulated mixed fleet: workers that describe their devices as other
machines' (a TEST SEAM, not a feature).

Every decision keras-hetero takes from what a device is (precision "auto",
`kh.doctor`, `kh.placement.profile`'s memory) reads one description,
`keras_hetero.devices.describe`. `emulated_fleet` makes that description
say "A100" on one worker and "Tesla T4" on another, so a test on CPUs runs
the same code path the real fleet would. Only the description changes: the
ops still run on the CPU, in the dtype the decision picked. With CPU quotas
(`run_workers(..., cpu_quotas=...)`) the emulated devices also differ in
speed.
"""

import contextlib
import json
import os

from keras_hetero import devices as devices_lib


@contextlib.contextmanager
def emulated_fleet(devices):
    """Makes worker processes started inside the `with` (and this process)
    describe their replica devices as `devices`.

    Sets `keras_hetero.devices.EMULATE_ENV`, which `run_workers` and the
    launcher pass on to the workers, and restores it on leaving.

    Args:
        devices: One entry per worker, by global worker index (a list), or
            one entry for every process (not a list). An entry is a name of
            `keras_hetero.devices.FLEET` (`"H100"`, `"A100"`, `"V100"`,
            `"T4"`, `"CPU"`) or a dict of `DeviceDescription` fields
            (`kind`, `model`, `compute_capability`, `memory_bytes`,
            `bfloat16`).

    Yields:
        None.

    Raises:
        ValueError: For an unknown entry (before anything is set).

    Example:

    >>> with emulated_fleet(["A100", "T4"]):
    ...     pass  # kh.testing.run_workers(target, 2): worker 1 is a "T4"
    """
    entries = devices if isinstance(devices, list) else [devices]
    for entry in entries:
        devices_lib.fleet_entry(entry)
    previous = os.environ.get(devices_lib.EMULATE_ENV)
    os.environ[devices_lib.EMULATE_ENV] = json.dumps(devices)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(devices_lib.EMULATE_ENV, None)
        else:
            os.environ[devices_lib.EMULATE_ENV] = previous
