"""Creates a HeteroModel's run-time objects (`state.RunState`) when first
needed, and saves and loads the ones a `.keras` file holds beside Keras'
variables: the partial gradient sums and the low-communication state."""

import warnings

import numpy as np

from keras_hetero.training import accumulation
from keras_hetero.training import low_communication
from keras_hetero.training import parameter_server as parameter_server_lib
from keras_hetero.training import state

# Prefix of the partial gradient sums in a `.keras` file's model entry.
_ACCUMULATION_KEY = "keras_hetero_accumulation_"
# Prefix of low-communication training's state (anchor, outer optimizer).
_LOW_COMMUNICATION_KEY = "keras_hetero_low_communication_"


def accumulator(model):
    """The `GradientAccumulator` (created once), or None for k = 1."""
    run = state.run_state(model)
    steps = state.settings(model).accumulation_steps
    if steps == 1:
        return None
    if run.accumulator is None:
        with model.distribute_strategy.scope():
            run.accumulator = accumulation.GradientAccumulator(
                model.trainable_variables, steps
            )
    return run.accumulator


def local_training(model):
    """The `LocalTraining` state (created once), or None: not
    low-communication training, or a model without weights yet."""
    run = state.run_state(model)
    mode = state.settings(model).low_communication
    if mode is None:
        return None
    if run.local_training is None:
        if not model.trainable_variables:
            return None  # not built yet (refused before `fit`)
        run.local_training = low_communication.LocalTraining(model, mode)
    return run.local_training


def parameter_server(model):
    """The `ParameterServerRunner` (created once); its telemetry becomes
    the model's."""
    run = state.run_state(model)
    if run.parameter_server is None:
        run.parameter_server = parameter_server_lib.ParameterServerRunner(model)
        run.telemetry = run.parameter_server.telemetry
    return run.parameter_server


def own_variables(model):
    """The variables of the model's own state that a checkpoint must hold
    (loss scale, gradient sums, low-communication anchor and optimizer)."""
    run = state.run_state(model)
    found = []
    if run.loss_scale is not None:
        found += run.loss_scale.variables
    if accumulator(model) is not None:
        found += run.accumulator.variables
    if model.built and local_training(model) is not None:
        found += run.local_training.variables
    return found


def warn_unsaved_sums(model, filepath):
    """Warns when `model.save(filepath)` drops gradient sums that have not
    made an update yet: only `.keras` files hold them."""
    sums = state.run_state(model).accumulator
    pending = 0 if sums is None else int(sums.count.numpy())
    steps = state.settings(model).accumulation_steps
    if pending and not str(filepath).endswith(".keras"):
        # Legacy `.h5` files and tf-keras' SavedModel hold Keras'
        # variables only (see `save_own_state`).
        warnings.warn(
            f"`{model.name}` is saved to {str(filepath)!r} with the "
            f"gradient sums of {pending} micro-step(s) that have not "
            f"made an update yet (`accumulation_steps={steps}`); only "
            "`.keras` files "
            "hold them. A model loaded from this file does not go on "
            "exactly as this one: save to a `.keras` file, or after "
            "an update.",
            stacklevel=3,
        )


def save_own_state(model, store):
    """Adds the partial gradient sums and the low-communication state to
    `store` (the dict-like store of the model's `.keras` entry)."""
    run = state.run_state(model)
    if run.accumulator is not None:
        for name, value in run.accumulator.state().items():
            store[_ACCUMULATION_KEY + name] = value
    if run.local_training is not None:
        # The anchor and the outer optimizer's state (e.g. its Nesterov
        # momentum): a loaded model goes on with the same outer steps.
        for index, variable in enumerate(run.local_training.variables):
            store[f"{_LOW_COMMUNICATION_KEY}{index}"] = np.array(
                variable.numpy()
            )


def keras_entries(store):
    """`store`'s entries that are Keras' own (not `save_own_state`'s)."""
    own = (_ACCUMULATION_KEY, _LOW_COMMUNICATION_KEY)
    return {
        name: store[name] for name in store.keys() if not name.startswith(own)
    }


def load_own_state(model, store):
    """Restores what `save_own_state` saved; warns about state the model
    has no place for (another `accumulation_steps`, no low communication)."""
    names = list(store.keys())
    _load_low_communication(
        model,
        [
            np.asarray(store[f"{_LOW_COMMUNICATION_KEY}{index}"])
            for index in range(
                sum(n.startswith(_LOW_COMMUNICATION_KEY) for n in names)
            )
        ],
    )
    saved = {
        name[len(_ACCUMULATION_KEY) :]: np.asarray(store[name])
        for name in names
        if name.startswith(_ACCUMULATION_KEY)
    }
    if not saved:
        return
    sums = accumulator(model) if model.trainable_variables else None
    steps = state.settings(model).accumulation_steps
    if sums is not None:
        sums.restore(saved)
    elif int(saved["micro_steps"]):
        warnings.warn(
            f"The file holds the gradient sums of {int(saved['micro_steps'])} "
            "micro-step(s) that had not made an update yet, and "
            f"`{model.name}` has `accumulation_steps={steps}`: they are "
            "dropped, so "
            "training does not go on exactly as the saved model would.",
            stacklevel=3,
        )


def _load_low_communication(model, arrays):
    if not arrays:
        return
    local = local_training(model) if model.built else None
    variables = [] if local is None else local.variables
    shapes = [tuple(np.shape(a)) for a in arrays]
    if shapes != [tuple(v.shape) for v in variables]:
        warnings.warn(
            f"The file holds low-communication state ({len(arrays)} "
            f"arrays: the anchor and the outer optimizer's state) that "
            f"`{model.name}` has no place for (low_communication="
            f"{state.settings(model).low_communication!r}); it is dropped.",
            stacklevel=4,
        )
        return
    for variable, array in zip(variables, arrays):
        variable.assign(array)


def warn_custom_compile():
    """Keras' warning for a model loaded uncompiled because its class
    overrides `compile` (`compile_from_config` does not know the user's
    `compile`)."""
    warnings.warn(
        "`compile()` was not called as part of model loading "
        "because the model's `compile()` method is custom. "
        "All subclassed Models that have `compile()` "
        "overridden should also override "
        "`get_compile_config()` and `compile_from_config(config)`. "
        "Alternatively, you can call `compile()` manually after "
        "loading.",
        stacklevel=3,
    )
