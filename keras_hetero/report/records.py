"""`Records`: what every replica did during one `fit`, step by step."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Records:
    """Per-step, per-replica measurements of one `fit`, and its events.

    Row `k` of the arrays is the `k`-th recorded train step.

    Attributes:
        steps: Global train step of each record, shape `[n]`.
        rows: Rows each replica trained on, shape `[n, replicas]`.
        compute_seconds: Each replica's compute seconds per step, shape
            `[n, replicas]` (from `model.step_stats`).
        step_seconds: Wall seconds of each step as the training loop saw
            it, shape `[n]`; NaN where not measured (a `fit`'s first step).
        devices: The device of each replica.
        events: `kh.callbacks.StragglerEvent`s, oldest first.
        checkpoints: `(step, blocking seconds, write seconds)` per save.
        share_changes: `(step, shares)` per `ShardRebalancer` decision.
        wait_seconds: Low-communication training (`kh.LowCommunication`):
            each replica's seconds per step waiting at the synchronisation
            before the record's, shape `[n, replicas]`; else None.
    """

    steps: np.ndarray
    rows: np.ndarray
    compute_seconds: np.ndarray
    step_seconds: np.ndarray
    devices: list
    events: list = dataclasses.field(default_factory=list)
    checkpoints: list = dataclasses.field(default_factory=list)
    share_changes: list = dataclasses.field(default_factory=list)
    wait_seconds: np.ndarray = None

    @property
    def num_replicas(self):
        """How many replicas the records cover."""
        return len(self.devices)

    @property
    def shares(self):
        """Each replica's fraction of each step's rows, `[n, replicas]`."""
        total = self.rows.sum(axis=1, keepdims=True)
        return self.rows / np.maximum(total, 1)
