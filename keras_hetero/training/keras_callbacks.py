"""Keras' own file-writing callbacks under multi-worker training.

Under MultiWorkerMirroredStrategy every worker runs the same `fit`, and so
the same callbacks. Keras 3's `BackupAndRestore`, `ModelCheckpoint`,
`TensorBoard` and `CSVLogger` (and tf-keras' `CSVLogger`) have no notion of
a chief: every worker writes the same paths, h5 files fail to lock
(`BlockingIOError`) and the job dies. tf-keras' answer, followed here: the
chief writes the user's paths and every other worker writes the same files
to a temporary directory that is removed afterwards. The other workers keep
writing (rather than skip) because a save may read sync-on-read variables,
a collective that needs every worker.

`prepare`, called by `HeteroModel.fit`:

- on the chief changes nothing;
- on every other worker points each such callback at its own directory
  under one temporary directory, removed (and the callbacks pointed back)
  when `fit` returns or fails;
- gives a non-chief `BackupAndRestore` a copy of the chief's backup first,
  so every worker restores the same state while only the chief writes, and
  deletes, the backup.

With any `BackupAndRestore` (either flavour) the workers first meet (a
previous `fit`'s chief may still be deleting its backup), then compare the
names and sizes of the files they see in `backup_dir`: if they differ (a
directory that not every worker reads as the same, so the workers would
restore different states), `fit` stops on every worker with a `ValueError`
before anything is restored.
"""

import os
import shutil
import tempfile
import zlib

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._compat import keras


def prepare(model, callbacks):
    """Makes Keras' file-writing callbacks safe on this worker.

    Args:
        model: The model about to `fit`.
        callbacks: What `fit` was given as `callbacks`.

    Returns:
        A function that undoes every change, to call when `fit` returns or
        fails.

    Raises:
        ValueError: If the workers see different files in the `backup_dir`
            of a `BackupAndRestore` (it is not shared by them).

    Example:

    >>> undo = prepare(model, callbacks)  # doctest: +SKIP
    >>> try:
    ...     model.fit(x, callbacks=callbacks)
    ... finally:
    ...     undo()
    """
    strategy = model.distribute_strategy
    if not isinstance(callbacks, (list, tuple)) or not (
        _distribute.is_multi_worker(strategy)
    ):
        return _nothing
    backups = [
        c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)
    ]
    if backups:
        # A previous `fit`'s chief may still be deleting its backup.
        _barrier(strategy)
        for backup in backups:
            _check_shared(strategy, backup.backup_dir)
    redirected = []
    if not _distribute.is_chief(strategy):
        redirected = [c for c in callbacks if _compat.shared_file_paths(c)]
    directory = _temporary_directory(strategy) if redirected else None
    undos = [
        _redirect(callback, os.path.join(directory, str(index)))
        for index, callback in enumerate(redirected)
    ]

    def undo():
        for undo_one in reversed(undos):
            undo_one()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    return undo


def _nothing():
    pass


def _temporary_directory(strategy):
    resolver = strategy.cluster_resolver
    return tempfile.mkdtemp(
        prefix=f"keras_hetero-{resolver.task_type}{resolver.task_id}-"
    )


def _redirect(callback, directory):
    """Points `callback`'s paths into `directory`; returns the undo."""
    paths = _compat.shared_file_paths(callback)
    moved = {
        name: os.path.join(directory, _relative(path))
        for name, path in paths.items()
    }
    for name, path in moved.items():
        parent = os.path.dirname(path)
        if "{" not in parent:  # ModelCheckpoint formats its own
            os.makedirs(parent, exist_ok=True)
        original = paths[name]
        if (
            _compat.restores_from_files(callback)
            and tf.io.gfile.exists(original)
            and not tf.io.gfile.isdir(original)
        ):
            tf.io.gfile.copy(original, path, overwrite=True)
    for name, path in moved.items():
        setattr(callback, name, path)

    def undo():
        for name, path in paths.items():
            setattr(callback, name, path)

    return undo


def _relative(path):
    """`path` as a relative path, so it can live under another directory
    with its structure (`{epoch}` placeholders included)."""
    path = os.fspath(path).split("://", 1)[-1]
    return os.path.splitdrive(path)[1].lstrip("/\\") or "_"


def _barrier(strategy):
    _gather(strategy, [0])


def _gather(strategy, values):
    """`values` (ints) of every replica of the job: one row per replica."""
    values = tf.constant(values, tf.int64)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda _: values
    )
    gathered = strategy.gather(per_replica, axis=0)
    return np.asarray(gathered).reshape(strategy.num_replicas_in_sync, -1)


def _listing_checksum(directory):
    """A checksum of the names and sizes of the files under `directory`,
    leaving out tf-keras' temporary `workertemp_<i>` directories."""
    lines = []
    if tf.io.gfile.isdir(directory):
        for parent, folders, names in tf.io.gfile.walk(directory):
            folders[:] = [f for f in folders if not f.startswith("workertemp_")]
            for name in names:
                path = os.path.join(parent, name)
                relative = os.path.relpath(path, directory)
                lines.append(f"{relative}:{tf.io.gfile.stat(path).length}")
    return zlib.crc32("\n".join(sorted(lines)).encode())


def _check_shared(strategy, backup_dir):
    """Raises on every worker unless all see the same files in `backup_dir`.

    Raises:
        ValueError: If they do not.
    """
    rows = _gather(strategy, [_listing_checksum(backup_dir)])
    if (rows == rows[0]).all():
        return
    raise ValueError(
        f"`BackupAndRestore(backup_dir={backup_dir!r})`: the workers see "
        "different files in it (checksum of the file names and sizes per "
        f"replica, worker 0's first: {rows.ravel().tolist()}). Every worker "
        "restores the chief's backup, so `backup_dir` must be storage that "
        "all workers read as the same directory (a shared or network file "
        "system, or a bucket such as gs://...), not a local directory on "
        "each machine."
    )
