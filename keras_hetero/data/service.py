"""Input through TensorFlow's own distributed input engine, the tf.data
service: `kh.data.shard(examples, B, service=address)`.

The service's workers run the examples' pipeline (reading and parsing
included) and, in `"distributed_epoch"` mode, hand each element out once
per pass between all consumers: the data is read once per pass between the
service's workers, whatever the number of training workers. Each training
worker pulls elements (blocks of a few rows) from one service job per pass
(all workers join it by name) and keeps the rows in a FIFO; at each step it
takes the rows its replicas train on under the shares in force (the split's
bounds), pulling more blocks as it needs them. Which rows a worker gets is
decided by the order in which workers ask, not by a queue every worker
computes (`kh.data.blocks`): the service is the queue.

A pass has `ceil(examples / global batch)` steps on every worker (the
synchronous replicas must agree on it, so the number of examples must be
known). At the pass's last step each worker trains every row it still
holds, and a worker that the service ran out of before trains fewer rows
(down to none): every example the service hands out trains once, and the
per-replica batches follow the shares except at a pass's end. The exact
gradient over unequal replica batches (`kh.HeteroModel`) makes that step
the mean over the rows the workers hold, as one device on them would.

No checkpoint can hold the service's hand-out, so a run resumes at a pass
boundary: `kh.callbacks.ElasticCheckpoint` saves only at epochs' ends under
a service input (see docs/arrow.md, "Three ways to read").
"""

import collections
import secrets
import socket
import urllib.parse

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero.data import passes

# Seconds to wait for the dispatcher's port before `shard` gives up.
_CONNECT_TIMEOUT = 5.0

# `HeteroDataset.shuffle_mechanism` and `reads` under a service input.
SERVICE = "service"

# Stages that each service worker would apply to its own part of the data
# (`"distributed_epoch"` splits the source between them), not to the whole.
_PER_PART = {
    "TakeDataset": "`take`",
    "SkipDataset": "`skip`",
    "ShardDataset": "`shard`",
    "RepeatDataset": "`repeat`",
    "AssertCardinalityDataset": "`assert_cardinality` (but as the last stage)",
}


def check_pipeline(examples):
    """Refuses stages of `examples` that would mean something else on a
    tf.data service in `"distributed_epoch"` mode, where each service
    worker runs the pipeline over a part of the data.

    Raises:
        ValueError: Naming the stages found.
    """
    graph = _compat.dataset_graph(
        _compat.without_last_cardinality_assertion(examples)
    )
    nodes = [
        *graph.node,
        *(n for f in graph.library.function for n in f.node_def),
    ]
    found = sorted({_PER_PART[n.op] for n in nodes if n.op in _PER_PART})
    if found:
        raise ValueError(
            "Invalid value for argument `examples`: under a tf.data service "
            "each service worker runs the pipeline over a part of the data "
            "(`distributed_epoch`), so these stages would apply to each "
            f"part, not to the whole: {', '.join(found)}. Expected a finite "
            "pipeline without them (its number of examples known, or "
            "asserted by `tf.data.experimental.assert_cardinality` as its "
            "last stage, which the service does not run)."
        )


def check_address(service):
    """The dispatcher address of `service`, checked reachable.

    Args:
        service: `"grpc://host:port"`, `"host:port"`, or a
            `tf.data.experimental.service.DispatchServer`.

    Returns:
        `"grpc://host:port"`.

    Raises:
        ValueError: If `service` is not an address, or nothing listens
            there (the message names the address and the error).

    Example:

    >>> check_address("grpc://127.0.0.1:1")  # doctest: +SKIP
    Traceback (most recent call last):
    ValueError: ... cannot reach the tf.data service dispatcher ...
    """
    target = getattr(service, "target", service)
    if not isinstance(target, str):
        raise ValueError(
            "Invalid value for argument `service`. Received: "
            f"service={service!r}. Expected the tf.data service "
            'dispatcher\'s address ("grpc://host:port" or "host:port") or '
            "a `tf.data.experimental.service.DispatchServer`."
        )
    parsed = urllib.parse.urlsplit(
        target if "://" in target else f"grpc://{target}"
    )
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if parsed.scheme != "grpc" or not host or not port:
        raise ValueError(
            "Invalid value for argument `service`. Received: "
            f"service={target!r}. Expected the dispatcher's address as "
            '"grpc://host:port" or "host:port".'
        )
    try:
        socket.create_connection((host, port), _CONNECT_TIMEOUT).close()
    except OSError as error:
        raise ValueError(
            f"kh.data.shard cannot reach the tf.data service dispatcher at "
            f"{target!r} ({error}). Expected a running dispatcher "
            "(`tf.data.experimental.service.DispatchServer`) listening "
            "there, reachable from this host."
        ) from None
    return f"grpc://{host}:{port}"


class ServiceReader:
    """One training worker's reads from the tf.data service.

    Args:
        blocks: The examples batched into blocks (what the service runs).
        address: The dispatcher's address.
        job_prefix: The job names' prefix, the same on every worker of
            this run and new for every run.
        replicas_per_worker: Replicas on each worker.
        worker: This worker's number.
        num_rows: Examples per pass.
        global_batch_size: Rows per global batch.
    """

    def __init__(
        self,
        blocks,
        address,
        job_prefix,
        replicas_per_worker,
        worker,
        num_rows,
        global_batch_size,
    ):
        self._blocks = blocks
        self._address = address
        self._prefix = job_prefix
        self._first = int(worker) * int(replicas_per_worker)
        self._count = int(replicas_per_worker)
        self.num_rows = int(num_rows)
        self._steps = -(-self.num_rows // int(global_batch_size))
        self._iterator = None
        self._fifo = collections.deque()  # flat lists of arrays, by block
        self._held = 0
        self._steps_left = 0
        self._done = True
        self._pass = None
        self.bytes_read = 0
        self.rows_read = 0
        self.by_pass = {}  # pass number -> [bytes, rows] received for it

    def job_name(self, number):
        """The service job of pass `number`, shared by all workers."""
        return f"{self._prefix}-pass{int(number)}"

    def start_pass(self, number):
        """Joins pass `number`'s job.

        Returns:
            The rows of the pass.
        """
        distributed = self._blocks.apply(
            tf.data.experimental.service.distribute(
                processing_mode="distributed_epoch",
                service=self._address,
                job_name=self.job_name(number),
            )
        )
        self._iterator = iter(distributed)
        self._fifo.clear()
        self._held = 0
        self._steps_left = self._steps
        self._done = False
        self._pass = int(number)
        return self.num_rows

    def _pull(self):
        """Receives one block into the FIFO (or notes the pass's end)."""
        try:
            element = next(self._iterator)
        except StopIteration:
            self._done = True
            return
        flat = [t.numpy() for t in tf.nest.flatten(element)]
        rows = len(flat[0])
        size = sum(a.nbytes for a in flat)
        self._fifo.append(flat)
        self._held += rows
        self.bytes_read += size
        self.rows_read += rows
        this_pass = self.by_pass.setdefault(self._pass, [0, 0])
        this_pass[0] += size
        this_pass[1] += rows

    def step(self, bounds):
        """Takes one global batch's rows for this worker's replicas.

        Args:
            bounds: The replicas' row bounds of the global batch.

        Returns:
            `(flat rows or None, local bounds)`: this worker's rows (their
            replicas' in order) and the replicas' bounds in them.
        """
        rows = np.diff(np.asarray(bounds, np.int64))
        wanted = rows[self._first : self._first + self._count]
        need = int(wanted.sum())
        self._steps_left -= 1
        last = self._steps_left <= 0
        while not self._done and (last or self._held < need):
            self._pull()
        take = self._held if last else min(need, self._held)
        return self._take(take), _local_bounds(wanted, take)

    def _take(self, rows):
        """The first `rows` rows of the FIFO, concatenated, or None."""
        parts = []
        while rows > 0:
            flat = self._fifo[0]
            size = len(flat[0])
            if size <= rows:
                parts.append(self._fifo.popleft())
            else:
                parts.append([a[:rows] for a in flat])
                self._fifo[0] = [a[rows:] for a in flat]
                size = rows
            self._held -= size
            rows -= size
        if not parts:
            return None
        return [np.concatenate(arrays) for arrays in zip(*parts)]


def _local_bounds(wanted, rows):
    """The bounds that give replicas `wanted` rows each out of `rows`: in
    order while they last (the last replicas short), or each its own plus
    an even part of the rest (a pass's last step).

    >>> _local_bounds(np.array([3, 2]), 4).tolist()
    [0, 3, 4]
    >>> _local_bounds(np.array([3, 2]), 8).tolist()
    [0, 5, 8]
    """
    if rows <= wanted.sum():
        ends = np.minimum(np.cumsum(wanted), rows)
    else:
        extra = rows - int(wanted.sum())
        more = np.full(len(wanted), extra // len(wanted))
        more[: extra % len(wanted)] += 1
        ends = np.cumsum(wanted + more)
    return np.concatenate([[0], ends]).astype(np.int64)


class ServiceSource(passes.BlockSource):
    """`kh.data.shard(service=...)` examples: read through a tf.data
    service job per pass, each worker pulling the rows of its replicas.

    Args:
        examples: The user's unbatched examples (their number known).
        address: The dispatcher's checked address.
        global_batch_size: Rows per global batch (a pass's step count).
    """

    def __init__(self, examples, address, global_batch_size):
        super().__init__(examples)
        self.address = address
        self._global_batch_size = int(global_batch_size)
        self.job_prefix = None

    def shuffle_mechanism(self, shuffle):
        return SERVICE

    def cache(self, filename):
        raise ValueError(
            "`cache` has no use with a tf.data service input: the "
            "service's workers read the examples. Cache in the examples' "
            "pipeline (it runs on the service) instead."
        )

    def agree(self, strategy):
        """Draws the run's job name prefix on the first replica's worker
        and sends it to the others (one collective: call on every
        worker). Not from numpy's seeded state: a restarted run must not
        join the jobs of the run it replaces."""
        if self.job_prefix is None:
            drawn = secrets.randbits(31)
            nonce = _distribute.broadcast_from_first_replica(strategy, drawn)
            self.job_prefix = f"keras_hetero-{nonce:08x}"

    def attach(self, input_context, num_replicas):
        """Makes this worker's `ServiceReader` (once per process)."""
        if self.reader is not None:
            return
        workers = input_context.num_input_pipelines
        replicas = num_replicas // workers
        # The service runs the pipeline without a last `assert_cardinality`
        # (each of its workers sees a part); the total sets the steps.
        served = _compat.without_last_cardinality_assertion(self.examples)
        self.reader = ServiceReader(
            served.batch(self._block_rows(num_replicas)),
            self.address,
            self.job_prefix,
            replicas,
            input_context.input_pipeline_id,
            self.num_examples,
            self._global_batch_size,
        )

    def _block_rows(self, num_replicas):
        # A quarter of an equal replica's rows per element: a worker holds
        # at most that many rows beyond its need, which it trains at the
        # pass's end, and pulls a few elements per step.
        return max(1, self._global_batch_size // (4 * num_replicas))

    def start_reader(self, skip, number, seed, shuffle):
        if skip:
            raise ValueError(
                f"A tf.data service input cannot resume pass {number} "
                f"after {skip} examples: which rows each worker trained "
                "was the service's hand-out, which no checkpoint holds. "
                "Resume from a checkpoint at an epoch's end."
            )
        return self.reader.start_pass(number)

    def state_after(self, pass_number, steps):
        return None

    def read(self, bounds, first, count):
        spec = self.examples.element_spec
        flat_spec = tf.nest.flatten(spec)

        def read_rows(bounds):
            flat, local = self.reader.step(bounds)
            if flat is None:
                flat = [
                    np.zeros([0] + s.shape.as_list(), s.dtype.as_numpy_dtype)
                    for s in flat_spec
                ]
            return [*flat, local]

        dtypes = [s.dtype for s in flat_spec] + [tf.int64]
        *flat, local = tf.numpy_function(
            read_rows, [bounds], dtypes, stateful=True
        )
        for tensor, s in zip(flat, flat_spec):
            tensor.set_shape([None] + s.shape.as_list())
        local.set_shape([count + 1])
        return tf.nest.pack_sequence_as(spec, flat), local
