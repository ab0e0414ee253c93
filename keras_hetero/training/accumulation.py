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

import numpy as np
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

    def state(self):
        """The running sums as numpy values by name (for `.keras` files)."""
        values = {
            f"gradient_{index}": total.numpy()
            for index, total in enumerate(self.sums)
        }
        values["rows"] = self.rows.numpy()
        values["micro_steps"] = self.count.numpy()
        return values

    def restore(self, values):
        """Assigns sums saved by `state` (call in cross-replica context).

        Raises:
            ValueError: If `values` holds another number of gradient sums
                or other shapes than this model's trainable variables.
        """
        saved = sum(name.startswith("gradient_") for name in values)
        shapes = [
            tuple(np.shape(values.get(f"gradient_{index}")))
            for index in range(len(self.sums))
        ]
        expected = [tuple(total.shape) for total in self.sums]
        if saved != len(self.sums) or shapes != expected:
            raise ValueError(
                "The saved gradient accumulation state does not fit this "
                f"model: it holds {saved} partial gradient sums of shapes "
                f"{shapes}; the model's trainable variables have shapes "
                f"{expected}."
            )
        for index, total in enumerate(self.sums):
            total.assign(np.asarray(values[f"gradient_{index}"]))
        self.rows.assign(np.asarray(values["rows"], np.float32))
        self.count.assign(np.asarray(values["micro_steps"], np.int64))

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
