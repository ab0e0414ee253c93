"""Callbacks that act on HeteroModel telemetry."""

from keras_hetero.callbacks.elastic_checkpoint import ElasticCheckpoint
from keras_hetero.callbacks.hetero_tensorboard import HeteroTensorBoard
from keras_hetero.callbacks.run_report import RunReport
from keras_hetero.callbacks.shard_rebalancer import ShardRebalancer
from keras_hetero.callbacks.straggler_detector import StragglerDetector
from keras_hetero.straggler import StragglerEvent

__all__ = [
    "ElasticCheckpoint",
    "HeteroTensorBoard",
    "RunReport",
    "ShardRebalancer",
    "StragglerDetector",
    "StragglerEvent",
]
