"""What a HeteroModel holds besides Keras' own state, and the package's one
way to reach it.

A model has its `Settings` (immutable, `training.options`) and a `RunState`:
the objects it makes while it runs (telemetry, the dynamic loss scale, the
gradient accumulator, the low-communication state, the parameter-server
runner), each created once, when first needed (`training.runtime`). Modules
of the package read both through the functions here, never through the
model's attributes. This module imports nothing of the package, so every
training module may use it.
"""

# Where a model keeps them (kept out of Keras' tracking: plain objects).
_SETTINGS = "_hetero_settings"
_RUN_STATE = "_hetero_run_state"


class RunState:
    """The run-time objects of one HeteroModel, None until made.

    Attributes:
        telemetry: The `Telemetry` (or the parameter-server runner's) that
            gathers every replica's rows and seconds.
        loss_scale: The `DynamicLossScale` when a layer computes in
            float16 (set at `compile`).
        accumulator: The `GradientAccumulator` with `accumulation_steps >
            1`.
        local_training: The `LocalTraining` state of low-communication
            training.
        parameter_server: The `ParameterServerRunner` under
            ParameterServerStrategy.
        worker_devices: One list of `keras_hetero.devices.DeviceDescription`
            per worker (by global worker index) of its replica devices, as
            the workers exchanged them at the start of the last `fit`.
        clock_check: The `ClockCheck` the callbacks of this `fit` share
            (`clock_check.shared`).
    """

    def __init__(self):
        self.telemetry = None
        self.loss_scale = None
        self.accumulator = None
        self.local_training = None
        self.parameter_server = None
        self.worker_devices = None
        self.clock_check = None


def attach(model, settings):
    """Gives a new model its settings and an empty run state."""
    setattr(model, _SETTINGS, settings)
    setattr(model, _RUN_STATE, RunState())


def settings(model):
    """The model's `Settings`."""
    return model.__dict__[_SETTINGS]


def set_settings(model, new_settings):
    """Replaces the settings of a model that has not run yet (a model made
    by Keras' `from_config`, which passed Keras' arguments only)."""
    setattr(model, _SETTINGS, new_settings)


def run_state(model):
    """The model's `RunState`, or None while it is being constructed."""
    return model.__dict__.get(_RUN_STATE)
