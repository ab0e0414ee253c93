"""`kh.spark.run`: the driver's side of a training run as a barrier stage."""

import dataclasses
import functools
import logging
import os
import pickle
import uuid

from pyspark import cloudpickle

from keras_hetero import _compat
from keras_hetero._checks import check_int
from keras_hetero._environment import NUM_WORKERS_ENV
from keras_hetero._environment import RESTART_ENV
from keras_hetero.spark import _task

logger = logging.getLogger("keras_hetero")

# Spark's Python workers then run the task without importing keras_hetero.
cloudpickle.register_pickle_by_value(_task)

# Passed on from the driver when set there: the Keras flavour must match.
_DRIVER_ENV = ("KERAS_BACKEND",)
# What `SparkContext.setJobGroup` sets.
_JOB_PROPERTIES = (
    "spark.jobGroup.id",
    "spark.job.description",
    "spark.job.interruptOnCancel",
)


@dataclasses.dataclass(frozen=True)
class Result:
    """What `kh.spark.run` returns.

    Attributes:
        values: What `train_fn` returned on each worker, by worker index
            (the `TF_CONFIG` task index).
        attempts: How many times the stage ran (1 without a failure).
    """

    values: list
    attempts: int


def run(
    train_fn,
    num_workers,
    *,
    args=(),
    kwargs=None,
    spark=None,
    max_restarts=0,
    env=None,
):
    """Runs `train_fn` on `num_workers` workers as one Spark barrier stage.

    Each of the stage's `num_workers` tasks starts a fresh Python process
    on its executor that calls `train_fn(*args, **kwargs)` with:

    - `TF_CONFIG`: every task's executor host with a port free there, in
      task order, and this task's index (Spark's partition id), so
      `tf.distribute.MultiWorkerMirroredStrategy()` joins the workers;
    - `KERAS_HETERO_RESTART` (the attempt: `0`, then `1`, ... after
      failures) and `KERAS_HETERO_NUM_WORKERS`, as under `keras-hetero run`;
    - the driver's Keras flavour (`TF_USE_LEGACY_KERAS`, `KERAS_BACKEND`),
      `TF_CPP_MIN_LOG_LEVEL=2` unless set, and `env`;
    - `CUDA_VISIBLE_DEVICES` from the task's Spark GPU resources, if any;
    - Spark's Python path (files added with `SparkContext.addPyFile` can be
      imported).

    A barrier stage runs all its tasks at once: Spark needs `num_workers`
    free task slots (executor cores / `spark.task.cpus`), which is checked
    first. Give each task a whole executor (`spark.task.cpus` =
    `spark.executor.cores`) so that each TensorFlow worker has its machine.

    If a task fails (its process exits with an error, is killed, or its
    executor is lost), Spark stops the whole stage, and `run` starts it
    again with `KERAS_HETERO_RESTART` one higher, up to `max_restarts`
    times. A `kh.callbacks.ElasticCheckpoint` whose directory every
    executor shares then resumes at the next untrained global batch.

    `train_fn`, `args` and `kwargs` travel to the executors pickled with
    cloudpickle; what `train_fn` returns travels back pickled. Input every
    worker reads whole, such as Parquet files that Spark wrote, comes in
    through `kh.data.from_arrow` inside `train_fn`.

    Args:
        train_fn: The training function, run once per worker.
        num_workers: Workers (barrier tasks), >= 1.
        args: Positional arguments for `train_fn`. Defaults to `()`.
        kwargs: Keyword arguments for `train_fn`. Defaults to `None` (none).
        spark: The `SparkSession` or `SparkContext` to run on. Defaults to
            `None`: the active session, or a new one from Spark's
            configuration (as `spark-submit` sets it).
        max_restarts: How many times a failed stage is started again,
            >= 0. Defaults to `0`.
        env: More environment variables for the workers (`{name: value}`,
            strings). Defaults to `None`.

    Returns:
        A `kh.spark.Result`: each worker's return value, by worker index,
        and the number of attempts.

    Raises:
        TypeError: If `train_fn` is not callable, `args`, `kwargs` or `env`
            have the wrong type, or `train_fn` and its arguments cannot be
            pickled.
        ValueError: If `num_workers` or `max_restarts` is not a valid
            count, or Spark has fewer task slots than `num_workers`.
        RuntimeError: If the stage failed `max_restarts + 1` times; the
            message holds the last failure (a worker's last output lines).

    Example:

    >>> def train_fn(epochs):  # doctest: +SKIP
    ...     strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ...     with strategy.scope():
    ...         model = build_model()
    ...     examples = kh.data.from_arrow("/shared/train", "x", label="y")
    ...     data = kh.data.shard(examples, 256, strategy=strategy)
    ...     history = model.fit(data, epochs=epochs, callbacks=[
    ...         kh.callbacks.ElasticCheckpoint("/shared/ckpt")])
    ...     return history.history
    >>> result = kh.spark.run(train_fn, 4, args=(10,),  # doctest: +SKIP
    ...                       max_restarts=3)
    >>> result.values[0]["loss"]  # doctest: +SKIP
    """
    if not callable(train_fn):
        raise TypeError(
            "Invalid value for argument `train_fn`. Received: "
            f"train_fn={train_fn!r}. Expected a callable."
        )
    num_workers = check_int("num_workers", num_workers)
    max_restarts = check_int("max_restarts", max_restarts, 0)
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            "Invalid value for argument `args`. Received: "
            f"args={args!r}. Expected a tuple of positional arguments."
        )
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(
            "Invalid value for argument `kwargs`. Received: "
            f"kwargs={kwargs!r}. Expected a dict of keyword arguments."
        )
    environment = _environment(env)
    job = _pickled(train_fn, tuple(args), kwargs)
    context = _spark_context(spark)
    _check_slots(context, num_workers)

    group = f"keras-hetero-{uuid.uuid4().hex[:12]}"
    for attempt in range(max_restarts + 1):
        task = functools.partial(
            _task.run_task,
            job,
            {
                **environment,
                RESTART_ENV: str(attempt),
                NUM_WORKERS_ENV: str(num_workers),
            },
            attempt,
        )
        # The job group (cancelled on Ctrl-C) and description label our
        # jobs only: the caller's are restored afterwards.
        saved = {key: context.getLocalProperty(key) for key in _JOB_PROPERTIES}
        context.setJobGroup(
            group,
            f"keras-hetero: {num_workers} workers, attempt {attempt}",
            interruptOnCancel=True,
        )
        try:
            pairs = (
                context.parallelize(range(num_workers), num_workers)
                .barrier()
                .mapPartitions(task)
                .collect()
            )
        except KeyboardInterrupt:
            context.cancelJobGroup(group)
            raise
        except Exception as error:
            failure = _failure(error)
            if attempt == max_restarts:
                raise RuntimeError(
                    f"The keras-hetero Spark stage failed {attempt + 1} "
                    f"time(s) (max_restarts={max_restarts}). Last failure:\n"
                    f"{failure}"
                ) from error
            logger.warning(
                "kh.spark.run: attempt %d failed; starting attempt %d of "
                "%d. Failure:\n%s",
                attempt,
                attempt + 1,
                max_restarts + 1,
                failure,
            )
            continue
        finally:
            for key, value in saved.items():
                context.setLocalProperty(key, value)
        values = [None] * num_workers
        for index, value in pairs:
            values[index] = pickle.loads(value)
        return Result(values=values, attempts=attempt + 1)


def _environment(env):
    """The workers' environment variables beyond the executor's own."""
    env = {} if env is None else env
    if not isinstance(env, dict) or not all(
        isinstance(key, str) and isinstance(value, str)
        for key, value in env.items()
    ):
        raise TypeError(
            f"Invalid value for argument `env`. Received: env={env!r}. "
            "Expected a dict of environment variables, strings to strings."
        )
    environment = {
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        "TF_USE_LEGACY_KERAS": "1" if _compat.FLAVOUR == "tf-keras" else "0",
    }
    for name in _DRIVER_ENV:
        if name in os.environ:
            environment[name] = os.environ[name]
    return {**environment, **env}


def _pickled(train_fn, args, kwargs):
    try:
        return cloudpickle.dumps((train_fn, args, kwargs))
    except Exception as error:
        raise TypeError(
            "`train_fn` and its `args` and `kwargs` must be picklable "
            "(cloudpickle) to reach the Spark executors. Received: "
            f"train_fn={train_fn!r}; pickling failed with "
            f"{type(error).__name__}: {error}"
        ) from error


def _spark_context(spark):
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if spark is None:
        spark = SparkSession.builder.getOrCreate()
    if isinstance(spark, SparkSession):
        return spark.sparkContext
    if isinstance(spark, SparkContext):
        return spark
    raise TypeError(
        f"Invalid value for argument `spark`. Received: spark={spark!r}. "
        "Expected a SparkSession, a SparkContext or None."
    )


def _task_slots(context):
    """Tasks Spark can run at once now (what a barrier stage needs), or
    None if this Spark does not say."""
    try:
        scala = context._jsc.sc()
        profile = scala.resourceProfileManager().defaultResourceProfile()
        return int(scala.maxNumConcurrentTasks(profile))
    except Exception:
        return None


def _check_slots(context, num_workers):
    # Spark's own check for this retries for 10 minutes (40 times 15 s)
    # before it fails.
    slots = _task_slots(context)
    if slots is not None and slots < num_workers:
        task_cpus = context.getConf().get("spark.task.cpus", "1")
        raise ValueError(
            "Invalid value for argument `num_workers`. Received: "
            f"num_workers={num_workers}, but Spark (master "
            f"{context.master!r}) has {slots} task slot(s) now "
            f"(executor cores / spark.task.cpus={task_cpus}). A barrier "
            "stage runs all its tasks at once, one per worker: give Spark "
            f"at least {num_workers} slots (e.g. master 'local[{num_workers}]'"
            ", more executors or spark.executor.cores) or use fewer workers."
        )


def _failure(error):
    """The useful part of a failed job's error: the Python side of a task's
    failure, without the JVM's stack frames."""
    text = str(error)
    start = text.find("keras-hetero worker")
    if start >= 0:
        text = text[start:]
    lines = [line for line in text.splitlines() if not line.startswith("\tat ")]
    return "\n".join(lines[:80])
