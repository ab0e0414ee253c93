"""`kh.spark.run` on a local Spark: 2 barrier tasks on 127.0.0.1.

One SparkSession per module (`local[2,1]`: 2 task slots; a failed task
fails its barrier stage at once). Each task starts a worker process that
trains the suite's small HeteroModel under MultiWorkerMirroredStrategy on
Parquet files Spark wrote (`tests/support/spark_workers.py`), read with
`kh.data.from_arrow`.
"""

import os
import shutil
import subprocess
import sys
import threading
from unittest import mock

import numpy as np
import pytest

import keras_hetero as kh
from tests.support import helpers
from tests.support import spark_workers

pyspark = pytest.importorskip("pyspark")

import keras_hetero.spark  # noqa: E402

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


def _has_java():
    home = os.environ.get("JAVA_HOME")
    return bool(
        shutil.which("java")
        or (home and os.path.exists(os.path.join(home, "bin", "java")))
    )


@pytest.fixture(scope="module")
def spark():
    if not _has_java():
        pytest.skip(
            "Spark needs Java, which is not installed (Debian: apt-get "
            "install -y openjdk-17-jre-headless)"
        )
    # Spark's Python workers (and so the training processes) run the
    # interpreter PYSPARK_PYTHON names, read when the context starts.
    with mock.patch.dict(os.environ, {"PYSPARK_PYTHON": sys.executable}):
        session = _session()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def _session():
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2,1]")
        .appName("keras-hetero-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        # The workers import `tests.support.spark_workers` (and keras_hetero)
        # from the checkout, as a cluster's executors would from their
        # Python path.
        .config("spark.executorEnv.PYTHONPATH", ROOT)
        .getOrCreate()
    )


@pytest.fixture(scope="module")
def parquet(spark, tmp_path_factory):
    """The suite's examples as Spark writes them: part files, in order."""
    from pyspark.sql import types

    x, y, _, _ = helpers.arrays()
    schema = types.StructType(
        [
            types.StructField(
                "features", types.ArrayType(types.FloatType(), False), False
            ),
            types.StructField("label", types.FloatType(), False),
        ]
    )
    rows = [(row.tolist(), float(label[0])) for row, label in zip(x, y)]
    path = str(tmp_path_factory.mktemp("parquet") / "examples")
    spark.createDataFrame(rows, schema).write.parquet(path)
    # Several part files, read in order, are the suite's examples.
    assert len([p for p in os.listdir(path) if p.startswith("part-")]) > 1
    read = list(
        kh.data.from_arrow(
            path,
            "features",
            label="label",
            shapes={"features": (helpers.FEATURES,), "label": (1,)},
        ).as_numpy_iterator()
    )
    np.testing.assert_array_equal(np.stack([f for f, _ in read]), x)
    np.testing.assert_array_equal(np.stack([label for _, label in read]), y)
    return path


@pytest.fixture(scope="module")
def reference():
    model, history = helpers.reference_fit(epochs=spark_workers.EPOCHS)
    return model.get_weights(), history


def _assert_single_device(result, reference):
    weights, history = reference
    for value in result.values:
        assert value["num_replicas"] == 2
        assert value["flavour"] == kh.FLAVOUR
        helpers.assert_weights_close(value["weights"], weights)


@pytest.mark.slow
def test_two_barrier_tasks_train_as_one_device(spark, parquet, reference):
    result = kh.spark.run(spark_workers.train, 2, args=(parquet,), spark=spark)
    assert result.attempts == 1
    # The job group that labelled its jobs is gone.
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None
    assert [value["attempt"] for value in result.values] == [0, 0]
    assert [value["first_step"] for value in result.values] == [1, 1]
    _assert_single_device(result, reference)
    assert result.values[0]["history"]["loss"] == pytest.approx(
        reference[1]["loss"], rel=1e-5
    )


@pytest.mark.slow
def test_killed_task_restarts_the_stage_which_resumes_exactly(
    spark, parquet, reference, tmp_path
):
    # 5 steps per epoch; checkpoints every 2 steps and at epoch ends. Worker
    # 1 kills its Spark task after step 7, in the second epoch.
    result = kh.spark.run(
        spark_workers.train,
        2,
        kwargs={
            "data_path": parquet,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "fault_at": 7,
        },
        spark=spark,
        max_restarts=1,
    )
    assert result.attempts == 2
    assert [value["attempt"] for value in result.values] == [1, 1]
    # The restarted stage resumed after the last checkpoint (step 6), not
    # from the start; the weights are those of the uninterrupted run.
    assert [value["first_step"] for value in result.values] == [7, 7]
    _assert_single_device(result, reference)


@pytest.mark.slow
def test_a_failing_worker_fails_the_run_with_its_error(spark):
    with pytest.raises(RuntimeError) as raised:
        kh.spark.run(_fails, 1, spark=spark)
    message = str(raised.value)
    assert "failed 1 time(s)" in message
    assert "ZeroDivisionError" in message


def _fails():
    return 1 / 0


@pytest.mark.slow
def test_bad_arguments_are_refused_before_any_task(spark):
    with pytest.raises(ValueError, match=r"2 task slot\(s\)"):
        kh.spark.run(spark_workers.train, 3, spark=spark)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_workers"):
            kh.spark.run(spark_workers.train, bad, spark=spark)
    with pytest.raises(ValueError, match="max_restarts"):
        kh.spark.run(spark_workers.train, 2, spark=spark, max_restarts=-1)
    with pytest.raises(TypeError, match="train_fn"):
        kh.spark.run("train", 2, spark=spark)
    with pytest.raises(TypeError, match="args"):
        kh.spark.run(spark_workers.train, 2, args="data/", spark=spark)
    with pytest.raises(TypeError, match="env"):
        kh.spark.run(spark_workers.train, 2, env={"A": 1}, spark=spark)
    with pytest.raises(TypeError, match="spark"):
        kh.spark.run(spark_workers.train, 2, spark="local[2]")
    with pytest.raises(TypeError, match="picklable"):
        kh.spark.run(spark_workers.train, 2, args=(threading.Lock(),))


def test_import_without_pyspark_names_the_extra():
    message = helpers.import_error_without("pyspark", "keras_hetero.spark")
    assert 'pip install "pyspark>=3.5,<5"' in message


@pytest.mark.slow
@pytest.mark.extended  # CI: the barrier-stage training job
def test_example_script_trains(tmp_path):
    # Its own local Spark (a second driver JVM), 2 workers, 1 epoch.
    if not _has_java():
        pytest.skip("Spark needs Java, which is not installed")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "spark_train.py"),
            "--epochs",
            "1",
            "--data",
            str(tmp_path / "train"),
            "--checkpoints",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "attempts: 1" in lines
    losses = [line.split(": ", 1)[1] for line in lines if "loss" in line]
    assert len(losses) == 2 and losses[0] == losses[1], done.stdout
