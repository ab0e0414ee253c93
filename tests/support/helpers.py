"""Shared test fixtures: data, a small model, and the single-device reference.

Also imported by worker processes (keep it free of pytest).
"""

import contextlib
import logging
import os
import subprocess
import tempfile

import numpy as np
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _distribute
from keras_hetero._compat import keras
from keras_hetero.training import state

FEATURES = 5
GLOBAL_BATCH = 16
ROWS = 72  # 4.5 global batches: the last one is partial.


def arrays(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype("float32")
    weights = rng.uniform(0.2, 2.0, size=(rows,)).astype("float32")
    ids = np.arange(rows, dtype="int64")
    return x, y, weights, ids


def examples(sample_weights=False, rows=ROWS):
    x, y, weights, _ = arrays(rows)
    if sample_weights:
        return tf.data.Dataset.from_tensor_slices((x, y, weights))
    return tf.data.Dataset.from_tensor_slices((x, y))


def layers(regularizer=False):
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(
        4,
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(0.01) if regularizer else None,
    )(inputs)
    return inputs, keras.layers.Dense(1)(hidden)


def seeded_layers():
    """Two Dense layers, not built; seeded initialisers give the same
    weights whenever they build."""
    return [
        keras.layers.Dense(
            4,
            activation="tanh",
            kernel_initializer=keras.initializers.GlorotUniform(seed=1),
        ),
        keras.layers.Dense(
            1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)
        ),
    ]


def compile_model(model, steps_per_execution=1):
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


def initial_weights(regularizer=False):
    keras.utils.set_random_seed(7)
    return keras.Model(*layers(regularizer)).get_weights()


def reference_fit(epochs=2, sample_weights=False, regularizer=False):
    """Single-device training on the concatenated global batches."""
    model = compile_model(keras.Model(*layers(regularizer)))
    model.set_weights(initial_weights(regularizer))
    history = model.fit(
        examples(sample_weights).batch(GLOBAL_BATCH), epochs=epochs, verbose=0
    )
    return model, history.history


def hetero_model(regularizer=False, steps_per_execution=1, **kwargs):
    """A compiled HeteroModel with the reference's initial weights.

    Call inside the strategy scope.
    """
    model = compile_model(
        kh.HeteroModel(*layers(regularizer), **kwargs), steps_per_execution
    )
    model.set_weights(initial_weights(regularizer))
    return model


def assert_weights_close(actual, expected, rtol=1e-5, atol=1e-6):
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def mirrored(devices):
    """See `kh.testing.mirrored`."""
    return kh.testing.mirrored(devices)


def id_model(
    seen,
    seconds_per_row,
    steps_per_execution=1,
    augment=(),
    momentum=0.0,
    **kwargs,
):
    """A HeteroModel over {"x", "id"} inputs that records the ids it trains
    on in `seen` (a list or a `kh.testing.Ledger`); build inside the
    strategy scope. `augment`: layers applied to x
    first (random augmentation); `kwargs`: HeteroModel's."""
    x_in = keras.Input((FEATURES,), name="x")
    id_in = keras.Input((), dtype="int64", name="id")
    features = x_in
    for layer in augment:
        features = layer(features)
    slow = kh.testing.SimulatedSpeed(seconds_per_row)(features)
    recorded = kh.testing.RecordIds(seen)([slow, id_in])
    model = kh.HeteroModel(
        {"x": x_in, "id": id_in}, keras.layers.Dense(1)(recorded), **kwargs
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=momentum),
        loss="mse",
        steps_per_execution=steps_per_execution,
    )
    return model


def without_random_access(examples):
    """`examples` through a `filter`, which has no random access (tf.data's
    global shuffle refuses it): `shard(shuffle=True)` then takes a buffer
    of the whole pass."""
    return examples.filter(lambda *example: True).apply(
        tf.data.experimental.assert_cardinality(int(examples.cardinality()))
    )


def id_examples(rows):
    x, y, _, ids = arrays(rows)
    return tf.data.Dataset.from_tensor_slices(({"x": x, "id": ids}, y))


class PoisonGradient(keras.layers.Layer):
    """Identity whose gradient becomes inf on replica `replica` while
    `armed[0]` is true (test only)."""

    def __init__(self, replica, armed, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "armed", armed)
        self.replica = replica

    def call(self, x):
        replica = _distribute.replica_id()

        def factor(_):
            poisoned = self.armed[0] and replica == self.replica
            return np.float32(np.inf if poisoned else 1.0)

        scale = tf.numpy_function(factor, [tf.constant(0)], tf.float32)
        scale.set_shape([])

        @tf.custom_gradient
        def identity(t):
            def grad(dy):
                return dy * tf.cast(scale, dy.dtype)

            return tf.identity(t), grad

        return identity(x)


def poisoned_model(armed, **kwargs):
    """A float16 HeteroModel whose replica 1 gets an inf gradient while
    `armed[0]`; build in the strategy scope under mixed_float16. `kwargs`
    go to HeteroModel. Seeded initialisers: with whatever weights an
    earlier test's random state left, the step after the poisoned one
    could overflow on its own (and be skipped) in one test order only."""
    inputs = keras.Input((FEATURES,))
    first, _ = seeded_layers()
    hidden = PoisonGradient(1, armed)(first(inputs))
    outputs = keras.layers.Dense(
        1,
        dtype="float32",
        kernel_initializer=keras.initializers.GlorotUniform(seed=2),
    )(hidden)
    model = kh.HeteroModel(inputs, outputs, precision="mixed_float16", **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse"
    )
    return model


def replica_state(strategy, model):
    """Every local replica's copy of every weight and optimizer variable."""
    _, variables = kh._compat.checkpoint_variables(model)
    scale = state.run_state(model).loss_scale.variables
    variables = [v for v in variables if not any(v is s for s in scale)]
    return [
        np.array(v.numpy())
        for variable in variables
        for v in strategy.experimental_local_results(variable)
    ]


class Arm(keras.callbacks.Callback):
    """Arms the poison for step `at`; records state around it in `probe`."""

    def __init__(self, armed, at, probe):
        super().__init__()
        self.armed, self.at, self.probe = armed, at, probe
        self.step = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.step += 1
        self.armed[0] = self.step == self.at
        if self.step == self.at:
            self.probe["before"] = self.probe["snapshot"]()
            self.probe["scale_before"] = self.model.loss_scale

    def on_train_batch_end(self, batch, logs=None):
        if self.step == self.at:
            self.probe["after"] = self.probe["snapshot"]()
            self.probe["scale_after"] = self.model.loss_scale
        if self.step == self.at + 1:
            self.probe["next"] = self.probe["snapshot"]()


def slow_model(strategy, seconds_per_row):
    """A compiled HeteroModel whose replicas are SIMULATED slow
    (`kh.testing.SimulatedSpeed(seconds_per_row)`) before one Dense layer."""
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        slow = kh.testing.SimulatedSpeed(seconds_per_row)(inputs)
        model = kh.HeteroModel(inputs, keras.layers.Dense(1)(slow))
        model.compile(optimizer="sgd", loss="mse")
    return model


def import_error_without(package, module):
    """The ImportError message of `import module` in a fresh interpreter in
    which `package` cannot be imported (an optional extra not installed)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"sys.modules[{package!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    return done.stdout


class LogCount(logging.Handler):
    """Counts the log records whose message contains `text`."""

    def __init__(self, text):
        super().__init__(logging.WARNING)
        self.text, self.count = text, 0

    def emit(self, record):
        self.count += self.text in record.getMessage()


def tf_data_service(workers=2):
    """A tf.data service in this process on 127.0.0.1: `(dispatcher,
    service workers, the dispatcher's "grpc://127.0.0.1:port")`."""
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer()
    port = dispatcher.target.rsplit(":", 1)[1]
    address = f"127.0.0.1:{port}"
    servers = [
        service.WorkerServer(
            service.WorkerConfig(
                dispatcher_address=address,
                worker_address="127.0.0.1:%port%",
            )
        )
        for _ in range(workers)
    ]
    return dispatcher, servers, f"grpc://{address}"


@contextlib.contextmanager
def etcd_server(address="127.0.0.1"):
    """A throwaway single-member etcd on `address` (`.ci/etcd/start.sh`
    installs Debian's etcd-server if missing); yields its client URL and
    stops it, removing its data, afterwards."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    scripts = os.path.join(root, ".ci", "etcd")
    directory = tempfile.mkdtemp(prefix="keras-hetero-etcd-")
    port = kh.testing.free_ports(1, address)[0]
    result = subprocess.run(
        ["bash", os.path.join(scripts, "start.sh"), directory, address,
         str(port)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        yield result.stdout.strip()
    finally:
        subprocess.run(
            ["bash", os.path.join(scripts, "stop.sh"), directory], check=False
        )
