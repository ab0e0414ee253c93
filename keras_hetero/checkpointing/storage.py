"""Checkpoint files: written atomically, verified before they are trusted
(the format is described in `keras_hetero/checkpointing/__init__.py`)."""

import hashlib
import json
import logging
import os
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


class CorruptCheckpointError(ValueError):
    """A checkpoint directory failed verification (see the message)."""


# --- writing -------------------------------------------------------------


def checkpoint_name(step):
    """The directory name of the checkpoint of train step `step`."""
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
    """Checkpoint names in `directory`, oldest first.

    Args:
        directory: An `ElasticCheckpoint` directory.

    Returns:
        A list of names (`ckpt-0000000010`: the global step), `[]` for a
        directory that does not exist. Partial writes (hidden temporary
        directories) are not listed; a listed one may still be corrupt
        (`verify`).

    Example:

    >>> kh.checkpointing.list_checkpoints("/no/such/directory")
    []
    """
    if not os.path.isdir(directory):
        return []
    return sorted(
        n
        for n in os.listdir(directory)
        if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit()
    )


def read_latest(directory):
    """The checkpoint the directory's `latest` pointer names.

    Args:
        directory: An `ElasticCheckpoint` directory.

    Returns:
        A checkpoint name, or None (no pointer yet, or unreadable).
        `newest_valid` is what a restart uses: the pointer's checkpoint
        if it verifies, else the newest that does.

    Example:

    >>> kh.checkpointing.read_latest("/no/such/directory") is None
    True
    """
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def verify(path):
    """Checks a checkpoint against its manifest; returns its state dict.

    Every file the manifest lists must exist with its size and SHA-256.

    Args:
        path: A checkpoint directory (`directory/ckpt-...`).

    Returns:
        The checkpoint's state: a dict with `global_step`, `epoch`,
        `step_in_epoch`, `shares`, `shuffle_seed` and the rest
        `ElasticCheckpoint` records (docs/checkpoints.md).

    Raises:
        CorruptCheckpointError: Saying what is missing or does not match.

    Example:

    >>> try:
    ...     kh.checkpointing.verify("/no/such/ckpt-0000000001")
    ... except kh.checkpointing.CorruptCheckpointError as error:
    ...     print("corrupt")
    corrupt
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

    Args:
        directory: An `ElasticCheckpoint` directory.

    Returns:
        `(path, state)` as `verify` gives the state, or None when no
        checkpoint verifies (or there is none).

    Example:

    >>> kh.checkpointing.newest_valid("/no/such/directory") is None
    True
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
