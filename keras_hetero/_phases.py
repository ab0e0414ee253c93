"""The phases of a worker's start, timed for the launcher.

`kh.launcher.launch` and `launch_host` set `PHASES_ENV` to a file per
worker and attempt; `mark(name)` appends the wall-clock time this process
first reached phase `name` to it, and the launcher logs each attempt's
phases once its workers have all trained a step (`launcher.timing`). With
no launcher (the variable unset) `mark` does nothing.

The phases, in the order a worker reaches them:

- `IMPORTED`: `import keras_hetero` done (TensorFlow and Keras imported);
- `IN_FIT`: `HeteroModel.fit` began on every worker (the cluster formed,
  the model was built and compiled, the workers' settings agreed);
- `RESTORED`: `ElasticCheckpoint` restored the newest checkpoint (or found
  none);
- `FIRST_STEP`: the first train step done (traced and run).
"""

import os
import time

from keras_hetero._environment import PHASES_ENV

IMPORTED = "imported"
IN_FIT = "in fit"
RESTORED = "restored"
FIRST_STEP = "first step"
ORDER = (IMPORTED, IN_FIT, RESTORED, FIRST_STEP)

_marked = set()


def mark(name):
    """Records that this process reached phase `name` now (the first
    time only; nothing without the launcher's `PHASES_ENV`)."""
    if name in _marked:
        return
    _marked.add(name)
    path = os.environ.get(PHASES_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(f"{name}\t{time.time():.6f}\n")
    except OSError:
        pass  # timing is for the log only: never fail a worker over it


def read(path):
    """`{phase: wall-clock time}` from a worker's phases file (empty if
    there is none yet; a half-written last line is skipped)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, _, value = line.partition("\t")
        try:
            times.setdefault(name, float(value))
        except ValueError:
            pass
    return times
