"""Input: global batches split across replicas by moving shares."""

from keras_hetero.data.arrow import from_arrow
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.data.shard import shard
from keras_hetero.data.shares import rows_from_shares
from keras_hetero.data.shares import validate_shares
from keras_hetero.data.tfrecord import from_tfrecords
from keras_hetero.data.tfrecord import index_tfrecords

__all__ = [
    "HeteroDataset",
    "from_arrow",
    "from_tfrecords",
    "index_tfrecords",
    "rows_from_shares",
    "shard",
    "validate_shares",
]
