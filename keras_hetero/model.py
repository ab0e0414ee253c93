"""`kh.HeteroModel`: a `keras.Model` whose step is right for unequal replicas.

This module is the class, its settings and its Keras surface. What each
method does lives in `keras_hetero.training`: the step (`training.step`),
`fit` / `evaluate` / `predict` around Keras' own (`training.fitting`, and
`training.parameter_server` under ParameterServerStrategy), the settings
(`training.options.Settings`) and the run-time state (`training.state`,
`training.runtime`).
"""

from keras_hetero import _compat
from keras_hetero import _distribute
from keras_hetero._compat import keras
from keras_hetero.training import epochs
from keras_hetero.training import fitting
from keras_hetero.training import loop
from keras_hetero.training import options
from keras_hetero.training import runtime
from keras_hetero.training import state
from keras_hetero.training import step


class HeteroModel(_compat.TrainerOverrides, keras.Model):
    """A `keras.Model` that trains correctly on unequal replicas.

    Use it wherever you would use `keras.Model`: functional
    (`HeteroModel(inputs, outputs)`), from an existing functional or
    Sequential model (`HeteroModel.from_model(model)`, layers shared), or as
    a base class with your own `call`. `compile`, `fit`, `evaluate`,
    `predict`, `.keras` saving and `keras.saving.load_model` work as usual.

    Under any synchronous `tf.distribute` strategy each replica's loss is
    weighted by its rows, so the update equals single-device training on the
    concatenated global batch even when replicas get different numbers of
    rows (see `kh.data.shard`). Logged loss and metrics are global and
    sample-weighted. After each train batch `model.step_stats` holds every
    replica's rows and compute seconds.

    Args:
        *args: What `keras.Model` takes (e.g. `inputs, outputs`).
        precision: `None`, `"float32"`, `"mixed_float16"`,
            `"mixed_bfloat16"` or `"auto"` (see `kh.set_precision`, which
            sets the matching Keras policy; build the model after it). A
            named mixed policy is checked against the layers at `compile`.
            Whenever a layer computes in float16 the loss is scaled
            dynamically, and a step whose AGGREGATED gradient is not finite
            (an overflow on any replica or worker) is skipped everywhere,
            weights and optimizer state untouched. Defaults to `None`
            (follow the layers).
        gradient_compression: `None`, `"fp16"` or `"bf16"`: the gradients'
            dtype on the wire during the all-reduce only. Defaults to `None`.
        accumulation_steps: Micro-steps (train batches) per optimizer
            update. The update after `k` micro-steps equals one step on the
            union of their rows, weighted by rows even when the split of
            rows differs between micro-steps; `optimizer.iterations` counts
            updates. Partial sums carry over epoch ends; those left when
            `fit` returns are not applied. Defaults to `1`.
        pipeline_microbatches: Micro-batches per replica batch (GPipe).
            Each replica's rows are cut into this many contiguous pieces
            that go through the model one after another, so a model split
            across devices (`kh.layers.Placed`, `kh.placement`) keeps all
            its stages busy: stage k works on micro-batch i+1 while stage
            k+1 works on micro-batch i. The loss is the row-weighted mean of
            the pieces' means, so the update equals `1` micro-batch (layers
            that use batch statistics, such as BatchNormalization, see the
            micro-batches). Defaults to `1`.
        communication: A `tf.distribute.experimental.CommunicationOptions`
            passed to the gradient all-reduce. Defaults to `None`.
        global_clipnorm: Clip the AGGREGATED gradient to this global norm.
            Defaults to `None` (no clipping). With `low_communication`, each
            replica's own gradient.
        low_communication: A `kh.LowCommunication`: local steps with no
            gradient collective, a pseudo-gradient all-reduce every
            `sync_every` steps and an outer optimizer (DiLoCo-style, see
            docs/low-communication.md). Defaults to `None` (synchronous).
        bucket_bytes: Split the gradient all-reduce into buckets of about
            this many bytes (on the wire), issued last layers first, as
            PyTorch's DistributedDataParallel does: a bucket's all-reduce
            can run while the backward pass still computes the earlier
            layers' gradients. The telemetry and metrics ride in the last
            bucket; the update is the same. A model of at most
            `bucket_bytes` stays one collective. Measured on CPU workers
            (benchmarks/RESULTS.md, "Bucketed all-reduce"). Not with
            `low_communication` nor `communication.bytes_per_pack`.
            Defaults to `None` (one collective per step).
        **kwargs: What `keras.Model` takes.

    Raises:
        ValueError: For an unknown `precision` or `gradient_compression`,
            `accumulation_steps` or `pipeline_microbatches` below 1, a
            `global_clipnorm` that is not positive, a `bucket_bytes` that
            is not a positive integer or comes with `low_communication` or
            `communication.bytes_per_pack`, or `low_communication` with
            `accumulation_steps` or `gradient_compression`.
        TypeError: If `communication` is not `CommunicationOptions`, or
            `low_communication` not a `kh.LowCommunication`.

    Example:

    >>> inputs = keras.Input((4,))
    >>> outputs = keras.layers.Dense(1)(inputs)
    >>> model = HeteroModel(inputs, outputs)
    >>> model.compile(optimizer="sgd", loss="mse")

    The gradient all-reduce in buckets of 1 MiB, last layers first:

    >>> bucketed = HeteroModel(inputs, outputs, bucket_bytes=1 << 20)
    >>> bucketed.hetero_settings.bucket_bytes
    1048576
    """

    # How its `fit` and `evaluate` cross epoch boundaries (read by the
    # compat layer's epoch iterators; other models keep Keras' own).
    _kh_epochs = epochs

    def __new__(cls, *args, **kwargs):
        if cls is HeteroModel and _compat.functional_init_arguments(
            args, kwargs
        ):
            cls = _FunctionalHeteroModel
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        precision=None,
        gradient_compression=None,
        accumulation_steps=1,
        pipeline_microbatches=1,
        communication=None,
        global_clipnorm=None,
        low_communication=None,
        bucket_bytes=None,
        **kwargs,
    ):
        settings = options.Settings(
            precision=precision,
            gradient_compression=gradient_compression,
            accumulation_steps=accumulation_steps,
            pipeline_microbatches=pipeline_microbatches,
            communication=communication,
            global_clipnorm=global_clipnorm,
            low_communication=low_communication,
            bucket_bytes=bucket_bytes,
        )
        if _compat.functional_init_arguments(args, kwargs):
            if not isinstance(self, _compat.Functional):
                # A subclass calling `super().__init__(inputs, outputs)`.
                _compat.derive_from_functional(
                    type(self), HeteroModel, _FunctionalHeteroModel
                )
            _compat.init_functional(self, args, kwargs)
        else:
            super().__init__(*args, **kwargs)
        state.attach(self, settings)
        _compat.reduce_logs_to_first_replica(
            self,
            type(self).train_step is HeteroModel.train_step
            and type(self).test_step is HeteroModel.test_step,
        )

    @classmethod
    def from_model(cls, model, **kwargs):
        """A HeteroModel that trains the layers of an existing Keras model.

        A functional model, or a Sequential model that knows its input
        shape, gives a functional HeteroModel over the same layers (and so
        the same weights). Any other model (a Sequential without
        `keras.Input`, a subclassed model) is wrapped: the HeteroModel calls
        it, and it builds on the first data as it would alone. A compiled
        `model` passes its compile settings on (the same optimizer object,
        so its state carries over).

        Args:
            model: A `keras.Model`.
            **kwargs: HeteroModel arguments, e.g. `gradient_compression`.

        Returns:
            A `HeteroModel`.

        Raises:
            TypeError: If `model` is not a `keras.Model`.

        Example:

        >>> base = keras.Sequential([keras.layers.Dense(2)])
        >>> base.compile(optimizer="sgd", loss="mse")
        >>> model = HeteroModel.from_model(base)
        >>> model.fit(np.zeros((4, 3)), np.zeros((4, 2)), verbose=0)
        ... # doctest: +ELLIPSIS
        <...History object at ...>
        """
        if not isinstance(model, keras.Model):
            raise TypeError(
                "Invalid value for argument `model`. Received: "
                f"model={model!r} of type {type(model).__name__}. Expected a "
                "`keras.Model` (functional, Sequential or subclassed)."
            )
        kwargs.setdefault("name", model.name)
        inputs, outputs = _compat.symbolic_inputs_outputs(model)
        if inputs is not None:
            hetero = HeteroModel(inputs=inputs, outputs=outputs, **kwargs)
        else:
            hetero = _WrappedModel(model, **kwargs)
        arguments = _compat.compile_arguments(model)
        if arguments is not None:
            hetero.compile(**arguments)
        return hetero

    @property
    def hetero_settings(self):
        """The model's keras-hetero settings (`HeteroModel`'s keyword
        arguments), read-only: an immutable object with one attribute per
        argument, e.g. `model.hetero_settings.accumulation_steps`."""
        return state.settings(self)

    @property
    def step_stats(self):
        """`kh.StepStats` of the last executed train step(s), or None.

        None before the first train step. Under ParameterServerStrategy one
        entry per worker (see docs/strategies.md).
        """
        run = state.run_state(self)
        if run is None or run.telemetry is None:
            return None
        return run.telemetry.step_stats()

    @property
    def loss_scale(self):
        """The current dynamic loss scale (float), or None without float16.

        Set at `compile` when any layer computes in float16: the loss is
        multiplied by it, and a step whose aggregated gradient is not finite
        on any replica is skipped everywhere and halves it.
        """
        run = state.run_state(self)
        scale = None if run is None else run.loss_scale
        return None if scale is None else float(scale.scale.numpy())

    # --- steps (training.step) ---------------------------------------------

    def train_step(self, data):
        return step.train_step(self, data)

    def test_step(self, data):
        return step.test_step(self, data)

    def make_train_function(self, force=False):
        return fitting.make_train_function(
            self, super().make_train_function, force
        )

    def _hetero_make_function(self, step_function):
        # Called by `_compat.Keras3TrainerOverrides` (Keras 3).
        return loop.make_function(self, step_function)

    def _hetero_variables(self):
        # Called by `_compat.saving`: the state a checkpoint must hold.
        return runtime.own_variables(self)

    # --- compile, fit, evaluate, predict (training.fitting) ---------------

    def compile(self, *args, **kwargs):
        fitting.compile_model(self, super().compile, args, kwargs)

    def fit(self, x=None, y=None, *args, **kwargs):
        return fitting.fit(self, super().fit, x, y, args, kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        return fitting.evaluate(self, super().evaluate, x, y, args, kwargs)

    def predict(self, x, *args, **kwargs):
        return fitting.predict(self, super().predict, x, args, kwargs)

    def train_on_batch(self, *args, **kwargs):
        # tf-keras with steps_per_execution > 1 asked its one batch for a
        # second (`_compat.one_batch_per_call`).
        with _compat.one_batch_per_call(self, "train"):
            return super().train_on_batch(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        with _compat.one_batch_per_call(self, "test"):
            return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, x):
        with _compat.one_batch_per_call(self, "predict"):
            outputs = super().predict_on_batch(x)
        if _distribute.num_workers(self.distribute_strategy) > 1:
            # Keras 3 gathers every worker's outputs, each of its own batch:
            # which rows are this worker's is not known here; as Keras.
            return outputs
        # Keras 3 with several replicas: each predicted the whole batch.
        return _compat.one_batch_outputs(self, x, outputs)

    # --- saving (training.runtime) ----------------------------------------

    def save(self, filepath, *args, **kwargs):
        runtime.warn_unsaved_sums(self, filepath)
        return super().save(filepath, *args, **kwargs)

    def save_own_variables(self, store):
        """Saves the model's own variables and the partial gradient sums.

        With `accumulation_steps > 1` the sums of micro-steps that have not
        made an update yet go into the file too (they are not Keras
        variables), so a model saved mid-accumulation and loaded goes on
        exactly as the one that was saved; so does the low-communication
        state (the anchor and the outer optimizer's state).

        Args:
            store: The dict-like store Keras saves this model's state in.
        """
        super().save_own_variables(store)
        runtime.save_own_state(self, store)

    def load_own_variables(self, store):
        """Loads what `save_own_variables` saved.

        Args:
            store: The dict-like store Keras loads this model's state from.
        """
        super().load_own_variables(runtime.keras_entries(store))
        runtime.load_own_state(self, store)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A HeteroModel from `get_config()`'s dict, with its settings.

        `HeteroModel.from_config` of a functional model's config gives the
        functional HeteroModel with the saved settings (tf-keras' own
        `from_config` rebuilt it from inputs and outputs alone, dropping
        them). Other configs go to Keras' `from_config`.

        Args:
            config: A dict from `get_config()`.
            custom_objects: As in `keras.Model.from_config`.

        Returns:
            A HeteroModel.
        """
        functional_keys = ("layers", "input_layers", "output_layers")
        if cls is HeteroModel and all(key in config for key in functional_keys):
            return _FunctionalHeteroModel.from_config(
                config, custom_objects=custom_objects
            )
        return super().from_config(config, custom_objects=custom_objects)

    def compile_from_config(self, config):
        """Compiles the model from `get_compile_config()` (used on load).

        Keras' own version skips compiling a model whose class overrides
        `compile`, as HeteroModel does (it adds to Keras' `compile`, so the
        saved arguments are the user's), which left loaded models
        uncompiled.

        Args:
            config: The dict `get_compile_config()` returned at save time.
        """
        if type(self).compile is not HeteroModel.compile:
            runtime.warn_custom_compile()  # as Keras does: the user's
            return
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            _compat.build_optimizer(self)

    # No `get_config` here: a subclass gets what Keras gives a subclass of
    # `keras.Model` (its own `__init__` arguments, captured when it is
    # made), and HeteroModel's settings are not arguments of its `__init__`
    # unless it passes them on, when the capture has them. The functional
    # and wrapping classes below add the settings to their configs.


@_compat.register_serializable("HeteroModel")
class _FunctionalHeteroModel(
    options.SettingsInConfig, HeteroModel, _compat.Functional
):
    """The class of functional HeteroModels (`HeteroModel(inputs, outputs)`)."""

    def get_config(self):
        config = _compat.functional_config(
            self, super(HeteroModel, self).get_config
        )
        config.update(self.hetero_settings.config())
        return config


# Keras names a model's class in configs, summaries and legacy `.h5` files by
# `__name__`; `__qualname__` stays the real one, so pickle can find it.
_FunctionalHeteroModel.__name__ = "HeteroModel"
_compat.register_plain_name("HeteroModel", _FunctionalHeteroModel)


@_compat.register_serializable("WrappedModel")
class _WrappedModel(HeteroModel):
    """A HeteroModel that calls a model with no symbolic inputs.

    Made by `HeteroModel.from_model` for a Sequential model without
    `keras.Input` or a subclassed model: it builds with its first data.
    """

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.wrapped = model
        self._optimizer_shared = False

    def call(self, inputs, training=None, mask=None):
        if mask is None:
            return self.wrapped(inputs, training=training)
        return self.wrapped(inputs, training=training, mask=mask)

    def get_config(self):
        config = {
            **super().get_config(),
            **self.hetero_settings.config(),
            "model": keras.saving.serialize_keras_object(self.wrapped),
        }
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and (
            getattr(self.wrapped, "optimizer", None) is optimizer
        ):
            config["shares_optimizer"] = True
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        shared = config.pop("shares_optimizer", False)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        wrapper = cls(model, **config)
        wrapper._optimizer_shared = shared
        return wrapper

    def compile_from_config(self, config):
        # `from_model` of a compiled model shares its optimizer, so Keras
        # saves the optimizer's variables once, under the wrapped model (its
        # layers come first in the walk). Loading gives the wrapped model an
        # optimizer of its own from its compile config, which would take
        # them, leaving this model's new optimizer without its state.
        super().compile_from_config(config)
        if self._optimizer_shared and self.optimizer is not None:
            self.wrapped.optimizer = self.optimizer
