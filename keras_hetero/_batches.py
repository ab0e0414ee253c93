"""How every stage counts and slices a batch (one definition of "rows")."""

import tensorflow as tf


def batch_rows(structure):
    """Rows of the batch `structure` (an int32 scalar tensor): the first
    dimension of its first tensor, leaves fed None (optional inputs) aside;
    0 if every leaf is None (the model's own call says what is missing)."""
    leaves = [leaf for leaf in tf.nest.flatten(structure) if leaf is not None]
    if not leaves:
        return tf.constant(0)
    return tf.shape(leaves[0])[0]


def row_slice(structure, start, end):
    """Rows `start:end` of every tensor in `structure` (None stays None)."""
    return tf.nest.map_structure(
        lambda t: None if t is None else t[start:end], structure
    )
