"""`kh.Timeouts`: every timeout of a multi-worker job in one place."""

import dataclasses

from keras_hetero import _compat


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """The timeouts that decide how a multi-worker job meets a network
    fault, with defaults that let the hang watchdog act first.

    Order matters: a cut shorter than `watchdog` is ridden out (TCP
    retransmits, the collective finishes late); a longer one makes the
    survivors' watchdog name the cut-off worker and, with
    `abort_on_hang=True`, exit so the launcher restarts the group. TF's own
    coordination-service heartbeat (`heartbeat`) is kept longer than the
    watchdog so that the watchdog, which names the worker, acts first.

    Attributes:
        watchdog: Seconds a train step may take before `StragglerDetector`
            reports a hang (its `hang_timeout`). Defaults to `60.0`.
        heartbeat: Seconds without a heartbeat before TF's coordination
            service declares a worker dead (TF's default: 10 s). Defaults
            to `max(watchdog * 2, watchdog + 10)`: the watchdog's report
            (the timeout, its poll and a check of the others, about 2 s)
            must come before TF's own error aborts the survivors'
            collectives, also on a loaded machine.
        register: Seconds the coordination service waits for every worker
            to join at start (TF's default: 1 hour; None keeps it).
            Defaults to None.
        shutdown_barrier: Seconds workers wait for each other at exit
            (TF's default: 10 s; None keeps it). Defaults to None.
        collective: Seconds one collective may wait before it fails with
            DeadlineExceeded (TF's `CommunicationOptions.timeout_seconds`;
            None: wait forever, the watchdog decides). Defaults to None.

    gRPC's own timeouts (keepalive, reconnect back-off) are not settable
    from Python in TF 2.21; see docs/network-faults.md.

    Raises:
        ValueError: For a value that is not a positive number (or None
            where allowed).

    Example:

    >>> timeouts = Timeouts(watchdog=30)
    >>> timeouts.heartbeat
    60.0
    >>> # timeouts.apply(); strategy = timeouts.strategy()
    """

    watchdog: float = 60.0
    heartbeat: object = None
    register: object = None
    shutdown_barrier: object = None
    collective: object = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name != "watchdog":
                continue
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and value > 0
            ):
                raise ValueError(
                    f"Invalid value for argument `{field.name}`. Received: "
                    f"{field.name}={value!r}. Expected seconds > 0"
                    + ("." if field.name == "watchdog" else " or None.")
                )
            object.__setattr__(self, field.name, float(value))
        if self.heartbeat is None:
            object.__setattr__(
                self, "heartbeat", max(self.watchdog * 2, self.watchdog + 10)
            )

    def apply(self):
        """Passes `heartbeat`, `register` and `shutdown_barrier` to TF's
        coordination service. Call it before creating the
        MultiWorkerMirroredStrategy (which otherwise sets the service up
        with TF's defaults); a no-op without `TF_CONFIG`.
        """
        from keras_hetero import _distribute

        if _distribute.env_task().task_type is None:
            return
        _compat.configure_coordination_timeouts(
            heartbeat_ms=_ms(self.heartbeat),
            register_ms=_ms(self.register),
            shutdown_ms=_ms(self.shutdown_barrier),
        )

    def communication_options(self):
        """`tf.distribute.experimental.CommunicationOptions` with the
        `collective` timeout."""
        import tensorflow as tf

        return tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=self.collective
        )

    def strategy(self, **kwargs):
        """`apply()`, then a `MultiWorkerMirroredStrategy` with these
        communication options (`kwargs` pass through)."""
        import tensorflow as tf

        self.apply()
        kwargs.setdefault("communication_options", self.communication_options())
        return tf.distribute.MultiWorkerMirroredStrategy(**kwargs)


def _ms(seconds):
    return 0 if seconds is None else int(seconds * 1000)
