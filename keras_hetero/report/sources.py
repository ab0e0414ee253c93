"""What the other keras-hetero callbacks of a `fit` report, step by step.

`RunReport` and `HeteroTensorBoard` run after the other callbacks (see
`HeteroModel.fit`) and poll them once per step: an event, share change or
checkpoint that appeared during a step is put on that step of the model's
step axis (`model.step_stats.step`), whatever counter its callback keeps.
"""

import dataclasses

import numpy as np

from keras_hetero import _callback_protocol as base
from keras_hetero.balancing.rebalancer import ShardRebalancer
from keras_hetero.checkpointing.callback import ElasticCheckpoint
from keras_hetero.stragglers.detector import StragglerDetector


class Sources:
    """Polls the `StragglerDetector`s, `ShardRebalancer`s and
    `ElasticCheckpoint`s among `callbacks`."""

    def __init__(self, callbacks):
        callbacks = list(callbacks)
        self.detectors = [
            c for c in callbacks if isinstance(c, StragglerDetector)
        ]
        self.rebalancers = [
            c for c in callbacks if isinstance(c, ShardRebalancer)
        ]
        self.checkpoints = [
            c for c in callbacks if isinstance(c, ElasticCheckpoint)
        ]
        self.start()

    def start(self):
        """Forgets everything; call after the sources' `on_train_begin`."""
        self.events = []
        self.share_changes = []
        self._save_steps = {}  # (checkpoint, its step) -> our step
        self._events_seen = [len(d.events) for d in self.detectors]
        self._changes_seen = [len(r.changes) for r in self.rebalancers]
        self._saves_seen = [
            {save[0] for save in c.saves} for c in self.checkpoints
        ]

    def poll(self, step):
        """Takes what appeared since the last poll as happening at `step`."""
        for index, detector in enumerate(self.detectors):
            seen = self._events_seen[index]
            if len(detector.events) > seen:
                self.events.extend(
                    dataclasses.replace(event, step=step)
                    for event in detector.events[seen:]
                )
                self._events_seen[index] = len(detector.events)
        for index, rebalancer in enumerate(self.rebalancers):
            seen = self._changes_seen[index]
            if len(rebalancer.changes) > seen:
                self.share_changes.extend(
                    (step, np.asarray(shares, np.float64))
                    for _, _, shares in rebalancer.changes[seen:]
                )
                self._changes_seen[index] = len(rebalancer.changes)
        for index, checkpoint in enumerate(self.checkpoints):
            seen = self._saves_seen[index]
            for own_step, _, _ in checkpoint.saves:
                if own_step not in seen:
                    seen.add(own_step)
                    self._save_steps[(index, own_step)] = step

    def saves(self):
        """`(step, blocking seconds, write seconds or None)` per save seen,
        on the polled step axis, oldest first."""
        found = []
        for index, checkpoint in enumerate(self.checkpoints):
            for own_step, blocking, written in checkpoint.saves:
                step = self._save_steps.get((index, own_step))
                if step is not None:
                    found.append((step, blocking, written))
        return sorted(found, key=lambda save: save[0])

    def scalars(self):
        """The detectors' current scores (`StragglerDetector.scalars`)."""
        scalars = {}
        for detector in self.detectors:
            scalars.update(detector.scalars())
        return scalars


class Observer(base.HeteroCallback):
    """Base of callbacks that watch the others: `HeteroModel.fit` runs them
    after the others (stage `"observe"`) and hands them the others."""

    stage = "observe"

    def __init__(self):
        super().__init__()
        self._sources = Sources(())

    def prepare_fit(self, context):
        self._sources = Sources(
            c for c in context.callbacks if not isinstance(c, Observer)
        )
