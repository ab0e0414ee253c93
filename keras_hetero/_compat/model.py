"""Model construction, configuration and compile internals of both flavours."""

import contextlib

import tensorflow as tf

from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.flavour import Functional
from keras_hetero._compat.flavour import _model_module
from keras_hetero._compat.flavour import keras


def register_serializable(name):
    """`register_keras_serializable` under the `keras_hetero` package."""
    return keras.saving.register_keras_serializable(
        package="keras_hetero", name=name
    )


def register_plain_name(name, cls):
    """Makes `cls` known to Keras by its bare class `name` too.

    Legacy `.h5` files store the bare class name (`HeteroModel`), which
    `register_serializable` does not cover (it registers
    `keras_hetero>HeteroModel`); `load_model` then needs no `custom_objects`
    after `import keras_hetero`.
    """
    keras.saving.get_custom_objects()[name] = cls


def init_functional(model, args, kwargs):
    """Initialises `model`, whose class already derives from `Functional`.

    `keras.Model.__init__` would "inject" `Functional` into the bases of every
    class above the instance's, i.e. rewrite `HeteroModel` itself, after which
    subclass-style `HeteroModel`s break. Our functional variant class already
    has `Functional` in its bases, so we run the initialisers directly.
    """
    if not IS_LEGACY:
        _model_module.Trainer.__init__(model)
    Functional.__init__(model, *args, **kwargs)


def functional_config(model, default_get_config):
    """The Functional config (layers and wiring) of a functional HeteroModel.

    tf-keras only writes the layer graph for classes whose `__init__` has
    exactly Functional's arguments; HeteroModel's takes `*args, **kwargs`.
    """
    if IS_LEGACY:
        from tf_keras.src.engine import functional

        return functional.get_network_config(
            model, config={"name": model.name, "trainable": model.trainable}
        )
    return default_get_config()


def symbolic_inputs_outputs(model):
    """`(inputs, outputs)` of a model that has symbolic ones, in the
    structure it was built with (one tensor stays one tensor, so `predict`
    and `export` signatures stay the same), else `(None, None)`."""
    if isinstance(model, keras.Sequential):
        try:  # Both flavours raise for a Sequential that was never built.
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            return None, None
        return (inputs[0], outputs[0]) if inputs else (None, None)
    if not isinstance(model, Functional):
        return None, None
    if IS_LEGACY:
        return model._nested_inputs, model._nested_outputs
    return model._inputs_struct, model._outputs_struct


def compile_arguments(model):
    """The arguments of `model`'s last `compile`, or None if it has none.

    Both flavours keep them in `model._compile_config.config` (what
    `get_compile_config` serialises). The optimizer is the compiled object
    (not, say, the string "adam"), so its state carries over.
    """
    config = getattr(model, "_compile_config", None)
    if config is None:
        return None
    arguments = dict(config.config)
    if getattr(model, "optimizer", None) is not None:
        arguments["optimizer"] = model.optimizer
    return arguments


def reduce_logs_to_first_replica(model, own_steps):
    """tf-keras: `fit` / `evaluate` take replica 0's logs of our steps.

    HeteroModel's `train_step` / `test_step` return global logs, the same
    on every replica; tf-keras' default reduction ("auto": "sum") would add
    them up across workers under MultiWorkerMirroredStrategy. A subclass
    with its own steps returns its own logs (tf-keras' tests return
    per-replica shares of a global mean), so Keras' default stays.

    Args:
        model: The HeteroModel being initialised.
        own_steps: Whether its `train_step` and `test_step` are
            HeteroModel's.
    """
    if IS_LEGACY and own_steps:
        model.distribute_reduction_method = "first"


def model_strategy(model):
    """The strategy `model` was created under, or None."""
    if IS_LEGACY:
        return model._distribution_strategy
    return model._distribute_strategy


def all_layers(model):
    """Every layer inside `model`, nested models' layers included."""
    seen, stack = [], list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop()
        if any(layer is s for s in seen):
            continue
        seen.append(layer)
        stack.extend(getattr(layer, "layers", []) or [])
    return seen


def steps_per_execution(model):
    """The model's `steps_per_execution` as an int."""
    value = getattr(
        model, "_steps_per_execution" if IS_LEGACY else "steps_per_execution", 1
    )
    if hasattr(value, "numpy"):
        value = value.numpy()
    return int(value or 1)


@contextlib.contextmanager
def one_batch_per_call(model, kind):
    """tf-keras only: `train_on_batch`, `test_on_batch` and
    `predict_on_batch` run one step when `steps_per_execution > 1`.

    Upstream (tf-keras 2.21, `Model.make_train_function` and its test and
    predict twins): with `steps_per_execution > 1` the function loops
    `tf.range(self._steps_per_execution)` over its iterator, and the
    `*_on_batch` methods give it a one-batch iterator, so the second step
    raises `OutOfRangeError` (stock `keras.Model` too; no upstream issue
    found). The loop reads the variable when it runs: the function is made
    first with the compiled value (as `fit` will use it), then runs with
    the variable at 1, which is restored after the call. Keras 3 stops at
    the end of its one-batch iterator by itself.

    Args:
        model: The compiled HeteroModel.
        kind: `"train"`, `"test"` or `"predict"`.
    """
    compiled = steps_per_execution(model)  # 1 if not compiled
    if (
        not IS_LEGACY
        or compiled == 1
        or getattr(model, "_cluster_coordinator", None) is not None
    ):
        yield
        return
    with model.distribute_strategy.scope():  # as Keras makes it
        getattr(model, f"make_{kind}_function")()
    model._steps_per_execution.assign(1)
    try:
        yield
    finally:
        model._steps_per_execution.assign(compiled)


def one_batch_outputs(model, x, outputs):
    """`predict_on_batch`'s outputs for `x`'s rows once, in order.

    Upstream (Keras 3.10-3.15, TF backend, `TensorFlowTrainer.
    predict_on_batch`): under a strategy with several replicas the batch
    is not split; every replica predicts all of it and the outputs are
    concatenated replica after replica, so `len(outputs)` is replicas
    times the rows (stock `keras.Model` too; no upstream issue found).
    The first replica's part is the answer. tf-keras splits the batch.
    For one worker's replicas only: with several workers Keras gathers
    every worker's outputs, and the caller leaves them as they are.
    """
    replicas = model.distribute_strategy.num_replicas_in_sync
    if IS_LEGACY or replicas == 1:
        return outputs
    rows = int(tf.nest.flatten(x)[0].shape[0])
    return tf.nest.map_structure(lambda value: value[:rows], outputs)


def jit_compiled(model):
    """Whether the model's train step is compiled with XLA."""
    if IS_LEGACY:
        return bool(getattr(model, "_jit_compile", False))
    return bool(getattr(model, "jit_compile", False))


def fix_synchronized_batch_norm(model):
    """tf-keras only: synchronized BatchNormalization on a replica with no
    rows still updates its moving statistics.

    Upstream (tf-keras 2.21, `BatchNormalizationBase._support_zero_size_input`
    and `_assign_moving_average`): under a strategy with partial batches a
    replica whose LOCAL batch is empty skips the moving-average update even
    when the statistics are synchronized (global, valid). The moving
    statistics are ON_READ MEAN, so the read then averages in a stale copy:
    with shares [1, 0] they come out halved. Keras 3 has no such skip.
    """
    if not IS_LEGACY:
        return
    for layer in all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and getattr(
            layer, "synchronized", False
        ):
            # An instance attribute: only this model's layers change.
            object.__setattr__(layer, "_support_zero_size_input", _no)


def _no():
    return False


def build_optimizer(model):
    """Creates the optimizer's variables now if no step has yet.

    Returns:
        The optimizer (or None).
    """
    optimizer = model.optimizer
    if optimizer is not None:
        built = getattr(optimizer, "built", None)  # Keras 3
        if built is None:  # tf-keras; its legacy optimizers cannot build
            built = getattr(optimizer, "_built", False) or not hasattr(
                optimizer, "build"
            )
        inside_run = (
            tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context()
        )
        if not built and inside_run:
            # A lazily built model's first XLA trace, inside `strategy.run`:
            # in the strategy's scope already, which a replica context
            # cannot enter again ("Method requires being in cross-replica
            # context", e.g. under OneDeviceStrategy).
            optimizer.build(model.trainable_variables)
        elif not built:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
    return optimizer


def inbound_nodes(layer):
    """The nodes of `layer`'s calls on symbolic tensors (private
    `_inbound_nodes` in both flavours; Keras has no public graph walk of a
    model's layers), each with `input_tensors` and `output_tensors`."""
    return getattr(layer, "_inbound_nodes", None) or []


def derive_from_functional(cls, base, functional):
    """Puts `functional` (the functional class of `base`) under `cls` in
    place of `base`.

    What Keras does for a `keras.Model` subclass whose `__init__` calls
    `super().__init__(inputs, outputs)` (`inject_functional_model_class`,
    keras/src/models/model.py: `Model` becomes `Functional` in the bases
    of the subclass and of its parents up to `Model`), except that it stops
    at `base` (HeteroModel), which itself stays as it is: rewriting it
    would make every HeteroModel functional.

    Returns:
        `cls`, or the class that replaces it in the bases.
    """
    if cls is base:
        return functional
    if not issubclass(cls, base) or issubclass(cls, Functional):
        return cls
    cls.__bases__ = tuple(
        derive_from_functional(b, base, functional) for b in cls.__bases__
    )
    return cls
