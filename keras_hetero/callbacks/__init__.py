"""Callbacks that act on HeteroModel telemetry."""

from keras_hetero.callbacks.shard_rebalancer import ShardRebalancer

__all__ = ["ShardRebalancer"]
