"""`ElasticCheckpoint`: exact mid-epoch resume, async, atomic, elastic."""

import json
import logging
import os
import signal
import threading
import time
import warnings

import numpy as np

from keras_hetero import _callback_protocol as base
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._checks import check_choice
from keras_hetero._checks import check_int
from keras_hetero.checkpointing import schedule
from keras_hetero.checkpointing import storage
from keras_hetero.data import reproducibility
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.data.shard import mechanism_before_record
from keras_hetero.training import runtime
from keras_hetero.training import state
from keras_hetero.training import stopping
from keras_hetero.training.parameter_server import ParameterServerInput

logger = logging.getLogger("keras_hetero")

RESIZE = ("keep_global_batch", "scale_learning_rate")


class ElasticCheckpoint(base.HeteroCallback):
    """Saves training so a restarted job continues at the exact next step.

    Pass it to `HeteroModel.fit` with a `kh.data.HeteroDataset`. On every
    `fit` it first looks in `directory` for the newest checkpoint that
    verifies and, if there is one, restores model and optimizer variables
    (under Keras 3 incl. the layers' random seed state), the epoch and
    step, the dataset's shares, and the state of a `ShardRebalancer` /
    `StragglerDetector` in the same `fit`. The interrupted epoch continues
    with the next global batch not yet trained: no example of it is seen
    twice or skipped. A job restarted with another number of workers or
    replicas resumes the same way (global batches are unchanged; shares
    and per-replica callback state start afresh).

    Saving: every `save_every` (steps, a duration, or `"auto"` = Young/Daly
    `sqrt(2 * save_cost * mtbf)` from the measured cost, re-tuned after each
    save), at the end of `fit`, on `save_now()`, and when the process gets
    SIGTERM or SIGINT (then `fit` stops at the next step boundary and, with
    `exit_on_signal`, the process exits with `PREEMPTED_EXIT_CODE`). Under
    MultiWorkerMirroredStrategy a signal to any worker stops every worker
    after the same step: the request travels in the next step's own
    collective (`keras_hetero.training.stopping`), so no worker is left
    waiting in a collective the others never join. With
    `async_save` the variables are copied on the training thread and written
    by a background thread; at most one save is in flight. Every save is
    atomic (see `kh.checkpointing`): a crash mid-write leaves the previous
    checkpoint as the newest valid one, and a corrupt or truncated newest
    checkpoint is skipped with a warning. Only the chief (worker 0) writes;
    all workers restore, so under MultiWorkerMirroredStrategy `directory`
    must be one every worker can read (shared storage across machines).

    Exact resume needs each epoch's order of examples to be known again
    after the restart: shuffle with `kh.data.shard(..., shuffle=...)` or
    pass numpy arrays (`fit` shards them): the checkpoint holds the shuffle
    seed and the pass, and the resumed epoch takes the order it had (the
    checkpoint's seed wins over a new one). Before the first step it reads
    the examples' own tf.data pipeline and refuses stages whose order or
    values a restarted process would not reproduce: a shuffle that
    reshuffles every epoch (tf.data's default) or has no seed,
    `deterministic=False`, unseeded random ops and random state kept in
    variables (`tf.random.Generator`, Keras random layers) in its
    functions, `tf.data.Options(deterministic=False)`; see
    docs/checkpoints.md for the table and the fix for each. Python stages
    (`from_generator`, `py_function`) cannot be inspected: they must
    produce the same examples in the same order in every process. Metrics
    of the resumed epoch cover its remaining steps.

    Args:
        directory: Where checkpoints go; created if missing.
        save_every: Positive int (steps), duration ("30s", "5m", "2h"), or
            "auto". Defaults to `"auto"`.
        keep: Checkpoints kept, >= 1. Defaults to `3`.
        async_save: Write in a background thread. Defaults to `True`.
        mtbf: Mean time between failures for "auto" (seconds or duration).
            Defaults to `"1h"` (preemptible machines; raise it for reliable
            ones).
        resize: What a restart with another global batch size does:
            `"keep_global_batch"` refuses it (clear error; the worker count
            may still change), `"scale_learning_rate"` continues the epoch
            at its first untrained example and multiplies the learning rate
            by new / old global batch (the linear scaling rule of Goyal et
            al., 2017; not for learning-rate schedules). Defaults to
            `"keep_global_batch"`.
        exit_on_signal: After a signal-triggered save, exit the process with
            `PREEMPTED_EXIT_CODE` when `fit` returns. Defaults to `True`.
        signals: Signals that trigger save-and-stop. Defaults to SIGTERM and
            SIGINT (a second SIGINT interrupts at once).
        approximate_resume: Accept input stages that a restart cannot
            reproduce (see above), tf-keras random layers on TF1 stateful
            ops, and an epoch resumed with another shuffle mechanism than
            the checkpoint's (`HeteroDataset.shuffle_mechanism`; a pipeline
            edit): `fit` then warns once, naming them, and
            trains. A resumed epoch still skips as many examples as were
            trained before the restart, but in another order they are not
            the same examples: until the epoch ends some of its examples
            are trained twice and others not at all (later epochs see each
            example once), and random augmentation draws other numbers
            than the uninterrupted run. Defaults to `False` (refuse them).

    Raises:
        ValueError: For an unwritable `directory`, a bad `save_every`,
            `mtbf` or `resize`, or `keep` < 1; and from `fit`, before the
            first step, if the examples of the `kh.data.HeteroDataset`
            have a stage a restart cannot reproduce (the message names each
            stage and its fix), a tf-keras model has random layers on TF1
            stateful ops, or a checkpoint stopped in an epoch shuffled by
            another mechanism, and `approximate_resume` is False.

    Example:

    >>> ckpt = ElasticCheckpoint("/tmp/run1", save_every="5m")  # doctest: +SKIP
    >>> model.fit(data, epochs=3, callbacks=[ckpt])  # doctest: +SKIP
    """

    PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, what schedulers expect
    stage = "restore"  # after the callbacks that attach to the input
    needs_data_position = True

    def __init__(
        self,
        directory,
        save_every="auto",
        keep=3,
        async_save=True,
        *,
        mtbf="1h",
        resize="keep_global_batch",
        exit_on_signal=True,
        signals=(signal.SIGTERM, signal.SIGINT),
        approximate_resume=False,
    ):
        super().__init__()
        self.save_every = schedule.parse_save_every(save_every)
        check_int("keep", keep)
        self.mtbf = schedule.parse_duration(mtbf, "mtbf")
        self.resize = check_choice("resize", resize, RESIZE)
        self.directory = os.fspath(directory)
        self.keep = keep
        self.async_save = bool(async_save)
        self.exit_on_signal = bool(exit_on_signal)
        self.signals = tuple(signals)
        self.approximate_resume = bool(approximate_resume)
        self._warned_approximate = set()
        _check_directory(self.directory, write=_distribute.env_task().is_chief)
        self._writer = None
        self._error = None
        self._lock = threading.Lock()
        self._saves = {}  # step -> [blocking seconds, write seconds]
        self.restored_from = None
        self.preempted = False
        self._pending_states = None
        self._companions = []
        self._dataset = None
        self._reset_counters()

    # --- what HeteroModel.fit calls (the HeteroCallback protocol) ---------

    def prepare_fit(self, context):
        """Restores the newest valid checkpoint before `fit` trains.

        Subclasses that fetch checkpoints from elsewhere override it and
        call `super().prepare_fit(context)` (as `kh.ray.ElasticCheckpoint`
        does).

        Args:
            context: The `kh.callbacks.FitContext` of this `fit`.

        Returns:
            A function that undoes the changes to `fit`'s arguments.

        Raises:
            ValueError: For another `ElasticCheckpoint` in the same `fit`,
                an input without a data position, examples that cannot be
                resumed exactly, or a checkpoint of another model.
        """
        count = sum(isinstance(c, ElasticCheckpoint) for c in context.callbacks)
        dataset = context.input
        if count > 1 or not isinstance(
            dataset, (HeteroDataset, ParameterServerInput)
        ):
            raise ValueError(
                "ElasticCheckpoint needs exactly one ElasticCheckpoint in "
                "`callbacks` and a `kh.data.HeteroDataset` or numpy arrays "
                "as `x` (it restores the data position). Received "
                f"{count} ElasticCheckpoint(s) and x of type "
                f"{type(dataset).__name__}."
            )
        self._check_reproducible(dataset)
        self._dataset = dataset
        self._companions = [
            c
            for c in context.callbacks
            if c is not self and isinstance(c, base.HeteroCallback)
        ]
        undo_arguments = self._restore(context.model, context.fit_kwargs)
        # A resumed epoch ends early on purpose: Keras 3's warning that the
        # input ran out of data is not for the user.
        quiet = warnings.catch_warnings()
        quiet.__enter__()
        warnings.filterwarnings("ignore", message=_compat.RAN_OUT_OF_DATA)

        def undo():
            quiet.__exit__(None, None, None)
            undo_arguments()

        return undo

    def _check_reproducible(self, dataset):
        find = getattr(dataset, "unreproducible_stages", None)
        stages = [] if find is None else find()
        if not stages:
            return
        names = reproducibility.describe(stages)
        self._refuse_or_warn(
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

    def _check_random_layers(self, model):
        layers = ", ".join(map(repr, _compat.unsaved_random_layers(model)))
        if not layers:
            return
        self._refuse_or_warn(
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

    def _check_same_order(self, path, state, dataset):
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
        self._refuse_or_warn(
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

    def _refuse_or_warn(self, problem, approximation):
        """Raises a ValueError naming `problem`, or with
        `approximate_resume` warns `approximation` once per kind."""
        if not self.approximate_resume:
            raise ValueError(
                f"ElasticCheckpoint cannot resume this run exactly: {problem}"
                "\nOr pass `ElasticCheckpoint(..., approximate_resume=True)` "
                'to accept an approximate resume (docs/checkpoints.md, "Input '
                'pipelines and exact resume").'
            )
        if approximation not in self._warned_approximate:
            self._warned_approximate.add(approximation)
            warnings.warn(
                "ElasticCheckpoint(approximate_resume=True): " + approximation,
                UserWarning,
                stacklevel=3,
            )

    def _restore(self, model, kwargs):
        """Loads the newest valid checkpoint into `model` before `fit`.

        Returns:
            A function that undoes `fit` argument changes afterwards.
        """
        self._check_random_layers(model)
        self._chief = _distribute.is_chief(model.distribute_strategy)
        self._reset_counters()
        # Pass number of the first epoch of this `fit` (the shuffle order of
        # epoch e is the one of pass `first pass + e - first epoch`).
        self._first_pass = (
            getattr(self._dataset, "next_pass", None),
            kwargs.get("initial_epoch", 0),
        )
        found = storage.newest_valid(self.directory)
        if found is None:
            return lambda: None
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
        self._restore_replica_state(
            model, path, state, arrays[len(variables) :]
        )
        dataset = self._dataset
        old_batch = state["global_batch_size"]
        new_batch = dataset.global_batch_size
        if new_batch != old_batch:
            self._resize_batch(model, path, state, old_batch, new_batch)
        epoch = state["epoch"]
        done = state["examples_in_epoch"]
        if state["num_replicas"] == dataset.num_replicas:
            dataset.shares = state["shares"]
            self._pending_states = state["callbacks"]
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
                self._check_same_order(path, state, dataset)
            data_pass = state.get("data_pass")
            dataset.resume_after(
                done, pass_number=data_pass, seed=state.get("shuffle_seed")
            )
            if data_pass is not None:
                self._first_pass = (data_pass, epoch)
        # The step the resumed epoch starts at, counted in the new global
        # batches: the remaining examples take `remaining` steps.
        per_epoch = kwargs.get("steps_per_epoch") or dataset.num_batches
        if new_batch is None:  # parameter servers: steps, not examples
            step = state["step_in_epoch"]
        elif per_epoch:
            examples = dataset.num_examples
            remaining = (
                -(-(examples - done) // new_batch)
                if examples is not None
                else per_epoch - done // new_batch
            )
            step = max(per_epoch - remaining, 0)
        else:
            step = -(-done // new_batch)
        self._epoch, self._step_in_epoch = epoch, step
        self._examples_in_epoch = done
        self._global_step = state["global_step"]
        self.restored_from = path
        logger.warning(
            "ElasticCheckpoint: restored %s in %.2fs; continuing at epoch "
            "%d after %d of its examples (step %d; global step %d).",
            path,
            time.perf_counter() - started,
            epoch,
            done,
            step,
            self._global_step,
        )
        if isinstance(dataset, ParameterServerInput):
            kwargs["initial_epoch"], kwargs["initial_step"] = epoch, step
            return lambda: None
        return _compat.set_initial_step(model, epoch, step, kwargs)

    def _restore_replica_state(self, model, path, state, replica_arrays):
        local = _local_training(model)
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

    def _resize_batch(self, model, path, state, old_batch, new_batch):
        if self.resize != "scale_learning_rate":
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

    # --- lifecycle ----------------------------------------------------------

    def _reset_counters(self):
        self._epoch = 0
        self._step_in_epoch = 0
        self._examples_in_epoch = 0
        self._global_step = 0
        self._since_save = 0
        self._last_save_time = None
        self._cost = None
        self._write_seconds = None
        self._stop_requested = False
        self._stop_sent = False

    def on_train_begin(self, logs=None):
        if self._dataset is None:
            raise ValueError(
                "ElasticCheckpoint needs `kh.HeteroModel.fit` with a "
                "`kh.data.HeteroDataset` (it restores the data position). "
                "Received a model of type "
                f"{type(self.model).__name__}; swap `keras.Model` for "
                "`kh.HeteroModel` and pass `kh.data.shard(...)` to `fit`."
            )
        if self._chief:
            os.makedirs(self.directory, exist_ok=True)
            storage.remove_partial(self.directory)
        self.preempted = False
        self._last_save_time = time.monotonic()
        self._install_signal_handlers()

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._epoch, self._step_in_epoch = epoch, 0
            self._examples_in_epoch = 0

    def on_train_batch_begin(self, batch, logs=None):
        if (
            not isinstance(self._dataset, ParameterServerInput)
            and self._epoch_complete()
        ):
            # A resumed epoch whose data ran out: end it before Keras calls
            # a step that has no batch (and moves the layers' seeds).
            _compat.end_epoch_before_step()
        if (
            self._stop_requested
            and not self._stop_sent
            and stopping.agrees(self.model)
        ):
            # Several workers: the request goes to all of them in this
            # call's collectives; they stop together after it.
            stopping.request(self.model)
            self._stop_sent = True
        if self._pending_states is not None:
            # After the companions' own on_train_begin reset them.
            states, self._pending_states = self._pending_states, None
            for companion in self._companions:
                state = states.get(companion.checkpoint_key)
                if state is not None:
                    companion.set_state(state)

    def on_train_batch_end(self, batch, logs=None):
        self._raise_writer_error()
        steps = self._steps_of_call(batch)
        self._global_step += steps
        self._step_in_epoch += steps
        self._examples_in_epoch += steps * (
            self._dataset.global_batch_size or 0
        )
        self._since_save += steps
        local = _local_training(self.model)
        if local is not None:
            self._low_communication_batch_end(local)
            return
        if self._stop_due():
            self.preempted = True
            self.save_now()
            self.model.stop_training = True
            return
        if self._chief and self.save_due():
            self._save(wait=not self.async_save)

    def _stop_due(self):
        """Whether `fit` stops after the call that just ended: at once on
        this process's own signal, or, where workers agree
        (`stopping.agrees`), when the call carried any worker's request."""
        if not stopping.agrees(self.model):
            return self._stop_requested
        if not stopping.agreed(self.model):
            return False
        if not self._stop_requested:
            logger.warning(
                "ElasticCheckpoint: another worker got a signal; saving "
                "step %d with every worker, then stopping.",
                self._global_step,
            )
        return True

    def _low_communication_batch_end(self, local):
        """Under low-communication training a checkpoint is taken right
        after a synchronisation: the chief asks (the request travels in the
        next synchronisation's collective), and then every worker gathers
        the state that differs between replicas (the inner optimizer's) for
        the chief to save. A signal mid-round stops without saving: the
        newest checkpoint is at a round boundary, and the steps since are
        trained again (their effect on the shared weights was not yet
        made, so nothing is lost or applied twice)."""
        self._save_if_agreed(local)
        if self._stop_requested:
            self.preempted = True
            self.model.stop_training = True
            logger.warning(
                "ElasticCheckpoint: stopping without a save (low-communication "
                "training, mid-round); a restart resumes from the newest "
                "checkpoint, at a round boundary."
            )
            return
        if self._chief and self.save_due():
            local.save_requested = True

    def _save_at_round_end(self, local, write=True):
        """Low-communication training, at a point every worker reaches
        (the end of `fit`, a Ray report): ends the round, gathers every
        replica's inner optimizer state, and the chief saves if `write`."""
        local.maybe_synchronise(force=True)
        local.save_agreed = False
        replica_state = local.gather_replica_state()
        if self._chief and write:
            self._join()
            self._save(wait=True, replica_state=replica_state)

    def _low_communication(self):
        """The model's low-communication state, or None (see
        `kh.LowCommunication`)."""
        return _local_training(self.model)

    def _save_if_agreed(self, local, wait=None):
        if not local.save_agreed:
            return
        local.save_agreed = False
        replica_state = local.gather_replica_state()  # every worker
        if self._chief:
            self._join()
            self._save(
                wait=not self.async_save if wait is None else wait,
                replica_state=replica_state,
            )

    def _steps_of_call(self, batch):
        """Train steps that the call ending now ran: several with
        `steps_per_execution > 1`, and fewer at an epoch's end."""
        if isinstance(self._dataset, ParameterServerInput):
            # `batch` is the epoch's last scheduled step (step_stats covers
            # the closures collected, which lag behind).
            return batch + 1 - self._step_in_epoch
        return self.model.step_stats.steps

    def on_epoch_end(self, epoch, logs=None):
        local = _local_training(self.model)
        if local is not None:  # the epoch's last round ended just before
            self._save_if_agreed(local)
        # Keras also ends an epoch that `stop_training` cut short; only a
        # complete one moves the position to the next epoch. Of unknown
        # length, an epoch Keras ends by itself ran out of data: complete.
        if self._epoch_complete(ended=not self.model.stop_training):
            self._epoch, self._step_in_epoch = epoch + 1, 0
            self._examples_in_epoch = 0

    def on_train_end(self, logs=None):
        self._restore_signal_handlers()
        local = _local_training(self.model)
        if local is not None and not self.preempted:
            # Every worker ends here (whether the chief saves: only it knows).
            self._save_at_round_end(local, write=self._since_save > 0)
        elif self._since_save and not self.preempted:
            self.save_now()
        self._join()
        self._raise_writer_error()
        self._dataset = None
        if self.preempted and self.exit_on_signal:
            logger.warning(
                "ElasticCheckpoint: stopped on a signal after saving step "
                "%d; exiting with status %d.",
                self._global_step,
                self.PREEMPTED_EXIT_CODE,
            )
            raise SystemExit(self.PREEMPTED_EXIT_CODE)

    # --- saving -------------------------------------------------------------

    def save_now(self):
        """Saves the current step and waits until it is on disk (chief).

        Waits for a save in flight first. Other workers do nothing.
        """
        if self.is_chief and self.model is not None:
            self._join()
            self._save(wait=True)

    def save_due(self):
        """Whether the chief saves at the end of the current step, by
        `save_every` (a subclass that saves at other points, as
        `kh.ray.ElasticCheckpoint` does at its reports, returns False).

        Returns:
            True if a save is due and none is in flight.
        """
        if self._writer is not None and self._writer.is_alive():
            return False  # at most one save in flight
        every = self.save_every
        if every.steps is not None:
            return self._since_save >= every.steps
        elapsed = time.monotonic() - self._last_save_time
        if every.seconds is not None:
            return elapsed >= every.seconds
        if self._cost is None:
            return True  # measure the cost once, early
        return elapsed >= self.interval

    @property
    def global_step(self):
        """Train steps done, counted across restarts."""
        return self._global_step

    @property
    def epoch(self):
        """The epoch being trained (or the last one, after `fit`)."""
        return self._epoch

    @property
    def epoch_complete(self):
        """Whether the current epoch's last step ran."""
        return self._epoch_complete()

    @property
    def is_chief(self):
        """Whether this process writes the checkpoints (set by `fit`)."""
        return getattr(self, "_chief", True)

    @property
    def interval(self):
        """Seconds between "auto" saves (Young/Daly), or None before the
        first save."""
        if self._cost is None:
            return None
        return schedule.young_daly_interval(
            self._cost,
            self.mtbf,
            minimum=1.5 * (self._write_seconds or 0.0),
        )

    def _epoch_complete(self, ended=False):
        """Whether the current epoch's last step ran. `ended`: Keras ended
        the epoch on its own (decides only when the length is unknown)."""
        steps = (self.params or {}).get("steps")
        examples = self._dataset.num_examples
        if steps or examples is not None:
            return bool(steps and self._step_in_epoch >= steps) or (
                examples is not None and self._examples_in_epoch >= examples
            )
        return ended

    def _position(self):
        """`(epoch, step, examples)` of the next step to train; an epoch
        whose last step ran is complete even before Keras calls
        `on_epoch_end`."""
        if self._epoch_complete():
            return self._epoch + 1, 0, 0
        return self._epoch, self._step_in_epoch, self._examples_in_epoch

    def _state(self, names, variables):
        dataset = self._dataset
        epoch, step_in_epoch, examples = self._position()
        return {
            "global_step": self._global_step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "examples_in_epoch": examples,
            "learning_rate": _learning_rate(self.model.optimizer),
            "global_batch_size": dataset.global_batch_size,
            "num_replicas": dataset.num_replicas,
            "num_workers": _distribute.num_workers(
                self.model.distribute_strategy
            ),
            "shares": [float(s) for s in dataset.shares],
            "shuffle_seed": getattr(dataset, "seed", None),
            "shuffle_mechanism": getattr(dataset, "shuffle_mechanism", None),
            "data_pass": self._data_pass(epoch),
            "callbacks": {
                c.checkpoint_key: _plain(state)
                for c, state in ((c, c.get_state()) for c in self._companions)
                if state is not None
            },
            "variables": names,
            "shapes": [list(v.shape) for v in variables],
            "flavour": _compat.FLAVOUR,
            "time": time.time(),
        }

    def _data_pass(self, epoch):
        """The number of the input pass that trains `epoch` (or None)."""
        first_pass, first_epoch = getattr(self, "_first_pass", (None, 0))
        if first_pass is None:
            return None
        return int(first_pass + epoch - first_epoch)

    def _save(self, wait, replica_state=None):

        started = time.perf_counter()
        names, variables = _compat.checkpoint_variables(self.model)
        arrays = [np.array(v.numpy()) for v in variables]
        state = self._state(names, variables)
        if replica_state is not None:
            # Low-communication training: every replica's own copy of the
            # inner optimizer's state, after the model's tensors.
            state["replica_tensors"] = len(replica_state)
            arrays += replica_state
        step = self._global_step
        self._since_save = 0
        self._last_save_time = time.monotonic()
        with self._lock:
            self._saves[step] = [None, None]

        def write():
            write_started = time.perf_counter()
            try:
                storage.write(self.directory, step, arrays, state)
                storage.prune(self.directory, self.keep)
            except BaseException as error:  # surfaced on the main thread
                with self._lock:
                    self._error = error
                    del self._saves[step]
                return
            seconds = time.perf_counter() - write_started
            with self._lock:
                self._write_seconds = _ema(self._write_seconds, seconds)
                self._saves[step][1] = seconds

        if wait:
            write()
            self._raise_writer_error()
        else:
            self._writer = threading.Thread(
                target=write, name="keras_hetero-checkpoint", daemon=True
            )
            self._writer.start()
        blocking = time.perf_counter() - started
        with self._lock:
            self._cost = _ema(self._cost, blocking)
            if step in self._saves:
                self._saves[step][0] = blocking

    @property
    def saves(self):
        """`(step, seconds training was blocked, seconds the write took)`
        per save of this callback, oldest first (write None while in
        flight)."""
        with self._lock:
            return [(s, b, w) for s, (b, w) in sorted(self._saves.items())]

    def _join(self):
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _raise_writer_error(self):
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(
                f"ElasticCheckpoint could not write to {self.directory}: "
                f"{error}"
            ) from error

    # --- signals ------------------------------------------------------------

    def _install_signal_handlers(self):
        self._previous_handlers = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for number in self.signals:
            self._previous_handlers[number] = signal.signal(
                number, self._on_signal
            )

    def _restore_signal_handlers(self):
        for number, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(number, handler)
        self._previous_handlers = {}

    def _on_signal(self, number, frame):
        if self._stop_requested and number == signal.SIGINT:
            self._restore_signal_handlers()
            raise KeyboardInterrupt
        self._stop_requested = True
        logger.warning(
            "ElasticCheckpoint: got %s; saving at the next step boundary, "
            "then stopping.",
            signal.Signals(number).name,
        )

    # --- state --------------------------------------------------------------

    def get_state(self):
        """Counters as plain data (the checkpoint itself is on disk)."""
        return {
            "global_step": self._global_step,
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "examples_in_epoch": self._examples_in_epoch,
        }


def _learning_rate(optimizer):
    """The optimizer's learning rate as a float, or None for a schedule."""
    if optimizer is None or _compat.has_learning_rate_schedule(optimizer):
        return None
    rate = optimizer.learning_rate
    try:
        return float(rate.numpy() if hasattr(rate, "numpy") else rate)
    except (TypeError, ValueError):
        return None


def _ema(old, new, weight=0.3):
    return new if old is None else (1 - weight) * old + weight * new


def _plain(value):
    return json.loads(json.dumps(value, default=_to_builtin))


def _to_builtin(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def _shapes_text(names, shapes, limit=3):
    head = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes[:limit]))
    return head + (", ..." if len(names) > limit else "")


def _check_directory(directory, write):
    try:
        if write:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".probe-{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        elif os.path.exists(directory) and not os.access(directory, os.R_OK):
            raise PermissionError("not readable")
    except OSError as error:
        raise ValueError(
            "Invalid value for argument `directory`. Received: "
            f"directory={directory!r}, which cannot be "
            f"{'written' if write else 'read'} ({error}). Expected a "
            "directory this process can create and write to."
        ) from None


def _local_training(model):
    """The model's low-communication state (`kh.LowCommunication`), or None."""
    if state.run_state(model) is None or not getattr(model, "built", False):
        return None  # not a HeteroModel, or not built yet
    return runtime.local_training(model)
