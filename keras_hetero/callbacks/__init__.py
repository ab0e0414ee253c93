"""Callbacks that act on HeteroModel telemetry."""

from keras_hetero.callbacks.elastic_checkpoint import ElasticCheckpoint
from keras_hetero.callbacks.shard_rebalancer import ShardRebalancer
from keras_hetero.callbacks.straggler_detector import StragglerDetector
from keras_hetero.straggler import StragglerEvent

__all__ = [
    "ElasticCheckpoint",
    "ShardRebalancer",
    "StragglerDetector",
    "StragglerEvent",
]
