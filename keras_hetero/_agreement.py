"""One job, one set of decisions: what the workers of a multi-worker job
exchange so that they decide alike, and the check that their settings
match.

Each worker contributes one record (a JSON object: its devices and the
settings that must match); `exchange` hands every worker all records in
ONE all-gather of a fixed shape, so the exchange itself completes whatever
the records hold. `check_settings` then raises the same error on every
worker, naming each setting that differs, the workers and their values.
"""

import hashlib
import json
import weakref

import numpy as np
import tensorflow as tf

from keras_hetero import _distribute

# Bytes of one worker's record on the wire (int32 words, the first holding
# the length). Fixed, so every worker's gather has the same shape.
RECORD_BYTES = 8192


def needs_exchange(strategy):
    """Whether `strategy` runs several worker processes that each decide
    for themselves (MultiWorkerMirroredStrategy across workers). Under
    ParameterServerStrategy one process, the coordinator, decides; under
    any other strategy there is one process."""
    return _distribute.is_multi_worker(strategy)


def exchange(strategy, record):
    """Every worker's `record`, by global worker index.

    Under a multi-worker strategy every worker must call this at the same
    point (one all-gather); elsewhere it returns `[record]` and costs
    nothing.

    Args:
        strategy: The job's strategy.
        record: A JSON-serialisable dict (this worker's).

    Returns:
        A list of the workers' records, worker 0 first.

    Raises:
        ValueError: If a worker's record does not fit in `RECORD_BYTES`
            (raised on every worker).
    """
    if not needs_exchange(strategy):
        return [record]
    index = _distribute.env_task().worker_index
    words = encode({"worker": index, **record})
    rows = _gather_rows(strategy, words)
    records = {}
    for row in rows:
        decoded = decode(row)
        records[decoded.pop("worker")] = decoded
    oversize = sorted(w for w, r in records.items() if "oversize" in r)
    if oversize:
        raise ValueError(
            f"The settings of worker(s) {oversize} do not fit the "
            f"{RECORD_BYTES} bytes workers exchange at the start of `fit` "
            f"({[records[w]['oversize'] for w in oversize]} bytes)."
        )
    return [records[w] for w in sorted(records)]


def encode(record):
    """`record` as `RECORD_BYTES // 4 + 1` int32 words (length first); a
    record too long becomes `{"worker": ..., "oversize": length}`."""
    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > RECORD_BYTES:
        small = {"worker": record.get("worker"), "oversize": len(data)}
        data = json.dumps(small).encode()
    padded = data + b"\0" * (RECORD_BYTES - len(data))
    words = np.frombuffer(padded, dtype="<i4")
    return np.concatenate([[len(data)], words]).astype(np.int32)


def decode(words):
    """The record `encode` made of `words`."""
    words = np.asarray(words, dtype=np.int32)
    data = words[1:].astype("<i4").tobytes()[: int(words[0])]
    return json.loads(data.decode())


def _gather_rows(strategy, words):
    """One row of `words` per global replica (a worker's replicas all send
    its words)."""
    gather = _GATHERS.get(strategy)
    if gather is None:
        # Traced once per strategy (the words have a fixed shape): an eager
        # gather builds its collective anew at every call.
        @tf.function
        def gather(value):
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda _: tf.identity(value)
            )
            return strategy.gather(per_replica, axis=0)

        _GATHERS[strategy] = gather
    gathered = gather(tf.constant(words[None, :]))
    return np.asarray(gathered).reshape(-1, len(words))


# The traced gather of each live strategy.
_GATHERS = weakref.WeakKeyDictionary()


def digest(value):
    """A short, stable digest of a JSON-serialisable value (for values too
    long to exchange whole, e.g. every weight's shape)."""
    text = json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:12]


def mismatches(settings):
    """The settings whose values differ between workers.

    Args:
        settings: One dict of `{setting: value}` per worker, by worker
            index (a setting a worker lacks counts as None).

    Returns:
        A list of `(setting, values)`, `values` one per worker, in the
        settings' sorted order.

    Example:

    >>> mismatches([{"batch": 32, "seed": 1}, {"batch": 64, "seed": 1}])
    [('batch', [32, 64])]
    """
    names = sorted(set().union(*settings)) if settings else []
    found = []
    for name in names:
        values = [worker.get(name) for worker in settings]
        if any(value != values[0] for value in values[1:]):
            found.append((name, values))
    return found


def mismatch_message(found, when):
    """The error text for settings that differ between workers.

    Args:
        found: What `mismatches` returned (not empty).
        when: What was being prepared, e.g. ``"`fit`"``.

    Returns:
        A message naming each setting, the workers and their values.

    Example:

    >>> message = mismatch_message([("batch", [32, 64])], "`fit`")
    >>> "batch: worker 0: 32, worker 1: 64" in message
    True
    """
    parts = []
    for name, values in found:
        per_worker = ", ".join(
            f"worker {index}: {value!r}" for index, value in enumerate(values)
        )
        parts.append(f"{name}: {per_worker}")
    return (
        "The workers of this job differ in settings that must match "
        f"(checked before the first step of {when}, so no worker trains "
        "differently or waits in a collective): "
        + "; ".join(parts)
        + ". Give every worker the same values."
    )


def check_settings(records, when):
    """Raises unless every worker's `"settings"` are the same.

    Args:
        records: What `exchange` returned.
        when: What was being prepared, for the message.

    Raises:
        ValueError: Naming the settings, the workers and their values (the
            same on every worker, which all hold all records).
    """
    found = mismatches([record.get("settings", {}) for record in records])
    if found:
        raise ValueError(mismatch_message(found, when))
