"""ParameterServerStrategy: `fit` and `evaluate` through a ClusterCoordinator.

Stock Keras 3.15 has no ClusterCoordinator path (its `fit` fails with "To use
this dataset, you need to pass this dataset to
ClusterCoordinator.create_per_worker_dataset"); tf-keras has one, but it
cannot say which worker ran which step. HeteroModel runs this loop under both
flavours.

Each train step (or `steps_per_execution` steps) is a closure the
coordinator schedules on whichever worker is free, so fast workers simply
take more steps: asynchronous training, nothing for `ShardRebalancer` to
balance. Every closure returns which worker ran it, its rows and its
seconds, so `model.step_stats` has one entry per worker and
`StragglerDetector` works. A closure whose worker fails is re-run on
another worker, and a restarted worker rejoins: a step may run more than
once (at-least-once), see docs/strategies.md.
"""

import collections
import inspect

import numpy as np
import tensorflow as tf

from keras_hetero import _batches
from keras_hetero import _callback_protocol
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._checks import check_int
from keras_hetero._compat import keras
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.training import telemetry

_WORKER_GONE = (
    tf.errors.UnavailableError,
    tf.errors.CancelledError,
    tf.errors.AbortedError,
)


class ParameterServerRunner:
    """Runs a HeteroModel's `fit` / `evaluate` through a ClusterCoordinator.

    Created once per model by `HeteroModel` (under ParameterServerStrategy).

    Args:
        model: A compiled `kh.HeteroModel` created in the strategy's scope.
    """

    def __init__(self, model):
        _compat.atomic_variable_updates()
        self.model = model
        self.strategy = model.distribute_strategy
        # One coordinator per strategy (the class returns the existing one).
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(
            self.strategy
        )
        workers = _compat.coordinator_workers(self.coordinator)
        self.num_workers = len(workers)
        self.worker_ids = _worker_ids(self.coordinator)
        self.telemetry = telemetry.WorkerTelemetry(self.num_workers)
        self._closures = {}

    # --- input --------------------------------------------------------------

    def per_worker_iterator(self, x):
        """An iterator over per-worker datasets made from `x` (repeated)."""
        strategy = self.strategy
        if isinstance(x, tf.data.Dataset):
            distributed = strategy.experimental_distribute_dataset(x.repeat())
            dataset = self.coordinator.create_per_worker_dataset(distributed)
        elif callable(x):
            dataset_fn = _with_input_context(x)

            def per_worker_dataset_fn():
                return strategy.distribute_datasets_from_function(
                    lambda context: dataset_fn(context).repeat()
                )

            dataset = self.coordinator.create_per_worker_dataset(
                per_worker_dataset_fn
            )
        else:
            raise TypeError(
                "Under ParameterServerStrategy, HeteroModel takes a "
                "`dataset_fn(input_context)` returning a batched "
                "`tf.data.Dataset` (built on each worker), or a batched "
                f"`tf.data.Dataset`. Received x of type {type(x).__name__}."
            )
        return iter(dataset)

    # --- steps ----------------------------------------------------------

    def _closure(self, step_function, steps):
        key = (step_function.__name__, steps)
        if key not in self._closures:
            self._closures[key] = self._make_closure(step_function, steps)
        return self._closures[key]

    def _make_closure(self, step_function, steps):
        strategy = self.strategy
        # What the steps' update writes: the clock waits for all of it.
        variables = [
            *self.model.trainable_variables,
            self.model.optimizer.iterations,
        ]

        @tf.function
        def closure(iterator, worker):
            start = tf.timestamp()
            rows = tf.constant(0, tf.int64)
            logs = None
            for _ in range(steps):
                data = next(iterator)
                x, _, _ = _compat.unpack_x_y_sample_weight(data)
                rows += tf.cast(_batches.batch_rows(x), tf.int64)
                with _distribute.parameter_server_worker(worker):
                    logs = strategy.run(step_function, args=(data,))
            logs = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0], logs
            )
            seconds = closure_seconds(start, logs, variables)
            return logs, worker, rows, seconds

        return closure

    def _schedule(self, closure, iterator):
        with self.strategy.scope():
            return self.coordinator.schedule(
                closure, args=(iterator, self.worker_ids)
            )

    def _collect(self, pending, keep, steps_of):
        """Fetches all but the newest `keep` scheduled closures.

        Returns:
            The newest fetched logs (numpy), or None if none was fetched.
        """
        results, logs = [], None
        while len(pending) > keep:
            remote, steps = pending.popleft(), steps_of.popleft()
            try:
                logs, worker, rows, seconds = remote.fetch()
            except _WORKER_GONE:
                # The step ran (its update is on the parameter servers), but
                # its outputs stayed on a worker that has since failed.
                self.telemetry.unattributed_steps += steps
                continue
            results.append((int(worker), int(rows), float(seconds), steps))
        self.telemetry.add(results)
        return logs

    # --- fit / evaluate -------------------------------------------------

    def fit(
        self,
        x,
        *,
        epochs=1,
        steps_per_epoch=None,
        callbacks=None,
        verbose=1,
        initial_epoch=0,
        initial_step=0,
        validation_data=None,
        validation_steps=None,
        validation_freq=1,
    ):
        """Like `keras.Model.fit`; see `HeteroModel.fit`."""
        model = self.model
        verbose = 1 if verbose == "auto" else verbose
        steps_per_epoch = _steps(x, steps_per_epoch, "steps_per_epoch")
        if validation_data is not None:
            validation_steps = _steps(
                validation_data, validation_steps, "validation_steps"
            )
        iterator = self.per_worker_iterator(x)
        per_call = max(int(_compat.steps_per_execution(model)), 1)
        callback_list = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            model=model,
            verbose=verbose,
            epochs=epochs,
            steps=steps_per_epoch,
        )
        # A few closures stay in flight so the workers never wait for the
        # coordinator; older ones are collected (they are done by then).
        in_flight = 2 * self.num_workers
        model.stop_training = False
        self.telemetry.reset()
        callback_list.on_train_begin()
        resumed = _compat.backup_resume_epoch(
            model, steps_per_epoch, initial_epoch
        )
        if resumed != initial_epoch:  # Keras' BackupAndRestore restored
            initial_epoch, initial_step = resumed, 0
        epoch_logs = {}
        for epoch in range(initial_epoch, epochs):
            model.reset_metrics()
            callback_list.on_epoch_begin(epoch)
            pending, steps_of = collections.deque(), collections.deque()
            # A resumed fit (ElasticCheckpoint) starts inside its epoch.
            step = initial_step if epoch == initial_epoch else 0
            while step < steps_per_epoch:
                steps = min(per_call, steps_per_epoch - step)
                callback_list.on_train_batch_begin(step)
                pending.append(
                    self._schedule(
                        self._closure(model.train_step, steps), iterator
                    )
                )
                steps_of.append(steps)
                step += steps
                logs = self._collect(pending, in_flight, steps_of)
                callback_list.on_train_batch_end(
                    step - 1, _python(logs) if logs is not None else {}
                )
                if model.stop_training:
                    break
            self.coordinator.join()
            self._collect(pending, 0, steps_of)
            epoch_logs = _python(model.get_metrics_result())
            if validation_data is not None and _due(epoch, validation_freq):
                results = self.evaluate(
                    validation_data, steps=validation_steps, verbose=0
                )
                epoch_logs.update({f"val_{k}": v for k, v in results.items()})
            callback_list.on_epoch_end(epoch, epoch_logs)
            if model.stop_training:
                break
        callback_list.on_train_end(epoch_logs)
        return model.history

    def evaluate(self, x, *, steps=None, callbacks=None, verbose=1):
        """Like `keras.Model.evaluate`; returns the metrics as a dict."""
        model = self.model
        verbose = 1 if verbose == "auto" else verbose
        steps = _steps(x, steps, "steps")
        iterator = self.per_worker_iterator(x)
        callback_list = keras.callbacks.CallbackList(
            callbacks,
            add_progbar=verbose != 0,
            model=model,
            verbose=verbose,
            epochs=1,
            steps=steps,
        )
        model.reset_metrics()
        callback_list.on_test_begin()
        closure = self._closure(model.test_step, 1)
        pending = []
        for step in range(steps):
            callback_list.on_test_batch_begin(step)
            pending.append(self._schedule(closure, iterator))
            callback_list.on_test_batch_end(step, {})
        self.coordinator.join()
        for remote in pending:
            remote.fetch()  # raises if a step failed for good
        logs = _python(model.get_metrics_result())
        callback_list.on_test_end(logs)
        return logs

    def predict(self, x, *, batch_size=None, steps=None):
        """Predictions computed on the coordinator, batch by batch.

        The workers run scheduled training closures; prediction needs every
        output back in order, so it runs where the outputs are wanted,
        reading the variables from the parameter servers.

        Args:
            x: Inputs: arrays, tensors, or a batched `tf.data.Dataset` (of
                inputs, or of `(inputs, ...)` tuples).
            batch_size: Rows per batch for arrays. Defaults to 32.
            steps: Batches to predict, all if None.

        Returns:
            The outputs, concatenated along the batch axis (numpy).
        """
        model = self.model
        if isinstance(x, tf.data.Dataset):
            dataset = x
        else:
            dataset = tf.data.Dataset.from_tensor_slices(x).batch(
                batch_size or 32
            )
        if steps is not None:
            dataset = dataset.take(steps)

        @tf.function
        def forward(batch):
            return model(batch, training=False)

        outputs = []
        for batch in dataset:
            if isinstance(batch, tuple):  # (inputs, targets, ...)
                batch = batch[0]
            outputs.append(tf.nest.map_structure(np.asarray, forward(batch)))
        if not outputs:
            raise ValueError(
                "`predict` received no data under ParameterServerStrategy."
            )
        return tf.nest.map_structure(
            lambda *parts: np.concatenate(parts), *outputs
        )


def closure_seconds(start, logs, variables):
    """Seconds from `start` until the closure's steps are over: their
    `logs` exist and their updates of `variables` (on the parameter
    servers) are done.

    The logs alone come before the update (the metrics read the step's
    predictions), so a clock ordered after them only would leave the
    update's traffic to the parameter servers out of the closure's time.

    Args:
        start: The closure's start reading (`tf.timestamp`).
        logs: The last step's logs (a structure of tensors).
        variables: The variables the steps update.

    Returns:
        A float64 scalar tensor.
    """
    waits = tf.nest.flatten(logs)
    updated = telemetry.written(variables)
    if updated is not None:
        waits.append(updated)
    with tf.control_dependencies(waits):
        return tf.timestamp() - start


def _worker_ids(coordinator):
    """A `PerWorkerValues` holding each worker's index, on that worker.

    Uses the coordinator's private per-worker `create_resource`: the public
    API only builds identical per-worker values (datasets), and under
    ParameterServerStrategy every worker's input context says pipeline 0.
    A resource is re-created when its worker restarts.
    """

    @tf.function
    def make(index):
        return tf.identity(index)

    return _compat.per_worker_values(
        worker.create_resource(
            make, args=(tf.constant(worker.worker_index, tf.int32),)
        )
        for worker in _compat.coordinator_workers(coordinator)
    )


def _with_input_context(dataset_fn):
    """`dataset_fn(input_context)`, also for a function that takes none."""
    try:
        parameters = inspect.signature(dataset_fn).parameters
    except (TypeError, ValueError):
        return dataset_fn
    if not parameters:
        return lambda context: dataset_fn()
    return dataset_fn


def _steps(x, steps, name):
    if steps is not None:
        return check_int(name, steps)
    if isinstance(x, tf.data.Dataset):
        count = int(x.cardinality())
        if count > 0:
            return count
    raise ValueError(
        f"Under ParameterServerStrategy `{name}` is required: each worker "
        "reads its own repeated copy of the data, so there is no end to "
        f"find. Pass `{name}=` (steps over all workers together)."
    )


def _due(epoch, frequency):
    if isinstance(frequency, int):
        return (epoch + 1) % frequency == 0
    return (epoch + 1) in frequency


def _python(logs):
    return {key: float(np.asarray(value)) for key, value in dict(logs).items()}


class ParameterServerInput:
    """What ElasticCheckpoint keeps of the input under
    ParameterServerStrategy: nothing but the step count.

    Each worker reads its own repeated copy of the data there, so there is
    no data position to save; a resumed `fit` continues at the saved epoch
    and step with fresh input (steps are at-least-once anyway).
    """

    global_batch_size = None
    num_examples = None
    num_batches = None

    def __init__(self, num_workers):
        self.num_replicas = num_workers
        self.shares = [1.0 / num_workers] * num_workers

    def resume_after(self, examples):
        del examples  # no position to skip to


def fit_arguments(method, x, y, args, kwargs):
    """`fit` / `evaluate` arguments for the parameter-server runner.

    Raises:
        ValueError: For arguments that have no meaning there.
    """

    bound = inspect.signature(getattr(keras.Model, method)).bind(
        None, x, y, *args, **kwargs
    )
    given = dict(bound.arguments)
    given.pop("self")
    given.update(given.pop("kwargs", {}))
    supported = {
        "fit": (
            "x",
            "epochs",
            "steps_per_epoch",
            "callbacks",
            "verbose",
            "initial_epoch",
            "validation_data",
            "validation_steps",
            "validation_freq",
        ),
        "evaluate": ("x", "steps", "callbacks", "verbose", "return_dict"),
    }[method]
    # Defaults that mean "not used" are fine.
    ignorable = {
        "y": None,
        "batch_size": None,
        "shuffle": True,
        "sample_weight": None,
        "class_weight": None,
        "validation_split": 0.0,
        "validation_batch_size": None,
        "max_queue_size": 10,
        "workers": 1,
        "use_multiprocessing": False,
    }
    unsupported = [
        name
        for name, value in given.items()
        if name not in supported
        and not (name in ignorable and value == ignorable[name])
    ]
    if unsupported:
        raise ValueError(
            f"`{method}` under ParameterServerStrategy takes the data as a "
            "`dataset_fn(input_context)` or a batched `tf.data.Dataset` "
            f"(labels and weights inside it); {sorted(unsupported)} cannot "
            f"be used there. Supported arguments: {list(supported)}."
        )
    options = {name: given[name] for name in supported if name in given}
    if method == "evaluate":
        options.setdefault("return_dict", False)
    return options


def per_worker_input(x, kwargs, steps, validation_steps=None):
    """`x` (and `validation_data`) as ParameterServerStrategy takes them: a
    HeteroDataset becomes its `parameter_server_dataset()`, and its global
    batches per epoch the default step count."""
    kwargs = dict(kwargs)
    if isinstance(x, HeteroDataset):
        if kwargs.get(steps) is None and x.num_batches is not None:
            kwargs[steps] = x.num_batches
        x = x.parameter_server_dataset()
    validation = kwargs.get("validation_data")
    if validation_steps and isinstance(validation, HeteroDataset):
        if kwargs.get(validation_steps) is None:
            kwargs[validation_steps] = validation.num_batches
        kwargs["validation_data"] = validation.parameter_server_dataset()
    return x, kwargs


# --- `HeteroModel.fit` / `evaluate` / `predict` under the strategy ---------


def fit(runner, x, y, args, kwargs):
    """`model.fit(x, y, *args, **kwargs)` through `runner` (the model's
    ParameterServerRunner), with keras-hetero's callbacks prepared.

    Raises:
        ValueError: For `fit` arguments that have no meaning there.
    """
    x, kwargs = per_worker_input(
        x, kwargs, "steps_per_epoch", "validation_steps"
    )
    options = fit_arguments("fit", x, y, args, kwargs)
    undo = _callback_protocol.prepare_fit(
        runner.model,
        ParameterServerInput(runner.num_workers),
        options.get("callbacks"),
        options,
    )
    try:
        return runner.fit(**options)
    finally:
        undo()


def evaluate(runner, x, y, args, kwargs):
    """`model.evaluate(x, y, *args, **kwargs)` through `runner`: the loss
    and metrics as `keras.Model.evaluate` returns them.

    Raises:
        ValueError: For `evaluate` arguments that have no meaning there.
    """
    x, kwargs = per_worker_input(x, kwargs, "steps")
    options = fit_arguments("evaluate", x, y, args, kwargs)
    return_dict = options.pop("return_dict")
    logs = runner.evaluate(**options)
    if return_dict:
        return logs
    values = list(logs.values())  # loss first, then the metrics
    return values[0] if len(values) == 1 else values


def predict(runner, x, args, kwargs):
    """`model.predict(x, *args, **kwargs)` through `runner` (batch size and
    steps honoured, on the coordinator)."""
    bound = inspect.signature(keras.Model.predict).bind(
        None, x, *args, **kwargs
    )
    given = {**bound.arguments, **bound.arguments.get("kwargs", {})}
    return runner.predict(
        x, batch_size=given.get("batch_size"), steps=given.get("steps")
    )
