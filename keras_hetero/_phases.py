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

With `IMPORTED` the file gets the values `IMPORT_ENV` had then, which a
warm spare for the next attempt imports with (`launcher.warm`).
"""

import json
import os
import time

from keras_hetero._environment import PHASES_ENV

IMPORTED = "imported"
IN_FIT = "in fit"
RESTORED = "restored"
FIRST_STEP = "first step"
ORDER = (IMPORTED, IN_FIT, RESTORED, FIRST_STEP)
# Read when TensorFlow or Keras is imported (the Keras flavour,
# `keras_hetero._compat.flavour`; Keras 3's backend; oneDNN's kernels): a
# process imported with one value cannot serve a script that wants another.
IMPORT_ENV = ("TF_USE_LEGACY_KERAS", "KERAS_BACKEND", "TF_ENABLE_ONEDNN_OPTS")
_ENV_LINE = "import env"

_marked = set()


def mark(name, imported_with=None):
    """Records that this process reached phase `name` now (the first
    time only; nothing without the launcher's `PHASES_ENV`). With
    `IMPORTED`, `imported_with` are the `IMPORT_ENV` values the libraries
    were imported with (default: this environment's now)."""
    path = os.environ.get(PHASES_ENV)
    if not path or name in _marked:
        return
    _marked.add(name)
    line = f"{name}\t{time.time():.6f}\n"
    if name == IMPORTED:
        values = imported_with or {n: os.environ.get(n) for n in IMPORT_ENV}
        line += f"{_ENV_LINE}\t{json.dumps(values)}\n"
    try:
        with open(path, "a") as f:
            f.write(line)
    except OSError:
        pass  # timing is for the log only: never fail a worker over it


def import_env(path):
    """The `IMPORT_ENV` values a worker had when it imported keras_hetero
    (from its phases file), or None if it has not."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition("\t")
        if name == _ENV_LINE:
            try:
                return json.loads(value)
            except ValueError:
                return None
    return None


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
