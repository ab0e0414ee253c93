"""Per-replica step telemetry: rows and compute seconds -> `model.step_stats`.

Each replica measures, inside the graph, the seconds from the start of its
step until its gradients are ready (before the collective). The numbers of all
replicas travel in the same all-reduce as the gradients, so every worker ends
up with every replica's numbers at no extra collective.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero import _distribute


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What each replica did in the last executed train step(s).

    With `steps_per_execution > 1` the numbers cover all steps of the last
    execution (rows and seconds are sums over them).

    Attributes:
        step: Train steps completed by this model so far, the covered ones
            included.
        steps: How many train steps the last call(s) ran.
        rows: Rows each global replica processed, in global replica order.
        compute_seconds: Seconds from each replica's step start until its
            gradients were ready, summed over the measured steps.
        devices: The device of each global replica.
        measured_steps: How many steps `rows` and `compute_seconds` cover:
            `steps`, except under low-communication training
            (`kh.LowCommunication`), where a round's numbers arrive with its
            synchronisation: 0 before it, the round's steps at it.
        wait_seconds: Low-communication training only (else None): each
            replica's seconds waiting for the others at the synchronisation
            BEFORE the one these numbers arrived with (a wait is known only
            after its collective, so it travels in the next one).
        call_seconds: Host seconds this worker spent in the last
            train-function call(s) these numbers cover (its steps, their
            collectives and input), or None where not measured. Minus the
            slowest replica's `compute_seconds`, it is the time outside
            compute: what a slow network link makes grow.
    """

    step: int
    steps: int
    rows: np.ndarray
    compute_seconds: np.ndarray
    devices: list
    measured_steps: int = None
    wait_seconds: np.ndarray = None
    call_seconds: float = None

    def __post_init__(self):
        if self.measured_steps is None:
            object.__setattr__(self, "measured_steps", self.steps)

    @property
    def seconds_per_row(self):
        """`compute_seconds / rows` (NaN where a replica had no rows)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(
                self.rows > 0, self.compute_seconds / self.rows, np.nan
            )


def clock(dependencies, enabled=True):
    """Time in seconds (`tf.timestamp`), once `dependencies` are FINISHED.

    "Finished" means on the device that computes them, not only enqueued:
    an accelerator's (GPU) kernel counts as done for TensorFlow's executor
    as soon as it is queued on the device's stream: being ordered after it
    means after its *enqueuing*. What waits for the device to run it is a
    device-to-host copy, which completes only once the device has run every
    kernel queued before it; the reading takes one as its data input
    (`device_token`: one float32 element per device). Tensors on the host
    CPU (a CPU replica, the logical CPUs of the tests) are finished when
    their kernel returns; they are waited for by a control edge, which
    costs no extra op.

    In-graph and unordered with the other replicas' clocks (see
    `_compat.unordered_timestamp`): a stateful op would serialise the
    replicas' steps, and a host callback (`numpy_function`) costs a Python
    call per reading. The reading runs on the host CPU of the replica's
    task.

    Args:
        dependencies: A tensor or a list of tensors (None and
            `tf.IndexedSlices` accepted), e.g. a replica's gradients.
        enabled: With False (an XLA-compiled step takes no readings) the
            time is NaN: "not measured" to everything that reads it.

    Returns:
        A float64 scalar tensor on the host CPU.
    """
    if not enabled:
        return tf.constant(np.nan, tf.float64)
    tensors = _tensors(dependencies)
    if not tensors:
        raise ValueError(
            "Invalid value for argument `dependencies`. Received: "
            f"dependencies={dependencies!r}. Expected at least one tensor."
        )
    on_device, on_host = [], []
    for tensor in tensors:
        (on_host if _on_host(tensor.device) else on_device).append(tensor)
    with tf.device(_host_of(tensors[0].device)):
        token = device_token(on_device) if on_device else None
        if token is None:
            # Nothing numeric on a device (e.g. string inputs): their
            # producers' completion is what there is to wait for.
            token, *on_host = on_host + on_device
        with tf.control_dependencies(on_host):
            return _compat.unordered_timestamp(token)


def device_token(tensors):
    """A host float32 scalar that exists once every tensor is computed.

    One element per device, made on that device under control
    dependencies on all of that device's tensors, copied to the host. Why
    this waits for the device's work, not its enqueuing (TensorFlow
    2.19-2.21 source):

    - the control edges make the executor run the element's kernel after
      every kernel that made the device's tensors was queued, on the same
      compute stream (a kernel on a GPU is "done" for the executor once
      queued: ordering, not completion);
    - its consumer (`tf.reduce_sum`) is on the host CPU, so the graph
      partitioner puts a `_Send`/`_Recv` pair on the edge
      (tensorflow/core/graph/graph_partition.cc, `Partition`); the host's
      `_Recv` completes through `SameWorkerRecvDone`
      (tensorflow/core/common_runtime/rendezvous_mgr.cc) ->
      `CopyTensor::ViaDMA` (copy_tensor.cc) -> `GPUUtil::
      CopyGPUTensorToCPU` (tensorflow/core/common_runtime/gpu/
      gpu_util.cc), which makes the device-to-host stream
      `ThenWaitFor(send_stream)`, the compute stream as far as it was
      queued, UNCONDITIONALLY (before, and whatever, its `total_bytes >
      0` test), and calls `done` from `event_mgr->ThenExecute` on that
      stream. The file's IMPLEMENTATION NOTE 2 (at its top) says so for
      a 0-byte copy: "we must ensure the causal ordering by arranging the
      copy done callback happens-after all activities scheduled on the
      given stream being finished". So the bytes copied do not matter,
      the stream wait does: a data edge from every gradient is not
      needed. (The partitioner sends even a cross-device control edge
      this way, as an empty float constant, `AddDummyConst`; the element
      makes the copy explicit, for the graph test to check.) One element
      per device is the copy this takes, made from a tensor already
      there (no cast of a float32 one).
    - The one pitfall is a tensor in HOST memory: TensorFlow keeps int32
      tensors of a GPU device there, and `SameWorkerRecvDone`'s shortcut
      for a host-memory tensor hands the buffer over with no stream wait.
      So the element is float32 (an int32 or other integer one is cast
      to float32 by a kernel on the device), never int32.

    The token's value means nothing (it may be NaN or inf); it is an
    ordering device only.

    Args:
        tensors: Tensors on any devices (None entries and non-numeric
            tensors are skipped).

    Returns:
        A float32 scalar tensor on the host CPU, or None when no tensor
        was numeric.
    """
    elements = device_elements(tensors)
    if not elements:
        return None
    with tf.device(_host_of(elements[0].device)):
        return tf.reduce_sum(
            tf.concat(elements, 0) if len(elements) > 1 else elements[0]
        )


def device_elements(tensors):
    """One float32 element per device of `tensors`, made on that device
    under control dependencies on all of its tensors (see `device_token`).

    Args:
        tensors: Tensors on any devices (None entries and non-numeric
            tensors are skipped).

    Returns:
        A list of `[1]`-shaped (`[0]` for an empty tensor) float32 tensors,
        one per device, in the order the devices first appear.
    """
    by_device = {}
    for tensor in _tensors(tensors):
        dtype = tf.as_dtype(tensor.dtype)
        if dtype.is_floating or dtype.is_integer or dtype.is_bool:
            by_device.setdefault(tensor.device, []).append(tensor)
    elements = []
    for device, group in by_device.items():
        # A floating tensor if the device has one: no cast kernel.
        source = next((t for t in group if t.dtype.is_floating), group[0])
        with tf.device(device), tf.control_dependencies(group):
            # One element (none of an empty tensor): a 0-byte copy waits
            # for the stream all the same (see `device_token`).
            element = tf.reshape(source, [-1])[:1]
            if element.dtype != tf.float32:
                element = tf.cast(element, tf.float32)
        elements.append(element)
    return elements


def written(variables):
    """A float32 scalar that exists once every write to `variables` traced
    before it (in the same `tf.function`) is done.

    Each variable is read on its own device (automatic control
    dependencies order a read after the writes traced before it); one
    element per device of those reads crosses to where the scalar is
    used (`device_elements`). E.g. the optimizer's update on parameter
    servers, seen from a worker's clock.

    Args:
        variables: Keras or TensorFlow variables (a `tf.distribute`
            ShardedVariable counts as its shards).

    Returns:
        A float32 scalar tensor (placed where it is used), or None for no
        variables.
    """
    reads = []
    for variable in variables:
        variable = _compat.distributed_variable(variable)
        for part in getattr(variable, "variables", None) or [variable]:
            with tf.device(part.device):
                reads.append(part.read_value())
    elements = device_elements(reads)
    if not elements:
        return None
    return tf.reduce_sum(tf.concat(elements, 0))


def _tensors(structure):
    """The tensors of `structure` (a tensor or a list), None left out,
    `tf.IndexedSlices` as their values and other composite tensors
    (`tf.RaggedTensor`, `tf.SparseTensor`: an input of the step) as their
    component tensors."""
    tensors = []
    for item in tf.nest.flatten(structure):
        if isinstance(item, tf.IndexedSlices):
            item = item.values
        if item is not None:
            tensors.extend(tf.nest.flatten(item, expand_composites=True))
    return tensors


def _on_host(device):
    """Whether `device` (a device string, maybe empty) is a host CPU, whose
    kernels are finished when they return."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.device_type is not None:
        return spec.device_type.upper() == "CPU"
    # No device given: TensorFlow places such ops on an accelerator if the
    # process has one, else on the CPU.
    return all(
        device.device_type == "CPU"
        for device in tf.config.list_logical_devices()
    )


def _host_of(device):
    """The host CPU of the task that `device` belongs to."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.device_type is not None and spec.device_type.upper() == "CPU":
        return spec.to_string()
    return spec.replace(device_type="CPU", device_index=0).to_string()


def stats_vector(num_replicas, rows, seconds):
    """This replica's rows and seconds at its slots; a SUM gathers all."""
    # float32, the gradients' usual dtype, so it travels in their collective
    # (exact for up to 2**24 rows per step).
    replica_id = _distribute.replica_id()
    one_hot = tf.one_hot(replica_id, num_replicas, dtype=tf.float32)
    return tf.concat(
        [
            one_hot * tf.cast(rows, tf.float32),
            one_hot * tf.cast(seconds, tf.float32),
        ],
        axis=0,
    )


class TelemetrySource:
    """Where `HeteroModel.step_stats` comes from: one protocol, two sources.

    `Telemetry` (every strategy but ParameterServerStrategy) sums each
    step's all-reduced stats into a variable inside the step;
    `WorkerTelemetry` (ParameterServerStrategy) is filled by the runner
    from each closure's timing on its worker, so its in-step methods do
    nothing. The model calls `reset` when `fit` starts, `record` inside
    the step, `snapshot` after each train-function call; callbacks read
    `step_stats`.
    """

    # Whether the step's collective carries the workers' stop requests
    # (`training.stopping`): only `Telemetry` under several workers.
    carries_stop = False

    def reset(self):
        """Starts a new series (at the start of `fit`)."""
        raise NotImplementedError

    def record(self, gathered_stats, steps=None):
        """Adds gathered stats covering `steps` steps (default one; inside
        the replica step)."""
        raise NotImplementedError

    def snapshot(self, call_seconds=None, totals=None):
        """Marks the end of one train-function call (`call_seconds`: its
        host time, for the next `step_stats`; `totals`: the running totals
        as the call read them, if it did)."""
        raise NotImplementedError

    def step_stats(self):
        """`StepStats` of the last call, or None."""
        raise NotImplementedError

    def with_stop_request(self, stats):
        """`stats` as the step sends it: with this worker's stop request
        appended when the source carries them (inside the replica step)."""
        return stats


class Telemetry(TelemetrySource):
    """Holds the running totals variable and turns it into `StepStats`.

    The variable is `[steps, measured steps, rows_0..rows_R-1,
    seconds_0..seconds_R-1]`, summed over all steps so far (then, with
    `waits`, the R synchronisation waits; with `carries_stop`, the stop
    requests). It is ON_READ with ONLY_FIRST_REPLICA: the first local
    replica adds the all-reduced numbers to its own copy (no merge, no
    extra collective; the others would add the same numbers, so they skip
    it and their copies stay untouched) and a read takes that first copy.

    With `carries_stop` (several workers in one synchronous collective:
    `training.stopping`) the stats vector has one more element, this
    worker's stop request: the float32 variable `stop_request`, 0 or 1,
    ON_READ too (each replica reads its own copy in the step; an assign
    between calls sets every local copy). The gradients' all-reduce sums it
    with the rest, at no extra collective, and the totals count the
    requests every step carried.
    """

    def __init__(self, strategy, devices, waits=False, carries_stop=False):
        self.num_replicas = strategy.num_replicas_in_sync
        self.devices = list(devices)
        # Low-communication training: R more slots, the synchronisation waits.
        self.waits = waits
        self.carries_stop = carries_stop
        self.size = (
            (3 if waits else 2) * self.num_replicas + 2 + int(carries_stop)
        )
        with strategy.scope():
            self.totals = tf.Variable(
                tf.zeros([self.size], tf.float64),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="keras_hetero_telemetry",
            )
            self.stop_request = None
            if carries_stop:
                self.stop_request = tf.Variable(
                    0.0,
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    name="keras_hetero_stop_request",
                )
        # One copy per local replica (Mirrored, MultiWorkerMirrored): the
        # first holds all a read needs. Else (CentralStorageStrategy's one
        # copy) an update in a replica is a merge_call, which every replica
        # must make alike.
        self._copy_per_replica = len(getattr(self.totals, "values", ())) > 1
        self.reset()

    def record(self, gathered_stats, steps=None):
        """Adds one step and its gathered stats (inside the replica step).

        Args:
            gathered_stats: `[rows_0..R-1, seconds_0..R-1]` of all replicas
                (and the summed stop requests, with `carries_stop`).
            steps: Low-communication training: the steps these stats cover
                (a float64 tensor), recorded at a synchronisation, whose
                steps `count_step` counted. Defaults to this one step.
        """
        if (
            self._copy_per_replica
            and _distribute.is_first_local_replica() is False
        ):
            # Every replica has the same gathered sums and a read takes
            # the first local copy: the other replicas' additions were ops
            # for nothing (benchmarks/RESULTS.md, "fewer cross-device edges").
            return
        counts = (
            tf.ones([2], tf.float64)
            if steps is None
            else tf.stack([tf.zeros([], tf.float64), steps])
        )
        self.totals.assign_add(
            tf.concat([counts, tf.cast(gathered_stats, tf.float64)], axis=0)
        )

    def count_step(self):
        """Counts one step whose stats come later (low-communication:
        at the next synchronisation); no collective."""
        return self.totals.assign_add(
            tf.one_hot(0, self.size, dtype=tf.float64)
        )

    def snapshot(self, call_seconds=None, totals=None):
        """Marks the end of one train-function call (no host sync).

        `totals` is the call's own `read_totals` (one of the train
        function's outputs under Keras 3); without it, reads them here, an
        eager op per call. A read tensor is a snapshot, as resource
        variables copy on write.
        """
        self._previous = self._current
        self._current = self.read_totals() if totals is None else totals
        self._call_seconds = call_seconds
        self._stats = None

    def read_totals(self):
        """The running totals: one local copy (all hold the same sums), in
        cross-replica context; inside the train function after the step,
        or eagerly."""
        return _first_copy(self.totals).read_value()

    def with_stop_request(self, stats):
        if self.stop_request is None:
            return stats
        request = tf.reshape(self.stop_request.read_value(), [1])
        return tf.concat([stats, request], axis=0)

    def request_stop(self):
        """This worker asks to stop: every step from the next call on
        carries the request (eagerly, between train-function calls)."""
        self.stop_request.assign(1.0)

    def stop_requests(self):
        """Replica requests to stop that the last call's steps carried,
        summed over its steps (0 without `carries_stop`): the same number
        on every worker, read from the same all-reduced sums."""
        last = self._last_call()
        if not self.carries_stop or last is None:
            return 0
        return int(last[1][-1])

    def reset(self):
        """Starts a new series; the next `snapshot` has nothing before it.
        A stop request of the previous `fit` is withdrawn."""
        if self.stop_request is not None:
            self.stop_request.assign(0.0)
        self._current = self.read_totals()
        self._previous = None
        self._call_seconds = None
        self._stats = None

    def step_stats(self):
        """`StepStats` of the last call, or None before the first one.

        Computed once per call (several callbacks read it every step).
        """
        if getattr(self, "_stats", None) is None:
            self._stats = self._step_stats()
        return self._stats

    def _last_call(self):
        """`(totals, totals - totals before)` of the last call as host
        arrays, or None before the first call."""
        if self._previous is None or self._current is None:
            return None
        # Keep the host copies: the next call's "previous" is this "current".
        self._current = current = _host(self._current)
        self._previous = previous = _host(self._previous)
        return current, current - previous

    def _step_stats(self):
        last = self._last_call()
        if last is None:
            return None
        current, delta = last
        replicas = self.num_replicas
        return StepStats(
            step=int(current[0]),
            steps=int(delta[0]),
            rows=np.rint(delta[2 : 2 + replicas]).astype(np.int64),
            compute_seconds=delta[2 + replicas : 2 + 2 * replicas],
            devices=list(self.devices),
            measured_steps=int(delta[1]),
            wait_seconds=(
                delta[2 + 2 * replicas : 2 + 3 * replicas]
                if self.waits
                else None
            ),
            call_seconds=self._call_seconds,
        )


def _first_copy(variable):
    """The first local component of a distributed variable, else itself."""
    values = getattr(variable, "values", None)
    return values[0] if values else variable


def _host(value):
    return value if isinstance(value, np.ndarray) else value.numpy()


class WorkerTelemetry(TelemetrySource):
    """Per-worker steps, rows and seconds of the collected closures.

    `step_stats()` has the `telemetry.StepStats` shape with one entry per
    worker: the steps collected since the previous train batch ended (a
    worker that ran none has 0 rows). `compute_seconds` is each closure's
    whole time on its worker (input, step and parameter-server traffic).
    """

    def __init__(self, num_workers):
        self.devices = [
            f"/job:worker/replica:0/task:{index}"
            for index in range(num_workers)
        ]
        self.reset()

    def reset(self):
        workers = len(self.devices)
        self._step = 0
        self._stats = None
        self.steps_per_worker = np.zeros(workers, np.int64)
        self.seconds_per_worker = np.zeros(workers, np.float64)
        # Steps whose worker failed before its results were fetched.
        self.unattributed_steps = 0

    def add(self, results):
        """Records `(worker, rows, seconds, steps)` tuples of one batch end."""
        workers = len(self.devices)
        rows = np.zeros(workers, np.int64)
        seconds = np.zeros(workers, np.float64)
        steps = 0
        for worker, worker_rows, worker_seconds, worker_steps in results:
            rows[worker] += worker_rows
            seconds[worker] += worker_seconds
            self.steps_per_worker[worker] += worker_steps
            self.seconds_per_worker[worker] += worker_seconds
            steps += worker_steps
        self._step += steps
        self._stats = StepStats(
            step=self._step,
            steps=steps,
            rows=rows,
            compute_seconds=seconds,
            devices=list(self.devices),
        )

    def step_stats(self):
        return self._stats

    def snapshot(self, call_seconds=None, totals=None):
        """Nothing to do: the runner calls `add` at every batch end."""

    def record(self, gathered_stats, steps=None):
        """Nothing to do in the step: the runner times each closure on its
        worker and calls `add` with the results."""
        # A body of a docstring only makes AutoGraph warn that it "could
        # not transform" the method (it strips the docstring first).
        return None
