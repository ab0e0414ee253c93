"""`StragglerDetector`: finds slow replicas and stuck workers."""

import json
import logging
import os
import threading
import time

import numpy as np

from keras_hetero import _callback_protocol as base
from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero import _environment
from keras_hetero import _scalar_writer as writer
from keras_hetero._checks import check_int
from keras_hetero._checks import check_number
from keras_hetero._environment import HANG_REPORT_ENV
from keras_hetero.stragglers import communication
from keras_hetero.stragglers import links
from keras_hetero.stragglers import scoring as straggler
from keras_hetero.training import clock_check

logger = logging.getLogger("keras_hetero")


ACTIONS = ("warn", "rebalance", "checkpoint", "stop")


class StragglerDetector(base.HeteroCallback):
    """Scores every replica's speed each step and reports stragglers.

    With a `HeteroModel` it reads `model.step_stats` (every replica of every
    worker; all workers see the same numbers and flag alike); with a plain
    `keras.Model` it times this worker's train batches (one series per
    worker: coarser). Over the median of the last `window` steps it scores
    each replica (`kh.straggler`): individual = its expected time at its
    current rows / its time, against the least slowed replica; relative =
    the best replica's seconds per row / its own. A score below `threshold`
    (or the relative one below `relative_threshold`) for `patience`
    evaluations makes a straggler; both scores back above for `patience`
    evaluations, a recovery.

    A slower device is not a straggler; a device slower than itself is:
    with a `ShardRebalancer` in the `fit` (or `rebalancer=` given) the
    relative score is used only if `relative_threshold` is set, so a fleet
    that differs from the start raises no event. A low score counts only if
    the replica also loses more compute per step than `min_excess_seconds`
    and than the noise measured during the run (steps of a few milliseconds
    on a busy machine); a slowdown that spares no step of the window is
    flagged within `window + patience - 2` steps. A replica whose clock
    does not see its device's work (`ClockCheck`) is named in one warning,
    recorded in `clock_findings` and no longer scored. docs/stragglers.md
    says why each rule is there and what it was measured against.

    Each event is appended to `.events`, logged in one line (replica,
    worker, device, scores), passed to `on_straggler(event)`, written to
    TensorBoard under `log_dir`, and acted on: `"warn"` (the line only),
    `"rebalance"` (`rebalancer` decides now), `"checkpoint"`
    (`checkpoint.save_now()`), `"stop"` (checkpoint if possible, then
    `model.stop_training = True`).

    Slow links: when each step's time outside compute (the collective's
    wait, the input) stays above twice its baseline while no replica is
    slower, it logs once that communication, not a device, slows the steps
    and appends a `CommunicationEvent` to `.communication_events`; under
    MultiWorkerMirroredStrategy with `probe_links` the workers probe the
    paths to each other and the event names the workers behind the slow
    link. No action: shares cannot help with a slow link.

    Hang watchdog (multi-worker): with `hang_timeout`, a train step that
    does not finish in time makes it ask TensorFlow's coordination service
    which workers have not reached the step and log them; with
    `abort_on_hang=True` the process then exits with `HANG_EXIT_CODE`, for
    a launcher to restart the job.

    Epoch logs get `straggler/relative_<i>`, `straggler/individual_<i>`,
    `straggler/flagged` and `straggler/communication`.

    Args:
        threshold: Score below which a replica is slow, in (0, 1]. Defaults
            to `0.7`.
        relative_threshold: Relative score below which a replica is slow,
            in (0, 1]; `None`: not used with a `ShardRebalancer` in the
            `fit`, `threshold` without one. Defaults to `None`.
        patience: Evaluations in a row before flagging or recovering, >= 1.
            Defaults to `3`.
        action: One of "warn", "rebalance", "checkpoint", "stop", or a list
            of them. Defaults to `"warn"`.
        on_straggler: Called with every `StragglerEvent`. Defaults to None.
        window: Readings the median covers, one per train batch callback
            (with `steps_per_execution=k`, one per call of up to k steps).
            Defaults to `9`.
        min_excess_seconds: Compute seconds per step (per execution with
            `steps_per_execution > 1`) a replica must lose before a low
            score counts, >= 0. Defaults to `0.003`.
        rebalancer: The `ShardRebalancer` for `action="rebalance"`.
        checkpoint: An object with `save_now()` (e.g. a checkpoint callback)
            for `"checkpoint"` / `"stop"`. Defaults to None.
        log_dir: Directory for TensorBoard scalars. Defaults to None.
        hang_timeout: Seconds a train step may take before the watchdog
            reports; None disables it. Defaults to None.
        abort_on_hang: Exit the process after reporting a hang. Defaults to
            `False`.
        probe_links: Under MultiWorkerMirroredStrategy, probe the links
            between workers to name the one behind a slow link. Defaults
            to `True`.

    Raises:
        ValueError: For `threshold` or `relative_threshold` outside
            (0, 1], `patience` or `window` below 1, a negative
            `min_excess_seconds`, an unknown action, `"rebalance"` without a
            rebalancer, or a non-positive `hang_timeout`.
        TypeError: If `on_straggler` is not callable.

    Example:

    >>> detector = StragglerDetector(threshold=0.7, patience=3)
    >>> # model.fit(data, callbacks=[detector]); detector.events
    """

    HANG_EXIT_CODE = _environment.HANG_EXIT_CODE

    # Every worker scores the same readings and acts (rebalance, save,
    # stop, abort on a hang) at the same steps: these decide which and when.
    agreed_settings = (
        "threshold",
        "relative_threshold",
        "patience",
        "min_excess_seconds",
        "actions",
        "window",
        "hang_timeout",
        "abort_on_hang",
        "probe_links",
    )

    def __init__(
        self,
        threshold=0.7,
        patience=3,
        action="warn",
        on_straggler=None,
        *,
        window=9,
        rebalancer=None,
        checkpoint=None,
        log_dir=None,
        hang_timeout=None,
        abort_on_hang=False,
        relative_threshold=None,
        min_excess_seconds=straggler.MIN_EXCESS_SECONDS,
        probe_links=True,
    ):
        super().__init__()
        check_number("threshold", threshold, 0, 1, above=True)
        if relative_threshold is not None:
            check_number(
                "relative_threshold", relative_threshold, 0, 1, above=True
            )
        check_int("patience", patience)
        check_int("window", window)
        actions = [action] if isinstance(action, str) else list(action)
        unknown = [a for a in actions if a not in ACTIONS]
        if unknown or not actions:
            raise ValueError(
                "Invalid value for argument `action`. Received: "
                f"action={action!r}. Expected one or more of {ACTIONS}."
            )
        if "rebalance" in actions and rebalancer is None:
            raise ValueError(
                'action="rebalance" needs `rebalancer=` (the ShardRebalancer '
                "of the dataset being trained on)."
            )
        if on_straggler is not None and not callable(on_straggler):
            raise TypeError(
                "Invalid value for argument `on_straggler`. Received: "
                f"on_straggler={on_straggler!r}. Expected a callable or None."
            )
        check_number("min_excess_seconds", min_excess_seconds, 0)
        if hang_timeout is not None:
            check_number("hang_timeout", hang_timeout, 0, above=True)
        self.threshold = float(threshold)
        self.relative_threshold = (
            None if relative_threshold is None else float(relative_threshold)
        )
        self.patience = patience
        self.min_excess_seconds = float(min_excess_seconds)
        self.actions = actions
        self.on_straggler = on_straggler
        self.window = window
        self.rebalancer = rebalancer
        self.checkpoint = checkpoint
        self.log_dir = log_dir
        self.hang_timeout = hang_timeout
        self.abort_on_hang = abort_on_hang
        self.probe_links = bool(probe_links)
        self.events = []
        self.hangs = []
        self.clock_findings = []
        self._clock = None
        clock_check.forget(self.model)
        self._scorer = None
        self._communication = None
        self._watch = None
        self._writer = None
        self._watchdog = None
        self._rebalanced = False

    # --- lifecycle ---------------------------------------------------------

    def prepare_fit(self, context):
        """Notes whether a callback of this `fit` changes the shares (a
        `ShardRebalancer`; the `kh.callbacks.HeteroCallback` protocol).

        Args:
            context: The `kh.callbacks.FitContext` of this `fit`.
        """
        self._rebalanced = any(
            getattr(callback, "changes_shares", False)
            for callback in context.callbacks
        )

    def _relative_threshold(self):
        if self.relative_threshold is not None:
            return self.relative_threshold
        if self._rebalanced or self.rebalancer is not None:
            # A device slower than the others from the start is the
            # rebalancer's to size, not an event: only a replica slower
            # than itself (the individual score) is flagged.
            return 0.0
        return self.threshold

    def on_train_begin(self, logs=None):
        self.events = []
        self.hangs = []
        self.clock_findings = []
        self._clock = None
        clock_check.forget(self.model)
        self._scorer = None
        restored = getattr(self, "_restored_communication", None)
        self._communication = communication.CommunicationTracker(
            self.window, self.patience, self.min_excess_seconds
        )
        if restored is not None:
            self._communication.set_state(restored)
        self._watch = links.SlowLinkWatch(
            self._communication, self._make_links()
        )
        self._steps = 0
        self._batch_start = None
        if self.log_dir is not None and self._writer is None:
            # The same scalar writer as HeteroTensorBoard's.
            self._writer = writer.ScalarWriter(self.log_dir)
        if self.hang_timeout is not None:
            self._watchdog = _Watchdog(self, self.hang_timeout)
            self._watchdog.start()

    def on_train_end(self, logs=None):
        # The next `fit` may have no rebalancer (its `prepare_fit` says).
        self._rebalanced = False
        if self._watch is not None:
            self._watch.close()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._writer is not None:
            self._writer.flush()

    def on_epoch_begin(self, epoch, logs=None):
        if self._watchdog is not None:
            self._watchdog.epoch_started()

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_start = time.perf_counter()
        if self._watchdog is not None:
            self._watchdog.step_started(self._steps + 1)

    def on_train_batch_end(self, batch, logs=None):
        rows, seconds, steps, measured, devices, call = self._observation()
        if steps == 0:  # ParameterServerStrategy: no step finished yet
            return
        self._steps += steps
        if self._watchdog is not None:
            self._watchdog.step_finished(self._steps)
        if not measured:
            # Low-communication training before a synchronisation: the
            # round's numbers arrive with it.
            return
        stats = getattr(self.model, "step_stats", None)
        if stats is not None:
            # The model's one check, shared with a ShardRebalancer.
            self._clock = clock_check.shared(self.model, devices)
        elif self._clock is None or len(self._clock.devices) != len(rows):
            self._clock = clock_check.ClockCheck(devices)
        findings = self._clock.add(
            rows, seconds, measured, at=None if stats is None else stats.step
        )
        for finding in findings:
            self.clock_findings.append(finding)
            logger.warning(
                "StragglerDetector: %s",
                finding.message(
                    "It is no longer scored."
                    if finding.blind
                    else "It is still scored (on window medians)."
                ),
            )
        if any(finding.blind for finding in findings):
            # A blind clock's readings so far (near zero) may be what made
            # the others look slow: the scores start over without them.
            self._scorer = None
        seconds = self._clock.masked(seconds)
        if self._scorer is None or self._scorer.num_replicas != len(rows):
            # None, or restored (`set_state`) for another replica count.
            self._scorer = straggler.Scorer(len(rows), self.window)
        # Also after `set_state`, which restores the scorer only.
        self._devices = devices
        changes = self._scorer.step(
            rows,
            seconds,
            threshold=self.threshold,
            patience=self.patience,
            relative_threshold=self._relative_threshold(),
            min_excess_seconds=self.min_excess_seconds,
        )
        if self._watch is not None and measured == steps:
            # Not low-communication training, inside a fit.
            self._watch.step(self._steps, call, seconds, steps, bool(changes))
        for replica, kind, relative, individual in changes:
            self._emit(
                straggler.StragglerEvent(
                    step=self._steps,
                    replica=replica,
                    worker=_worker_of(replica, self._devices),
                    device=self._devices[replica],
                    relative_score=relative,
                    individual_score=individual,
                    kind=kind,
                )
            )

    @property
    def communication_events(self):
        """The `CommunicationEvent`s of the last `fit` (see the class
        docstring), oldest first."""
        return [] if self._watch is None else self._watch.events

    def _make_links(self):
        task = _distribute.env_task()
        strategy = getattr(self.model, "distribute_strategy", None)
        if (
            not self.probe_links
            or task.num_workers < 2
            or len(task.addresses) != task.num_workers
            or strategy is None
            or not _distribute.is_multi_worker(strategy)
        ):
            return None
        return links.LinkRounds(task.worker_index, task.addresses)

    def _observation(self):
        stats = getattr(self.model, "step_stats", None)
        if stats is not None:
            return (
                stats.rows,
                stats.compute_seconds,
                stats.steps,
                stats.measured_steps,
                stats.devices,
                stats.call_seconds,
            )
        # Plain keras.Model: this worker's wall time per batch, one "row".
        seconds = time.perf_counter() - (self._batch_start or 0.0)
        return (
            np.array([1]),
            np.array([seconds]),
            1,
            1,
            [_distribute.env_task().device_job],
            None,  # no call time: the time outside compute is not followed
        )

    def on_epoch_end(self, epoch, logs=None):
        scalars = self.scalars()
        if logs is None or not scalars:
            return
        logs.update(scalars)
        if self._writer is not None:
            self._writer.write(self._steps, scalars)

    def scalars(self):
        """The current scores as flat numbers, e.g. for TensorBoard.

        Returns:
            `{"straggler/relative_<i>": float, "straggler/individual_<i>":
            float, ..., "straggler/flagged": int}` (a score is 1.0 until
            the window has a reading), or `{}` before the first step.
        """
        if self._scorer is None:
            return {}
        state = self._scorer.state()
        relative, individual = straggler.scores(state)
        scalars = {}
        for replica in range(len(relative)):
            scalars[f"straggler/relative_{replica}"] = float(
                np.nan_to_num(relative[replica], nan=1.0)
            )
            scalars[f"straggler/individual_{replica}"] = float(
                np.nan_to_num(individual[replica], nan=1.0)
            )
        scalars["straggler/flagged"] = int(state.flagged.sum())
        if self._communication is not None:
            scalars["straggler/communication"] = int(self._communication.slow)
        return scalars

    # --- events and actions ---------------------------------------------

    def _thresholds(self):
        relative = self._relative_threshold()
        if relative == self.threshold:
            return f"{self.threshold:.2f}"
        if not relative:
            return f"{self.threshold:.2f}, relative not used: rebalanced"
        return f"{self.threshold:.2f}, relative {relative:.2f}"

    def _emit(self, event):
        self.events.append(event)
        verb = "is a straggler" if event.kind == "straggler" else "recovered"
        logger.warning(
            "StragglerDetector: replica %d (worker %d, %s) %s at step %d: "
            "relative score %.2f, individual score %.2f (threshold %s)",
            event.replica,
            event.worker,
            event.device,
            verb,
            event.step,
            event.relative_score,
            event.individual_score,
            self._thresholds(),
        )
        if self.on_straggler is not None:
            self.on_straggler(event)
        if event.kind != "straggler":
            return
        if "rebalance" in self.actions:
            self.rebalancer.rebalance_now()
        if "checkpoint" in self.actions or "stop" in self.actions:
            save = getattr(self.checkpoint, "save_now", None)
            if save is not None:
                save()
        if "stop" in self.actions:
            self.model.stop_training = True

    # --- state -------------------------------------------------------------

    def get_state(self):
        """Plain-data state for checkpoints."""
        return {
            "scores": None
            if self._scorer is None
            else self._scorer.state().to_dict(),
            "steps": getattr(self, "_steps", 0),
            "communication": None
            if self._communication is None
            else self._communication.state(),
        }

    def set_state(self, state):
        """Restores `get_state()` output."""
        scores = state["scores"]
        self._scorer = (
            None
            if scores is None
            else straggler.Scorer.from_state(
                straggler.ScoreState.from_dict(scores)
            )
        )
        self._steps = int(state["steps"])
        # Older states have no "communication": the baseline is measured
        # again.
        self._restored_communication = state.get("communication")
        if self._communication is not None and self._restored_communication:
            self._communication.set_state(self._restored_communication)


def _worker_of(replica, devices):
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(devices[replica])
    return int(spec.task or 0)


class _Watchdog:
    """Reports workers that have not reached the current step in time.

    Progress goes through TensorFlow's coordination service key-value store
    (running in every multi-worker job), so it works while the collective
    that waits for the missing worker is blocked. A worker is missing if it
    has not started the step (stalled) or if its heartbeat, a counter it
    rewrites every `period` seconds from a thread of its own, does not
    advance while the survivor looks (its link is cut: both may have
    started the step, and the collective waits for its bytes).
    """

    def __init__(self, detector, timeout):
        self.detector = detector
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._step = 0
        self._first = None
        self._started = None
        self._reported = None
        self._stop = threading.Event()
        self.period = min(1.0, self.timeout / 4)
        self._thread = threading.Thread(
            target=self._run, name="keras_hetero-watchdog", daemon=True
        )
        self._beat = threading.Thread(
            target=self._heartbeat, name="keras_hetero-heartbeat", daemon=True
        )
        task = _distribute.env_task()
        self._workers, self._task = task.num_workers, task.worker_index

    def start(self):
        self._thread.start()
        if self._workers > 1:
            self._beat.start()

    def _heartbeat(self):
        beat = 0
        while not self._stop.wait(self.period):
            beat += 1
            _beat(self._task, beat)

    def stop(self):
        self._stop.set()

    def step_started(self, step):
        with self._lock:
            previous = self._step
            self._step, self._started = step, time.monotonic()
            if self._first is None:
                self._first = step
        _publish(self._task, step, previous)

    def epoch_started(self):
        # The first step of an epoch waits for the new iterator (and, under
        # MWMS, for workers finishing the epoch's saves): measured 6-8 s on
        # a loaded 2-core machine right after a network outage, and not a
        # hang. It is not watched, like the first step of the fit.
        with self._lock:
            self._first = None

    def step_finished(self, step):
        with self._lock:
            self._started = None

    def _run(self):
        heartbeats = _Heartbeats(self.period)
        while not self._stop.wait(self.period):
            with self._lock:
                step, started = self._step, self._started
            # The first step of a fit traces and sets up the collectives
            # (and that of each epoch waits for its iterator): it may take
            # any time, and is not watched.
            if started is None or self._reported == step or step == self._first:
                heartbeats.forget()
                continue
            elapsed = time.monotonic() - started
            others = [w for w in range(self._workers) if w != self._task]
            # From half the timeout on, the others' heartbeats are read at
            # every poll: at the timeout, a worker silent since then is
            # known at once (no further wait that TF's own heartbeat
            # timeout could overtake).
            if elapsed >= self.timeout / 2:
                heartbeats.read(others)
            if elapsed < self.timeout:
                continue
            self._reported = step
            # Tells the other survivors this worker is waiting here too: it
            # may exit (and its heartbeat stop) while they still decide.
            _publish_waiting(self._task, step)
            stalled = [w for w in others if not _reached(w, step)]
            silent = heartbeats.silent(
                [w for w in others if w not in stalled],
                waiting=lambda task, step=step: _waiting(task, step),
            )
            missing = sorted(stalled + silent)
            self.detector.hangs.append((step, missing))
            logger.error(
                "StragglerDetector: step %d has not finished after %.0fs; "
                "worker(s) %s have not reached it%s.",
                step,
                self.timeout,
                missing,
                f" (unreachable: {silent})" if silent else "",
            )
            _write_report(self._task, step, missing)
            if self.detector.abort_on_hang:
                if self._task == 0 and len(missing) < len(others):
                    # Worker 0 holds the coordination service: the other
                    # survivors read its heartbeat and the others' there.
                    # Leaving at once would make it look cut off to those
                    # still deciding (up to one heartbeat window). With no
                    # other survivor it leaves at once: lingering only gave
                    # TF's own heartbeat error time to end it with exit 1.
                    self._stop.wait(heartbeats.window + self.period)
                logging.shutdown()
                os._exit(StragglerDetector.HANG_EXIT_CODE)


def _write_report(task, step, missing):
    """Tells the launcher (`kh.launcher.launch` sets `HANG_REPORT_ENV` to a
    file per worker) which workers this one found missing: with
    `min_workers`, a restart leaves out those most reports name."""
    path = os.environ.get(HANG_REPORT_ENV)
    if not path:
        return
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"worker": task, "step": step, "missing": missing}, f)
        os.replace(path + ".tmp", path)
    except OSError as error:
        logger.warning(
            "StragglerDetector: no hang report at %s: %s", path, error
        )


def _waiting_key(task, step):
    return f"keras_hetero/waiting/{task}/{step}"


def _publish_waiting(task, step):
    """Marks that worker `task` found step `step` hung (it is alive)."""
    try:
        _compat.set_coordination_value(_waiting_key(task, step), "1")
    except Exception:  # unreachable service: what the others detect
        pass


def _waiting(task, step):
    """Whether worker `task` found step `step` hung too (waits 0.1 s)."""
    return _compat.has_coordination_value(_waiting_key(task, step), 100)


def _progress_key(task, step):
    return f"keras_hetero/progress/{task}/{step}"


def _publish(task, step, previous):
    """Marks that worker `task` started step `step` and drops its mark of
    step `previous` (`step - k` with `steps_per_execution=k`; 0: none)."""
    try:
        _compat.set_coordination_value(_progress_key(task, step), "1")
        if previous:
            _compat.delete_coordination_value(_progress_key(task, previous))
    except Exception:  # no coordination service (single worker)
        pass


def _heartbeat_key(task):
    return f"keras_hetero/heartbeat/{task}"


def _beat(task, beat):
    """Rewrites worker `task`'s heartbeat counter (failures are silent: an
    unreachable service is what the others detect)."""
    try:
        _compat.delete_coordination_value(_heartbeat_key(task))
        _compat.set_coordination_value(_heartbeat_key(task), str(beat))
    except Exception:
        pass


class _Heartbeats:
    """What the watchdog has read of the other workers' heartbeats: each
    one's last value and when it last changed (monotonic seconds)."""

    def __init__(self, period):
        self.period = period
        # A worker whose counter has not moved for this long is silent
        # (it moves every `period` while the worker can reach the service).
        self.window = 3 * period + 0.5
        self._seen = {}

    def forget(self):
        self._seen.clear()

    def read(self, tasks):
        now = time.monotonic()
        for task in tasks:
            value = _compat.get_coordination_value(_heartbeat_key(task), 200)
            last = self._seen.get(task)
            if last is None or (value is not None and value != last[0]):
                self._seen[task] = (value, now)

    def silent(self, tasks, waiting=lambda task: False):
        """The workers of `tasks` whose heartbeat has not moved for
        `window` seconds, reading on until each has moved, says it is
        `waiting` at the same step, or that long has passed since it last
        moved (cut off, or dead)."""
        undecided, silent = set(tasks), []
        while True:
            # A change is one seen by this read (a task not read before
            # has none yet).
            before = {t: self._seen[t][0] for t in undecided if t in self._seen}
            self.read(sorted(undecided))
            now = time.monotonic()
            for task in sorted(undecided):
                value, changed = self._seen[task]
                if task in before and value != before[task]:
                    undecided.discard(task)  # it beat again: alive
                elif waiting(task):
                    undecided.discard(task)  # it reports the hang too
                elif now - changed >= self.window:
                    undecided.discard(task)
                    silent.append(task)
            if not undecided:
                return sorted(silent)
            time.sleep(self.period / 4)


def _reached(task, step):
    """Whether worker `task` has started step `step` (its mark is written
    when the step starts, long before a timeout: waits up to 0.5 s)."""
    return _compat.has_coordination_value(_progress_key(task, step), 500)
