"""An exactly-once ledger: which examples each train step trained, per
worker and attempt, and a reader that merges a restarted run and checks
that every epoch trained every example exactly once.

Exactly once is asserted from the ids, not inferred from weights: a step
trained twice on a restart, or an example skipped by a resume, shows as a
duplicated or missing id of a named epoch.
"""

import dataclasses
import glob
import hashlib
import json
import os
import re
import threading

import numpy as np
import tensorflow as tf

from keras_hetero import _distribute
from keras_hetero import _environment
from keras_hetero._compat import keras

_FILE = re.compile(r"attempt(\d+)-worker(\d+)\.jsonl$")


def ledger_key(example_id):
    """The integer the ledger records for one example id.

    Integer ids are recorded as they are; a string (or bytes) id as the
    first 8 bytes of its BLAKE2b hash, a signed 64-bit integer (any two of
    10^8 distinct ids collide with probability about 3e-4).

    Args:
        example_id: An int, numpy integer, str or bytes.

    Returns:
        An int.

    Raises:
        TypeError: If `example_id` is of another type.

    Example:

    >>> ledger_key(7)
    7
    >>> ledger_key("a") == ledger_key(b"a")
    True
    """
    if isinstance(example_id, (int, np.integer)) and not isinstance(
        example_id, bool
    ):
        return int(example_id)
    if isinstance(example_id, str):
        example_id = example_id.encode()
    if isinstance(example_id, bytes):
        digest = hashlib.blake2b(example_id, digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)
    raise TypeError(
        f"Invalid example id: {example_id!r} of type "
        f"{type(example_id).__name__}. Expected an integer, str or bytes."
    )


class Ledger(keras.callbacks.Callback):
    """A callback that writes, for each train step, the ids of the examples
    this worker's replicas trained on.

    Put `RecordIds(ledger)` in the model, on a feature and the batch's ids,
    and pass the ledger to `fit` FIRST among the callbacks: before
    `kh.callbacks.ElasticCheckpoint` (a step is then in the ledger before
    any checkpoint holds it; a kill between the two makes the restart
    repeat the step, and the reader drops the attempt's records after the
    step the next attempt restored), and before any callback that stops
    training (an epoch's end that a stop cut short is recorded as such).
    Each process appends JSON lines to `<folder>/attempt<A>-worker<W>.jsonl`:
    a `{"start": step}` line when training starts (the step a restart
    resumed after), `{"step", "epoch", "ids"}` per train step (per call with
    `steps_per_execution` > 1: `step` is the last step of the call) and
    `{"epoch_end": epoch, "step": step, "stopped": bool}` at each epoch's
    end (`stopped`: `model.stop_training` was set: the end may be early).
    Lines are flushed to the operating system at once, so a killed process
    (SIGKILL) loses none; `read_ledger` merges the files.

    Args:
        folder: The folder of the ledger's files (created if missing),
            shared by all workers or copied together before reading.
        attempt: The attempt number. Defaults to `None`: the launcher's
            `KERAS_HETERO_RESTART` (0 if unset).
        worker: This worker's number. Defaults to `None`: its place in
            `TF_CONFIG`'s cluster (chief first; 0 if unset).
        extra: A function `extra(step, logs)` returning a dict of more
            fields for each step's line (e.g. the loss). Defaults to `None`.

    Raises:
        ValueError: If `attempt` or `worker` is negative.

    Example:

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> ledger = Ledger(folder)
    >>> x_in = keras.Input((2,), name="x")
    >>> id_in = keras.Input((), dtype="int64", name="id")
    >>> out = keras.layers.Dense(1)(RecordIds(ledger)([x_in, id_in]))
    >>> model = keras.Model({"x": x_in, "id": id_in}, out)
    >>> model.compile("sgd", "mse")
    >>> x = {"x": np.zeros((4, 2), "float32"), "id": np.arange(4)}
    >>> _ = model.fit(x, np.zeros((4, 1)), batch_size=2, shuffle=False,
    ...               verbose=0, callbacks=[ledger])
    >>> report = read_ledger(folder, ids=range(4))
    >>> report.steps
    {1: [0, 1], 2: [2, 3]}
    >>> report.assert_exactly_once()
    """

    def __init__(self, folder, attempt=None, worker=None, extra=None):
        super().__init__()
        if attempt is None:
            attempt = int(os.environ.get(_environment.RESTART_ENV, "0"))
        if worker is None:
            worker = _distribute.env_task().worker_index
        for name, value in (("attempt", attempt), ("worker", worker)):
            if int(value) < 0:
                raise ValueError(
                    f"Invalid value for argument `{name}`. Received: "
                    f"{name}={value!r}. Expected an integer >= 0."
                )
        self.folder = os.fspath(folder)
        self.path = os.path.join(
            self.folder, f"attempt{int(attempt)}-worker{int(worker)}.jsonl"
        )
        self.extra = extra
        self._lock = threading.Lock()
        self._seen = []
        self._file = None
        self._epoch = 0
        self._started = False

    def add(self, keys):
        """Adds the ids (ledger keys) a replica trained on in this step;
        `RecordIds` calls it, from any replica's thread."""
        with self._lock:
            self._seen.extend(keys)

    def _write(self, record):
        if self._file is None:
            os.makedirs(self.folder, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def _step(self):
        return int(self.model.optimizer.iterations.numpy())

    def on_train_begin(self, logs=None):
        self._started = False
        with self._lock:
            self._seen.clear()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = int(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._started:
            # After `on_train_begin`, where a checkpoint callback restores.
            self._started = True
            self._write({"start": self._step()})

    def on_train_batch_end(self, batch, logs=None):
        step = self._step()
        with self._lock:
            ids, self._seen = self._seen, []
        record = {"step": step, "epoch": self._epoch, "ids": ids}
        if self.extra is not None:
            record.update(self.extra(step, logs or {}))
        self._write(record)

    def on_epoch_end(self, epoch, logs=None):
        # Keras ends an epoch that a callback stopped mid-way too; such an
        # end is recorded as `stopped` (so the ledger goes first: an
        # `EarlyStopping` after it stops at a finished epoch's end).
        stopped = bool(getattr(self.model, "stop_training", False))
        self._write(
            {"epoch_end": int(epoch), "step": self._step(), "stopped": stopped}
        )

    def on_train_end(self, logs=None):
        if self._file is not None:
            self._file.close()
            self._file = None


class RecordIds(keras.layers.Layer):
    """Identity on a feature that records the batch's example ids in a
    `Ledger` (or appends them to a list) at each training call.

    Called on `[features, ids]`, it returns `features` unchanged (plus a
    zero that keeps the recording in the graph); `ids` is a batch of
    integer or string ids (strings are recorded by `ledger_key`). Each
    replica records its own rows; in `predict` and `evaluate` nothing is
    recorded.

    Args:
        target: A `Ledger`, or a list the ledger keys are appended to.
        **kwargs: What `keras.layers.Layer` takes.

    Raises:
        TypeError: If `target` is neither.

    Example:

    >>> seen = []
    >>> layer = RecordIds(seen)
    >>> _ = layer([tf.zeros((2, 1)), tf.constant([3, 5])], training=True)
    >>> seen
    [3, 5]
    """

    def __init__(self, target, **kwargs):
        super().__init__(**kwargs)
        if isinstance(target, Ledger):
            add = target.add
        elif isinstance(target, list):
            add = target.extend
        else:
            raise TypeError(
                "Invalid value for argument `target`. Received: "
                f"target={target!r}. Expected a `kh.testing.Ledger` or a list."
            )
        # Not a Keras-tracked attribute (a list would be copied).
        object.__setattr__(self, "_add", add)

    def call(self, inputs, training=None):
        features, ids = inputs
        if training is False:
            return features

        def record(values):
            if values.dtype.kind in "SUO":
                keys = [ledger_key(v) for v in values.reshape(-1).tolist()]
            else:
                keys = np.rint(values).astype(np.int64).reshape(-1).tolist()
            self._add(keys)
            return np.zeros((), features.dtype.as_numpy_dtype)

        zero = tf.numpy_function(record, [ids], features.dtype)
        zero.set_shape([])
        return features + zero

    def compute_output_shape(self, input_shape):
        return input_shape[0]


@dataclasses.dataclass
class LedgerReport:
    """What a ledger says about a run, its restarts merged.

    Attributes:
        steps: `{step: sorted ledger keys}` of the steps the run counts:
            each attempt's up to the step the next attempt resumed after.
        restored: The step each attempt started after (0 for the first).
        epochs: `{epoch: ledger keys trained in it}`, of the counted steps.
        finished: The epochs the run finished: it recorded their end, or
            trained a later epoch.
        missing: `{epoch: keys}` of finished epochs: expected, not trained.
        duplicated: `{epoch: keys}`: trained more than once in the epoch.
        unexpected: `{epoch: keys}`: trained, but not in `ids`.
    """

    steps: dict
    restored: list
    epochs: dict
    finished: list
    missing: dict
    duplicated: dict
    unexpected: dict

    @property
    def exactly_once(self):
        """Whether no epoch missed, repeated or added an example."""
        return not (self.missing or self.duplicated or self.unexpected)

    def counts(self):
        """`(missing, duplicated, unexpected)`: ids summed over epochs."""
        return tuple(
            sum(len(keys) for keys in found.values())
            for found in (self.missing, self.duplicated, self.unexpected)
        )

    def summary(self):
        """One line: epochs, steps, and missing / duplicated counts."""
        missing, duplicated, unexpected = self.counts()
        partial = sorted(set(self.epochs) - set(self.finished))
        return (
            f"ledger: {len(self.finished)} finished epoch(s)"
            + (f" and partial epoch(s) {partial}" if partial else "")
            + f", {len(self.steps)} steps, {len(self.restored)} attempt(s): "
            f"{missing} missing, {duplicated} duplicated, "
            f"{unexpected} unexpected"
        )

    def assert_exactly_once(self):
        """Raises unless every finished epoch trained every example exactly
        once (and a partial one none twice).

        Raises:
            AssertionError: Naming the epochs and (up to 10 of) the ids.
        """
        if self.exactly_once:
            return
        lines = [self.summary()]
        for name, found in (
            ("missing", self.missing),
            ("duplicated", self.duplicated),
            ("unexpected", self.unexpected),
        ):
            for epoch, keys in sorted(found.items()):
                lines.append(
                    f"epoch {epoch}: {len(keys)} {name}: {keys[:10]}"
                    + (" ..." if len(keys) > 10 else "")
                )
        raise AssertionError("\n".join(lines))


def _segments(folder):
    """`{(attempt, index): {"start", "steps", "ends"}}`: each training run
    in a file (a `start` line begins one) merged over workers."""
    paths = glob.glob(os.path.join(os.fspath(folder), "attempt*-worker*.jsonl"))
    segments = {}
    for path in sorted(paths):
        match = _FILE.search(os.path.basename(path))
        if match is None:
            continue
        attempt, index = int(match.group(1)), -1
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.endswith("\n"):
                    break  # a line cut by a kill
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise ValueError(
                        f"Invalid ledger line {number} of {path}: {error}."
                    ) from None
                if "start" in record:
                    index += 1
                    segment = segments.setdefault(
                        (attempt, index),
                        {"start": record["start"], "steps": {}, "ends": {}},
                    )
                    if segment["start"] != record["start"]:
                        raise ValueError(
                            f"Workers of attempt {attempt} started after "
                            f"different steps ({segment['start']} and "
                            f"{record['start']} in {path}): not one job."
                        )
                    continue
                if index < 0:
                    raise ValueError(
                        f"Invalid ledger {path}: line {number} comes before "
                        "the attempt's `start` line."
                    )
                segment = segments[(attempt, index)]
                if "epoch_end" in record:
                    if not record.get("stopped"):
                        segment["ends"][record["epoch_end"]] = record["step"]
                    continue
                step = segment["steps"].setdefault(
                    record["step"], {"epoch": record["epoch"], "ids": []}
                )
                step["ids"].extend(record["ids"])
    return segments


def read_ledger(folder, ids=None):
    """Merges a run's ledger files (`Ledger`) and checks it.

    Attempts count in order (attempt number, then their order in a file):
    each one's steps after the step it resumed after, up to the step the
    next one resumed after (a step trained again after a restart counts
    once, from the later attempt). Then each epoch's ids are compared with
    `ids`: a finished epoch (its end recorded and not `stopped`, or a later
    epoch trained) must hold each exactly once; an unfinished one (the run
    stopped in it) none twice.

    Args:
        folder: The ledger's folder.
        ids: The example ids of an epoch (ints, strings or bytes). Defaults
            to `None`: only duplicates are checked.

    Returns:
        A `LedgerReport`.

    Raises:
        FileNotFoundError: If `folder` holds no ledger file.
        ValueError: If a line is not a ledger record, or workers of one
            attempt resumed after different steps.

    Example:

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with open(f"{folder}/attempt0-worker0.jsonl", "w") as f:
    ...     _ = f.write('{"start": 0}\\n'
    ...                 '{"step": 1, "epoch": 0, "ids": [1, 0]}\\n'
    ...                 '{"epoch_end": 0, "step": 1}\\n')
    >>> read_ledger(folder, ids=[0, 1]).exactly_once
    True
    >>> read_ledger(folder, ids=[0, 1, 2]).missing
    {0: [2]}
    """
    segments = _segments(folder)
    if not segments:
        raise FileNotFoundError(
            f"No ledger file (attempt<A>-worker<W>.jsonl) in {folder!r}."
        )
    order = sorted(segments)
    restored = [segments[key]["start"] for key in order]
    steps, epoch_of, finished = {}, {}, set()
    for position, key in enumerate(order):
        last = restored[position + 1] if position + 1 < len(order) else np.inf
        segment = segments[key]
        for step, record in segment["steps"].items():
            if restored[position] < step <= last:
                steps[step] = sorted(record["ids"])
                epoch_of[step] = record["epoch"]
        for epoch, step in segment["ends"].items():
            if restored[position] < step <= last:
                finished.add(epoch)
    epochs = {}
    for step in sorted(steps):
        epochs.setdefault(epoch_of[step], []).extend(steps[step])
    # An epoch the run went past ended, also where a kill at its last step
    # kept every worker from recording the end.
    finished.update(epoch for epoch in epochs if epoch < max(epochs))
    expected = None
    if ids is not None:
        expected = np.array(sorted(ledger_key(i) for i in ids), np.int64)
    missing, duplicated, unexpected = {}, {}, {}
    for epoch, keys in epochs.items():
        values, counts = np.unique(np.array(keys, np.int64), return_counts=True)
        if (counts > 1).any():
            duplicated[epoch] = values[counts > 1].tolist()
        if expected is None:
            continue
        extra = np.setdiff1d(values, expected)
        if extra.size:
            unexpected[epoch] = extra.tolist()
        if epoch in finished:
            lost = np.setdiff1d(expected, values)
            if lost.size:
                missing[epoch] = lost.tolist()
    return LedgerReport(
        steps=dict(sorted(steps.items())),
        restored=restored,
        epochs=epochs,
        finished=sorted(finished),
        missing=missing,
        duplicated=duplicated,
        unexpected=unexpected,
    )
