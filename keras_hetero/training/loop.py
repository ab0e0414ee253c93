"""HeteroModel's train, test and predict functions on Keras 3: Keras 3.15's
own loop (tf.function, jit_compile, steps_per_execution) with the changes a
distributed, uneven step needs. tf-keras' own functions serve as they are.

`_compat.Keras3TrainerOverrides._make_function`, Keras' hook, calls
`make_function` through the model.
"""

import functools

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero.training import step


def make_function(model, step_function):
    """Keras' function that runs `step_function` for `model` (up to
    `steps_per_execution` steps per call).

    Args:
        model: A HeteroModel on Keras 3.
        step_function: Its `train_step`, `test_step` or `predict_step`.

    Returns:
        A callable taking an iterator (or a list of batches) and returning
        the last step's outputs; `StopIteration` when no data was left.
    """
    one_step_on_data, looped_step = _step_on_data(model, step_function)
    steps_per_execution = int(model.steps_per_execution)
    multi_step_on_iterator = _multi_step(
        one_step_on_data, looped_step, steps_per_execution
    )
    if not model.run_eagerly:
        multi_step_on_iterator = tf.function(
            multi_step_on_iterator, reduce_retracing=True
        )

    def function(iterator):
        if isinstance(
            iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
        ):
            outputs = multi_step_on_iterator(iterator)
            if not outputs.has_value():
                raise StopIteration
            return outputs.get_value()
        outputs = None
        for _, data in zip(range(steps_per_execution), iterator):
            outputs = one_step_on_data(data)
        return outputs

    return function


def _step_on_data(model, step_function):
    """One step on one batch, as Keras calls it (`one_step_on_data`), and
    the same step as `_multi_step`'s loop calls it under a strategy."""
    # Keras 3.10-3.15 reduce step outputs with `reduce_per_replica(...,
    # "auto")`, which under MultiWorkerMirroredStrategy calls
    # `strategy.reduce("MEAN", v, axis=0)` on scalar logs and fails with
    # "Invalid reduction dimension 0" (tensorflow#72388). HeteroModel's
    # steps return logs that are already global and identical on every
    # replica, so replica 0's copy is the answer; everything else is
    # Keras' own function (tf.function, jit_compile, steps_per_execution).
    # Under a strategy XLA compiles each replica's step (as tf-keras
    # does), not the whole `strategy.run`: Keras 3.15 compiles the
    # latter, which cannot reach variables on any device but the first
    # ("Trying to access resource ... located in device CPU:1"), e.g.
    # under OneDeviceStrategy("/cpu:1"). Without a strategy, Keras' own
    # structure. XLA cannot lift variables created inside HeteroModel's
    # step, so the optimizer's are created first.
    strategy = model.distribute_strategy
    jit = bool(model.jit_compile) and not model.run_eagerly
    per_replica = jit and _compat.model_strategy(model) is not None
    replica_step = step_function
    if jit and model.built:
        _compat.build_optimizer(model)
    if per_replica:
        replica_step = tf.function(
            step_function, reduce_retracing=True, jit_compile=True
        )

    # Tensors the model adds to the train function's outputs (read after
    # the step, in the same call: no eager op per call), or None.
    extras = None
    if step_function == getattr(model, "train_step", None):
        extras = functools.partial(step.train_function_extras, model)

    # Not autograph-converted, as in Keras: the user's errors (say a
    # metric name that does not exist) keep their own type.
    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        outputs = _compat.first_local_values(strategy, outputs)
        if extras is not None and isinstance(outputs, dict):
            outputs = {**outputs, **extras()}
        return outputs

    looped_step = one_step_on_data
    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=jit and not per_replica,
        )
        if _compat.model_strategy(model) is None:
            looped_step = one_step_on_data
    if _compat.CONVERTS_OPTIONAL_INPUTS:
        one_step_on_data = _compat.autoconvert_optionals(
            model, one_step_on_data
        )
        looped_step = _compat.autoconvert_optionals(model, looped_step)
    return one_step_on_data, looped_step


def _multi_step(one_step_on_data, looped_step, steps_per_execution):
    """Keras' `multi_step_on_iterator`: up to `steps_per_execution` steps
    of one iterator, returning a `tf.experimental.Optional` of the last
    step's outputs (empty when no data was left)."""

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        # Keras 3.15's loop (Apache-2.0), unchanged but for the reduction in
        # `_step_on_data` and `looped_step`: run up to `steps_per_execution`
        # steps while data lasts, never fetching a batch that the next call
        # should get. Under a strategy the step is traced inline here: a nested
        # tf.function around `strategy.run` (Keras' structure) or around the
        # replica function (which MirroredStrategy wraps in one) called in this
        # tf.cond inside tf.while_loop fails at run time with "You must feed a
        # value for placeholder tensor 'while/cond/Placeholder'" (measured on TF
        # 2.21, MirroredStrategy with 2 replicas; stock Keras 3.15 fails this
        # way). The distributed Optional passed through the loop is fine.
        if steps_per_execution == 1:
            return tf.experimental.Optional.from_value(
                one_step_on_data(iterator.get_next())
            )
        empty_outputs = tf.experimental.Optional.empty(None)

        def cond(step, optional_outputs, next_inputs):
            return tf.logical_and(
                tf.less(step, steps_per_execution), next_inputs.has_value()
            )

        def body(step, optional_outputs, next_inputs):
            def has_next():
                outputs = tf.experimental.Optional.from_value(
                    looped_step(next_inputs.get_value())
                )
                _compat.set_element_spec(empty_outputs, outputs.element_spec)
                return outputs

            def no_has_next():
                _compat.set_element_spec(
                    optional_outputs, empty_outputs.element_spec
                )
                return optional_outputs

            outputs = tf.cond(
                tf.logical_and(
                    tf.less(step, steps_per_execution),
                    next_inputs.has_value(),
                ),
                has_next,
                no_has_next,
            )
            return (
                step + 1,
                outputs,
                tf.cond(
                    tf.less(step + 1, steps_per_execution),
                    lambda: iterator.get_next_as_optional(),
                    lambda: next_inputs,
                ),
            )

        _, outputs, _ = tf.while_loop(
            cond,
            body,
            loop_vars=[
                tf.constant(0),
                empty_outputs,
                iterator.get_next_as_optional(),
            ],
        )
        _compat.set_element_spec(outputs, empty_outputs.element_spec)
        return outputs

    return multi_step_on_iterator
