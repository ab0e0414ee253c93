"""The check at the start of `fit` that every worker of a multi-worker job
trains with the same settings (`keras_hetero._agreement` exchanges them).

Under MultiWorkerMirroredStrategy across workers, each worker computes the
fingerprint below from its own model, settings, callbacks and input; one
all-gather of a fixed shape hands every worker all of them; a difference
raises the same error on every worker before the first step, naming the
setting, the workers and their values. Settings that differ would
otherwise hang a collective (a different `steps_per_execution`, bucket
size or save schedule) or fail in one (a different global batch or weight
shape), or train differently without a word (a different optimizer
setting, shuffle seed or rebalancing interval). Under any other strategy
there is nothing to exchange and nothing runs.
"""

import json

import tensorflow as tf

from keras_hetero import _agreement
from keras_hetero import _callback_protocol
from keras_hetero import _compat
from keras_hetero import devices as devices_lib
from keras_hetero import precision as precision_lib
from keras_hetero.data.shard import HeteroDataset
from keras_hetero.training import options
from keras_hetero.training import state

# `fit` arguments that decide how many steps run: a difference hangs the
# workers that run more.
_FIT_ARGUMENTS = ("epochs", "initial_epoch", "steps_per_epoch")


def fit_arguments(kwargs):
    """The `fit` arguments that decide how many steps run, as given (take
    them before `fit` fills in defaults that follow other settings), and
    the library's callbacks with their settings that must match
    (`HeteroCallback.agreed_settings`: one worker rebalancing or saving at
    other steps than the others would hang a collective or move shares on
    one worker only)."""
    values = {name: kwargs.get(name) for name in _FIT_ARGUMENTS}
    callbacks = _callback_protocol.agreed_settings(kwargs.get("callbacks"))
    values.update({name: _plain(v) for name, v in callbacks.items()})
    return values


def check_fit(model, dataset, arguments):
    """Raises on every worker unless all train with the same settings.

    Every worker must call this at the same point of `fit` (before anything
    else that communicates), under MultiWorkerMirroredStrategy; elsewhere
    nothing is exchanged. Either way the model's run state gets every
    worker's replica devices (`RunState.worker_devices`), which the
    decisions that depend on what a device is read (memory caps).

    Args:
        model: The `HeteroModel`.
        dataset: `fit`'s input (a `kh.data.HeteroDataset` adds its global
            batch, shares and shuffling).
        arguments: What `fit_arguments` took from `fit`'s keyword
            arguments.

    Raises:
        ValueError: Naming each setting that differs, the workers and
            their values.
    """
    strategy = model.distribute_strategy
    run = state.run_state(model)
    local = devices_lib.describe_replicas(strategy)
    if not _agreement.needs_exchange(strategy):
        run.worker_devices = [local]
        return
    record = {
        "devices": [d.to_dict() for d in local],
        "settings": fingerprint(model, dataset, arguments),
    }
    records = _agreement.exchange(strategy, record)
    _agreement.check_settings(records, "`fit`")
    run.worker_devices = [
        [devices_lib.DeviceDescription.from_dict(d) for d in r["devices"]]
        for r in records
    ]


def fingerprint(model, dataset, arguments):
    """What must match between the workers of a job, as plain values.

    Args:
        model: The `HeteroModel`.
        dataset: `fit`'s input.
        arguments: What `fit_arguments` returned.

    Returns:
        A dict `{setting: value}` of JSON values.
    """
    settings = model.hetero_settings
    values = {
        "keras": f"{_compat.FLAVOUR} {_compat.keras.__version__}",
        "tensorflow": tf.__version__,
        "compute dtypes": sorted(precision_lib.compute_dtypes(model)),
        "loss scaling": state.run_state(model).loss_scale is not None,
        "steps_per_execution": _compat.steps_per_execution(model),
        **{
            name: _plain(getattr(settings, name)) for name in options.SERIALISED
        },
        "communication": _communication(settings.communication),
        **arguments,
        "optimizer": _optimizer(model.optimizer),
        "weights": _weights(model),
    }
    if isinstance(dataset, HeteroDataset):
        values.update(
            {
                "global batch size": dataset.global_batch_size,
                "examples": _spec(dataset.example_spec),
                "shares": [round(float(s), 6) for s in dataset.shares],
                "shuffle": _plain(dataset.shuffling),
                "shuffle seed": dataset.seed,
                "examples per epoch": dataset.num_examples,
            }
        )
    return values


def _plain(value):
    """`value` as JSON values (a `LowCommunication` as its config)."""
    if hasattr(value, "get_config"):
        value = value.get_config()
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _spec(spec):
    """Each example tensor's shape and dtype (a different feature count
    gives a lazily built model other weight shapes)."""
    if spec is None:
        return None
    return [
        f"{tf.as_dtype(part.dtype).name}{tuple(part.shape)}"
        for part in tf.nest.flatten(spec)
    ]


def _communication(communication):
    if communication is None:
        return None
    return {
        "implementation": str(communication.implementation),
        "bytes_per_pack": communication.bytes_per_pack,
    }


def _optimizer(optimizer):
    """The optimizer's class and a digest of its config (learning rate,
    momentum, ...: a difference trains the workers' copies apart)."""
    if optimizer is None:
        return None
    try:
        config = _plain(optimizer.get_config())
    except (NotImplementedError, TypeError, ValueError):
        config = None
    return f"{type(optimizer).__name__} (config {_agreement.digest(config)})"


def _weights(model):
    """The count, size and a digest of the shapes and dtypes of the model's
    weights in order, or None before the model is built."""
    if not model.built:
        return None
    shapes = [
        [list(weight.shape), tf.as_dtype(weight.dtype).name]
        for weight in model.weights
    ]
    parameters = sum(
        int(tf.TensorShape(shape).num_elements() or 0) for shape, _ in shapes
    )
    return (
        f"{len(shapes)} weights, {parameters} parameters "
        f"(shapes and dtypes {_agreement.digest(shapes)})"
    )
