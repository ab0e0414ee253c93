"""`ShardRebalancer`: moves rows from slow replicas to fast ones during fit."""

import logging

import numpy as np

from keras_hetero import _callback_protocol as base
from keras_hetero import _distribute
from keras_hetero._checks import check_int
from keras_hetero._checks import check_number
from keras_hetero.balancing import core as rebalance
from keras_hetero.balancing import memory
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.training import clock_check
from keras_hetero.training import trust_check

logger = logging.getLogger("keras_hetero")


class ShardRebalancer(base.HeteroCallback):
    """Sets a HeteroDataset's shares in proportion to measured replica speed.

    After every train batch it reads `model.step_stats` (rows and compute
    seconds of every replica; all workers see the same numbers) and keeps a
    window of each replica's seconds per row. Every `every_n_steps` steps it
    estimates speed as the window median (robust to noise and outliers),
    proposes shares proportional to speed within `min_share` and each
    replica's row cap (`max_rows`: by default what its device's memory is
    estimated to hold),
    and applies them only if the predicted step time drops by more than
    `tolerance` (so shares do not oscillate). A change applies from the
    global batch `lag` batches after the current one, named explicitly, so
    every worker's input pipeline splits every batch the same way and every
    example is still seen exactly once per epoch. When a replica's speed
    changes, the window forgets the old speed within about `window / 2`
    observations and the shares follow. With `steps_per_execution=k` Keras
    calls the callback once per call of up to k steps: `every_n_steps` and
    `warmup_steps` still count steps, and each call is one reading (its
    rows and seconds summed).

    The epoch logs (and so `History` and the progress bar) get
    `share/replica_<i>`. With `fit(verbose=1)` or `2`, each change also
    prints one line: "ShardRebalancer: step 12: shares 0.143 0.286 0.571
    (rows 6 12 24) from batch 16".

    Without `dataset` it acts on the input of each `fit` it is passed to:
    a `kh.data.HeteroDataset`, or numpy arrays / tensors, which
    `HeteroModel.fit` shards itself. With one replica there is nothing to
    balance and it does nothing.

    With `max_rows="auto"` (the default), each replica's rows per global
    batch are capped by what its device's memory is estimated to hold
    (`keras_hetero.balancing.memory`: the model's weights, gradients and
    optimizer state, and twice each layer's output per row, with 10% of
    the memory left free; every worker's devices as exchanged at the start
    of `fit`, so every worker computes the same caps), worked out at the
    first decision of each `fit` and kept in `row_caps`. A move never gives
    a replica more rows than its cap, and a replica that holds more than
    its cap is moved down at the first decision whatever the gain; when a
    cap holds a replica below what its speed would give it, one warning
    (logger `keras_hetero`) names the replica, its device and the
    estimate. The estimate leaves out TensorFlow's and cuDNN's workspaces:
    where it is too high for a model, give `max_rows` by hand (the
    doctor's `max rows*` is the same estimate). A replica whose memory or
    whose model's per-row bytes are unknown (a subclassed model, whose
    layers have no symbolic outputs) is not capped; when the caps cannot
    hold the global batch together, a warning says so and none applies.

    It checks that the readings mean device time before it acts on them
    (`keras_hetero.training.clock_check.ClockCheck`): a replica whose
    seconds stay near zero, or do not move when its rows do (a share
    change), is named in one warning (logger `keras_hetero`) and keeps its
    share (recorded in `clock_findings`), rather than the shares following
    noise. Readings that jump from step to step are reported once too.
    Every `trust_every_n_steps` steps it also runs the trust check on one
    replica in turn (`keras_hetero.training.trust_check`): the replica's
    forward pass, loss and gradients of its rows (random data shaped like
    the model's inputs) timed from the host, synchronised with its device,
    against what its in-step clock reads; a clock reading under half of
    that is blind too, and its share is held. This is what tells two
    equally blind devices apart. It runs on single-worker strategies (a
    worker can time only its own devices, and every worker must decide
    alike); a model without symbolic inputs is not checked.

    Args:
        dataset: The `kh.data.HeteroDataset` to act on. Defaults to `None`:
            the input `fit` gets.
        every_n_steps: Steps between decisions. Defaults to `10`.
        warmup_steps: Steps ignored at the start of each `fit` (tracing,
            caches). Defaults to `2`.
        window: Readings per replica the estimate uses. Defaults to `10`.
        min_share: Lower bound for every share. Defaults to `0.0`.
        max_rows: Upper bound on a replica's rows per global batch:
            `"auto"` (from its device's memory, see above), an int, one
            int per replica (in global replica order), or None for no
            bound. Defaults to `"auto"`.
        tolerance: Minimum predicted step-time gain for a change. Defaults
            to `0.05`.
        lag: Global batches between a decision and the first batch it
            splits; larger than what the pipeline prefetches after the split.
            Defaults to `4`.
        trust_every_n_steps: Steps between two trust checks (each of one
            replica; a few calls of a gradient function, and a trace the
            first time on each replica); None for none. Defaults to `500`.

    Raises:
        TypeError: If `dataset` is not None or a `kh.data.HeteroDataset`.
        ValueError: For a non-positive `every_n_steps`, `window` or `lag`, a
            negative `warmup_steps`, `min_share` outside `[0, 1/replicas]`,
            `max_rows` not "auto", None or rows >= 1, `tolerance` < 0, or a
            non-positive `trust_every_n_steps`. At the start of `fit`:
            (without `dataset`) if the input cannot be rebalanced (a
            `tf.data.Dataset` or generator under several replicas); if
            `max_rows` given per replica does not name one per replica, or
            given rows cannot hold the global batch together.

    Example:

    >>> model.fit(x, y, callbacks=[ShardRebalancer()])  # doctest: +SKIP
    >>> data = kh.data.shard(examples, 64)  # doctest: +SKIP
    >>> model.fit(data, callbacks=[ShardRebalancer(data)])  # doctest: +SKIP
    """

    def __init__(
        self,
        dataset=None,
        every_n_steps=10,
        *,
        warmup_steps=2,
        window=10,
        min_share=0.0,
        max_rows="auto",
        tolerance=0.05,
        lag=4,
        trust_every_n_steps=500,
    ):
        super().__init__()
        if dataset is not None and not isinstance(dataset, HeteroDataset):
            raise TypeError(
                "Invalid value for argument `dataset`. Received: "
                f"dataset={dataset!r} of type {type(dataset).__name__}. "
                "Expected the kh.data.HeteroDataset given to `fit` (made by "
                "`kh.data.shard`), or None for whatever `fit` gets."
            )
        for name, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("window", window, 1),
            ("lag", lag, 1),
            ("warmup_steps", warmup_steps, 0),
        ):
            check_int(name, value, low)
        if trust_every_n_steps is not None:
            check_int("trust_every_n_steps", trust_every_n_steps, 1)
        _check_min_share(min_share, dataset)
        _check_max_rows(max_rows)
        check_number("tolerance", tolerance, 0)
        self.dataset = dataset
        self._given = dataset
        self.every_n_steps = every_n_steps
        self.warmup_steps = warmup_steps
        self.window = window
        self.min_share = float(min_share)
        self.max_rows = max_rows
        self._auto = isinstance(max_rows, str)  # "auto", checked above
        self.tolerance = float(tolerance)
        self.lag = lag
        self.trust_every_n_steps = trust_every_n_steps
        self._reset()

    stage = "input"
    changes_shares = True
    # Every worker decides the same shares at the same steps from the same
    # readings: these decide which and when.
    agreed_settings = (
        "every_n_steps",
        "warmup_steps",
        "window",
        "min_share",
        "max_rows",
        "tolerance",
        "lag",
        "trust_every_n_steps",
    )

    def prepare_fit(self, context):
        """Takes `fit`'s input when made without a dataset (the
        `kh.callbacks.HeteroCallback` protocol).

        Args:
            context: The `kh.callbacks.FitContext` of this `fit`.

        Raises:
            ValueError: If `fit`'s input is not a `kh.data.HeteroDataset`
                (or arrays, which `fit` shards into one), or `min_share`
                does not fit its replicas.
        """
        if self._given is not None:
            return
        dataset, model = context.input, context.model
        strategy = model.distribute_strategy
        if (
            strategy.num_replicas_in_sync == 1
            or _distribute.is_parameter_server(strategy)
        ):
            # One replica, or workers that each step on whole batches as
            # they are free: nothing to balance.
            self.dataset = None
            return
        if not isinstance(dataset, HeteroDataset):
            raise ValueError(
                "`ShardRebalancer()` without `dataset` rebalances the input "
                "of `fit`: numpy arrays or tensors (sharded by `fit`), or a "
                "`kh.data.HeteroDataset` (`kh.data.shard(examples, "
                "global_batch_size)`). Received x of type "
                f"{type(dataset).__name__}, whose per-replica rows cannot "
                "change. Pass unbatched examples through `kh.data.shard`."
            )
        _check_min_share(self.min_share, dataset)
        self.dataset = dataset
        self._reset()

    def _reset(self):
        self._speeds = rebalance.SpeedWindow.empty(
            self.dataset.num_replicas if self.dataset is not None else 1,
            self.window,
        )
        self._steps = 0
        self._since_decision = 0
        self._pass = None
        self._pass_steps = 0
        self._clock = None
        self._since_trust = 0
        self._trust_replica = 0
        self._bound = set()
        self.row_caps = None
        self.changes = []
        self.clock_findings = []

    def on_train_begin(self, logs=None):
        self._reset()
        clock_check.forget(self.model)
        if self.dataset is not None and not self._auto:
            self.row_caps = _given_caps(self.max_rows, self.dataset)

    def on_train_batch_end(self, batch, logs=None):
        stats = getattr(self.model, "step_stats", None)
        if stats is None or self.dataset is None:
            return
        self._track_pass(stats.steps)
        self._steps += stats.steps
        if self._steps <= self.warmup_steps or not stats.measured_steps:
            # measured_steps == 0: low-communication training before a
            # synchronisation (a round's numbers arrive with it).
            return
        self._check_clock(stats)
        self._since_trust += stats.measured_steps
        if (
            self.trust_every_n_steps is not None
            and self._since_trust >= self.trust_every_n_steps
        ):
            self._since_trust = 0
            self._trust_check()
        self._speeds = self._speeds.add(stats.rows, stats.compute_seconds)
        self._since_decision += stats.measured_steps
        if self._since_decision < self.every_n_steps:
            return
        self.rebalance_now()

    def _check_clock(self, stats):
        # The model's one check, shared with a StragglerDetector.
        self._clock = clock_check.shared(self.model, stats.devices)
        self._report(
            self._clock.add(
                stats.rows,
                stats.compute_seconds,
                stats.measured_steps,
                at=stats.step,
            )
        )

    def _report(self, findings):
        for finding in findings:
            self.clock_findings.append(finding)
            logger.warning(
                "ShardRebalancer: %s",
                finding.message(
                    "Its share is held where it is."
                    if finding.blind
                    else "Decisions go on from the window's medians."
                ),
            )

    def _trust_check(self):
        """Times one replica's work from the host and compares (see the
        class docstring); the next call takes the next replica."""
        model = self.model
        strategy = model.distribute_strategy
        if _distribute.is_multi_worker(strategy):
            return
        usable = np.flatnonzero(self._clock.usable())
        if self._trust_replica is None or not len(usable):
            return
        replica = int(
            usable[np.searchsorted(usable, self._trust_replica) % len(usable)]
        )
        self._trust_replica = replica + 1
        rows, clock_seconds = self._clock.recent_seconds(replica)
        if not rows >= 1:
            return
        arrays = trust_check.random_batch(model, int(rows))
        if arrays is None:
            self._trust_replica = None  # nothing to shape data by
            return
        device = self._clock.devices[replica]
        with strategy.scope():
            host_seconds = trust_check.host_seconds(model, arrays, device)
        self._report(self._clock.compare(replica, clock_seconds, host_seconds))

    def rebalance_now(self):
        """Decides from the current window now (e.g. on a straggler event).

        Returns:
            The new shares, or None if they stay (or there is nothing to
            balance).
        """
        self._since_decision = 0
        if self.dataset is None:
            return None
        speeds = self._speeds
        if self._clock is not None:
            # Unusable clocks read NaN: their replicas keep their shares.
            speeds = rebalance.SpeedWindow(
                np.where(self._clock.usable(), speeds.readings, np.nan)
            )
        if self.row_caps is None and self._auto:
            self.row_caps, self._per_row = memory.auto_caps(
                self.model, self.dataset
            )
        caps = None
        if self.row_caps is not None:
            caps = np.array(
                [np.inf if c is None else c for c in self.row_caps], np.float64
            )
        shares = rebalance.decide(
            speeds,
            self.dataset.shares,
            self.dataset.global_batch_size,
            min_share=self.min_share,
            max_rows=caps,
            tolerance=self.tolerance,
        )
        if shares is not None and caps is not None:
            self._warn_bound(speeds, shares, caps)
        if shares is not None:
            start = self.dataset.set_shares(
                shares, from_batch=(self._pass, self._pass_steps + self.lag)
            )
            self.changes.append((self._steps, start, shares))
            self._print_change(start)
        return shares

    def _warn_bound(self, speeds, shares, caps):
        """Warns once a fit for each replica a cap holds below what its
        speed would give it."""
        total = self.dataset.global_batch_size
        free = rebalance.balanced_shares(
            speeds.seconds_per_row(),
            self.dataset.shares,
            total,
            min_share=self.min_share,
        )
        for replica in np.flatnonzero(free * total > caps + 0.5):
            if replica in self._bound:
                continue
            self._bound.add(replica)
            if self._auto:
                why = (
                    "the rows its memory is estimated to hold "
                    f"(max_rows='auto': {self._per_row} bytes a row)"
                )
            else:
                why = "its max_rows"
            logger.warning(
                "ShardRebalancer: replica %d (%s) is held at %d rows per "
                "global batch, %s; its speed would give it %d.",
                replica,
                memory.device_text(self.model, replica),
                int(caps[replica]),
                why,
                int(round(free[replica] * total)),
            )

    def _print_change(self, start):
        # Keras' progress bar only prints numbers, and tf-keras averages a
        # per-batch log over the epoch; a line per change is exact in both.
        verbose = (self.params or {}).get("verbose", 0)
        if not verbose or self.model is None:
            return
        shares = " ".join(f"{share:.3f}" for share in self.dataset.shares)
        rows = " ".join(str(int(row)) for row in self.dataset.rows)
        print(
            ("\n" if verbose == 1 else "")
            + f"ShardRebalancer: step {self._steps}: shares {shares} "
            + f"(rows {rows}) from batch {start[1]}",
            flush=True,
        )

    def _track_pass(self, steps):
        # Batches are numbered per pass of the input pipeline; the batch
        # after this one is index `_pass_steps` of pass `_pass`.
        current = self.dataset.passes_started - 1
        if current != self._pass:
            self._pass, self._pass_steps = current, 0
        self._pass_steps += steps

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self.dataset is not None:
            for replica, share in enumerate(self.dataset.shares):
                logs[f"share/replica_{replica}"] = float(share)

    def get_state(self):
        """Plain-data state, for checkpoints (see `set_state`): the speed
        readings and step counters. The shares are the dataset's own state
        (`HeteroDataset.get_state`)."""
        return {
            "readings": self._speeds.readings.tolist(),
            "steps": self._steps,
            "since_decision": self._since_decision,
        }

    def set_state(self, state):
        """Restores `get_state()` output. A state saved by keras-hetero
        0.1.0 also holds the dataset's share schedule (`"schedule"`); it is
        handed to the dataset."""
        self._speeds = rebalance.SpeedWindow(
            np.asarray(state["readings"], np.float64)
        )
        self._steps = int(state["steps"])
        self._since_decision = int(state["since_decision"])
        if "schedule" in state and self.dataset is not None:
            self.dataset.set_state({"schedule": state["schedule"]})


def _check_max_rows(max_rows):
    if max_rows is None or (isinstance(max_rows, str) and max_rows == "auto"):
        return
    values = np.atleast_1d(np.asarray(max_rows, dtype=object))
    if values.ndim != 1 or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
        for v in values
    ):
        raise ValueError(
            "Invalid value for argument `max_rows`. Received: "
            f"max_rows={max_rows!r}. Expected 'auto', None, rows >= 1, or "
            "one such int per replica."
        )


def _given_caps(max_rows, dataset):
    """`max_rows` (None, an int or one per replica) as a list per replica
    of ints or None; raises when they cannot hold the global batch."""
    replicas, total = dataset.num_replicas, dataset.global_batch_size
    if max_rows is None:
        return None
    if np.ndim(max_rows) == 0:
        caps = [int(max_rows)] * replicas
    else:
        caps = [int(c) for c in max_rows]
    if len(caps) != replicas:
        raise ValueError(
            "Invalid value for argument `max_rows`. Received: "
            f"max_rows={max_rows!r}, {len(caps)} value(s) for "
            f"{replicas} replicas. Expected one per replica (global "
            "replica order), one int for all, 'auto' or None."
        )
    if sum(caps) < total:
        raise ValueError(
            "Invalid value for argument `max_rows`. Received: "
            f"max_rows={max_rows!r}, {sum(caps)} rows together, but each "
            f"global batch has {total}. Expected caps that hold the global "
            "batch."
        )
    return caps


def _check_min_share(min_share, dataset):
    replicas = 1 if dataset is None else dataset.num_replicas
    check_number("min_share", min_share, 0.0, 1.0 / replicas)
