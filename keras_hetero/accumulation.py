"""Gradient accumulation over micro-steps whose rows differ.

HeteroModel sums each micro-step's gradients of the loss SUM (mean times
rows) across replicas, then adds them and the global row count to running
sums here. On every `steps`-th micro-step the update uses
`sum of gradients / sum of rows`: exactly one step on the union of the
micro-steps' rows, however the rows were split between replicas or steps.

The sums are taken after the all-reduce, so they are identical on every
replica: they live in ON_READ variables (ONLY_FIRST_REPLICA) that each
replica updates locally, with no extra collective.
"""

import tensorflow as tf


class GradientAccumulator:
    """Running sums of aggregated gradients and rows; create in the scope.

    Args:
        variables: The trainable variables, in gradient order.
        steps: Micro-steps per update, >= 2.
    """

    def __init__(self, variables, steps):
        self.steps = int(steps)
        common = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.sums = [
            tf.Variable(
                tf.zeros(tuple(v.shape), tf.as_dtype(v.dtype)),
                name=f"accumulated_gradient_{index}",
                **common,
            )
            for index, v in enumerate(variables)
        ]
        self.rows = tf.Variable(
            0.0, dtype=tf.float32, name="accumulated_rows", **common
        )
        self.count = tf.Variable(
            0, dtype=tf.int64, name="accumulated_micro_steps", **common
        )

    @property
    def variables(self):
        return [*self.sums, self.rows, self.count]

    def add(self, grads, rows):
        """This micro-step's sums so far (call in replica context).

        Args:
            grads: Aggregated gradients of the loss sum (None allowed).
            rows: Global rows of this micro-step.

        Returns:
            `(grads, rows, ready)`: the sums including this micro-step, and
            a bool scalar, True on the micro-step that completes an update.
        """
        total = [
            None if g is None else s + tf.convert_to_tensor(g)
            for g, s in zip(grads, self.sums)
        ]
        ready = self.count + 1 >= self.steps
        return total, self.rows + tf.cast(rows, tf.float32), ready

    def store(self, grads, rows, ready):
        """Keeps `add`'s sums for the next micro-step, or clears them."""
        updates = [
            s.assign(tf.where(ready, tf.zeros_like(g), g))
            for g, s in zip(grads, self.sums)
            if g is not None
        ]
        updates.append(self.rows.assign(tf.where(ready, 0.0, rows)))
        updates.append(
            self.count.assign(
                tf.where(ready, tf.constant(0, tf.int64), self.count + 1)
            )
        )
        return tf.group(updates)


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
