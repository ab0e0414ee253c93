"""keras-hetero's callbacks, and the protocol by which `HeteroModel.fit`
prepares them (`HeteroCallback`, `FitContext`)."""

from keras_hetero.callbacks.base import FitContext
from keras_hetero.callbacks.base import HeteroCallback
from keras_hetero.callbacks.elastic_checkpoint import ElasticCheckpoint
from keras_hetero.callbacks.hetero_tensorboard import HeteroTensorBoard
from keras_hetero.callbacks.run_report import RunReport
from keras_hetero.callbacks.shard_rebalancer import ShardRebalancer
from keras_hetero.callbacks.straggler_detector import StragglerDetector
from keras_hetero.straggler import StragglerEvent

__all__ = [
    "ElasticCheckpoint",
    "FitContext",
    "HeteroCallback",
    "HeteroTensorBoard",
    "RunReport",
    "ShardRebalancer",
    "StragglerDetector",
    "StragglerEvent",
]
