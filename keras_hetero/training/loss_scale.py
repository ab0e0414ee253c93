"""The loss scale and the guarded apply: what the step does between the
loss and the optimizer for float16 (and for gradient accumulation).

- `loss_to_differentiate`, `gradients_of_sum`, `divisor`: the loss the tape
  differentiates (rows x mean, or scale x mean under float16), the
  gradients of the replica's loss SUM, and what the aggregated sum is
  divided by (global rows, times the scale under float16).
- `guarded_apply`: the optimizer update, everywhere or nowhere: skipped
  when a gradient is not finite (float16) or the accumulated update is not
  complete (`accumulation_steps`); `apply_when` is its cross-replica cond.

Dynamic loss scaling that skips a step when ANY replica overflowed.

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
        apply_when(
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


def loss_to_differentiate(mean_loss, row_count, scale):
    """The loss whose gradient the step takes on a replica.

    Without a loss scale: `mean_loss * rows`, the replica's loss sum. With
    one: `mean_loss * scale`, as Keras scales it, so float16 activations'
    gradients do not grow with the replica's rows (`gradients_of_sum`
    multiplies by the rows afterwards, in float32).
    """
    if scale is None:
        return mean_loss * row_count
    return mean_loss * scale.scale


def gradients_of_sum(grads, row_count, scale):
    """Gradients of the replica's (scaled) loss sum, from those of
    `loss_to_differentiate`."""
    if scale is None:
        return grads
    return [_times(g, row_count) for g in grads]


def divisor(rows, scale):
    """What the aggregated gradient sum is divided by: the global rows
    (of all accumulated micro-steps), times the loss scale if any."""
    return rows if scale is None else rows * scale.scale


def guarded_apply(apply_fn, grads, scale=None, ready=None):
    """In replica context: the optimizer update `apply_fn(grads)`, taken on
    every replica or on none.

    Args:
        apply_fn: Applies aggregated gradients (replica context).
        grads: Aggregated gradients, identical on every replica.
        scale: The `DynamicLossScale`, or None: with one, a step whose
            gradients are not all finite is skipped and the scale updated.
        ready: None, or a bool scalar identical on every replica (gradient
            accumulation): nothing is applied unless it is True.
    """
    if scale is not None:
        scale.apply_if_finite(apply_fn, grads, ready)
    elif ready is not None:
        apply_when(ready, apply_fn, grads)
    else:
        apply_fn(grads)


def _times(grad, factor):
    """`grad * factor` in the gradient's dtype (a float16 variable's is
    float16), the product taken in float32: an overflow becomes inf, which
    the finite check after aggregation catches."""
    if grad is None:
        return None

    def scaled(values):
        product = tf.cast(values, tf.float32) * tf.cast(factor, tf.float32)
        return tf.cast(product, values.dtype)

    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(
            scaled(grad.values), grad.indices, grad.dense_shape
        )
    return scaled(grad)


def apply_when(predicate, apply_fn, grads, after=None, after_args=()):
    """In replica context: `apply_fn(grads)` on every replica iff `predicate`.

    `predicate` (and `after_args`) must be identical on all replicas, e.g.
    computed from aggregated values. The branch runs in cross-replica
    context: a `tf.cond` in replica context may not contain the optimizer's
    own `merge_call`.

    Args:
        predicate: Scalar bool tensor.
        apply_fn: Called in replica context with `grads`.
        grads: Gradients to apply.
        after: Optional; called in cross-replica context with `after_args`
            once the branch is done (e.g. to update a loss scale).
        after_args: Tensors for `after` (first replica's values).
    """
    context = tf.distribute.get_replica_context()

    def cross_replica(strategy, grads, predicate, after_args):
        def first(value):
            return strategy.experimental_local_results(value)[0]

        def apply():
            strategy.extended.call_for_each_replica(apply_fn, args=(grads,))
            return tf.constant(True)

        applied = tf.cond(first(predicate), apply, lambda: tf.constant(False))
        if after is not None:
            with tf.control_dependencies([applied]):
                after(*[first(value) for value in after_args])

    context.merge_call(
        cross_replica, args=(grads, predicate, tuple(after_args))
    )
