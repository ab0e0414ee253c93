"""Stopping on a signal: `SignalStop` turns SIGTERM / SIGINT into a
request to save and stop at the next step boundary, which under
MultiWorkerMirroredStrategy every worker follows after the same step (the
request travels in the next step's own collective,
`keras_hetero.training.stopping`)."""

import logging
import signal
import threading

from keras_hetero.training import stopping

logger = logging.getLogger("keras_hetero")


class SignalStop:
    """A stop request from a signal, and the agreement to stop.

    Args:
        signals: The signals that request a stop (a second SIGINT
            interrupts at once).
    """

    def __init__(self, signals):
        self.signals = tuple(signals)
        self._previous = {}
        self.reset()

    def reset(self):
        """No request (a new `fit`)."""
        self.requested = False
        self._sent = False

    def install(self):
        """Handles the signals (from the main thread only; elsewhere
        Python cannot)."""
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._on_signal)

    def uninstall(self):
        """Puts back the handlers `install` replaced."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def send(self, model):
        """Before a step: where workers agree (`stopping.agrees`), this
        process's request goes to all of them in the step's collectives."""
        if self.requested and not self._sent and stopping.agrees(model):
            stopping.request(model)
            self._sent = True

    def due(self, model, global_step):
        """Whether `fit` stops after the call that just ended: at once on
        this process's own signal, or, where workers agree, when the call
        carried any worker's request."""
        if not stopping.agrees(model):
            return self.requested
        if not stopping.agreed(model):
            return False
        if not self.requested:
            logger.warning(
                "ElasticCheckpoint: another worker got a signal; saving "
                "step %d with every worker, then stopping.",
                global_step,
            )
        return True

    def _on_signal(self, number, frame):
        if self.requested and number == signal.SIGINT:
            self.uninstall()
            raise KeyboardInterrupt
        self.requested = True
        logger.warning(
            "ElasticCheckpoint: got %s; saving at the next step boundary, "
            "then stopping.",
            signal.Signals(number).name,
        )
