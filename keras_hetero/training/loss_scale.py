"""Dynamic loss scaling that skips a step when ANY replica overflowed.

Stock Keras 3.15's `LossScaleOptimizer` decides "finite" from replica 0's
gradients before they are all-reduced (the all-reduce happens later, inside
the inner optimizer), so an inf on replica 1 alone is applied and poisons
every weight. HeteroModel all-reduces first: the gradients every replica
checks are the global ones, so all replicas and workers take the same
decision. On a non-finite step nothing is applied (weights, optimizer slots
and `iterations` stay untouched) and the scale is halved; after
`growth_steps` finite steps in a row it doubles.

The decision runs in cross-replica context (`merge_call`), as
`LossScaleOptimizer` does: a `tf.cond` in replica context may not contain the
optimizer's own `merge_call`.
"""

import tensorflow as tf

from keras_hetero.training import accumulation


class DynamicLossScale:
    """Loss scale state and the skip-or-apply step; create in the scope.

    Args:
        initial_scale: Starting scale. Defaults to `2**15`.
        growth_steps: Finite steps in a row before the scale doubles.
            Defaults to `2000`.
        multiplier: Factor to grow / shrink by. Defaults to `2.0`.
    """

    def __init__(self, initial_scale=2.0**15, growth_steps=2000, multiplier=2):
        self.growth_steps = int(growth_steps)
        self.multiplier = float(multiplier)
        common = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.scale = tf.Variable(
            float(initial_scale), dtype=tf.float32, name="loss_scale", **common
        )
        self.good_steps = tf.Variable(
            0, dtype=tf.int64, name="loss_scale_good_steps", **common
        )
        self.skipped = tf.Variable(
            0, dtype=tf.int64, name="loss_scale_skipped_steps", **common
        )

    @property
    def variables(self):
        return [self.scale, self.good_steps, self.skipped]

    def apply_if_finite(self, apply_fn, grads, ready=None):
        """In replica context: `apply_fn(grads)` everywhere iff every
        gradient is finite, then updates the scale.

        `grads` must already be aggregated (identical on all replicas).
        With `ready` (a bool scalar, identical on all replicas; gradient
        accumulation), nothing is applied and the scale is left alone unless
        `ready` is True.
        """
        finite = all_finite(grads)
        if ready is None:
            ready = tf.constant(True)
        accumulation.apply_when(
            tf.logical_and(finite, ready),
            apply_fn,
            grads,
            after=self._update,
            after_args=(finite, ready),
        )

    def _update(self, finite, ready):
        grow = tf.logical_and(finite, self.good_steps + 1 >= self.growth_steps)
        new_scale = tf.where(
            grow,
            self.scale * self.multiplier,
            tf.where(
                finite,
                self.scale,
                tf.maximum(self.scale / self.multiplier, 1.0),
            ),
        )
        good = tf.where(
            finite,
            tf.where(grow, tf.constant(0, tf.int64), self.good_steps + 1),
            tf.constant(0, tf.int64),
        )
        skipped = tf.cast(tf.logical_not(finite), tf.int64)
        self.scale.assign(tf.where(ready, new_scale, self.scale))
        self.good_steps.assign(tf.where(ready, good, self.good_steps))
        self.skipped.assign_add(skipped * tf.cast(ready, tf.int64))


def all_finite(grads):
    """A scalar bool: every element of every gradient is finite."""
    checks = [
        tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None
    ]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
