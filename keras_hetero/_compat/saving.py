"""What a checkpoint must hold that Keras keeps privately (optimizer and
random-generator state)."""

from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.model import all_layers
from keras_hetero._compat.model import build_optimizer


def checkpoint_variables(model):
    """Every variable a checkpoint must hold: model state, then optimizer.

    Builds the optimizer's variables first if it has not run a step yet, so
    a restore before the first step has somewhere to put the slots.

    Returns:
        `(names, variables)`, in a stable order for the same model code.
    """
    optimizer = build_optimizer(model)
    variables = list(model.variables)
    if optimizer is not None:
        extra = optimizer.variables
        variables += list(extra() if callable(extra) else extra)
    own = getattr(model, "_hetero_variables", None)
    if own is not None:  # loss scale, gradient accumulator
        variables += own()
    variables += random_generator_states(model)
    unique, seen = [], set()
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    names = [getattr(v, "path", None) or v.name for v in unique]
    return names, unique


def random_generator_states(model):
    """tf-keras: the state variables of the layers' `tf.random.Generator`s.

    Keras 3 random layers (Dropout, GaussianNoise, RandomFlip, ...) keep
    their `SeedGenerator` state in `model.variables`, so a checkpoint has it
    already. tf-keras layers draw through a `backend.RandomGenerator`
    (`layer._random_generator`). By default ("legacy_stateful") it calls TF1
    stateful random ops, whose state lives inside the op kernel: no
    checkpoint can hold it, and a restarted process draws the first step's
    numbers again. After `tf.keras.backend.experimental
    .enable_tf_random_generator()` it holds a `tf.random.Generator` whose
    state is a variable, but one that tf-keras leaves out of
    `model.variables` and creates lazily at the first call; this creates
    it (in the model's strategy scope, as the first call would) and returns
    it.

    Returns:
        A list of state variables (empty under Keras 3).
    """
    if not IS_LEGACY:
        return []
    states = []
    for _, generator in _random_generators(model, "stateful"):
        with model.distribute_strategy.scope():
            generator._maybe_init()
        inner = getattr(generator, "_generator", None)
        if inner is not None:
            states.append(inner.state)
    return states


def unsaved_random_layers(model):
    """tf-keras: names of the layers whose random state no checkpoint holds.

    Those are the layers drawing through TF1 stateful random ops, tf-keras'
    default (`backend.RandomGenerator` with rng type "legacy_stateful"; see
    `random_generator_states`): a restarted process draws the first step's
    numbers again. Keras 3 keeps every random layer's state in a variable.

    Returns:
        A list of layer names (empty under Keras 3).
    """
    if not IS_LEGACY:
        return []
    return [
        layer.name for layer, _ in _random_generators(model, "legacy_stateful")
    ]


def _random_generators(model, rng_type):
    """tf-keras: `(layer, layer._random_generator)` of the layers whose
    `backend.RandomGenerator` has `rng_type`."""
    for layer in all_layers(model):
        generator = getattr(layer, "_random_generator", None)
        if getattr(generator, "_rng_type", None) == rng_type:
            yield layer, generator
