"""Rebalancing shares to device speeds: `core` (pure numpy: speed window,
the decision) and `rebalancer` (`ShardRebalancer`, the Keras callback that
feeds it `step_stats` and sets the dataset's shares)."""
