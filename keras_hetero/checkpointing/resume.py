"""Resuming from a checkpoint: what `ElasticCheckpoint` does before `fit`
trains. `ResumeChecks` refuses (or, with `approximate_resume`, warns
about) what a restart would not reproduce; `restore` loads the newest
valid checkpoint into the model and the dataset and says where the
interrupted epoch continues (`Resumed`)."""

import dataclasses
import logging
import os
import time
import warnings

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero.checkpointing import storage
from keras_hetero.data import reproducibility
from keras_hetero.data.passes import mechanism_before_record
from keras_hetero.training import runtime
from keras_hetero.training import state as state_lib
from keras_hetero.training.parameter_server import ParameterServerInput

logger = logging.getLogger("keras_hetero")


class ResumeChecks:
    """The checks that a restart reproduces the interrupted run.

    Args:
        approximate: `ElasticCheckpoint`'s `approximate_resume`: warn once
            per kind of problem instead of raising.
    """

    def __init__(self, approximate):
        self.approximate = bool(approximate)
        self._warned = set()

    def reproducible_input(self, dataset):
        """Refuses input stages a restarted process would not reproduce."""
        find = getattr(dataset, "unreproducible_stages", None)
        stages = [] if find is None else find()
        if not stages:
            return
        names = reproducibility.describe(stages)
        self.refuse_or_warn(
            "its examples (the `tf.data.Dataset` given to `kh.data.shard`) "
            "have stages whose order or values a restarted process would "
            "not reproduce, so a resumed epoch would skip the wrong examples "
            f"(or draw other random numbers):\n{names}",
            "these input stages are not reproduced by a restart:\n"
            f"{names}\nA resumed epoch skips as many examples as were "
            "trained before the restart, but not the same ones: until the "
            "epoch ends some examples are trained twice and others not at "
            "all.",
        )

    def random_layers(self, model):
        """Refuses tf-keras random layers on TF1 stateful random ops."""
        layers = ", ".join(map(repr, _compat.unsaved_random_layers(model)))
        if not layers:
            return
        self.refuse_or_warn(
            f"its random layers ({layers}) draw with TF1 stateful random "
            "ops (tf-keras' default), whose state no checkpoint can hold: a "
            "restarted process would draw the first step's numbers again. "
            "Fix: call "
            "`tf.keras.backend.experimental.enable_tf_random_generator()` "
            "before building the model (the layers then draw from "
            "`tf.random.Generator`s, whose states the checkpoint holds).",
            f"the random layers {layers} draw other numbers after a restart "
            "than the uninterrupted run would (TF1 stateful random ops); "
            "every example is still trained once per epoch.",
        )

    def same_order(self, path, state, dataset):
        """Refuses to resume a shuffled epoch if its order was made by
        another mechanism than the dataset's (a pipeline edit, or a
        checkpoint older than the record: see
        `HeteroDataset.shuffle_mechanism`)."""
        if state.get("shuffle_seed") is None:
            return  # not shuffled: the order is the examples'
        now = dataset.shuffle_mechanism
        then = state.get("shuffle_mechanism")
        if then is None:
            # Written before checkpoints recorded it: then `shuffle=True`
            # over tf.data (and `from_arrow`) examples always took a buffer
            # of the pass; arrays and buffer sizes are unchanged.
            then = mechanism_before_record(now)
        if then == now:
            return
        self.refuse_or_warn(
            f"checkpoint {path} stopped in the middle of an epoch shuffled "
            f"by {then!r}, and this dataset shuffles by {now!r}, so the "
            "resumed epoch would skip other examples than were trained. "
            "The mechanism follows the examples (a `filter`, `take` or "
            "`from_generator` upstream has no random access, so "
            "`shuffle=True` takes a buffer; before checkpoints recorded it, "
            "`shuffle=True` over tf.data examples always did). Fix: resume "
            "with "
            "the pipeline that wrote the "
            "checkpoint, or start the epoch afresh in a new `directory`.",
            "the resumed epoch's order is made by another mechanism than "
            f"the one that trained its first steps ({then!r} then, {now!r} "
            "now); until the epoch ends some examples are trained twice and "
            "others not at all.",
        )

    def refuse_or_warn(self, problem, approximation):
        """Raises a ValueError naming `problem`, or with `approximate`
        warns `approximation` once per kind."""
        if not self.approximate:
            raise ValueError(
                f"ElasticCheckpoint cannot resume this run exactly: {problem}"
                "\nOr pass `ElasticCheckpoint(..., approximate_resume=True)` "
                'to accept an approximate resume (docs/checkpoints.md, "Input '
                'pipelines and exact resume").'
            )
        if approximation not in self._warned:
            self._warned.add(approximation)
            warnings.warn(
                "ElasticCheckpoint(approximate_resume=True): " + approximation,
                UserWarning,
                stacklevel=3,
            )


@dataclasses.dataclass
class Resumed:
    """Where a `fit` starts, as `restore` found it.

    Attributes:
        first_pass: `(input pass, epoch)`: the pass of the input that
            trains that epoch (the pass is None for an input without
            passes).
        undo: Undoes the changes to `fit`'s arguments, after `fit`.
        path: The checkpoint restored, or None (none found: a fresh start).
        epoch, step, examples: The epoch, its step and the examples of it
            already trained.
        global_step: Train steps done across restarts.
        callback_states: The companion callbacks' states by checkpoint
            key, or None (none, or another number of replicas).
        failures: The checkpoint's record of the job's restarts
            (`ElasticCheckpoint.observed_mtbf`), or None.
    """

    first_pass: tuple
    undo: object
    path: str = None
    epoch: int = 0
    step: int = 0
    examples: int = 0
    global_step: int = 0
    callback_states: dict = None
    failures: dict = None


def restore(
    model, dataset, directory, kwargs, *, resize, checks, local_directory=None
):
    """Loads the newest valid checkpoint of `directory` before `fit`.

    Args:
        model: The `HeteroModel`.
        dataset: `fit`'s `kh.data.HeteroDataset` (or the parameter-server
            input).
        directory: The checkpoints' directory.
        kwargs: `fit`'s keyword arguments (the initial step is set there).
        resize: `ElasticCheckpoint`'s `resize`.
        checks: The `ResumeChecks`.
        local_directory: `ElasticCheckpoint`'s local copies, or None.

    Returns:
        A `Resumed`.

    Raises:
        ValueError: For a checkpoint of another model, another global batch
            size (unless `resize` scales the learning rate), or an epoch
            shuffled by another mechanism.
    """
    # Pass number of the first epoch of this `fit` (the shuffle order of
    # epoch e is the one of pass `first pass + e - first epoch`).
    first_pass = (
        getattr(dataset, "next_pass", None),
        kwargs.get("initial_epoch", 0),
    )
    found = _newest(model, directory, local_directory)
    if found is None:
        return Resumed(first_pass, lambda: None)
    path, state = found
    started = time.perf_counter()
    names, variables = _compat.checkpoint_variables(model)
    shapes = [list(v.shape) for v in variables]
    if state["shapes"] != shapes:
        raise ValueError(
            f"Checkpoint {path} does not fit this model: it holds "
            f"{len(state['shapes'])} variables "
            f"({_shapes_text(state['variables'], state['shapes'])}), the "
            f"model and optimizer have {len(shapes)} "
            f"({_shapes_text(names, shapes)}). Use a new `directory` for a "
            "different model."
        )
    arrays = storage.read_arrays(path, state["tensors"])
    for variable, array in zip(variables, arrays):
        variable.assign(array)
    _restore_replica_state(model, path, arrays[len(variables) :])
    old_batch = state["global_batch_size"]
    new_batch = dataset.global_batch_size
    if new_batch != old_batch:
        _resize_batch(model, path, state, old_batch, new_batch, resize)
    epoch = state["epoch"]
    done = state["examples_in_epoch"]
    callback_states = None
    if state["num_replicas"] == dataset.num_replicas:
        dataset.shares = state["shares"]
        callback_states = state["callbacks"]
    else:
        logger.warning(
            "ElasticCheckpoint: resuming a %d-replica checkpoint (%d "
            "worker(s)) with %d replicas (%d worker(s)); the epoch "
            "continues exactly, shares and per-replica callback state "
            "start afresh.",
            state["num_replicas"],
            state["num_workers"],
            dataset.num_replicas,
            _distribute.num_workers(model.distribute_strategy),
        )
    if isinstance(dataset, ParameterServerInput):
        dataset.resume_after(done)
    else:
        if done:
            checks.same_order(path, state, dataset)
            _resume_reads(path, state, dataset, model)
        data_pass = state.get("data_pass")
        dataset.resume_after(
            done, pass_number=data_pass, seed=state.get("shuffle_seed")
        )
        if data_pass is not None:
            first_pass = (data_pass, epoch)
    step = _resumed_step(state, dataset, kwargs, done, new_batch)
    logger.warning(
        "ElasticCheckpoint: restored %s in %.2fs; continuing at epoch "
        "%d after %d of its examples (step %d; global step %d).",
        path,
        time.perf_counter() - started,
        epoch,
        done,
        step,
        state["global_step"],
    )
    if isinstance(dataset, ParameterServerInput):
        kwargs["initial_epoch"], kwargs["initial_step"] = epoch, step
        undo = lambda: None  # noqa: E731
    else:
        undo = _compat.set_initial_step(model, epoch, step, kwargs)
    return Resumed(
        first_pass,
        undo,
        path=path,
        epoch=epoch,
        step=step,
        examples=done,
        global_step=state["global_step"],
        callback_states=callback_states,
        failures=state.get("failures"),
    )


def _newest(model, directory, local_directory):
    """`(path, state)` of the checkpoint to restore, or None.

    Without local copies, the newest valid one in `directory`. With them,
    the job resumes at the newest step of either place on the chief
    (agreed with one collective), read by each worker from its local copy
    if it holds that step, else from `directory`; if a worker has neither,
    every worker resumes from `directory`'s newest. A local copy older than
    `directory`'s newest is never used (a warning says so).

    Raises:
        ValueError: If some worker cannot read the agreed step and
            `directory` holds no checkpoint (naming the step).
    """
    shared = storage.newest_valid(directory)
    if local_directory is None:
        return shared
    local = storage.newest_valid(local_directory)
    shared_step = -1 if shared is None else shared[1]["global_step"]
    local_step = -1 if local is None else local[1]["global_step"]
    if 0 <= local_step < shared_step:
        logger.warning(
            "ElasticCheckpoint: the local copy %s (step %d) is older than "
            "%s (step %d): not used.",
            local[0],
            local_step,
            shared[0],
            shared_step,
        )
    strategy = model.distribute_strategy
    step = _distribute.broadcast_from_first_replica(
        strategy, max(shared_step, local_step)
    )
    mine = {shared_step: shared, local_step: local}.get(step)  # local first
    if step >= 0 and mine is None:
        mine = _find_step(step, local_directory, directory)
    missing = _distribute.sum_over_workers(strategy, int(mine is None))
    if step < 0:
        return None
    if not missing:
        if mine is local:
            logger.warning(
                "ElasticCheckpoint: step %d from the local copy %s.",
                step,
                local[0],
            )
        return mine
    if shared is None:
        raise ValueError(
            f"ElasticCheckpoint: the job resumes at step {step}, which "
            f"{missing} worker(s) hold neither in local_directory nor in "
            f"{directory}, and {directory} holds no checkpoint. Restore "
            "the shared checkpoints (or start again with the worker(s) "
            "whose local disks hold it)."
        )
    logger.warning(
        "ElasticCheckpoint: %d worker(s) do not hold step %d; every worker "
        "resumes from %s (step %d).",
        missing,
        step,
        shared[0],
        shared_step,
    )
    return shared


def _find_step(step, *directories):
    """`(path, state)` of step `step`'s valid checkpoint in the first of
    `directories` that holds one, or None."""
    for directory in directories:
        path = os.path.join(directory, storage.checkpoint_name(step))
        if os.path.isdir(path):
            try:
                return path, storage.verify(path)
            except storage.CorruptCheckpointError:
                continue
    return None


def _resumed_step(state, dataset, kwargs, done, new_batch):
    """The step the resumed epoch starts at, counted in the new global
    batches: the remaining examples take `remaining` steps."""
    per_epoch = kwargs.get("steps_per_epoch") or dataset.num_batches
    if new_batch is None:  # parameter servers: steps, not examples
        return state["step_in_epoch"]
    if per_epoch:
        examples = dataset.num_examples
        remaining = (
            -(-(examples - done) // new_batch)
            if examples is not None
            else per_epoch - done // new_batch
        )
        return max(per_epoch - remaining, 0)
    return -(-done // new_batch)


def _restore_replica_state(model, path, replica_arrays):
    local = local_training(model)
    if local is None and not replica_arrays:
        return
    if local is None or not replica_arrays:
        logger.warning(
            "ElasticCheckpoint: %s was written %s low-communication "
            "training and is restored %s it; the inner optimizers start "
            "from the saved (first replica's) state.",
            path,
            "with" if replica_arrays else "without",
            "without" if local is None else "with",
        )
        return
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replica_arrays[0].shape[0] != replicas:
        logger.warning(
            "ElasticCheckpoint: %s holds the inner optimizer state of %d "
            "replicas; with %d replicas each starts from the first "
            "replica's (resuming is not exact).",
            path,
            replica_arrays[0].shape[0],
            replicas,
        )
        return
    local.restore_replica_state(replica_arrays)


def _resize_batch(model, path, state, old_batch, new_batch, resize):
    if resize != "scale_learning_rate":
        raise ValueError(
            f"Checkpoint {path} was written with global batch size "
            f"{old_batch}; the dataset has {new_batch}. Resume with the "
            "same global batch size (any worker count), or pass "
            'ElasticCheckpoint(resize="scale_learning_rate") to scale '
            "the learning rate with the batch."
        )
    rate = state.get("learning_rate")
    if rate is None:
        raise ValueError(
            f"Checkpoint {path}: cannot scale the learning rate for the "
            f"new global batch size {new_batch} (was {old_batch}): the "
            "optimizer uses a learning-rate schedule. Scale the schedule "
            "yourself and keep the global batch size."
        )
    scaled = rate * new_batch / old_batch
    model.optimizer.learning_rate = scaled
    logger.warning(
        "ElasticCheckpoint: global batch %d -> %d; learning rate %g -> "
        "%g (linear scaling rule).",
        old_batch,
        new_batch,
        rate,
        scaled,
    )


def local_training(model):
    """The model's low-communication state (`kh.LowCommunication`), or None."""
    if state_lib.run_state(model) is None or not getattr(model, "built", False):
        return None  # not a HeteroModel, or not built yet
    return runtime.local_training(model)


def _shapes_text(names, shapes, limit=3):
    head = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes[:limit]))
    return head + (", ..." if len(names) > limit else "")


def _resume_reads(path, state, dataset, model):
    """Hands a mid-epoch checkpoint's block queue to a `reads="own"`
    dataset (`HeteroDataset.resume_input`), after checking that both runs
    read alike and with as many workers.

    Raises:
        ValueError: If one run read with `reads="own"` and the other not,
            the worker count changed under `reads="own"`, or this job
            reads through a tf.data service.
    """
    reads = getattr(dataset, "reads", "all")
    if reads == "service":
        raise ValueError(
            f"Checkpoint {path} was saved mid-epoch; this job reads "
            "through a tf.data service, which cannot resume an epoch part "
            "way (which rows each worker trained was the service's "
            "hand-out, which no checkpoint holds). Resume from a checkpoint "
            "saved at an epoch's end (ElasticCheckpoint saves only there "
            "under a service input), or with the saved run's input."
        )
    saved = state.get("input_state")
    if (saved is not None) != (reads == "own"):
        raise ValueError(
            f"Checkpoint {path} was saved mid-epoch by a job that read "
            f"with reads={'all' if reads == 'own' else 'own'!r}; this one "
            f"reads with reads={reads!r}, and its global batches are made "
            "otherwise. Resume with the saved run's `reads`, or from an "
            "epoch boundary."
        )
    if reads != "own":
        return
    workers = _distribute.num_workers(model.distribute_strategy)
    if state["num_workers"] != workers:
        raise ValueError(
            f"Checkpoint {path} was saved mid-epoch by "
            f'{state["num_workers"]} worker(s) reading with reads="own", '
            f"which deals the epoch's blocks to each worker; this job has "
            f"{workers}. Resume with as many workers, or from an epoch "
            "boundary."
        )
    dataset.resume_input(saved)
