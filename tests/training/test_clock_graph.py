"""The per-replica clock waits for the DEVICE to finish, by construction.

CI has no GPU, so these tests read the traced step's graph with the replica
placed on a GPU device string (tracing places nothing; nothing runs): the
end reading must take a data input that crosses from the device to the host
CPU (a device-to-host copy completes only after the device's earlier
kernels, `telemetry.device_token`), one float32 element per device made
after every gradient on it (a data or control edge from each), and never
an int32 tensor (TensorFlow keeps those in host memory on a GPU device, and
hands them over with no wait for the device).
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.training import telemetry

TASK = "/job:localhost/replica:0/task:0"
GPU = f"{TASK}/device:GPU:0"
HOST = f"{TASK}/device:CPU:0"


def _model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4)(inputs)
    model = kh.HeteroModel(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    # One real step on the CPU builds the optimizer and the telemetry.
    model.fit(
        np.ones((8, 3), np.float32),
        np.ones((8, 1), np.float32),
        batch_size=8,
        verbose=0,
    )
    return model


def _traced_step(model, device, monkeypatch):
    """The train step traced with the replica on `device`; returns the
    clock readings it made, as `(dependencies, reading)` pairs."""
    readings = []
    original = telemetry.clock

    def recording_clock(dependencies, enabled=True):
        reading = original(dependencies, enabled)
        readings.append((dependencies, reading))
        return reading

    monkeypatch.setattr(telemetry, "clock", recording_clock)

    def step(data):
        with tf.device(device):  # as a strategy places a replica's step
            return model.train_step(data)

    spec = (tf.TensorSpec([None, 3]), tf.TensorSpec([None, 1]))
    tf.function(step).get_concrete_function(spec)
    return readings


def _data_ancestors(op, follow):
    """Ops reaching `op` by data edges only, walking through the ops for
    which `follow(op)` holds; returns (walked ops, first ops not followed)."""
    walked, stopped, stack = set(), set(), [op]
    while stack:
        current = stack.pop()
        for tensor in current.inputs:
            producer = tensor.op
            if producer in walked or producer in stopped:
                continue
            if follow(producer):
                walked.add(producer)
                stack.append(producer)
            else:
                stopped.add(producer)
    return walked, stopped


def _on_host(op):
    return tf.DeviceSpec.from_string(op.device).device_type == "CPU"


def _ancestors(op):
    """Ops that `op` waits for, by data or control edges."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for producer in [t.op for t in current.inputs] + list(
            current.control_inputs
        ):
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return seen


def _crossings(reading):
    """The tensors that cross from a device into the host side of
    `reading` (the data edges into its host-placed ancestors)."""
    host_side, _ = _data_ancestors(reading.op, _on_host)
    return [
        tensor
        for op in host_side | {reading.op}
        for tensor in op.inputs
        if not _on_host(tensor.op)
    ]


def _assert_waits_through_host_copy(reading, tensors, devices=(GPU,)):
    clock_op = reading.op
    assert clock_op.device == HOST
    crossings = _crossings(reading)
    # One float32 element per device: int32 would sit in host memory and
    # reach the host with no wait for the device's stream.
    assert sorted(t.op.device for t in crossings) == sorted(devices)
    for tensor in crossings:
        assert tensor.dtype == tf.float32, (
            f"{tensor.name} ({tensor.dtype.name}) crosses to the host clock"
        )
        assert tensor.shape.num_elements() == 1
    reached = set()
    for tensor in crossings:
        reached |= {tensor.op} | _ancestors(tensor.op)
    for tensor in tensors:
        assert tensor.device in devices
        assert tensor.op in reached, (
            f"{tensor.name} is not waited for by a copy to the host"
        )


def _timestamp_function(graph, call):
    name = call.get_attr("f").name
    library = graph.as_graph_def().library.function
    (function,) = [f for f in library if f.signature.name == name]
    return function


def test_end_clock_waits_for_every_gradient_through_a_host_copy(monkeypatch):
    model = _model()
    readings = _traced_step(model, GPU, monkeypatch)
    (start_deps, start), (end_deps, end) = readings
    gradients = [t for t in end_deps[1:] if t is not None]
    assert len(gradients) == len(model.trainable_variables) == 4
    for gradient, variable in zip(gradients, model.trainable_variables):
        assert gradient.shape == variable.shape
    _assert_waits_through_host_copy(end, gradients)
    # The Timestamp itself reads the time once its (data) argument exists.
    function = _timestamp_function(end.graph, end.op)
    (timestamp,) = [n for n in function.node_def if n.op == "Timestamp"]
    argument = function.signature.input_arg[0].name
    assert timestamp.input == [f"^{argument}"]
    # The start: the step's rows, a value of the device's, host-copied.
    assert start.op.device == HOST
    _assert_waits_through_host_copy(start, [start_deps[0]])
    # The forward pass starts after the start reading: every matmul of the
    # step (the forward pass's first is on the input) waits for it.
    matmuls = [op for op in end.graph.get_operations() if op.type == "MatMul"]
    assert matmuls
    for matmul in matmuls:
        assert start.op in _ancestors(matmul), (
            f"{matmul.name} may run before the start reading"
        )


def test_host_replica_clock_takes_no_extra_ops(monkeypatch):
    """On a CPU replica a kernel is finished when it returns: the clock
    waits by control edges, with no copy or token ops."""
    model = _model()
    device = f"{TASK}/device:CPU:1"
    (_, start), (end_deps, end) = _traced_step(model, device, monkeypatch)
    for reading in (start, end):
        assert reading.op.device == device
        (data_input,) = reading.op.inputs
        assert data_input.op.type != "Sum"
    waited = {op.name for op in end.op.control_inputs}
    gradients = [t for t in end_deps[1:] if t is not None]
    assert {g.op.name for g in gradients} <= waited


def test_device_token_copies_once_per_device():
    """Pipeline stages: gradients on several devices, one device-to-host
    copy from each, all waited for."""
    devices = [GPU, f"{TASK}/device:GPU:1"]
    readings, tensors = [], []

    @tf.function
    def token():
        for index, device in enumerate(devices):
            with tf.device(device):
                tensors.extend(
                    [tf.ones([3, 2]) * index, tf.ones([5], tf.int32)]
                )
        with tf.device(devices[0]):
            readings.append(telemetry.clock(tensors))
        return readings[0]

    token.get_concrete_function()
    (reading,) = readings
    _assert_waits_through_host_copy(reading, tensors, devices)


def test_clock_rejects_no_dependencies():
    with pytest.raises(ValueError, match="dependencies=\\[None\\]"):
        telemetry.clock([None])


def test_clock_waits_for_composite_inputs_through_their_components():
    """A ragged or sparse input (Keras' `test_trainer_with_raggeds_*`) is
    waited for through its component tensors (a composite tensor has no
    device of its own)."""
    readings, components = [], []

    @tf.function
    def step():
        with tf.device(GPU):
            ragged = tf.RaggedTensor.from_row_lengths(
                tf.ones([5]), tf.constant([2, 3], tf.int64)
            )
            sparse = tf.sparse.from_dense(tf.ones([2, 2]))
            components.extend([ragged.flat_values, sparse.values])
            readings.append(telemetry.clock([ragged, sparse, None]))
        return readings[0]

    step.get_concrete_function()
    (reading,) = readings
    _assert_waits_through_host_copy(reading, components)


def test_fit_on_ragged_input_matches_keras_model():
    """A model reading a ragged batch trains, the same as keras.Model."""
    x = tf.ragged.constant([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]])
    y = np.array([[1.0], [0.0], [1.0], [0.0]], np.float32)

    def build(cls):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((None,), ragged=True)
        # Each row's sum: a ragged reduction, then a dense layer.
        summed = keras.layers.Lambda(
            lambda t: tf.reshape(tf.reduce_sum(t, axis=1), [-1, 1])
        )(inputs)
        model = cls(inputs, keras.layers.Dense(1)(summed))
        model.compile(optimizer="sgd", loss="mse")
        return model

    try:
        reference = build(keras.Model)
    except (TypeError, ValueError) as error:  # no ragged Input here
        pytest.skip(f"this Keras has no ragged Input: {error}")
    hetero = build(kh.HeteroModel)
    for model in (reference, hetero):
        model.fit(x, y, batch_size=4, epochs=3, verbose=0)
    for mine, theirs in zip(hetero.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5)


def _parameter_server_step(end_reading):
    """A step traced as a parameter-server closure runs it: a start
    reading, the forward pass, the logs, the optimizer's update, then
    `end_reading(start, logs, variables)`; returns the end reading's
    Timestamp op and the update's ops."""
    model = _model()
    variables = model.trainable_variables
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(variables)
    readings = []

    @tf.function
    def closure(x, y):
        start = tf.timestamp()
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = tf.reduce_mean(tf.square(predictions - y))
        logs = {"loss": loss}
        optimizer.apply_gradients(
            zip(tape.gradient(loss, variables), variables)
        )
        written = [*variables, optimizer.iterations]
        readings.append((start, end_reading(start, logs, written)))
        return readings[0][1]

    spec = (tf.TensorSpec([None, 3]), tf.TensorSpec([None, 1]))
    graph = closure.get_concrete_function(*spec).graph
    (start, seconds) = readings[0]
    (end,) = [
        op
        for op in _ancestors(seconds.op)
        if op.type == "Timestamp" and op is not start.op
    ]
    # The update's writes: the variables' and the optimizer's iterations.
    updates = [
        op
        for op in graph.get_operations()
        if op.type.startswith(("ResourceApply", "Assign"))
    ]
    return end, updates


def test_parameter_server_clock_reads_after_the_update():
    """A parameter-server closure's seconds include its update (its logs
    exist before the update: the metrics read the predictions)."""
    from keras_hetero.training.parameter_server import closure_seconds

    end, updates = _parameter_server_step(closure_seconds)
    assert len(updates) >= 4  # at least two kernels and two biases
    waited = _ancestors(end)
    for update in updates:
        assert update in waited, f"{update.name} may end after the reading"
