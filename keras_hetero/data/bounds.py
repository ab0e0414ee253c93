"""The split's row bounds, computed inside the input pipeline.

`ShareSchedule` (pure Python, data/shares.py) is the record of which shares
split which global batch. Asking it from the pipeline took a Python callback
per global batch (`numpy_function`: a thread switch and the GIL, which
Keras' own Python loop holds between steps); side by side in one process
that callback was most of the split's cost: about 0.3 ms of CPU per global
batch, the largest piece of HeteroModel's per-step cost under
MirroredStrategy (measured with benchmarks/overhead.py; in the history of
docs/benchmarks.md, "Per-step cost").

`PipelineSplit` keeps a copy of the schedule in host variables that the
pipeline reads with native ops, and the pipeline's position in another, so
no Python runs per batch. The schedule stays the record; the protocol below
keeps it truthful without a lock the pipeline would have to take:

- The pipeline, for each global batch in order (one sequential `map`):
  *claims* the batch (writes its `(pass, index)` to `cursor`), then reads
  the table, then writes down which table version it read (`seen`).
- `publish(changes, start)`, for a change from batch `start`: writes the
  table, then reads `cursor`. If no batch at or after `start` was claimed
  yet, every such batch reads the table after the write: the change holds
  from `start`. Otherwise the pipeline raced past `start` during the write;
  once the claimed batches have written down their version (microseconds),
  the first batch that read the new table is where the change really took
  effect, and `publish` returns it (the versions batches read only grow).
"""

import time

import numpy as np
import tensorflow as tf

from keras_hetero import _compat

# A global batch's key: pass << KEY_BITS | index, one int64 ordered as
# (pass, index) is.
KEY_BITS = 32
_NONE = np.iinfo(np.int64).min


def batch_key(position):
    """The int64 key of global batch `position = (pass, index)`."""
    number, index = position
    return (int(number) << KEY_BITS) + int(index)


def batch_position(key):
    """`(pass, index)` of a `batch_key`."""
    return (int(key) >> KEY_BITS, int(key) & ((1 << KEY_BITS) - 1))


def rows_from_shares(shares, total_rows):
    """`shares.rows_from_shares` in-graph: the same rows, bit for bit.

    Args:
        shares: A float64 vector summing to 1.
        total_rows: An int64 scalar.

    Returns:
        An int64 vector, one row count per replica, summing to `total_rows`.
    """
    exact = shares * tf.cast(total_rows, tf.float64)
    floor = tf.floor(exact)
    rows = tf.cast(floor, tf.int64)
    missing = total_rows - tf.reduce_sum(rows)
    # The rows left over go one each to the largest remainders, ties to the
    # lower replica (numpy's stable argsort of the negated remainders).
    order = tf.argsort(-(exact - floor), stable=True)
    extra = tf.cast(
        tf.range(tf.size(rows, out_type=tf.int64)) < missing, tf.int64
    )
    return rows + tf.scatter_nd(order[:, None], extra, tf.shape(rows))


class PipelineSplit:
    """A `ShareSchedule`'s copy that the input pipeline reads in-graph.

    Made by the pipeline (inside `distribute_datasets_from_function`, so its
    variables sit on the worker's host device, next to the pipeline) and
    attached to the schedule with `ShareSchedule.attach`.

    Args:
        num_replicas: Replicas the global batches are split across.
    """

    def __init__(self, num_replicas):
        self.num_replicas = num_replicas
        self._version = 0
        self._cursor = _compat.host_variable(tf.constant([-1, 0], tf.int64))
        self._table = _compat.host_variable(
            tf.zeros([1, 1 + num_replicas], tf.int64),
            shape=tf.TensorShape([None, 1 + num_replicas]),
        )
        self._seen = _compat.host_variable(tf.constant([-1, _NONE, _NONE]))

    def cursor(self):
        """`(pass, next index)` as the pipeline left it; pass -1 before the
        first batch."""
        number, index = self._cursor.numpy().tolist()
        return number, index

    def publish(self, changes, start=None, timeout=10.0):
        """Makes the pipeline split by `changes` from now on.

        Args:
            changes: The schedule's `[((pass, index), shares), ...]`, sorted.
            start: The batch the newest change starts at, to check; None to
                skip the check (a restored schedule, or a rewrite that
                changes only batches already split).
            timeout: Seconds to wait for claimed batches to write down
                what they read (they do so right after claiming).

        Returns:
            The batch from which the change at `start` holds: `start`, or a
            later batch if the pipeline split `start` before the write landed.
            None if `start` is None.

        Raises:
            RuntimeError: If a claimed batch did not write down its table
                version within `timeout` (the pipeline's thread stopped
                between two of its own ops).
        """
        self._write(changes)
        if start is None:
            return None
        return self._settle(tuple(start), timeout)

    def _write(self, changes):
        self._version += 1
        number, index = self.cursor()
        # The batches still to read the table are those not claimed yet and
        # the one claimed last: keep the change in force for it, and after.
        last_claimed = batch_key((number, index)) - 1
        keys = [batch_key(at) for at, _ in changes]
        first = max(
            [i for i, key in enumerate(keys) if key <= last_claimed] or [0]
        )
        rows = [[self._version] + [0] * self.num_replicas]
        for key, (_, shares) in zip(keys[first:], changes[first:]):
            bits = np.asarray(shares, np.float64).view(np.int64)
            rows.append([key, *bits.tolist()])
        self._table.assign(np.asarray(rows, np.int64))

    def _settle(self, start, timeout):
        """Where the change written last, meant from `start`, took effect."""
        number, index = self.cursor()
        if batch_key((number, index)) <= batch_key(start):
            return start  # no batch at or after `start` claimed yet
        last_claimed = batch_key((number, index - 1))
        deadline = time.monotonic() + timeout
        while True:
            version, first_key, seen_key = self._seen.numpy().tolist()
            if seen_key >= last_claimed:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"The input pipeline claimed global batch "
                    f"{batch_position(last_claimed)} but did not read its "
                    f"split within {timeout} s; a share change from "
                    f"{start} cannot be placed exactly."
                )
            time.sleep(0.0002)
        # The first batch that read the new table; if none has yet, the
        # next one to be claimed will.
        took = (
            first_key
            if version == self._version
            else batch_key((number, index))
        )
        return max(batch_position(took), start)

    def bounds(self, index, total_rows):
        """Row bounds of global batch `index` of the current pass, in-graph.

        Index 0 starts a new pass. Replica `i` takes rows
        `[bounds[i], bounds[i + 1])`. Claims the batch (see the module's
        docstring); call once per global batch, in order.

        Args:
            index: The batch's int64 index in its pass.
            total_rows: Its rows (an integer scalar tensor).

        Returns:
            An int64 vector of `num_replicas + 1` bounds.
        """
        index = tf.cast(index, tf.int64)
        cursor = self._cursor.read_value()
        number = tf.where(index == 0, cursor[0] + 1, cursor[0])
        claim = self._cursor.assign(tf.stack([number, index + 1]))
        with tf.control_dependencies([claim]):
            table = self._table.read_value()
        key = number * (1 << KEY_BITS) + index
        version = table[0, 0]
        seen = self._seen.read_value()
        first = tf.where(seen[0] == version, seen[1], key)
        record = self._seen.assign(tf.stack([version, first, key]))
        changes = table[1:]
        which = tf.reduce_sum(tf.cast(changes[:, 0] <= key, tf.int32)) - 1
        shares = tf.bitcast(changes[which, 1:], tf.float64)
        rows = rows_from_shares(shares, tf.cast(total_rows, tf.int64))
        with tf.control_dependencies([record]):
            bounds = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(rows)], 0)
        bounds.set_shape([self.num_replicas + 1])
        return bounds
