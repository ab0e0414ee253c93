"""HeteroModel's settings: what `HeteroModel(...)` takes besides Keras'
arguments, defined once (`Settings`): their defaults, their checks and how
they ride along in a model's config. What a model makes while it runs
(telemetry, loss scale, ...) is `training.state.RunState`, not here."""

import dataclasses

import tensorflow as tf

from keras_hetero import precision as precision_lib
from keras_hetero._checks import check_choice
from keras_hetero._checks import check_int
from keras_hetero._checks import check_positive
from keras_hetero.training import aggregation
from keras_hetero.training import low_communication as low_communication_lib
from keras_hetero.training import state

# `tf.distribute.experimental.CommunicationOptions` is a factory; this is
# the class of what it returns.
_COMMUNICATION_OPTIONS = type(tf.distribute.experimental.CommunicationOptions())


@dataclasses.dataclass(frozen=True)
class Settings:
    """A HeteroModel's settings, checked when made; immutable.

    The fields are `kh.HeteroModel`'s keyword arguments (documented
    there), with their defaults. `HeteroSequential` takes the same names,
    a model's config carries all of them but `communication` (a run-time
    choice, not serialisable), and `HeteroModel.hetero_settings` returns
    this object.

    Raises:
        ValueError: For an unknown `precision` or `gradient_compression`,
            `accumulation_steps` or `pipeline_microbatches` below 1, a
            `global_clipnorm` that is not positive, a `bucket_bytes` that
            is not a positive integer or comes with `low_communication` or
            `communication.bytes_per_pack`, or `low_communication` with
            `accumulation_steps` or `gradient_compression`.
        TypeError: If `communication` is not `CommunicationOptions`, or
            `low_communication` not a `kh.LowCommunication` (or its config).

    Example:

    >>> settings = Settings(accumulation_steps=2)
    >>> settings.config()["accumulation_steps"]
    2
    """

    precision: str | None = None
    gradient_compression: str | None = None
    accumulation_steps: int = 1
    pipeline_microbatches: int = 1
    communication: object = None
    global_clipnorm: float | None = None
    low_communication: object = None
    bucket_bytes: int | None = None

    def __post_init__(self):
        if isinstance(self.low_communication, dict):  # from a config
            object.__setattr__(
                self,
                "low_communication",
                low_communication_lib.LowCommunication.from_config(
                    self.low_communication
                ),
            )
        _check(self)

    def config(self):
        """The serialisable settings, as a model's config holds them."""
        config = {name: getattr(self, name) for name in SERIALISED}
        if self.low_communication is not None:
            config["low_communication"] = self.low_communication.get_config()
        return config


# The settings' names, in `HeteroModel`'s signature order.
NAMES = tuple(field.name for field in dataclasses.fields(Settings))
# CommunicationOptions is not serialisable; it is a run-time choice.
SERIALISED = tuple(name for name in NAMES if name != "communication")


def pop_settings(mapping):
    """Takes the settings' names out of `mapping` (a dict of keyword
    arguments or a config) and returns them as a dict."""
    return {name: mapping.pop(name) for name in NAMES if name in mapping}


def _check(settings):
    precision_lib.check_precision(settings.precision)
    check_choice(
        "gradient_compression",
        settings.gradient_compression,
        aggregation.COMPRESSIONS,
    )
    check_int("accumulation_steps", settings.accumulation_steps)
    check_int("pipeline_microbatches", settings.pipeline_microbatches)
    communication = settings.communication
    if communication is not None and not isinstance(
        communication, _COMMUNICATION_OPTIONS
    ):
        raise TypeError(
            "Invalid value for argument `communication`. Received: "
            f"communication={communication!r}. Expected a "
            "`tf.distribute.experimental.CommunicationOptions` or None."
        )
    if settings.global_clipnorm is not None:
        check_positive(
            "global_clipnorm",
            settings.global_clipnorm,
            "a positive number or None",
        )
    _check_bucket_bytes(settings)
    low_communication = settings.low_communication
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
    for name, default in (
        ("accumulation_steps", 1),
        ("gradient_compression", None),
    ):
        value = getattr(settings, name)
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


def _check_bucket_bytes(settings):
    bucket_bytes = settings.bucket_bytes
    if bucket_bytes is None:
        return
    check_int(
        "bucket_bytes",
        bucket_bytes,
        expected="a positive integer (bytes of gradients per all-reduce) "
        "or None",
    )
    if settings.low_communication is not None:
        raise ValueError(
            f"`low_communication` and `bucket_bytes={bucket_bytes!r}` do not "
            "combine: between synchronisations there is no gradient "
            "collective to split. Leave `bucket_bytes=None`."
        )
    bytes_per_pack = getattr(settings.communication, "bytes_per_pack", 0)
    if bytes_per_pack:
        raise ValueError(
            f"`bucket_bytes={bucket_bytes!r}` and `communication` with "
            f"`bytes_per_pack={bytes_per_pack!r}` both split the gradient "
            "all-reduce. Set one of them (`bucket_bytes` keeps the "
            "telemetry in the last bucket, so the others need not wait for "
            "the whole backward pass)."
        )


class SettingsInConfig:
    """Mixin for the HeteroModel classes whose config carries the settings
    (functional, Sequential): `from_config` takes them out before Keras'
    own `from_config` and gives them to the model it made."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        settings = Settings(**pop_settings(config))
        model = super().from_config(config, custom_objects=custom_objects)
        state.set_settings(model, settings)
        return model
