"""Training as a Spark barrier stage (`keras-hetero[spark]`).

`kh.spark.run(train_fn, num_workers)` runs `train_fn` once per worker, as
the tasks of one Spark barrier stage: Spark starts all of them at once (one
task slot each), and each task gives its worker a `TF_CONFIG` naming every
task's host, so `tf.distribute.MultiWorkerMirroredStrategy()` inside
`train_fn` joins them. The return values come back to the driver. Through
Spark this reaches whatever cluster Spark runs on (standalone, YARN,
Kubernetes). A failed stage is run again (`max_restarts`), and
`kh.callbacks.ElasticCheckpoint` resumes it where it stopped.

Requires pyspark (the `spark` extra: `pip install ".[spark]"` in a checkout)
and Java; tested with pyspark 4.3 on a local Spark (docs/spark.md).
"""

try:
    import pyspark  # noqa: F401
except ImportError as error:
    raise ImportError(
        "keras_hetero.spark needs pyspark, which is not installed (or not "
        f"importable: {error}). Install it (keras-hetero's "
        '"spark" extra) with: pip install "pyspark>=3.5,<5"'
    ) from error

from keras_hetero.spark._driver import Result
from keras_hetero.spark._driver import run

__all__ = ["Result", "run"]
