"""What a checkpoint's `state.json` holds beside the tensors: where
training stands, what the input and the job were, and the companion
callbacks' states (read back by `resume`)."""

import dataclasses
import json
import time

import numpy as np

from keras_hetero import _compat
from keras_hetero import _distribute


def state(model, dataset, *, position, data_pass, callbacks, names, variables):
    """The state record of a checkpoint of `model` trained on `dataset`.

    Args:
        model: The model saved.
        dataset: Its `HeteroDataset` (or parameter-server input).
        position: `(global step, epoch, step in epoch, examples in epoch)`
            of the next step to train.
        data_pass: The input pass that trains that epoch, or None.
        callbacks: The `HeteroCallback`s whose `get_state()` is saved too.
        names: The names of the saved variables.
        variables: The saved variables (for their shapes).

    Returns:
        A dict of plain JSON data.
    """
    global_step, epoch, step_in_epoch, examples = position
    return {
        "global_step": global_step,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "examples_in_epoch": examples,
        "learning_rate": _learning_rate(model.optimizer),
        "global_batch_size": dataset.global_batch_size,
        "num_replicas": dataset.num_replicas,
        "num_workers": _distribute.num_workers(model.distribute_strategy),
        "shares": [float(s) for s in dataset.shares],
        "shuffle_seed": getattr(dataset, "seed", None),
        "shuffle_mechanism": getattr(dataset, "shuffle_mechanism", None),
        "data_pass": data_pass,
        "input_state": _input_state(dataset, data_pass, examples),
        "callbacks": {
            c.checkpoint_key: _plain(saved)
            for c, saved in ((c, c.get_state()) for c in callbacks)
            if saved is not None
        },
        "variables": names,
        "shapes": [list(v.shape) for v in variables],
        "flavour": _compat.FLAVOUR,
        "time": time.time(),
    }


def _input_state(dataset, data_pass, examples):
    """What the dataset needs to resume mid-pass besides the example count
    (the block queue under `reads="own"`), or None."""
    input_state = getattr(dataset, "input_state", None)
    if input_state is None:
        return None
    state = input_state(data_pass, examples)
    if state is None and getattr(dataset, "reads", "all") == "own" and examples:
        raise RuntimeError(
            f"The block queue's state after {examples} examples of pass "
            f"{data_pass} is no longer kept; the checkpoint cannot be "
            "written exactly."
        )
    return state


def _learning_rate(optimizer):
    """The optimizer's learning rate as a float, or None for a schedule."""
    if optimizer is None or _compat.has_learning_rate_schedule(optimizer):
        return None
    rate = optimizer.learning_rate
    try:
        return float(rate.numpy() if hasattr(rate, "numpy") else rate)
    except (TypeError, ValueError):
        return None


def _plain(value):
    return json.loads(json.dumps(value, default=_to_builtin))


def _to_builtin(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")
