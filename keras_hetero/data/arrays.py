"""Array input for `HeteroModel.fit` / `evaluate` / `predict`.

Numpy arrays and tensors (and dicts, lists and tuples of them) become a
`kh.data.HeteroDataset` with Keras' semantics: `batch_size` (default 32) is
the global batch size, `validation_split` takes the last fraction of the
rows before any shuffling, `shuffle=True` gives every epoch its own order
(`"batch"`: shuffles within each global batch), `class_weight` and
`sample_weight` become per-example weights as the Keras flavour computes
them. The order of an epoch is a function of `(seed, epoch)`, so it is the
same on every worker and after a restart.
"""

import inspect
import math

import numpy as np
import tensorflow as tf

from keras_hetero import _compat
from keras_hetero._callback_protocol import HeteroCallback
from keras_hetero._checks import check_int
from keras_hetero._compat import keras
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.data.shard import check_seed


def is_array_input(*structures):
    """True if `structures[0]` is array-like and the others are too (or
    None): numpy arrays, dense tensors, objects with `__array__` (pandas),
    nested in dicts, lists and tuples."""
    if structures[0] is None:
        return False
    leaves = [
        leaf for structure in structures for leaf in tf.nest.flatten(structure)
    ]
    return bool(leaves) and all(_is_array(leaf) for leaf in leaves)


def _is_array(value):
    if value is None:
        return True
    if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
        return False  # Keras' own adapter slices these
    if isinstance(value, np.ndarray):
        return value.dtype != object or all(
            isinstance(item, str) for item in value.flat
        )
    if tf.is_tensor(value):
        return hasattr(value, "numpy")  # eager, not symbolic
    return hasattr(value, "__array__") and not hasattr(value, "tocsr")


def _to_tensor(value):
    """A CPU tensor of `value`; floats become `floatx()`, as Keras does."""
    if isinstance(value, np.ndarray) and value.dtype == object:
        value = value.astype(str)
    elif not tf.is_tensor(value) and not isinstance(value, np.ndarray):
        value = np.asarray(value)
    with tf.device("/cpu:0"):
        tensor = tf.convert_to_tensor(value)
        if tensor.dtype.is_floating and tensor.dtype != keras.backend.floatx():
            tensor = tf.cast(tensor, keras.backend.floatx())
    return tensor


def _lists_to_tuples(structure):
    # tf.data reads a list as one tensor to stack; Keras' adapters make
    # lists of inputs tuples.
    if isinstance(structure, (list, tuple)):
        return tuple(_lists_to_tuples(part) for part in structure)
    if isinstance(structure, dict):
        return {key: _lists_to_tuples(part) for key, part in structure.items()}
    return structure


def _num_rows(structure):
    rows = {
        int(leaf.shape[0])
        for leaf in tf.nest.flatten(structure)
        if leaf is not None
    }
    if len(rows) != 1:
        raise ValueError(
            "Data cardinality is ambiguous: the arrays passed as x, y and "
            f"sample_weight have different numbers of rows {sorted(rows)}. "
            "Make sure all arrays contain the same number of samples."
        )
    return rows.pop()


class ArraySource:
    """Examples held as tensors, taken in batches by index (no per-example
    tf.data work: one gather per global batch, as Keras' array adapter)."""

    def __init__(self, data):
        self.data = data
        self.num_examples = _num_rows(data)

    def cache(self, filename):
        return self  # already in memory

    def shuffle_mechanism(self, shuffle):
        """How `order` shuffles (`HeteroDataset.shuffle_mechanism`)."""
        if shuffle == "batch":
            return "numpy permutation within batches"
        return "numpy permutation"

    def order(self, pass_number, seed, shuffle, global_batch_size):
        """The example indices of pass `pass_number`, in order."""
        rows = self.num_examples
        if shuffle is None:
            return np.arange(rows, dtype=np.int64)
        rng = np.random.default_rng([int(seed), int(pass_number)])
        if shuffle == "batch":
            # Sorting by (batch, random key) shuffles within each batch.
            keys = np.arange(rows) // global_batch_size + rng.random(rows)
            return np.argsort(keys, kind="stable").astype(np.int64)
        return rng.permutation(rows).astype(np.int64)

    def pass_batches(self, start_pass, global_batch_size, shuffle):
        """One pass's global batches (traced once, run at each pass)."""

        def order():
            skip, number, seed = start_pass()
            return self.order(number, seed, shuffle, global_batch_size)[skip:]

        indices = tf.numpy_function(order, [], tf.int64)
        indices.set_shape([None])
        full = tf.size(indices, out_type=tf.int64) // global_batch_size
        full *= global_batch_size
        batches = tf.data.Dataset.from_tensor_slices(
            tf.reshape(indices[:full], [-1, global_batch_size])
        )
        rest = tf.data.Dataset.from_tensors(indices[full:]).filter(
            lambda rest: tf.size(rest) > 0
        )
        return batches.concatenate(rest).map(
            self._gather,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )

    def _gather(self, indices):
        return tf.nest.map_structure(
            lambda tensor: tf.gather(tensor, indices), self.data
        )


def from_arrays(
    x,
    y=None,
    sample_weight=None,
    *,
    batch_size,
    strategy,
    shuffle=None,
    seed=None,
    first_pass=0,
    argument="batch_size",
):
    """A `HeteroDataset` over arrays (see the module docstring).

    Args:
        x, y, sample_weight: As for `keras.Model.fit`.
        batch_size: The global batch size.
        strategy: The model's strategy.
        shuffle: None, True or "batch".
        seed: The shuffle seed, or None (chosen when training starts).
        first_pass: The number of the first pass (the first epoch).
        argument: The name `batch_size` has in the caller, for errors.

    Raises:
        ValueError: If the arrays differ in rows or `batch_size` is not an
            integer of at least the number of replicas.
    """
    replicas = strategy.num_replicas_in_sync
    batch_size = check_int(
        argument,
        batch_size,
        replicas,
        expected="an integer of at least the number of replicas "
        f"({replicas}) under {type(strategy).__name__} (it is the global "
        "batch size)",
    )
    # Tuples before packing: tf-keras packs a list `x` without `y` bare.
    data = keras.utils.pack_x_y_sample_weight(
        *map(_lists_to_tuples, (x, y, sample_weight))
    )
    data = tf.nest.map_structure(_to_tensor, data)
    return HeteroDataset(
        ArraySource(data),
        int(batch_size),
        strategy,
        np.ones(replicas),
        shuffle=shuffle,
        seed=check_seed(seed),
        first_pass=first_pass,
    )


def _batch_size(batch_size, steps, rows):
    # Keras' array adapters: ceil(rows / steps) if only steps are given.
    if batch_size:
        return batch_size
    return int(math.ceil(rows / steps)) if steps else 32


def _shuffle_kind(shuffle):
    if shuffle == "batch":
        return "batch"
    return True if shuffle else None


def _bind(method, x, y, args, kwargs):
    bound = inspect.signature(getattr(keras.Model, method)).bind(
        None, *((x,) if method == "predict" else (x, y)), *args, **kwargs
    )
    given = dict(bound.arguments)
    given.pop("self")
    given.update(given.pop("kwargs", {}))
    return given


def converts(model, callbacks=None):
    """Whether array input goes through a HeteroDataset for `model`.

    With several replicas, yes: that is how rows follow shares and training
    equals one device on the same global batches. With one replica, only if
    a callback needs the data position (`ElasticCheckpoint`); otherwise
    Keras' own array adapter runs, so numbers (and Keras' shuffle) are stock
    Keras'.
    """
    if model.distribute_strategy.num_replicas_in_sync > 1:
        return True
    return any(
        isinstance(c, HeteroCallback) and c.needs_data_position
        for c in callbacks or ()
    )


def fit_arguments(model, x, y, args, kwargs):
    """`fit`'s arguments with array input as a HeteroDataset, or None.

    Returns:
        All arguments by name (`x` a HeteroDataset; `y`, `batch_size`,
        `shuffle`, `class_weight`, `sample_weight` and `validation_split`
        consumed; array `validation_data` a HeteroDataset too), or None if
        `x` is not array input or `converts(model)` is false.
    """
    given = _bind("fit", x, y, args, kwargs)
    sample_weight = given.get("sample_weight")
    if not is_array_input(given.get("x"), given.get("y"), sample_weight):
        return None
    if not converts(model, given.get("callbacks")):
        return None
    strategy = model.distribute_strategy
    x, y = given.pop("x"), given.pop("y", None)
    sample_weight = given.pop("sample_weight", None)
    split = given.pop("validation_split", 0.0)
    validation = given.get("validation_data")
    if split and validation is None:
        (x, y, sample_weight), validation = _train_validation_split(
            (x, y, sample_weight), split
        )
    class_weight = given.pop("class_weight", None)
    if class_weight is not None:
        if tf.nest.is_nested(y):
            raise ValueError(
                "`class_weight` is only supported for Models with a single "
                "output."
            )
        sample_weight = _compat.array_class_weights(
            np.asarray(y), sample_weight, class_weight
        )
    user_batch = given.pop("batch_size", None)
    steps = given.get("steps_per_epoch")
    rows = _num_rows(keras.utils.pack_x_y_sample_weight(x, y, sample_weight))
    given["x"] = from_arrays(
        x,
        y,
        sample_weight,
        batch_size=_batch_size(user_batch, steps, rows),
        strategy=strategy,
        shuffle=_shuffle_kind(given.pop("shuffle", True)),
        first_pass=given.get("initial_epoch", 0),
    )
    validation_batch = given.pop("validation_batch_size", None) or user_batch
    if validation is not None:
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(
            tuple(validation) if isinstance(validation, list) else validation
        )
        if is_array_input(val_x, val_y, val_weight):
            val_rows = _num_rows(
                keras.utils.pack_x_y_sample_weight(val_x, val_y, val_weight)
            )
            validation = from_arrays(
                val_x,
                val_y,
                val_weight,
                batch_size=_batch_size(
                    validation_batch, given.get("validation_steps"), val_rows
                ),
                strategy=strategy,
                argument="validation_batch_size",
            )
        given["validation_data"] = validation
    return given


def evaluate_arguments(model, x, y, args, kwargs):
    """`evaluate`'s arguments with array input as a HeteroDataset, or None."""
    given = _bind("evaluate", x, y, args, kwargs)
    sample_weight = given.get("sample_weight")
    if not is_array_input(given.get("x"), given.get("y"), sample_weight):
        return None
    if not converts(model):
        return None
    x, y = given.pop("x"), given.pop("y", None)
    sample_weight = given.pop("sample_weight", None)
    rows = _num_rows(keras.utils.pack_x_y_sample_weight(x, y, sample_weight))
    given["x"] = from_arrays(
        x,
        y,
        sample_weight,
        batch_size=_batch_size(
            given.pop("batch_size", None), given.get("steps"), rows
        ),
        strategy=model.distribute_strategy,
    )
    return given


def predict_arguments(model, x, args, kwargs):
    """`predict`'s arguments with array input as a HeteroDataset, or None."""
    given = _bind("predict", x, None, args, kwargs)
    if not is_array_input(given.get("x")) or not converts(model):
        return None
    x = given.pop("x")
    rows = _num_rows(x)
    given["x"] = from_arrays(
        x,
        batch_size=_batch_size(
            given.pop("batch_size", None), given.get("steps"), rows
        ),
        strategy=model.distribute_strategy,
    )
    return given


def _train_validation_split(arrays, validation_split):
    """Keras' split: the last `validation_split` of the rows, in order."""
    rows = _num_rows(arrays)
    split_at = int(math.floor(rows * (1.0 - validation_split)))
    if split_at == 0 or split_at == rows:
        raise ValueError(
            f"Training data contains {rows} samples, which is not sufficient "
            "to split it into a validation and training set as specified by "
            f"`validation_split={validation_split}`. Either provide more "
            "data, or a different value for the `validation_split` argument."
        )

    def part(start, end):
        return tf.nest.map_structure(
            lambda t: None if t is None else t[start:end], arrays
        )

    return part(0, split_at), part(split_at, rows)
