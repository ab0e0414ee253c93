"""HeteroModel's step with one piece switched off, or put back as it was.

Benchmark-only patches of keras_hetero's internals, each a context manager
applied while a model's step is traced (`overhead.py --profile`,
`interleaved.py --profile`, `step_ops.py --profile`) or while a
`kh.data.shard` pipeline is built (`split_pipeline.py`, `teardown.py`):
what each piece costs. `PROFILE` names them, with the input each variant
runs on.
"""

import contextlib

import numpy as np


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _no_clocks():
    import tensorflow as tf

    from keras_hetero.training import telemetry

    return _patched(
        telemetry,
        "clock",
        lambda dependency, enabled=True: tf.constant(np.nan, tf.float64),
    )


def _control_edge_clock():
    # The clock as it was before it waited for the device: the reading
    # ordered after its dependencies by control edges only, on the
    # replica's device (on a GPU: the time to queue the work).
    from keras_hetero import _compat
    from keras_hetero.training import telemetry

    def clock(dependencies, enabled=True):
        import tensorflow as tf

        if not enabled:
            return tf.constant(np.nan, tf.float64)
        first, *rest = telemetry._tensors(dependencies)
        with tf.control_dependencies(rest):
            return _compat.unordered_timestamp(first)

    return _patched(telemetry, "clock", clock)


def _no_record():
    from keras_hetero.training import telemetry

    return _patched(telemetry.Telemetry, "record", lambda self, stats: None)


@contextlib.contextmanager
def _local_logs():
    from keras_hetero.training import step

    with (
        _patched(step, "global_logs", lambda model: model.get_metrics_result()),
        _patched(step, "packs_metrics", lambda: False),
    ):
        yield


def _no_divide():
    # Timing only: the gradients are then wrong by the factor of the rows.
    from keras_hetero.training import aggregation

    aggregate = aggregation.aggregate

    def undivided(*args, divisor=None, **kwargs):
        return aggregate(*args, **kwargs)

    return _patched(aggregation, "aggregate", undivided)


def python_bounds():
    """The split's bounds from a Python callback per global batch, as before
    the in-graph copy of the schedule (data/bounds.py): `numpy_function`
    over the schedule's own rule, at equal shares."""
    import tensorflow as tf

    from keras_hetero.data import bounds as bounds_lib
    from keras_hetero.data import shares as shares_lib

    def bounds(self, index, total_rows):
        schedule = shares_lib.ShareSchedule(
            np.full(self.num_replicas, 1.0 / self.num_replicas)
        )
        result = tf.numpy_function(
            schedule.next_bounds, [index, total_rows], tf.int64
        )
        result.set_shape([self.num_replicas + 1])
        return result

    return _patched(bounds_lib.PipelineSplit, "bounds", bounds)


def pipeline_then(transform):
    """kh.data.shard's pipeline with `transform` applied to what it
    returns."""
    from keras_hetero.data.shard import HeteroDataset

    pipeline = HeteroDataset._pipeline

    def patched(self, *args, **kwargs):
        return transform(pipeline(self, *args, **kwargs))

    return _patched(HeteroDataset, "_pipeline", patched)


def autotuning_on():
    """kh.data.shard's pipeline as before 2026-12-03: tf.data's autotuning
    thread on (docs/benchmarks.md, "Input iterator teardown")."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = True
    return pipeline_then(lambda dataset: dataset.with_options(options))


def pooled_maps():
    """The split's own map functions on TF's inter-op thread pool, as before
    2026-12-03 (`Dataset.map`; now `_compat.inline_map`)."""
    from keras_hetero import _compat

    return _patched(
        _compat, "inline_map", lambda dataset, function: dataset.map(function)
    )


def _per_tensor_collective():
    # The gradient path before 2026-12-03: the collective packs each tensor
    # and each gradient is divided on its own (`aggregation.aggregate`).
    # Since then also the path of models above `aggregation.PACK_LIMIT`
    # gradient elements (W=256 here), where this row equals HeteroModel's.
    from keras_hetero.training import aggregation

    return _patched(aggregation, "_packs_in_one", lambda *args: False)


def _every_replica():
    # Every replica adds the gathered telemetry to its own copy and orders
    # the update after its own global rows, as before 2026-12-04 (now the
    # first local replica only: `_distribute.is_first_local_replica`).
    from keras_hetero import _distribute

    return _patched(_distribute, "is_first_local_replica", lambda: True)


def _replayed():
    # The split's output kept in memory after its first pass (warm-up) and
    # replayed: what is left is the step's own cost, without the input
    # pipeline's CPU time (which logical CPU devices share with the step).
    return pipeline_then(lambda dataset: dataset.cache())


@contextlib.contextmanager
def all_off():
    """HeteroModel's bare step: no clocks, no telemetry record, local
    metrics read. With Keras' own input split, the baseline where stock
    Keras 3 cannot fit."""
    with _no_clocks(), _no_record(), _local_logs():
        yield


# name -> (patch made while tracing, input: "shared" (the HeteroModel
# run's kh.data.shard dataset), "own" (a kh.data.shard dataset of its own,
# built under the patch) or "keras" (Keras' own input split))
PROFILE = {
    "no clocks": (_no_clocks, "shared"),
    "clock by control edges (before)": (_control_edge_clock, "shared"),
    "no telemetry record": (_no_record, "shared"),
    "local metrics read": (_local_logs, "shared"),
    "Keras' input split": (contextlib.nullcontext, "keras"),
    "no gradient divide (wrong values)": (_no_divide, "shared"),
    "split bounds by a Python callback (before)": (python_bounds, "own"),
    "tf.data autotuning on (before)": (autotuning_on, "own"),
    "split maps on the thread pool (before)": (pooled_maps, "own"),
    "collective and division per tensor (before)": (
        _per_tensor_collective,
        "shared",
    ),
    "telemetry and update order on every replica (before)": (
        _every_replica,
        "shared",
    ),
    "input replayed from memory": (_replayed, "own"),
    "all four off": (all_off, "keras"),
}
