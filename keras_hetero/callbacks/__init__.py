"""keras-hetero's callbacks, and the protocol by which `HeteroModel.fit`
prepares them (`HeteroCallback`, `FitContext`)."""

from keras_hetero._callback_protocol import FitContext
from keras_hetero._callback_protocol import HeteroCallback
from keras_hetero.balancing.rebalancer import ShardRebalancer
from keras_hetero.checkpointing.callback import ElasticCheckpoint
from keras_hetero.report.run_report import RunReport
from keras_hetero.report.tensorboard import HeteroTensorBoard
from keras_hetero.stragglers.communication import CommunicationEvent
from keras_hetero.stragglers.detector import StragglerDetector
from keras_hetero.stragglers.scoring import StragglerEvent

__all__ = [
    "ElasticCheckpoint",
    "FitContext",
    "HeteroCallback",
    "HeteroTensorBoard",
    "RunReport",
    "ShardRebalancer",
    "StragglerDetector",
    "StragglerEvent",
    "CommunicationEvent",
]
