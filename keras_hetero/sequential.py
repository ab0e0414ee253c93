"""`kh.HeteroSequential`: a `keras.Sequential` trained by HeteroModel's step."""

import inspect

from keras_hetero import _compat
from keras_hetero import model as model_lib
from keras_hetero._compat import keras
from keras_hetero.training import options

# The positional arguments of the flavour's `Sequential` (Keras 3:
# `layers, trainable, name`; tf-keras: `layers, name`).
_SEQUENTIAL_SIGNATURE = inspect.signature(keras.Sequential.__init__)


@_compat.register_serializable("HeteroSequential")
class HeteroSequential(
    options.SettingsInConfig, model_lib.HeteroModel, keras.Sequential
):
    """A `keras.Sequential` that trains correctly on unequal replicas.

    The one-line swap for `keras.Sequential`: `add`, `pop`, a model built
    lazily on its first data or from a `keras.Input`, `get_config` /
    `from_config`, `.keras` (and legacy `.h5`) saving and `pickle` work as
    in Keras, and the model trains with `kh.HeteroModel`'s step: under any
    `tf.distribute` strategy each replica's loss is weighted by its rows,
    so the update equals single-device training on the concatenated global
    batch even for unequal shares (see `kh.data.shard`). It is a
    `kh.HeteroModel` and a `keras.Sequential`.

    Args:
        layers: The layers, in order, as `keras.Sequential` takes them.
            Defaults to `None` (none yet; `add` them).
        *args: The rest of `keras.Sequential`'s arguments (`trainable`,
            `name` on Keras 3; `name` on tf-keras).
        **kwargs: `keras.Sequential`'s keyword arguments (`name`, ...) and
            `kh.HeteroModel`'s settings (`precision`,
            `gradient_compression`, `accumulation_steps`,
            `pipeline_microbatches`, `communication`, `global_clipnorm`,
            `low_communication`, `bucket_bytes`).

    Raises:
        ValueError: For an invalid HeteroModel setting (see
            `kh.HeteroModel`).
        TypeError: For arguments `keras.Sequential` does not take.

    Example:

    >>> model = HeteroSequential(
    ...     [keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)],
    ...     gradient_compression="bf16",
    ... )
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> model.fit(np.zeros((8, 3)), np.zeros((8, 1)), verbose=0)
    ... # doctest: +ELLIPSIS
    <...History object at ...>
    """

    def __init__(self, layers=None, *args, **kwargs):
        settings = options.pop_settings(kwargs)
        # By name: HeteroModel would take two positional arguments for the
        # functional `(inputs, outputs)`.
        bound = _SEQUENTIAL_SIGNATURE.bind(None, layers, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(_SEQUENTIAL_SIGNATURE.parameters)))
        super().__init__(**arguments, **settings)

    def get_config(self):
        # Sequential's config and HeteroModel's settings (a HeteroModel
        # subclass gets Keras' own config only; the settings are ours).
        return {**super().get_config(), **self.hetero_settings.config()}


# Legacy `.h5` files name the class by its bare name.
_compat.register_plain_name("HeteroSequential", HeteroSequential)
