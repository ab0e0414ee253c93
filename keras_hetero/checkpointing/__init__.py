"""Checkpoint storage and scheduling behind `ElasticCheckpoint`: `storage`
(the files), `schedule` (when to save) and `callback` (`ElasticCheckpoint`
itself, exported as `kh.callbacks.ElasticCheckpoint`).

Storage is atomic: a checkpoint is written into a hidden temporary directory,
every file is fsynced and listed with its size and SHA-256 in `MANIFEST.json`
(written last), the directory is renamed into place, and only then does the
`latest` pointer move (write-to-temp + `os.replace`). A reader verifies the
manifest before trusting a checkpoint and falls back to the newest one that
verifies. Tensors are stored in TensorFlow's checkpoint bundle format (what
`tf.train.Checkpoint` writes, readable with `tf.train.load_checkpoint`; no
pickle); the rest of the state is JSON. This package exports what a user
reads checkpoints with; the rest is in `storage` and `schedule`.

Scheduling (`schedule`): `parse_save_every` accepts steps, durations or
`"auto"`, and `young_daly_interval` gives the interval that minimises
expected lost time, `sqrt(2 * C * MTBF)` for a save cost `C` (Young, 1974;
Daly, 2006).
"""

from keras_hetero.checkpointing.storage import CorruptCheckpointError
from keras_hetero.checkpointing.storage import list_checkpoints
from keras_hetero.checkpointing.storage import newest_valid
from keras_hetero.checkpointing.storage import read_latest
from keras_hetero.checkpointing.storage import verify

__all__ = [
    "CorruptCheckpointError",
    "list_checkpoints",
    "newest_valid",
    "read_latest",
    "verify",
]
