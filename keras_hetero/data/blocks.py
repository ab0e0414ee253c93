"""Share-proportional reads: a pass's blocks handed out to workers.

Under `kh.data.shard(..., reads="own")` a worker reads only the blocks
(Parquet row groups, Arrow IPC record batches, slices of a table) whose
rows its replicas train on, instead of the whole stream. Which rows a
worker trains on at a step depends on the shares in force then, which move
during training, so the blocks cannot be dealt out ahead. `BlockQueue`
deals them out step by step instead, as a deterministic function of the
pass's block order and of the rows each worker takes at each step; every
worker runs the same queue on the same inputs and so knows, without
talking to the others, which blocks are its own:

- Each worker keeps a FIFO of rows dealt to it and not trained yet.
- At a step, each worker in rank order is dealt the next blocks of the
  pass's order until its FIFO holds the rows it takes at that step.
- At the end of a pass, when no block is left to deal and a worker's FIFO
  is short, rows move to it from the back of the FIFO of the worker with
  the most rows to spare (ties: the lower rank). The receiving worker reads
  those rows' block too: at most a few blocks per pass are read twice.
- Then each worker takes its rows from the front of its FIFO.

Every row of the pass is dealt once and taken once, whatever the shares at
each step: every example exactly once per pass. A worker's rows of a step
are contiguous in its FIFO and follow its replicas in order.

No TensorFlow here: the queue is plain Python, tested alone, and its state
is plain data for checkpoints.
"""

import collections

import numpy as np


class BlockQueue:
    """Deals one pass's blocks to workers by the rows they take per step.

    Args:
        block_rows: Rows of each block, by block number.
        order: The block numbers in the order they are dealt this pass.
        num_workers: Workers taking rows.

    Example:

    >>> queue = BlockQueue([4, 4, 4], [2, 0, 1], num_workers=2)
    >>> queue.take([3, 1])
    [[(2, 0, 3)], [(0, 0, 1)]]
    >>> queue.take([2, 2])
    [[(2, 3, 4), (1, 0, 1)], [(0, 1, 3)]]
    """

    def __init__(self, block_rows, order, num_workers):
        self._block_rows = [int(rows) for rows in block_rows]
        self._order = [int(block) for block in order]
        if sorted(self._order) != list(range(len(self._block_rows))):
            raise ValueError(
                f"Invalid block order {self._order[:20]}: expected each of "
                f"the {len(self._block_rows)} blocks once."
            )
        self._next = 0
        self._fifos = [collections.deque() for _ in range(int(num_workers))]

    @property
    def num_workers(self):
        """Workers the blocks are dealt to."""
        return len(self._fifos)

    @property
    def remaining_rows(self):
        """Rows of the pass not taken yet."""
        undealt = sum(self._block_rows[b] for b in self._order[self._next :])
        return undealt + sum(self._held(w) for w in range(self.num_workers))

    def _held(self, worker):
        return sum(end - start for _, start, end in self._fifos[worker])

    def take(self, worker_rows):
        """One step: deals blocks as needed and takes each worker's rows.

        Args:
            worker_rows: Rows each worker takes at this step (their sum at
                most `remaining_rows`).

        Returns:
            Per worker, its rows of this step as `(block, start, end)`
            segments (rows `[start, end)` of the block), in order.

        Raises:
            ValueError: If `worker_rows` has the wrong length, a negative
                entry, or more rows than the pass has left.
        """
        need = [int(rows) for rows in worker_rows]
        if len(need) != self.num_workers or min(need, default=0) < 0:
            raise ValueError(
                f"Invalid rows per worker {worker_rows!r}: expected "
                f"{self.num_workers} non-negative integers."
            )
        if sum(need) > self.remaining_rows:
            raise ValueError(
                f"A step takes {sum(need)} rows ({need} per worker) but the "
                f"pass has {self.remaining_rows} left."
            )
        held = [self._held(w) for w in range(self.num_workers)]
        for worker in range(self.num_workers):
            while held[worker] < need[worker] and self._next < len(self._order):
                block = self._order[self._next]
                self._next += 1
                self._fifos[worker].append((block, 0, self._block_rows[block]))
                held[worker] += self._block_rows[block]
        for worker in range(self.num_workers):
            while held[worker] < need[worker]:
                spare = [held[v] - need[v] for v in range(self.num_workers)]
                donor = int(np.argmax(spare))
                moved = min(need[worker] - held[worker], spare[donor])
                self._fifos[worker].extend(self._from_back(donor, moved))
                held[worker] += moved
                held[donor] -= moved
        return [self._from_front(w, need[w]) for w in range(self.num_workers)]

    def _from_front(self, worker, rows):
        fifo, taken = self._fifos[worker], []
        while rows:
            block, start, end = fifo.popleft()
            if end - start > rows:
                fifo.appendleft((block, start + rows, end))
                end = start + rows
            taken.append((block, start, end))
            rows -= end - start
        return taken

    def _from_back(self, worker, rows):
        fifo, moved = self._fifos[worker], []
        while rows:
            block, start, end = fifo.pop()
            if end - start > rows:
                fifo.append((block, start, end - rows))
                start = end - rows
            moved.append((block, start, end))
            rows -= end - start
        return moved[::-1]

    def blocks_held(self, worker):
        """The blocks with rows in `worker`'s FIFO (to keep them read)."""
        return {block for block, _, _ in self._fifos[worker]}

    def get_state(self):
        """The queue's position as plain data (for checkpoints)."""
        return {
            "next": self._next,
            "fifos": [[list(s) for s in fifo] for fifo in self._fifos],
        }

    def set_state(self, state):
        """Restores `get_state()` output (same blocks and order).

        Raises:
            ValueError: If `state` is for another number of workers or
                blocks.
        """
        fifos = state["fifos"]
        if len(fifos) != self.num_workers or not (
            0 <= state["next"] <= len(self._order)
        ):
            raise ValueError(
                f"The saved block queue has {len(fifos)} worker(s) and "
                f"dealt {state['next']} block(s); this pass has "
                f"{self.num_workers} worker(s) and {len(self._order)} "
                "blocks."
            )
        self._next = int(state["next"])
        self._fifos = [
            collections.deque(tuple(int(v) for v in s) for s in fifo)
            for fifo in fifos
        ]


def worker_rows(replica_rows, replicas_per_worker):
    """Rows per worker from rows per replica (each worker's replicas are
    consecutive, worker 0's first)."""
    rows = np.asarray(replica_rows, np.int64).reshape(-1, replicas_per_worker)
    return rows.sum(axis=1).tolist()


def compose(block_rows, order, steps, replicas_per_worker):
    """The global batches a pass is trained in, as `(block, row)` pairs.

    What every worker's share of every step is, put together in replica
    order: the batches a single device trains on to match the job (the
    reference of the tests and of docs/arrow.md).

    Args:
        block_rows: Rows of each block.
        order: The pass's block order.
        steps: Rows per replica at each step (a list of lists).
        replicas_per_worker: Replicas on each worker.

    Returns:
        One list of `(block, row)` per step.
    """
    steps = [list(rows) for rows in steps]
    num_workers = len(steps[0]) // replicas_per_worker if steps else 1
    queue = BlockQueue(block_rows, order, num_workers)
    batches = []
    for rows in steps:
        taken = queue.take(worker_rows(rows, replicas_per_worker))
        batches.append(
            [
                (block, row)
                for segments in taken
                for block, start, end in segments
                for row in range(start, end)
            ]
        )
    return batches


# States kept per reader for checkpoints: the pipeline runs a few steps
# ahead of training, a checkpoint asks for the state after a trained step.
_STATES_KEPT = 256


class BlockReader:
    """One worker's reads under `reads="own"`: its blocks, its rows.

    Runs the pass's `BlockQueue` (all workers', as every worker does) and
    reads, converts and keeps only the blocks with rows of its own worker,
    each once while its rows last.

    Args:
        stream: What is read: `blocks()` (tuples whose last item is the
            block's rows) and `read_block(block, first_row)` (`({column:
            values}, bytes read)`).
        replicas_per_worker: Replicas on each worker.
        worker: This worker's number (its replicas come after those of the
            workers before it).
        num_workers: Workers in the job.
    """

    def __init__(self, stream, replicas_per_worker, worker, num_workers):
        self._stream = stream
        self._blocks = list(stream.blocks())
        self.block_rows = [int(block[-1]) for block in self._blocks]
        self.num_rows = sum(self.block_rows)
        self._first_rows = np.cumsum([0] + self.block_rows).tolist()
        self._replicas = int(replicas_per_worker)
        self._worker = int(worker)
        self._worker_count = int(num_workers)
        self._queue = None
        self._order_seed = None
        self._pass = None
        self._steps = 0
        self._cache = {}
        self._states = collections.OrderedDict()
        self.bytes_read = 0
        self.rows_read = 0
        self.by_pass = {}  # pass number -> [bytes, rows] read for it

    def order(self, order_seed):
        """The block order of a pass: in order (`order_seed` None) or a
        permutation of `order_seed`."""
        if order_seed is None:
            return list(range(len(self._blocks)))
        rng = np.random.default_rng(int(order_seed))
        return rng.permutation(len(self._blocks)).tolist()

    def start_pass(self, number, order_seed, state=None):
        """Starts pass `number` (at the queue `state` if resumed).

        Returns:
            The rows the pass has left to train.
        """
        self._queue = BlockQueue(
            self.block_rows, self.order(order_seed), self._worker_count
        )
        if state is not None:
            self._queue.set_state(state["queue"])
        self._order_seed = order_seed
        self._pass = int(number)
        self._steps = 0 if state is None else int(state["steps"])
        self._cache.clear()
        return self._queue.remaining_rows

    def state_after(self, pass_number, steps):
        """The queue's state after `steps` steps of pass `pass_number`, if
        still kept (for a checkpoint of that step), else None."""
        return self._states.get((int(pass_number), int(steps)))

    def step(self, bounds):
        """Takes one global batch's rows: this worker's, read.

        Args:
            bounds: The replicas' row bounds of the global batch (one more
                than replicas).

        Returns:
            `{column: values}` of this worker's rows, its replicas' in
            order.
        """
        rows = np.diff(np.asarray(bounds, np.int64))
        taken = self._queue.take(worker_rows(rows, self._replicas))
        self._steps += 1
        self._states[(self._pass, self._steps)] = {
            "steps": self._steps,
            "queue": self._queue.get_state(),
        }
        while len(self._states) > _STATES_KEPT:
            self._states.popitem(last=False)
        parts = [
            {
                name: values[start:end]
                for name, values in self._block(block).items()
            }
            for block, start, end in taken[self._worker]
        ]
        # Kept: the blocks with rows in this worker's FIFO, and those it
        # took rows of at this step, which a pass's end often hands it
        # more rows of at the next (rows moved from a worker that shared
        # the block). Dropping those at once made the worst worker of 4
        # with moving shares read 11.6% more rows than it trained, not
        # 3.0% (benchmarks/input_reads.py; one block more per worker).
        keep = self._queue.blocks_held(self._worker) | {
            block for block, _, _ in taken[self._worker]
        }
        for block in [b for b in self._cache if b not in keep]:
            del self._cache[block]
        if not parts:
            return None
        return {
            name: np.concatenate([part[name] for part in parts])
            for name in parts[0]
        }

    def _block(self, block):
        """Block `block`'s values, rows in the pass's order within it."""
        if block not in self._cache:
            values, read = self._stream.read_block(
                self._blocks[block], self._first_rows[block]
            )
            self.bytes_read += int(read)
            self.rows_read += self.block_rows[block]
            this_pass = self.by_pass.setdefault(self._pass, [0, 0])
            this_pass[0] += int(read)
            this_pass[1] += self.block_rows[block]
            if self._order_seed is not None:
                rng = np.random.default_rng((int(self._order_seed), block))
                within = rng.permutation(self.block_rows[block])
                values = {name: v[within] for name, v in values.items()}
            self._cache[block] = values
        return self._cache[block]
