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
pickle); the rest of the state is JSON.

Scheduling: `parse_save_every` accepts steps, durations or `"auto"`, and
`young_daly_interval` gives the interval that minimises expected lost time,
`sqrt(2 * C * MTBF)` for a save cost `C` (Young, 1974; Daly, 2006).
"""

from keras_hetero.checkpointing.schedule import SaveEvery as SaveEvery
from keras_hetero.checkpointing.schedule import parse_duration as parse_duration
from keras_hetero.checkpointing.schedule import (
    parse_save_every as parse_save_every,
)
from keras_hetero.checkpointing.schedule import (
    young_daly_interval as young_daly_interval,
)
from keras_hetero.checkpointing.storage import FORMAT as FORMAT
from keras_hetero.checkpointing.storage import LATEST as LATEST
from keras_hetero.checkpointing.storage import MANIFEST as MANIFEST
from keras_hetero.checkpointing.storage import PREFIX as PREFIX
from keras_hetero.checkpointing.storage import STATE as STATE
from keras_hetero.checkpointing.storage import TENSORS as TENSORS
from keras_hetero.checkpointing.storage import TMP_PREFIX as TMP_PREFIX
from keras_hetero.checkpointing.storage import (
    CorruptCheckpointError as CorruptCheckpointError,
)
from keras_hetero.checkpointing.storage import (
    checkpoint_name as checkpoint_name,
)
from keras_hetero.checkpointing.storage import (
    list_checkpoints as list_checkpoints,
)
from keras_hetero.checkpointing.storage import newest_valid as newest_valid
from keras_hetero.checkpointing.storage import prune as prune
from keras_hetero.checkpointing.storage import read_arrays as read_arrays
from keras_hetero.checkpointing.storage import read_latest as read_latest
from keras_hetero.checkpointing.storage import remove_partial as remove_partial
from keras_hetero.checkpointing.storage import verify as verify
from keras_hetero.checkpointing.storage import write as write
