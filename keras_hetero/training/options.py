"""HeteroModel's settings: what `HeteroModel(...)` takes besides Keras'
arguments, their checks, and how they ride along in a model's config."""

import tensorflow as tf

from keras_hetero import precision as precision_lib
from keras_hetero._checks import check_int
from keras_hetero.training import aggregation
from keras_hetero.training import low_communication as low_communication_lib

# `tf.distribute.experimental.CommunicationOptions` is a factory; this is
# the class of what it returns.
_COMMUNICATION_OPTIONS = type(tf.distribute.experimental.CommunicationOptions())


def split_settings(config):
    """`(config without HeteroModel's settings, those settings)`."""
    config = dict(config)
    settings = {
        name: config.pop(name) for name in Settings.SERIALISED if name in config
    }
    return config, settings


def set_settings(model, settings):
    """Gives a model made by Keras' `from_config` the saved settings."""
    settings = {**Settings.DEFAULTS, **settings}
    settings["low_communication"] = from_config_value(
        settings["low_communication"]
    )
    check_options(**settings)
    model._hetero = Settings(**settings)


def from_config_value(low_communication):
    """A `LowCommunication` from its config dict (as a model config holds
    it); anything else unchanged."""
    if isinstance(low_communication, dict):
        return low_communication_lib.LowCommunication.from_config(
            low_communication
        )
    return low_communication


class Settings:
    """A HeteroModel's settings and run-time objects (telemetry, loss scale,
    accumulator, parameter-server runner), kept out of Keras tracking."""

    DEFAULTS = {
        "precision": None,
        "gradient_compression": None,
        "accumulation_steps": 1,
        "pipeline_microbatches": 1,
        "communication": None,
        "global_clipnorm": None,
        "low_communication": None,
    }
    # CommunicationOptions is not serialisable; it is a run-time choice.
    SERIALISED = tuple(name for name in DEFAULTS if name != "communication")

    def __init__(self, **settings):
        self.settings = settings
        for name, value in settings.items():
            setattr(self, name, value)
        self.telemetry = None
        self.loss_scale = None
        self.accumulator = None
        self.parameter_server = None
        self.local_training = None

    def config(self):
        config = {name: self.settings[name] for name in self.SERIALISED}
        if config["low_communication"] is not None:
            config["low_communication"] = config[
                "low_communication"
            ].get_config()
        return config


def check_options(
    precision,
    gradient_compression,
    accumulation_steps,
    pipeline_microbatches,
    communication,
    global_clipnorm,
    low_communication=None,
):
    precision_lib.check_precision(precision)
    if gradient_compression not in (None, *aggregation.WIRE_DTYPES):
        raise ValueError(
            "Invalid value for argument `gradient_compression`. Received: "
            f"gradient_compression={gradient_compression!r}. Expected None, "
            '"fp16" or "bf16".'
        )
    for name, value in (
        ("accumulation_steps", accumulation_steps),
        ("pipeline_microbatches", pipeline_microbatches),
    ):
        check_int(name, value)
    if communication is not None and not isinstance(
        communication, _COMMUNICATION_OPTIONS
    ):
        raise TypeError(
            "Invalid value for argument `communication`. Received: "
            f"communication={communication!r}. Expected a "
            "`tf.distribute.experimental.CommunicationOptions` or None."
        )
    if global_clipnorm is not None and not (
        isinstance(global_clipnorm, (int, float))
        and not isinstance(global_clipnorm, bool)
        and global_clipnorm > 0
    ):
        raise ValueError(
            "Invalid value for argument `global_clipnorm`. Received: "
            f"global_clipnorm={global_clipnorm!r}. Expected a positive number "
            "or None."
        )
    if low_communication is None:
        return
    if not isinstance(
        low_communication, low_communication_lib.LowCommunication
    ):
        raise TypeError(
            "Invalid value for argument `low_communication`. Received: "
            f"low_communication={low_communication!r}. Expected a "
            "`kh.LowCommunication` or None."
        )
    for name, value, default in (
        ("accumulation_steps", accumulation_steps, 1),
        ("gradient_compression", gradient_compression, None),
    ):
        if value != default:
            raise ValueError(
                f"`low_communication` and `{name}={value!r}` do not combine: "
                "between synchronisations there is no gradient collective to "
                f"{'accumulate for' if default == 1 else 'compress'}. "
                + (
                    "Use `LowCommunication(compression=...)` for the "
                    "pseudo-gradient."
                    if default is None
                    else "Raise `sync_every` instead."
                )
            )


class SettingsInConfig:
    """Mixin for the HeteroModel classes whose config carries the settings
    (functional, Sequential): `from_config` takes them out before Keras'
    own `from_config` and gives them to the model it made."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config, settings = split_settings(config)
        model = super().from_config(config, custom_objects=custom_objects)
        set_settings(model, settings)
        return model
