"""How `HeteroModel.fit` meets its callbacks before training: one protocol.

A callback that needs `fit`'s input, the other callbacks, or a change to
`fit`'s arguments before the first step subclasses `HeteroCallback` and
implements `prepare_fit`. `fit` calls it once per `fit`, stage by stage:

1. `"input"`: callbacks that act on the input (`ShardRebalancer`);
2. `"restore"`: callbacks that restore state (`ElasticCheckpoint`), after
   the input ones, so that what they restore lands on attached callbacks;
3. `"observe"`: callbacks that watch the others (`RunReport`,
   `HeteroTensorBoard`); these also run after all the others at every
   step, so they see each step's events in the same step.

Callbacks that keep state across a restart implement `get_state` and
`set_state` (plain data); `ElasticCheckpoint` saves the state of every
`HeteroCallback` whose `get_state` returns something, keyed by
`checkpoint_key`, and hands it back after a restart.

Settings that decide when workers communicate or what they train (a
rebalancing interval, a save schedule) are named in `agreed_settings`: a
multi-worker `fit` compares them between the workers before the first
step (`keras_hetero.training.agreement`), with which of these callbacks
each worker has (callbacks without such settings may differ).
"""

import dataclasses

from keras_hetero._compat import keras

STAGES = ("input", "restore", "observe")


@dataclasses.dataclass
class FitContext:
    """What `HeteroModel.fit` hands `HeteroCallback.prepare_fit`.

    Attributes:
        model: The `kh.HeteroModel` being fit.
        input: What `fit` trains on: a `kh.data.HeteroDataset` (numpy
            input is sharded into one first), a stand-in with the
            `HeteroDataset` attributes a checkpoint needs under
            ParameterServerStrategy, or `fit`'s `x` as given otherwise.
        callbacks: The callbacks of this `fit`, in the order they run.
        fit_kwargs: The keyword arguments `fit` passes on to Keras' loop; a
            hook may set entries (e.g. `initial_epoch`).
    """

    model: object
    input: object
    callbacks: list
    fit_kwargs: dict


class HeteroCallback(keras.callbacks.Callback):
    """A Keras callback that `HeteroModel.fit` prepares before training.

    Subclass it to get `fit`'s input and the other callbacks before the
    first step (see the module docstring for the stages). With a plain
    `keras.Model` it is an ordinary Keras callback and `prepare_fit` is not
    called.

    Attributes:
        stage: `"input"`, `"restore"` or `"observe"` (class attribute).
        needs_data_position: Whether the callback needs `fit`'s input as a
            `kh.data.HeteroDataset` even with one replica, where numpy input
            otherwise goes through Keras' own adapter (class attribute;
            True for `ElasticCheckpoint`).
        changes_shares: Whether the callback changes the dataset's shares
            during training (class attribute; True for `ShardRebalancer`:
            `fit` warns about per-replica batch statistics then).
        agreed_settings: The names of the attributes that must be equal on
            every worker of a job (class attribute; a difference would hang
            a collective or train the workers apart): a multi-worker `fit`
            raises before the first step, naming the setting and each
            worker's value, if they differ or a worker lacks the callback.

    Example:

    >>> class CountRows(kh.callbacks.HeteroCallback):
    ...     def prepare_fit(self, context):
    ...         self.rows = context.input.num_examples
    """

    stage = "input"
    needs_data_position = False
    changes_shares = False
    agreed_settings = ()

    def prepare_fit(self, context):
        """Called by `HeteroModel.fit` before training.

        Args:
            context: A `FitContext`.

        Returns:
            None, or a function of no arguments that `fit` calls when it
            ends (also on error) to undo what this call changed.

        Raises:
            ValueError: A subclass raises it, naming the argument, when
                `fit`'s input or callbacks cannot work with it.
        """
        del context
        return None

    def get_state(self):
        """This callback's state as plain data, or None (nothing to save).

        Returns:
            JSON-serialisable data that `set_state` takes back, or None.
        """
        return None

    def set_state(self, state):
        """Restores what `get_state` returned (after a restart).

        Args:
            state: A value `get_state` returned.
        """
        del state

    @property
    def checkpoint_key(self):
        """The key of this callback's state in a checkpoint (its class
        name; one callback of a class per `fit`)."""
        return type(self).__name__


def prepare_fit(model, fit_input, callbacks, fit_kwargs):
    """Runs every `HeteroCallback.prepare_fit` of `callbacks` in stage order.

    Args:
        model: The model being fit.
        fit_input: `FitContext.input`.
        callbacks: The callbacks, in run order.
        fit_kwargs: `FitContext.fit_kwargs`.

    Returns:
        A function of no arguments that undoes every hook's changes, in
        reverse order.
    """
    context = FitContext(model, fit_input, list(callbacks or ()), fit_kwargs)
    undos = []

    def undo():
        while undos:
            undos.pop()()

    try:
        for stage in STAGES:
            for callback in context.callbacks:
                if isinstance(callback, HeteroCallback) and (
                    callback.stage == stage
                ):
                    done = callback.prepare_fit(context)
                    if done is not None:
                        undos.append(done)
    except BaseException:
        undo()
        raise
    return undo


def agreed_settings(callbacks):
    """`{"callbacks": sorted class names, "<Class>.<setting>": value}` of
    the `HeteroCallback`s among `callbacks` that name `agreed_settings`
    (observers such as a report writer may run on one worker only)."""
    ours = [
        c
        for c in callbacks or ()
        if isinstance(c, HeteroCallback) and c.agreed_settings
    ]
    values = {"callbacks": sorted(type(c).__name__ for c in ours)}
    for callback in ours:
        for name in callback.agreed_settings:
            key = f"{type(callback).__name__}.{name}"
            values[key] = getattr(callback, name)
    return values


def observers_last(callbacks):
    """`callbacks` with the `"observe"` stage ones moved to the end (they
    see each step's events and decisions in the same step)."""

    def observes(callback):
        return (
            isinstance(callback, HeteroCallback) and callback.stage == "observe"
        )

    callbacks = list(callbacks)
    return [c for c in callbacks if not observes(c)] + [
        c for c in callbacks if observes(c)
    ]
