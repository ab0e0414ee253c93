"""Input pipelines whose order a restart or another worker cannot reproduce:
refused before the first step, or accepted with `approximate_resume`."""

import importlib
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _compat
from keras_hetero import checkpointing
from keras_hetero._compat import keras
from keras_hetero.checkpointing import record
from tests.support import helpers
from tests.support import order_workers

BATCH = 8
ROWS = 32
AUTOTUNE = tf.data.AUTOTUNE


def _examples():
    x, y, _, _ = helpers.arrays(ROWS)
    return tf.data.Dataset.from_tensor_slices((x, y))


def augment(x, y):
    return x + tf.random.uniform(tf.shape(x)), y


def _generator_map():
    generator = tf.random.Generator.from_seed(1)
    return _examples().map(lambda x, y: (x + generator.normal([]), y))


def _random_layer_map():
    # Seeded, yet its seed state (a variable) advances with every example,
    # under Keras 3 and tf-keras alike.
    layer = keras.layers.RandomFlip("horizontal", seed=3)

    def flip(x, y):
        image = tf.reshape(x, [1, helpers.FEATURES, 1])
        return tf.reshape(layer(image, training=True), [-1]), y

    return _examples().map(flip)


def _no_determinism():
    options = tf.data.Options()
    options.deterministic = False
    return _examples().with_options(options)


def _list_files(directory, **kwargs):
    """Examples read from 4 TFRecord files listed by `list_files`."""
    x, y, _, _ = helpers.arrays(ROWS)
    for part in range(4):
        with tf.io.TFRecordWriter(os.path.join(directory, f"{part}.rec")) as w:
            for row in range(part, ROWS, 4):
                w.write(tf.io.serialize_tensor(np.r_[x[row], y[row]]).numpy())

    def parse(record):
        row = tf.io.parse_tensor(record, tf.float32)
        row.set_shape([helpers.FEATURES + 1])
        return row[:-1], row[-1:]

    files = tf.data.Dataset.list_files(os.path.join(directory, "*"), **kwargs)
    examples = files.interleave(tf.data.TFRecordDataset, cycle_length=2)
    # tf-keras needs the number of steps per epoch.
    return examples.map(parse).apply(
        tf.data.experimental.assert_cardinality(ROWS)
    )


# name -> (examples from a temporary directory, words of the error)
REFUSED = {
    "reshuffle_each_iteration": (
        lambda d: _examples().shuffle(ROWS, seed=1),
        ["Dataset.shuffle", "reshuffles every epoch", "kh.data.shard"],
    ),
    "unseeded_shuffle": (
        lambda d: _examples().shuffle(ROWS, reshuffle_each_iteration=False),
        ["Dataset.shuffle", "no seed"],
    ),
    "list_files_shuffled": (
        lambda d: _list_files(d, seed=2),
        ["Dataset.shuffle", "list_files", "reshuffles every epoch"],
    ),
    "shuffle_and_repeat": (
        lambda d: _examples().apply(
            tf.data.experimental.shuffle_and_repeat(ROWS, count=1, seed=1)
        ),
        ["shuffle_and_repeat", "reshuffles every epoch"],
    ),
    "parallel_map_not_deterministic": (
        lambda d: _examples().map(
            lambda x, y: (x * 2, y), num_parallel_calls=2, deterministic=False
        ),
        ["Dataset.map(..., deterministic=False)", "ParallelMapDatasetV2"],
    ),
    "interleave_not_deterministic": (
        lambda d: (
            tf.data.Dataset.range(2)
            .interleave(
                lambda _: _examples().take(ROWS // 2),
                num_parallel_calls=2,
                deterministic=False,
            )
            .apply(tf.data.experimental.assert_cardinality(ROWS))
        ),
        ["Dataset.interleave(..., deterministic=False)"],
    ),
    "parallel_batch_not_deterministic": (
        lambda d: (
            _examples()
            .batch(4, num_parallel_calls=2, deterministic=False)
            .unbatch()
            .apply(tf.data.experimental.assert_cardinality(ROWS))
        ),
        ["Dataset.batch(..., deterministic=False)"],
    ),
    "options_not_deterministic": (
        lambda d: _no_determinism(),
        ["tf.data.Options(deterministic=False)"],
    ),
    "unseeded_random_op": (
        lambda d: _examples().map(augment),
        ["Dataset.map", "RandomUniform", "in `augment`", "no seed"],
    ),
    "random_generator": (
        lambda d: _generator_map(),
        ["Dataset.map", "RngReadAndSkip", "tf.random.Generator"],
    ),
    "random_layer": (
        lambda d: _random_layer_map(),
        ["Dataset.map", "updates a variable", "Keras random layer"],
    ),
    "unseeded_dataset_random": (
        lambda d: tf.data.Dataset.zip(
            _examples(), tf.data.Dataset.random().take(ROWS)
        ).map(lambda xy, noise: xy),
        ["Dataset.random", "no seed"],
    ),
}

# name -> (examples from a temporary directory, shard's `shuffle`)
EXACT = {
    "shard_shuffle": (lambda d: _examples(), True),
    "seeded_shuffle_without_reshuffling": (
        lambda d: _examples().shuffle(
            ROWS, seed=1, reshuffle_each_iteration=False
        ),
        None,
    ),
    "list_files_unshuffled": (lambda d: _list_files(d, shuffle=False), 8),
    "deterministic_parallel_map": (
        lambda d: _examples().map(lambda x, y: (x * 2, y), AUTOTUNE),
        None,
    ),
    "stateless_random_ops": (
        lambda d: (
            _examples()
            .enumerate()
            .map(
                lambda i, xy: (
                    xy[0]
                    + tf.random.stateless_uniform(
                        tf.shape(xy[0]), seed=tf.stack([i, 3])
                    ),
                    xy[1],
                )
            )
        ),
        None,
    ),
    # Measured: a seeded stateful op draws the same numbers on every pass
    # and in a fresh process (docs/checkpoints.md).
    "seeded_random_op": (
        lambda d: _examples().map(
            lambda x, y: (x + tf.random.uniform(tf.shape(x), seed=5), y)
        ),
        None,
    ),
    "py_function": (
        lambda d: _examples().map(
            lambda x, y: (tf.py_function(lambda v: v * 2, [x], tf.float32), y)
        ),
        None,
    ),
}


@pytest.fixture(autouse=True)
def no_global_seed():
    """Pipelines are built without a global seed (`_model` sets one): with
    one, TensorFlow derives op seeds from it and they are reproducible."""
    tf.random.set_seed(None)


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1


def _model():
    keras.utils.set_random_seed(0)
    inputs, outputs = helpers.layers()
    model = kh.HeteroModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _refused(model, data, directory, match):
    """The message of the ValueError `fit` with an ElasticCheckpoint raises
    (matching `match`), after checking that no step ran."""
    counter = CountSteps()
    with pytest.raises(ValueError, match=match) as error:
        model.fit(
            data,
            epochs=1,
            verbose=0,
            callbacks=[kh.callbacks.ElasticCheckpoint(directory), counter],
        )
    assert counter.steps == 0
    return str(error.value)


def _fit(model, data, checkpoint, epochs=1, **kwargs):
    """Train steps this `fit` ran, and the approximate-resume warnings."""
    start = int(model.optimizer.iterations.numpy())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.fit(
                data,
                epochs=epochs,
                verbose=0,
                callbacks=[checkpoint],
                **kwargs,
            )
        finally:
            ours = [w for w in caught if "approximate_resume" in str(w.message)]
    return int(model.optimizer.iterations.numpy()) - start, ours


def _set_shape(examples):
    # `py_function` forgets the shape; Keras needs it to build the model.
    return examples.map(
        lambda x, y: (tf.ensure_shape(x, [helpers.FEATURES]), y)
    )


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_before_the_first_step(name, tmp_path):
    make, words = REFUSED[name]
    (tmp_path / "files").mkdir()
    data = kh.data.shard(make(str(tmp_path / "files")), BATCH)
    model = _model()
    directory = tmp_path / "ckpt"
    counter = CountSteps()
    with pytest.raises(ValueError, match="approximate_resume=True") as error:
        model.fit(
            data,
            epochs=1,
            verbose=0,
            callbacks=[kh.callbacks.ElasticCheckpoint(directory), counter],
        )
    message = str(error.value)
    for word in words:
        assert word in message
    assert "Fix:" in message
    assert counter.steps == 0
    assert int(model.optimizer.iterations.numpy()) == 0
    assert checkpointing.newest_valid(str(directory)) is None


def test_approximate_resume_warns_once_and_trains(tmp_path):
    data = kh.data.shard(_examples().shuffle(ROWS, seed=1), BATCH)
    model = _model()
    checkpoint = kh.callbacks.ElasticCheckpoint(
        tmp_path, save_every=1, approximate_resume=True
    )
    steps, ours = _fit(model, data, checkpoint)
    assert steps == ROWS // BATCH
    assert len(ours) == 1
    message = str(ours[0].message)
    assert "Dataset.shuffle" in message
    assert "trained twice" in message
    # The next `fit` (a restart in the same process) resumes, silently.
    steps, ours = _fit(model, data, checkpoint, epochs=2)
    assert checkpoint.restored_from is not None
    assert steps == ROWS // BATCH
    assert ours == []
    assert int(model.optimizer.iterations.numpy()) == 2 * ROWS // BATCH


@pytest.mark.parametrize("name", sorted(EXACT))
def test_reproducible_input_is_accepted_silently(name, tmp_path):
    make, shuffle = EXACT[name]
    (tmp_path / "files").mkdir()
    examples = _set_shape(make(str(tmp_path / "files")))
    data = kh.data.shard(examples, BATCH, shuffle=shuffle, seed=3)
    assert data.unreproducible_stages() == []
    steps, ours = _fit(
        _model(), data, kh.callbacks.ElasticCheckpoint(tmp_path / "ckpt")
    )
    assert steps == ROWS // BATCH
    assert ours == []


def test_arrays_are_accepted_silently(tmp_path):
    x, y, _, _ = helpers.arrays(ROWS)
    checkpoint = kh.callbacks.ElasticCheckpoint(tmp_path)
    steps, ours = _fit(_model(), x, checkpoint, batch_size=BATCH, y=y)
    assert steps == ROWS // BATCH
    assert ours == []


def test_from_arrow_is_accepted_silently(tmp_path):
    pa = pytest.importorskip("pyarrow")
    x, y, _, _ = helpers.arrays(ROWS)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(
                pa.array(x.ravel()), helpers.FEATURES
            ),
            "y": y.ravel(),
        }
    )
    examples = kh.data.from_arrow(table, "x", label="y", batch_rows=5)
    data = kh.data.shard(examples.map(lambda x, y: (x, y[None])), BATCH)
    assert data.unreproducible_stages() == []
    checkpoint = kh.callbacks.ElasticCheckpoint(tmp_path)
    steps, ours = _fit(_model(), data, checkpoint)
    assert steps == ROWS // BATCH
    assert ours == []


def test_refused_again_after_the_opt_out_is_not_given(tmp_path):
    """The opt-out belongs to one callback; another one refuses again."""
    data = kh.data.shard(_examples().shuffle(ROWS), BATCH)
    _fit(
        _model(),
        data,
        kh.callbacks.ElasticCheckpoint(tmp_path, approximate_resume=True),
    )
    with pytest.raises(ValueError, match="no seed"):
        _fit(_model(), data, kh.callbacks.ElasticCheckpoint(tmp_path))


# --- kh.data.shard under several workers ------------------------------------


@pytest.fixture
def two_workers(monkeypatch):
    """`kh.data.shard` believes it runs on one of two workers (the real
    multi-process case is `test_shard_under_two_workers`)."""
    distribute = importlib.import_module("keras_hetero._distribute")
    monkeypatch.setattr(distribute, "num_workers", lambda strategy: 2)


ORDER = [
    "unseeded_shuffle",
    "parallel_map_not_deterministic",
    "interleave_not_deterministic",
    "parallel_batch_not_deterministic",
    "options_not_deterministic",
    "unseeded_dataset_random",
]


@pytest.mark.parametrize("name", ORDER)
def test_shard_refuses_another_order_per_worker(name, tmp_path, two_workers):
    make, words = REFUSED[name]
    with pytest.raises(ValueError, match="same order on every worker") as e:
        kh.data.shard(make(str(tmp_path)), BATCH)
    assert words[0] in str(e.value)


@pytest.mark.parametrize("name", sorted(set(REFUSED) - set(ORDER)))
def test_shard_accepts_the_same_order_on_every_worker(
    name, tmp_path, two_workers
):
    """Seeded reshuffling and random values: the same order everywhere."""
    make, _ = REFUSED[name]
    data = kh.data.shard(make(str(tmp_path)), BATCH)
    assert data.unreproducible_stages()  # still refused by ElasticCheckpoint


def test_global_seed_makes_unseeded_stages_reproducible(tmp_path):
    # Measured: with `tf.random.set_seed`, ops without a seed of their own
    # get the same seeds in every process that builds the same pipeline.
    tf.random.set_seed(11)
    examples = _examples().shuffle(ROWS, reshuffle_each_iteration=False)
    examples = tf.data.Dataset.zip(
        examples.map(augment), tf.data.Dataset.random().take(ROWS)
    ).map(lambda xy, noise: xy)
    data = kh.data.shard(examples, BATCH)
    assert data.unreproducible_stages() == []


def test_shard_on_one_worker_is_unchanged():
    kh.data.shard(_examples().shuffle(ROWS), BATCH)  # no error


def test_unseeded_filter_changes_which_examples_each_worker_keeps(
    two_workers,
):
    examples = _examples().filter(lambda x, y: tf.random.uniform([]) < 0.5)
    with pytest.raises(ValueError, match="which examples are kept"):
        kh.data.shard(examples, BATCH)


@pytest.mark.slow
def test_shard_under_two_workers():
    """MultiWorkerMirrored, 2 processes: an unseeded shuffle is refused on
    both; a seeded per-epoch reshuffle is the same on both workers, so each
    epoch covers every example once."""
    results = kh.testing.run_workers(
        order_workers.shuffled_ids_mwms, 2, timeout=240, args=("unseeded",)
    )
    for result in results:
        kind, message = result.value
        assert kind == "error"
        assert "same order on every worker" in message
    results = kh.testing.run_workers(
        order_workers.shuffled_ids_mwms,
        2,
        timeout=240,
        args=("seeded_reshuffle",),
    )
    first, second = (r.value for r in results)
    orders = []
    for epoch in range(2):
        ids = [
            i
            for steps in zip(first[epoch], second[epoch])
            for part in steps
            for i in part
        ]
        assert sorted(ids) == list(range(order_workers.ROWS))
        orders.append(ids)
    assert orders[0] != orders[1]  # it does reshuffle


# --- what the classification rests on (measured) -----------------------------


def test_seeded_random_op_repeats_its_numbers_every_pass():
    """Why a seeded stateful op counts as exact and a `tf.random.Generator`
    does not: the op draws the same numbers on every pass over the data
    (and in a fresh process: `test_random_numbers_in_a_fresh_process`)."""
    seeded = order_workers.random_map_values("seeded_op")
    assert seeded[0] == seeded[1]
    advancing = order_workers.random_map_values("generator")
    assert advancing[0] != advancing[1]


@pytest.mark.slow
def test_random_numbers_in_a_fresh_process():
    """A fresh process (a restart) repeats a seeded op's numbers, but
    starts a Generator again at its first pass's numbers."""
    for kind in ("seeded_op", "generator"):
        here = order_workers.random_map_values(kind)
        (fresh,) = kh.testing.run_workers(
            order_workers.random_map_values, 1, timeout=120, args=(kind, 1)
        )
        assert fresh.value[0] == here[0]
        if kind == "generator":
            # The pass a restart would resume is not the one trained on.
            assert fresh.value[0] != here[1]


def test_a_pipeline_that_cannot_be_inspected_warns_and_trains(
    tmp_path, monkeypatch
):
    """E.g. more than 2 GB of constants, which tf.data cannot serialize."""

    def fail(dataset):
        raise tf.errors.InvalidArgumentError(None, None, "too large")

    compat = importlib.import_module("keras_hetero._compat")
    monkeypatch.setattr(compat, "dataset_graph", fail)
    data = kh.data.shard(_examples().shuffle(ROWS), BATCH)
    with pytest.warns(UserWarning, match="Could not inspect.*too large"):
        assert data.unreproducible_stages() == []
    steps, _ = _fit(_model(), data, kh.callbacks.ElasticCheckpoint(tmp_path))
    assert steps == ROWS // BATCH


def test_seeded_reshuffle_before_a_cache_is_exact():
    """`cache()` keeps the first pass's order, the same in every process;
    without a seed it differs between processes."""
    seeded = kh.data.shard(_examples().shuffle(ROWS, seed=1).cache(), BATCH)
    assert seeded.unreproducible_stages() == []
    unseeded = kh.data.shard(_examples().shuffle(ROWS).cache(), BATCH)
    assert [s.op for s in unseeded.unreproducible_stages()] == [
        "ShuffleDatasetV3"
    ]
    after = kh.data.shard(_examples().cache().shuffle(ROWS, seed=1), BATCH)
    assert [s.op for s in after.unreproducible_stages()] == ["ShuffleDatasetV3"]


def _dropout_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((helpers.FEATURES,))
    hidden = keras.layers.Dropout(0.5, name="drop")(inputs)
    model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.fixture
def tf_random_generator():
    """tf-keras' random layers draw from `tf.random.Generator`s (a global
    switch, put back afterwards). Keras 3 has no such switch."""
    if not _compat.IS_LEGACY:
        yield
        return
    experimental = keras.backend.experimental
    enabled = experimental.is_tf_random_generator_enabled()
    experimental.enable_tf_random_generator()
    yield
    if not enabled:
        experimental.disable_tf_random_generator()


@pytest.mark.skipif(
    not _compat.IS_LEGACY, reason="Keras 3 checkpoints every random state"
)
def test_tf_keras_stateful_random_layers_are_refused(tmp_path):
    data = kh.data.shard(_examples(), BATCH)
    model = _dropout_model()
    message = _refused(model, data, tmp_path, "enable_tf_random_generator")
    assert "'drop'" in message
    assert checkpointing.newest_valid(str(tmp_path)) is None
    checkpoint = kh.callbacks.ElasticCheckpoint(
        tmp_path, approximate_resume=True
    )
    steps, ours = _fit(model, data, checkpoint)
    assert steps == ROWS // BATCH
    assert len(ours) == 1 and "'drop'" in str(ours[0].message)


def test_random_layers_with_saved_state_are_accepted(
    tmp_path, tf_random_generator
):
    # Keras 3 always; tf-keras with `enable_tf_random_generator()`.
    data = kh.data.shard(_examples(), BATCH)
    steps, ours = _fit(
        _dropout_model(), data, kh.callbacks.ElasticCheckpoint(tmp_path)
    )
    assert steps == ROWS // BATCH
    assert ours == []


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            self.model.stop_training = True


def _checkpoint_after_step_2(data, directory):
    """Trains 2 steps of `data`'s first epoch, checkpointing every step."""
    _model().fit(
        data,
        epochs=1,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(directory, save_every=1),
            _StopAfter(2),
        ],
    )


def test_resuming_an_epoch_shuffled_by_another_mechanism_is_refused(tmp_path):
    first = kh.data.shard(_examples(), BATCH, shuffle=True, seed=3)
    assert first.shuffle_mechanism == "global shuffle"
    _checkpoint_after_step_2(first, tmp_path)
    edited = kh.data.shard(
        helpers.without_random_access(_examples()), BATCH, shuffle=True, seed=3
    )
    assert edited.shuffle_mechanism == "buffer of the pass"
    message = _refused(_model(), edited, tmp_path, "'global shuffle'")
    assert "'buffer of the pass'" in message
    checkpoint = kh.callbacks.ElasticCheckpoint(
        tmp_path, approximate_resume=True
    )
    steps, ours = _fit(_model(), edited, checkpoint)
    assert checkpoint.restored_from is not None
    assert steps == ROWS // BATCH  # 2 restored (iterations), 2 trained
    assert len(ours) == 1 and "another mechanism" in str(ours[0].message)
    # The same pipeline resumes silently.
    steps, ours = _fit(
        _model(), first, kh.callbacks.ElasticCheckpoint(tmp_path)
    )
    assert ours == []


def _noisy(x, y):
    return x + tf.random.uniform(tf.shape(x), seed=5), y


def _keyed(x, y):
    return x + tf.random.stateless_uniform(tf.shape(x), seed=[1, 2]), y


def test_seeded_random_op_in_map_fn_is_refused(tmp_path):
    # map_fn runs on the replicas' slices after the split: a resumed pass
    # restarts its numbers at the resume point, seed or not.
    data = kh.data.shard(_examples(), BATCH, map_fn=_noisy)
    message = _refused(_model(), data, tmp_path, "map_fn")
    assert "RandomUniform" in message
    assert "`_noisy`" in message
    # Without ElasticCheckpoint on one worker nothing is checked; a
    # stateless op with a fixed seed is accepted.
    _model().fit(data, epochs=1, verbose=0)
    keyed = kh.data.shard(_examples(), BATCH, map_fn=_keyed)
    assert keyed.unreproducible_stages() == []


def test_checkpoint_without_a_recorded_mechanism_resumes_like_before(
    tmp_path, monkeypatch
):
    # A checkpoint written before checkpoints recorded the mechanism: then
    # `shuffle=True` over tf.data examples took a buffer of the pass.
    state = record.state

    def unrecorded(*args, **kwargs):
        written = state(*args, **kwargs)
        assert written.pop("shuffle_mechanism") == "buffer of the pass"
        return written

    monkeypatch.setattr(record, "state", unrecorded)
    data = kh.data.shard(
        helpers.without_random_access(_examples()), BATCH, shuffle=True, seed=3
    )
    _checkpoint_after_step_2(data, tmp_path)
    monkeypatch.undo()
    # The global shuffle, which no such checkpoint can have used, is
    # refused; the same (buffered) pipeline resumes silently.
    message = _refused(
        _model(),
        kh.data.shard(_examples(), BATCH, shuffle=True, seed=3),
        tmp_path,
        "'buffer of the pass'",
    )
    assert "'global shuffle'" in message
    steps, ours = _fit(_model(), data, kh.callbacks.ElasticCheckpoint(tmp_path))
    assert ours == [] and steps == ROWS // BATCH
