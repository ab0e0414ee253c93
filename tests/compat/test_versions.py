"""The compat layer's version-keyed choices match the installed versions."""

import importlib.metadata

import numpy as np
import pytest
import tensorflow as tf
from packaging.requirements import Requirement

import keras_hetero as kh
from keras_hetero import _compat
from keras_hetero._compat import keras
from tests.conftest import DEVICES

keras3_only = pytest.mark.skipif(
    kh.FLAVOUR != "keras3", reason="a Keras 3 internal"
)


@pytest.mark.parametrize(
    "version, expected",
    [
        ("3.10.0", (3, 10)),
        ("3.15.1", (3, 15)),
        ("2.19.0rc1", (2, 19)),
        ("2.21.0.dev20260101", (2, 21)),
    ],
)
def test_release_is_major_and_minor(version, expected):
    assert _compat.release(version) == expected


def test_releases_are_the_installed_ones():
    assert _compat.TF_RELEASE == _compat.release(tf.__version__)
    installed = importlib.metadata.version(
        "tf-keras" if _compat.IS_LEGACY else "keras"
    )
    assert _compat.KERAS_RELEASE == _compat.release(installed)


def test_installed_versions_are_in_the_declared_range():
    # What keras-hetero's metadata (pyproject.toml) declares as tested.
    declared = {}
    for line in importlib.metadata.requires("keras-hetero"):
        requirement = Requirement(line)
        if requirement.name in ("tensorflow", "keras", "tf-keras"):
            declared.setdefault(requirement.name, requirement.specifier)
    names = ["tensorflow", "tf-keras" if _compat.IS_LEGACY else "keras"]
    for name in names:
        version = importlib.metadata.version(name)
        assert declared[name].contains(version), (name, version, declared)


def _first_epoch_entry(strategy=None):
    from keras.src.backend.tensorflow import trainer

    iterator = trainer.TFEpochIterator(
        distribute_strategy=strategy or tf.distribute.get_strategy(),
        x=np.zeros((4, 3), "float32"),
        y=np.zeros((4, 2), "float32"),
        batch_size=2,
    )
    with iterator.catch_stop_iteration():
        for entry in iterator:
            return entry


@keras3_only
def test_epoch_iterator_key_matches_what_keras_yields():
    entry = _first_epoch_entry()
    expected = 3 if _compat.EPOCH_ITERATOR_YIELDS_STEP_RANGE else 2
    assert len(entry) == expected, (_compat.KERAS_VERSION, entry)
    assert hasattr(entry[-1], "get_next"), entry  # the batches' iterator
    assert _compat.EPOCH_ITERATOR_YIELDS_STEP_RANGE == (
        _compat.KERAS_RELEASE >= (3, 11)
    )


@keras3_only
def test_optional_inputs_key_matches_the_trainer():
    from keras.src.backend.tensorflow import trainer

    has_conversion = hasattr(
        trainer.TensorFlowTrainer, "_autoconvert_optionals"
    )
    assert _compat.CONVERTS_OPTIONAL_INPUTS == has_conversion
    assert _compat.CONVERTS_OPTIONAL_INPUTS == (
        _compat.KERAS_RELEASE >= (3, 12)
    )


@pytest.mark.skipif(kh.FLAVOUR != "tf-keras", reason="tf-keras")
def test_no_keras3_key_is_set_on_tf_keras():
    assert not _compat.EPOCH_ITERATOR_YIELDS_STEP_RANGE
    assert not _compat.CONVERTS_OPTIONAL_INPUTS


class LazyModel(kh.HeteroModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)


class _WithoutSpec:
    """An epoch iterator whose dataset has no element spec."""

    def __init__(self, entry):
        self.entry = entry

    def __iter__(self):
        return iter([self.entry])


@keras3_only
def test_the_symbolic_build_fallback_reads_the_installed_iterator():
    # Without a distributed dataset's element spec `_maybe_symbolic_build`
    # takes a batch from the epoch iterator, whose entries are laid out as
    # the installed Keras lays them out (a wrong key reads a step number).
    strategy = kh.testing.mirrored(DEVICES[:2])
    with strategy.scope():
        model = LazyModel()
        model.compile(optimizer="sgd", loss="mse")
    assert not model.built
    entry = _first_epoch_entry(strategy)
    model._maybe_symbolic_build(iterator=_WithoutSpec(entry))
    assert model.built
    assert [tuple(w.shape) for w in model.dense.weights] == [(3, 2), (2,)]


def test_iterators_without_autotuning_reach_every_iterator_kind(monkeypatch):
    # conftest installs the hook; every iterator kind the tests make (eager,
    # a distributed dataset's multi-device one) must pass through it and
    # come out without tf.data's autotuning thread.
    from tensorflow.python.data.ops import dataset_ops

    hooked = dataset_ops.DatasetV2._apply_debug_options
    seen = []

    def spy(self):
        dataset = hooked(self)
        seen.append(dataset.options().autotune.enabled)
        return dataset

    monkeypatch.setattr(dataset_ops.DatasetV2, "_apply_debug_options", spy)
    dataset = tf.data.Dataset.range(8).batch(4)
    assert [int(b[0]) for b in dataset] == [0, 4]
    eager = len(seen)
    assert eager >= 1
    strategy = kh.testing.mirrored(DEVICES[:2])
    distributed = strategy.experimental_distribute_dataset(dataset)
    batches = [strategy.gather(b, axis=0).numpy().tolist() for b in distributed]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(seen) > eager
    assert seen == [False] * len(seen)

    before = dataset_ops.DatasetV2._apply_debug_options
    undo = _compat.iterators_without_autotuning()
    assert dataset_ops.DatasetV2._apply_debug_options is not before
    undo()
    assert dataset_ops.DatasetV2._apply_debug_options is before
