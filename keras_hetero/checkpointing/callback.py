"""`ElasticCheckpoint`: exact mid-epoch resume, async, atomic, elastic.

The callback keeps the position (epoch, step, examples) and decides when
to save; its parts: `resume` (the checks and the restore before `fit`),
`writer` (one save at a time, in the background), `preemption` (a signal's
stop, agreed between workers), `storage` (the files), `schedule` (when).
"""

import logging
import os
import secrets
import signal
import time
import warnings

import numpy as np

from keras_hetero import _callback_protocol as base
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero import _phases
from keras_hetero._checks import check_choice
from keras_hetero._checks import check_int
from keras_hetero.checkpointing import preemption
from keras_hetero.checkpointing import record
from keras_hetero.checkpointing import resume
from keras_hetero.checkpointing import schedule
from keras_hetero.checkpointing import storage
from keras_hetero.checkpointing import writer
from keras_hetero.data.shard import HeteroDataset
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
    save; once the job has restarted, `mtbf` is the shorter of the given one
    and the observed one, see `observed_mtbf`), at the end of `fit`, on
    `save_now()`, and when the process gets SIGTERM or SIGINT (then `fit`
    stops at the next step boundary and, with `exit_on_signal`, the process
    exits with `PREEMPTED_EXIT_CODE`). Under
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
    of the resumed epoch cover its remaining steps. Under a tf.data service
    input (`kh.data.shard(service=...)`), whose hand-out of rows to workers
    no checkpoint can hold, it saves only at epochs' ends (a save due
    mid-epoch is made at the epoch's last step; a signal mid-epoch stops
    without one) and a restart trains the interrupted epoch again.

    Args:
        directory: Where checkpoints go; created if missing.
        save_every: Positive int (steps), duration ("30s", "5m", "2h"), or
            "auto". Defaults to `"auto"`.
        keep: Checkpoints kept, >= 1. Defaults to `3`.
        async_save: Write in a background thread. Defaults to `True`.
        mtbf: Mean time between failures for "auto" (seconds or duration):
            the prior, used until the job restarted; then the observed mean
            (`observed_mtbf`) if shorter, so saves come more often when
            failures do. Defaults to `"1h"` (preemptible machines; raise it
            for reliable ones).
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
        local_directory: A directory on this machine's own disk where
            every worker (not only the chief) also keeps its newest `keep`
            saves. A restart restores from there when it holds the step the
            job resumes at (the newest of either place, agreed between the
            workers), so it needs neither the shared storage's bandwidth
            nor, if that is gone, the shared storage; a local copy older
            than `directory`'s newest is never used. With several workers
            `save_every` must be a number of steps (every worker saves at
            the same ones). A failed local write (a full disk) is logged,
            naming the directory, and ends the local copies of that `fit`;
            training and `directory` go on. Defaults to None.

    Raises:
        ValueError: For an unwritable `directory` or `local_directory`
            (`local_directory` under ParameterServerStrategy; with several
            workers, a `save_every` that is not steps), a bad `save_every`,
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
    # The workers save and stop together, at steps these decide.
    agreed_settings = (
        "save_every",
        "mtbf",
        "async_save",
        "resize",
        "exit_on_signal",
        "approximate_resume",
    )

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
        local_directory=None,
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
        self._checks = resume.ResumeChecks(self.approximate_resume)
        _check_directory(self.directory, write=_distribute.env_task().is_chief)
        self.local_directory = None
        if local_directory is not None:
            self.local_directory = os.fspath(local_directory)
            _check_directory(
                self.local_directory, write=True, name="local_directory"
            )
        self._writer = writer.Writer(self.directory, keep, self.local_directory)
        self._stop = preemption.SignalStop(self.signals)
        self.restored_from = None
        self.preempted = False
        self._pending_states = None
        self._companions = []
        self._dataset = None
        self._epoch_ends_only = False
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
        self._checks.reproducible_input(dataset)
        self._dataset = dataset
        self._epoch_ends_only = getattr(dataset, "reads", "all") == "service"
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

    def _restore(self, model, kwargs):
        """Loads the newest valid checkpoint into `model` before `fit`
        (`keras_hetero.checkpointing.resume`).

        Returns:
            A function that undoes `fit` argument changes afterwards.
        """
        self._checks.random_layers(model)
        self._chief = _distribute.is_chief(model.distribute_strategy)
        self._check_local_copies(model)
        self._reset_counters()
        resumed = resume.restore(
            model,
            self._dataset,
            self.directory,
            kwargs,
            resize=self.resize,
            checks=self._checks,
            local_directory=self.local_directory,
        )
        self._first_pass = resumed.first_pass
        _phases.mark(_phases.RESTORED)
        if resumed.path is not None:
            self._epoch, self._step_in_epoch = resumed.epoch, resumed.step
            self._examples_in_epoch = resumed.examples
            self._global_step = resumed.global_step
            self._pending_states = resumed.callback_states
            self.restored_from = resumed.path
            self._failures = _restarts(resumed.failures)
        return resumed.undo

    # --- lifecycle ----------------------------------------------------------

    def _reset_counters(self):
        # Restarts of the job so far, and since when (wall clock): carried
        # in each checkpoint, counted when another process restores it.
        self._failures = {"since": time.time(), "restores": 0}
        self._epoch = 0
        self._step_in_epoch = 0
        self._examples_in_epoch = 0
        self._global_step = 0
        self._since_save = 0
        self._save_pending = False
        self._last_save_time = None
        self._writer.reset_timings()
        self._stop.reset()

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
        if self.local_directory is not None:
            os.makedirs(self.local_directory, exist_ok=True)
            storage.remove_partial(self.local_directory)
        self.preempted = False
        self._last_save_time = time.monotonic()
        self._stop.install()

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
        # Several workers: a request goes to all of them in this call's
        # collectives; they stop together after it.
        self._stop.send(self.model)
        if self._pending_states is not None:
            # After the companions' own on_train_begin reset them.
            states, self._pending_states = self._pending_states, None
            for companion in self._companions:
                state = states.get(companion.checkpoint_key)
                if state is not None:
                    companion.set_state(state)

    def on_train_batch_end(self, batch, logs=None):
        # `step.timed_train_function` marks it too, but a ParameterServer
        # fit runs no such function: this covers it (the second mark of a
        # process is a set lookup).
        _phases.mark(_phases.FIRST_STEP)
        self._writer.raise_error()
        steps = self._steps_of_call(batch)
        self._global_step += steps
        self._step_in_epoch += steps
        self._examples_in_epoch += steps * (
            self._dataset.global_batch_size or 0
        )
        self._since_save += steps
        local = self._low_communication()
        if local is not None:
            self._low_communication_batch_end(local)
            return
        if self._epoch_ends_only and not self._epoch_complete():
            self._service_batch_end()
            return
        if self._stop.due(self.model, self._global_step):
            self.preempted = True
            self.save_now()
            self.model.stop_training = True
            return
        if self._saves_here and (self._save_pending or self.save_due()):
            self._save_pending = False
            self._save(wait=not self.async_save)

    def _service_batch_end(self):
        """Mid-epoch under a tf.data service input, which resumes only at
        an epoch's end (which rows each worker trained was the service's
        hand-out): a save that comes due is made at the epoch's last step;
        a signal stops without one, and a restart trains the epoch again
        from its start."""
        if self._stop.due(self.model, self._global_step):
            self.preempted = True
            self.model.stop_training = True
            logger.warning(
                "ElasticCheckpoint: stopping without a save (tf.data "
                "service input, mid-epoch); a restart resumes from the "
                "newest checkpoint, at an epoch's end."
            )
            return
        if self._saves_here and self.save_due():
            self._save_pending = True

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
        if self._stop.requested:
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
        if self._saves_here and write:
            self._writer.join()
            self._save(wait=True, replica_state=replica_state)

    def _low_communication(self):
        """The model's low-communication state, or None (see
        `kh.LowCommunication`)."""
        return resume.local_training(self.model)

    def _save_if_agreed(self, local, wait=None):
        if not local.save_agreed:
            return
        local.save_agreed = False
        replica_state = local.gather_replica_state()  # every worker
        if self._saves_here:
            self._writer.join()
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
        local = self._low_communication()
        if local is not None:  # the epoch's last round ended just before
            self._save_if_agreed(local)
        # Keras also ends an epoch that `stop_training` cut short; only a
        # complete one moves the position to the next epoch. Of unknown
        # length, an epoch Keras ends by itself ran out of data: complete.
        if self._epoch_complete(ended=not self.model.stop_training):
            self._epoch, self._step_in_epoch = epoch + 1, 0
            self._examples_in_epoch = 0

    def on_train_end(self, logs=None):
        self._stop.uninstall()
        local = self._low_communication()
        if local is not None and not self.preempted:
            # Every worker ends here (whether the chief saves: only it knows).
            self._save_at_round_end(local, write=self._since_save > 0)
        elif self._since_save and not self.preempted:
            if not self._epoch_ends_only or self._epoch_complete():
                self.save_now()
        self._writer.join()
        self._writer.raise_error()
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

        Waits for a save in flight first. Other workers write their local
        copy with `local_directory`, else do nothing.
        """
        if self._saves_here and self.model is not None:
            self._writer.join()
            self._save(wait=True)

    def save_due(self):
        """Whether the chief saves at the end of the current step, by
        `save_every` (a subclass that saves at other points, as
        `kh.ray.ElasticCheckpoint` does at its reports, returns False).

        Returns:
            True if a save is due and none is in flight.
        """
        if self._writer.busy:
            if not self._aligned:
                return False  # at most one save in flight
            # Every worker saves its local copy at the same steps: wait
            # for the one in flight rather than skip.
            self._writer.join()
        every = self.save_every
        if every.steps is not None:
            return self._since_save >= every.steps
        elapsed = time.monotonic() - self._last_save_time
        if every.seconds is not None:
            return elapsed >= every.seconds
        if self._writer.cost is None:
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
    def _saves_here(self):
        """Whether this process saves: the chief, and with
        `local_directory` every worker (its local copy)."""
        return self.is_chief or self.local_directory is not None

    @property
    def _aligned(self):
        """Whether every worker saves its local copy at the same steps
        (`local_directory` with several workers)."""
        return self.local_directory is not None and (
            self.model is not None
            and _distribute.is_multi_worker(self.model.distribute_strategy)
        )

    def _check_local_copies(self, model):
        """Before the first step: local copies on several workers need
        saves every worker makes at the same steps."""
        if self.local_directory is None:
            return
        strategy = model.distribute_strategy
        if _distribute.is_parameter_server(strategy):
            raise ValueError(
                "Invalid value for argument `local_directory`. Received: "
                f"local_directory={self.local_directory!r} under "
                "ParameterServerStrategy, where only the coordinator saves "
                "(the variables live on the parameter servers). Expected "
                "None: restore from `directory`."
            )
        if (
            _distribute.is_multi_worker(strategy)
            and self.save_every.steps is None
            and resume.local_training(model) is None
        ):
            raise ValueError(
                "Invalid value for argument `save_every`. Received: "
                f"save_every={_text(self.save_every)!r} with local_directory="
                f"{self.local_directory!r} and "
                f"{_distribute.num_workers(strategy)} workers. Every worker "
                "writes its local copy at the same steps, which a duration "
                "or 'auto' (timed on the chief alone) does not give. "
                "Expected a number of steps, e.g. save_every=100."
            )

    @property
    def interval(self):
        """Seconds between "auto" saves (Young/Daly), or None before the
        first save."""
        if self._writer.cost is None:
            return None
        observed = self.observed_mtbf
        return schedule.young_daly_interval(
            self._writer.cost,
            self.mtbf if observed is None else min(self.mtbf, observed),
            minimum=1.5 * (self._writer.write_seconds or 0.0),
        )

    @property
    def observed_mtbf(self):
        """Mean seconds between this job's restarts: the wall time since
        its first step over the restarts (restores, by a new process, of a
        checkpoint another process wrote; the count travels in the
        checkpoints), or None before the first restart. The downtime
        between a failure and the restore counts, so it errs short."""
        restores = self._failures["restores"]
        if not restores:
            return None
        return max(time.time() - self._failures["since"], 0.0) / restores

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
        epoch, step_in_epoch, examples = self._position()
        state = record.state(
            self.model,
            self._dataset,
            position=(self._global_step, epoch, step_in_epoch, examples),
            data_pass=self._data_pass(epoch),
            callbacks=self._companions,
            names=names,
            variables=variables,
        )
        state["failures"] = {**self._failures, "process": _PROCESS}
        if replica_state is not None:
            # Low-communication training: every replica's own copy of the
            # inner optimizer's state, after the model's tensors.
            state["replica_tensors"] = len(replica_state)
            arrays += replica_state
        self._since_save = 0
        self._last_save_time = time.monotonic()
        self._writer.save(
            self._global_step, arrays, state, wait, started, shared=self._chief
        )

    @property
    def saves(self):
        """`(step, seconds training was blocked, seconds the write took)`
        per save of this callback, oldest first (write None while in
        flight)."""
        return self._writer.saves

    # --- state --------------------------------------------------------------

    def get_state(self):
        """Counters as plain data (the checkpoint itself is on disk)."""
        return {
            "global_step": self._global_step,
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "examples_in_epoch": self._examples_in_epoch,
        }


def _text(every):
    return "auto" if every.auto else f"{every.seconds:g}s"


# Tells a checkpoint of this process from one of a process before a restart.
_PROCESS = secrets.token_hex(8)


def _restarts(failures):
    """The restart record after restoring a checkpoint whose record is
    `failures` (None: a checkpoint older than the record)."""
    failures = dict(failures or {"since": time.time(), "restores": 0})
    restores = int(failures.get("restores", 0))
    if failures.get("process") != _PROCESS:
        restores += 1  # a new process: the job restarted
    return {"since": float(failures["since"]), "restores": restores}


def _check_directory(directory, write, name="directory"):
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
            f"Invalid value for argument `{name}`. Received: "
            f"{name}={directory!r}, which cannot be "
            f"{'written' if write else 'read'} ({error}). Expected a "
            "directory this process can create and write to."
        ) from None
