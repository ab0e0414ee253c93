"""What `fit` warns about (or refuses) in the batch statistics of a model
whose replicas see different rows, or whose batches are cut into
micro-batches."""

import warnings

import numpy as np

from keras_hetero import _callback_protocol
from keras_hetero import _compat
from keras_hetero._compat import keras
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.training import state


def check_batch_normalization(model, dataset, callbacks):
    """Per-replica batch statistics and uneven shares: warn, or raise when a
    replica is given no rows (its empty batch makes the statistics NaN)."""
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replicas == 1 or not isinstance(dataset, HeteroDataset):
        return
    local = [
        layer.name
        for layer in _compat.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
        and not getattr(layer, "synchronized", False)
    ]
    if not local:
        return
    shares = dataset.shares
    fix = (
        "Use `BatchNormalization(synchronized=True)`: it all-reduces the "
        "batch statistics, which makes training match one device on the "
        "global batch for any split of rows (docs/precision.md)."
    )
    if (shares == 0).any():
        raise ValueError(
            f"BatchNormalization layer(s) {local} compute statistics over "
            f"each replica's own rows, and the shares {shares.tolist()} give "
            f"replica(s) {np.flatnonzero(shares == 0).tolist()} no rows: "
            f"their statistics would be NaN and poison the weights. {fix}"
        )
    moving = any(
        isinstance(c, _callback_protocol.HeteroCallback) and c.changes_shares
        for c in callbacks or ()
    )
    if moving or not np.allclose(shares, shares[0]):
        warnings.warn(
            f"BatchNormalization layer(s) {local} normalise each replica's "
            "rows separately, so with uneven shares a replica with few rows "
            "weighs as much as one with many in the moving statistics, and a "
            f"replica left with no rows makes them NaN. {fix}",
            stacklevel=3,
        )


def check_microbatch_statistics(model):
    """Batch statistics see micro-batches under `pipeline_microbatches`."""
    count = state.settings(model).pipeline_microbatches
    if count == 1:
        return
    names = [
        layer.name
        for layer in _compat.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    if names:
        warnings.warn(
            f"BatchNormalization layer(s) {names} normalise each of the "
            f"{count} micro-batches (`pipeline_microbatches={count}`) "
            "separately, so training is not the same as with whole batches "
            "(as in GPipe). Use LayerNormalization, or "
            "`pipeline_microbatches=1`, for updates that equal the whole "
            "batch.",
            stacklevel=3,
        )
