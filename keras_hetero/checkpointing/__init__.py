"""Checkpoint storage and scheduling behind `ElasticCheckpoint` (the
callback itself is `keras_hetero/checkpointing/callback.py`).

Storage is atomic: a checkpoint is written into a hidden temporary directory,
every file is fsynced and listed with its size and SHA-256 in `MANIFEST.json`
(written last), the directory is renamed into place, and only then does the
`latest` pointer move (write-to-temp + `os.replace`). A reader verifies the
manifest before trusting a checkpoint and falls back to the newest one that
verifies. Tensors are stored in TensorFlow's checkpoint bundle format (what
`tf.train.Checkpoint` writes, readable with `tf.train.load_checkpoint`; no
pickle); the rest of the state is JSON.

Scheduling: `parse_save_every` accepts steps, durations or `"auto"`, and
`young_daly_interval` gives the interval that minimises expected lost time,
`sqrt(2 * C * MTBF)` for a save cost `C` (Young, 1974; Daly, 2006).
"""

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil

import numpy as np

logger = logging.getLogger("keras_hetero")

PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
MANIFEST = "MANIFEST.json"
STATE = "state.json"
TENSORS = "tensors"
FORMAT = 1

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class CorruptCheckpointError(ValueError):
    """A checkpoint directory failed verification (see the message)."""


@dataclasses.dataclass(frozen=True)
class SaveEvery:
    """A parsed `save_every`: exactly one of the fields is set.

    Attributes:
        steps: Save every this many train steps.
        seconds: Save when this many seconds passed since the last save.
        auto: Young/Daly interval from the measured save cost.
    """

    steps: int = None
    seconds: float = None
    auto: bool = False


def parse_duration(value, name):
    """Seconds in `value`: a positive number, or a string like "30s", "5m".

    Raises:
        ValueError: Naming `name` and the value, if it is neither.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION.match(value):
        number, unit = _DURATION.match(value).groups()
        seconds = float(number) * _UNIT_SECONDS[unit]
    else:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: "
            f"{name}={value!r}. Expected a positive number of seconds or a "
            'duration string such as "500ms", "30s", "5m" or "2h".'
        )
    return seconds


def parse_save_every(value):
    """Parses `ElasticCheckpoint(save_every=...)`.

    Args:
        value: A positive int (steps), a duration string ("30s", "5m",
            "2h", "500ms"), or "auto".

    Returns:
        A `SaveEvery`.

    Raises:
        ValueError: For anything else.

    Example:

    >>> parse_save_every("5m").seconds
    300.0
    """
    if isinstance(value, str) and value.strip() == "auto":
        return SaveEvery(auto=True)
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 1:
            return SaveEvery(steps=value)
    elif isinstance(value, str) and _DURATION.match(value):
        return SaveEvery(seconds=parse_duration(value, "save_every"))
    raise ValueError(
        "Invalid value for argument `save_every`. Received: "
        f"save_every={value!r}. Expected a positive int (steps), a duration "
        'string such as "30s", "5m" or "2h", or "auto".'
    )


def young_daly_interval(save_cost, mtbf, minimum=0.0):
    """Seconds between saves minimising expected lost work: sqrt(2·C·MTBF).

    Args:
        save_cost: Seconds one save costs training (C).
        mtbf: Mean seconds between failures.
        minimum: Lower bound (e.g. the time a background write takes, so at
            most one save is in flight). Defaults to `0.0`.

    Returns:
        The interval in seconds.

    Example:

    >>> round(young_daly_interval(0.5, 3600), 1)
    60.0
    """
    return max(math.sqrt(2.0 * max(save_cost, 0.0) * mtbf), minimum)


# --- writing -------------------------------------------------------------


def checkpoint_name(step):
    return f"{PREFIX}{int(step):010d}"


def write(directory, step, arrays, state):
    """Writes one checkpoint atomically; returns its path.

    Args:
        directory: The checkpoint root (must exist).
        step: Global train step; names the checkpoint.
        arrays: List of numpy arrays (the tensors).
        state: JSON-serialisable dict.

    Returns:
        The final checkpoint directory.
    """
    import tensorflow as tf

    name = checkpoint_name(step)
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # The op behind `tf.train.Checkpoint`, on plain tensors: creating
        # variables here (a background thread) would go through the
        # strategy's variable creator, which under MultiWorkerMirrored
        # broadcasts initial values to all workers -- and only the chief
        # saves.
        with tf.device("/cpu:0"):
            tf.raw_ops.SaveV2(
                prefix=os.path.join(tmp, TENSORS),
                tensor_names=[f"t{i}" for i in range(len(arrays))],
                shape_and_slices=[""] * len(arrays),
                tensors=[tf.constant(a) for a in arrays],
            )
        with open(os.path.join(tmp, STATE), "w") as f:
            json.dump({**state, "format": FORMAT, "tensors": len(arrays)}, f)
        files = sorted(os.listdir(tmp))
        manifest = {}
        for file in files:
            path = os.path.join(tmp, file)
            _fsync(path)
            manifest[file] = {
                "bytes": os.path.getsize(path),
                "sha256": _sha256(path),
            }
        _write_json_synced(os.path.join(tmp, MANIFEST), manifest)
        _fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(directory)
        pointer = os.path.join(directory, f"{TMP_PREFIX}{LATEST}")
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(directory, LATEST))
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune(directory, keep):
    """Deletes all but the newest `keep` checkpoints (never `latest`)."""
    names = list_checkpoints(directory)
    latest = read_latest(directory)
    for name in names[:-keep] if keep < len(names) else []:
        if name != latest:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def remove_partial(directory):
    """Deletes temporary directories a killed writer left behind."""
    for name in os.listdir(directory):
        if name.startswith(TMP_PREFIX + PREFIX):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


# --- reading -------------------------------------------------------------


def list_checkpoints(directory):
    """Checkpoint names in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        n
        for n in os.listdir(directory)
        if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit()
    )


def read_latest(directory):
    """The name the `latest` pointer names, or None."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def verify(path):
    """Checks a checkpoint against its manifest; returns its state dict.

    Raises:
        CorruptCheckpointError: Saying what is missing or does not match.
    """
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        raise CorruptCheckpointError(
            f"{path}: no readable {MANIFEST} ({error})"
        ) from None
    for file, expected in manifest.items():
        full = os.path.join(path, file)
        if not os.path.exists(full):
            raise CorruptCheckpointError(f"{path}: {file} is missing")
        size = os.path.getsize(full)
        if size != expected["bytes"]:
            raise CorruptCheckpointError(
                f"{path}: {file} has {size} bytes, expected "
                f"{expected['bytes']} (truncated?)"
            )
        if _sha256(full) != expected["sha256"]:
            raise CorruptCheckpointError(f"{path}: {file} checksum mismatch")
    with open(os.path.join(path, STATE)) as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise CorruptCheckpointError(
            f"{path}: format {state.get('format')!r}, expected {FORMAT}"
        )
    return state


def newest_valid(directory):
    """`(path, state)` of the newest checkpoint that verifies, or None.

    Tries the one `latest` names first, then the others newest first;
    each one skipped is reported with a warning saying why.
    """
    names = list_checkpoints(directory)
    latest = read_latest(directory)
    order = ([latest] if latest in names else []) + [
        n for n in reversed(names) if n != latest
    ]
    if latest is not None and latest not in names:
        logger.warning(
            "ElasticCheckpoint: `latest` names %s, which does not exist in "
            "%s; looking for the newest valid checkpoint.",
            latest,
            directory,
        )
    for name in order:
        path = os.path.join(directory, name)
        try:
            return path, verify(path)
        except CorruptCheckpointError as error:
            logger.warning(
                "ElasticCheckpoint: skipping checkpoint %s, which is "
                "incomplete or corrupt: %s. Trying the previous one.",
                name,
                error,
            )
    return None


def read_arrays(path, count):
    """The `count` tensors of a verified checkpoint, as numpy arrays."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(path, TENSORS))
    return [np.asarray(reader.get_tensor(f"t{i}")) for i in range(count)]


# --- helpers -------------------------------------------------------------


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_synced(path, data):
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
