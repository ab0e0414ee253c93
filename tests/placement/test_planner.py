"""Device hints (`kh.layers.Placed`) and the stage planner
(`kh.placement.plan`)."""

import itertools
import math
import random

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import placement
from keras_hetero._compat import keras
from keras_hetero.layers import Placed
from keras_hetero.placement import partition
from keras_hetero.placement import search as _placement_search

# --- the planner's search, pure Python --------------------------------------


def _brute_force(costs, memory, inputs, speeds, capacity):
    layers, devices = len(costs), len(speeds)
    best = math.inf
    for cuts in itertools.combinations(range(1, layers), devices - 1):
        edges = (0, *cuts, layers)
        worst = 0.0
        for d in range(devices):
            start, end = edges[d], edges[d + 1]
            if capacity[d] is not None and sum(memory[start:end]) > capacity[d]:
                worst = math.inf
                break
            stage = sum(costs[start:end]) / speeds[d] + inputs[start]
            worst = max(worst, stage)
        best = min(best, worst)
    return best


def _bottleneck(bounds, costs, inputs, speeds):
    return max(
        sum(costs[s:e]) / speeds[d] + inputs[s]
        for d, (s, e) in enumerate(bounds)
    )


def test_partition_equals_brute_force_on_random_instances():
    rng = random.Random(0)
    checked = infeasible = 0
    for _ in range(300):
        layers = rng.randint(1, 8)
        devices = rng.randint(1, layers)
        costs = [rng.uniform(0.1, 5.0) for _ in range(layers)]
        memory = [rng.randint(1, 10) for _ in range(layers)]
        inputs = [0.0] + [rng.uniform(0.0, 1.0) for _ in range(layers - 1)]
        speeds = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(devices)]
        capacity = [
            rng.choice([None, rng.randint(5, 30)]) for _ in range(devices)
        ]
        want = _brute_force(costs, memory, inputs, speeds, capacity)
        if want == math.inf:
            with pytest.raises(ValueError, match="lacks"):
                partition(costs, memory, inputs, speeds, capacity)
            infeasible += 1
            continue
        bounds = partition(costs, memory, inputs, speeds, capacity)
        assert len(bounds) == devices
        assert bounds[0][0] == 0 and bounds[-1][1] == layers
        assert all(s < e for s, e in bounds)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        for d, (s, e) in enumerate(bounds):
            assert capacity[d] is None or sum(memory[s:e]) <= capacity[d]
        got = _bottleneck(bounds, costs, inputs, speeds)
        assert got == pytest.approx(want, rel=1e-12)
        checked += 1
    assert checked > 100 and infeasible > 10


def test_partition_infeasible_names_device_and_bytes():
    # GPU:0 needs a layer, and the smallest first layer is 50 bytes too big.
    with pytest.raises(ValueError, match=r"GPU:0 lacks 50 bytes"):
        partition(
            [1, 1, 1], [200, 100, 100], [0, 0, 0], [1, 1], [150, 1000],
            names=["GPU:0", "GPU:1"],
        )  # fmt: skip


def _brute_force_any(costs, memory, inputs, speeds, capacity, use_all):
    """`(bottleneck, sum of stages)` over every order, subset and split."""
    layers, devices = len(costs), len(speeds)
    best = (math.inf, math.inf)
    sizes = [devices] if use_all else range(1, min(devices, layers) + 1)
    for size in sizes:
        for order in itertools.permutations(range(devices), size):
            for cuts in itertools.combinations(range(1, layers), size - 1):
                edges = (0, *cuts, layers)
                seconds = []
                for index, device in enumerate(order):
                    start, end = edges[index], edges[index + 1]
                    limit = capacity[device]
                    if limit is not None and sum(memory[start:end]) > limit:
                        break
                    seconds.append(
                        sum(costs[start:end]) / speeds[device] + inputs[start]
                    )
                else:
                    value = (max(seconds), sum(seconds))
                    if value[0] < best[0] * (1 - 1e-9) or (
                        value[0] <= best[0] * (1 + 1e-9) and value[1] < best[1]
                    ):
                        best = value
    return best


def _random_profile(rng, max_layers=7, max_devices=4):
    layers = rng.randint(1, max_layers)
    devices = rng.randint(1, max_devices)
    return (
        [rng.uniform(0.1, 5.0) for _ in range(layers)],
        [rng.randint(1, 10) for _ in range(layers)],
        [0.0] + [rng.uniform(0.0, 1.0) for _ in range(layers - 1)],
        [rng.choice([1.0, 2.5, 0.6, 1.3]) for _ in range(devices)],
        [rng.choice([None, rng.randint(5, 30)]) for _ in range(devices)],
    )


@pytest.mark.parametrize("use_all", [False, True], ids=["subsets", "all"])
def test_search_equals_brute_force_over_orders_and_subsets(use_all):
    rng = random.Random(1 + use_all)
    checked = infeasible = reordered = 0
    for _ in range(250):
        costs, memory, inputs, speeds, capacity = _random_profile(rng)
        if use_all and len(speeds) > len(costs):
            continue
        want = _brute_force_any(
            costs, memory, inputs, speeds, capacity, use_all
        )
        found, method = _placement_search.search(
            costs, memory, inputs, speeds, capacity, use_all_devices=use_all
        )
        assert method == "exact"
        if want[0] == math.inf:
            assert found is None
            infeasible += 1
            continue
        assert [s for _, s, _ in found][0] == 0 and found[-1][2] == len(costs)
        assert all(a[2] == b[1] for a, b in zip(found, found[1:]))
        assert len({d for d, _, _ in found}) == len(found)
        if use_all:
            assert len(found) == len(speeds)
        for device, start, end in found:
            limit = capacity[device]
            assert limit is None or sum(memory[start:end]) <= limit
        got = _placement_search.bottleneck_and_total(
            found, costs, inputs, speeds
        )
        assert got[0] == pytest.approx(want[0], rel=1e-9)
        assert got[1] == pytest.approx(want[1], rel=1e-9)
        in_order = _brute_force(costs, memory, inputs, speeds, capacity)
        reordered += got[0] < in_order * (1 - 1e-9)
        checked += 1
    assert checked > 100 and infeasible > 10 and reordered > 20


def test_plan_equals_brute_force_on_a_model_with_speeds_and_memory():
    rng = random.Random(7)
    model = _mlp(layers=6)
    names = [layer.name for layer in model.layers]
    per_layer = kh.placement.plan(
        model, ["/cpu:0"], layer_costs=_equal_costs(model)
    ).stage_memory[0] // len(names)
    devices = ["/cpu:0", "/cpu:1", "/cpu:2"]
    for _ in range(12):
        costs = [rng.uniform(1e-3, 5e-3) for _ in names]
        speeds = [rng.choice([1.0, 2.5, 0.6]) for _ in devices]
        memory = [rng.choice([None, rng.randint(2, 5) * per_layer + 1])]
        memory += [rng.choice([None, rng.randint(2, 5) * per_layer + 1])]
        memory += [None]
        plan = kh.placement.plan(
            model,
            devices,
            device_speeds=speeds,
            device_memory=memory,
            layer_costs=dict(zip(names, costs)),
            bandwidth=1e15,
        )
        inputs = [0.0] * len(names)
        layer_memory = [per_layer] * len(names)
        want = _brute_force_any(
            costs, layer_memory, inputs, speeds, memory, False
        )
        assert plan.bottleneck_seconds == pytest.approx(want[0], rel=1e-9)
        assert plan.total_seconds == pytest.approx(want[1], rel=1e-9)
        for need, limit in zip(plan.stage_memory, plan.device_memory):
            assert limit is None or need <= limit
        used = [stage.device for stage in plan.stages]
        assert sorted(used + plan.unused_devices) == devices


def test_keep_order_and_all_devices_give_the_original_split():
    rng = random.Random(3)
    model = _mlp(layers=7)
    names = [layer.name for layer in model.layers]
    devices = ["/cpu:0", "/cpu:1", "/cpu:2"]
    for _ in range(20):
        costs = [rng.uniform(1e-3, 5e-3) for _ in names]
        speeds = [rng.choice([1.0, 2.5, 0.6]) for _ in devices]
        kwargs = dict(
            device_speeds=speeds,
            layer_costs=dict(zip(names, costs)),
            bandwidth=1e8,
        )
        plan = kh.placement.plan(
            model, devices, keep_order=True, use_all_devices=True, **kwargs
        )
        # The original planner's own search, over the same inputs.
        inputs = [0.0] + [
            4 * 32 * 8 / 1e8 for _ in range(len(names) - 1)
        ]  # float32 activations of 32 rows x 8 features
        memory = [0] * len(names)
        bounds = partition(costs, memory, inputs, speeds, [None] * 3)
        assert [len(stage.layers) for stage in plan.stages] == [
            e - s for s, e in bounds
        ]
        assert [stage.device for stage in plan.stages] == devices
        searched = kh.placement.plan(model, devices, **kwargs)
        assert searched.bottleneck_seconds <= plan.bottleneck_seconds * (
            1 + 1e-9
        )


def test_the_fast_device_takes_the_heavy_stage_and_a_slow_one_is_left_out():
    model = _mlp(layers=4)
    names = [layer.name for layer in model.layers]
    costs = dict(zip(names, [8e-3, 1e-3, 1e-3, 1e-3]))
    devices = ["/cpu:0", "/cpu:1", "/cpu:2"]
    plan = kh.placement.plan(
        model,
        devices,
        device_speeds=[1.0, 4.0, 0.1],
        layer_costs=costs,
        bandwidth=1e15,
    )
    # 9 ms of work at speed 4, then 2 ms at speed 1.
    assert plan.stages[0] == (devices[1], names[:2])
    assert plan.stages[1] == (devices[0], names[2:])
    assert plan.unused_devices == ["/cpu:2"]
    assert "unused devices: /cpu:2" in plan.summary()
    in_order = kh.placement.plan(
        model,
        devices,
        device_speeds=[1.0, 4.0, 0.1],
        layer_costs=costs,
        bandwidth=1e15,
        keep_order=True,
        use_all_devices=True,
    )
    assert plan.bottleneck_seconds == pytest.approx(2.25e-3)
    assert in_order.bottleneck_seconds == pytest.approx(1e-2)


def test_the_device_with_the_most_memory_takes_the_stage_that_needs_it():
    model = _mlp(layers=4)
    per_layer = (
        kh.placement.plan(
            model, ["/cpu:0"], layer_costs=_equal_costs(model)
        ).stage_memory[0]
        // 4
    )
    plan = kh.placement.plan(
        model,
        ["/cpu:0", "/cpu:1"],
        device_memory=[per_layer, 3 * per_layer],
        layer_costs=_equal_costs(model),
    )
    assert [(s.device, len(s.layers)) for s in plan.stages] == [
        ("/cpu:1", 3),
        ("/cpu:0", 1),
    ] or [(s.device, len(s.layers)) for s in plan.stages] == [
        ("/cpu:0", 1),
        ("/cpu:1", 3),
    ]
    with pytest.raises(ValueError, match="lacks"):
        kh.placement.plan(
            model,
            ["/cpu:0", "/cpu:1"],
            device_memory=[per_layer, 2 * per_layer],
            layer_costs=_equal_costs(model),
        )


def test_local_search_is_valid_and_never_beats_the_exact_search():
    rng = random.Random(5)
    gaps = []
    for _ in range(60):
        costs, memory, inputs, speeds, capacity = _random_profile(
            rng, max_layers=12, max_devices=5
        )
        exact, _ = _placement_search.search(
            costs, memory, inputs, speeds, capacity
        )
        local, method = _placement_search.search(
            costs, memory, inputs, speeds, capacity, method="local"
        )
        assert method == "local search"
        if exact is None:
            assert local is None
            continue
        if local is None:  # a local search may miss a feasible split
            continue
        for device, start, end in local:
            assert capacity[device] is None or (
                sum(memory[start:end]) <= capacity[device]
            )
        want = _placement_search.bottleneck_and_total(
            exact, costs, inputs, speeds
        )
        got = _placement_search.bottleneck_and_total(
            local, costs, inputs, speeds
        )
        assert got[0] >= want[0] * (1 - 1e-9)
        gaps.append(got[0] / want[0] - 1)
    assert len(gaps) > 30 and np.median(gaps) < 0.01


def test_many_different_devices_use_the_local_search():
    model = _mlp(layers=20)
    devices = [f"/cpu:{i}" for i in range(13)]
    plan = kh.placement.plan(
        model,
        devices,
        device_speeds=[1.0 + 0.1 * i for i in range(13)],
        layer_costs=_equal_costs(model),
    )
    assert plan.method == "local search"
    assert sum(len(stage.layers) for stage in plan.stages) == 20
    with pytest.raises(ValueError, match="`method`"):
        kh.placement.plan(model, devices, method="greedy")


# --- planning a Keras model --------------------------------------------------


def _mlp(layers=6, width=8, seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="tanh") for _ in range(layers)]
    )


def _equal_costs(model, seconds=1e-3):
    return {layer.name: seconds for layer in model.layers}


def test_equal_devices_get_a_balanced_split():
    model = _mlp(layers=6)
    plan = kh.placement.plan(
        model, ["/cpu:0", "/cpu:1"], layer_costs=_equal_costs(model)
    )
    assert [len(stage.layers) for stage in plan.stages] == [3, 3]
    device, names = plan.stages[0]
    assert device == "/cpu:0"
    assert names == [layer.name for layer in model.layers[:3]]
    assert plan.stage_seconds[0] == pytest.approx(3e-3)


def test_a_twice_as_fast_device_gets_twice_the_work():
    model = _mlp(layers=12)
    plan = kh.placement.plan(
        model,
        ["/cpu:0", "/cpu:1"],
        device_speeds=[1.0, 2.0],
        layer_costs=_equal_costs(model),
        bandwidth=1e15,
    )
    assert [len(stage.layers) for stage in plan.stages] == [4, 8]
    assert plan.stage_seconds[0] == pytest.approx(plan.stage_seconds[1])


def test_estimated_costs_follow_the_weights():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(256),
            keras.layers.Dense(16),
            keras.layers.Dense(16),
            keras.layers.Dense(16),
        ]
    )
    plan = kh.placement.plan(model, ["/cpu:0", "/cpu:1"])
    # The big first layer alone costs about as much as the other three.
    assert [len(stage.layers) for stage in plan.stages] == [1, 3]
    assert plan.stage_memory[0] == 4 * 4 * (16 * 256 + 256) + 32 * 256 * 4


def test_memory_limits_are_respected():
    model = _mlp(layers=6)
    free = kh.placement.plan(
        model, ["/cpu:0", "/cpu:1"], layer_costs=_equal_costs(model)
    )
    per_layer = free.stage_memory[0] // 3
    limited = kh.placement.plan(
        model,
        ["/cpu:0", "/cpu:1"],
        device_memory=[None, 2 * per_layer],
        layer_costs=_equal_costs(model),
    )
    assert [len(stage.layers) for stage in limited.stages] == [4, 2]
    assert limited.stage_memory[1] <= 2 * per_layer
    assert "memory MiB" in limited.summary()
    assert "1*" not in limited.summary() and "0*" in limited.summary()


def test_infeasible_memory_names_the_device_and_bytes():
    model = _mlp(layers=4)
    free = kh.placement.plan(
        model, ["/cpu:0", "/cpu:1"], layer_costs=_equal_costs(model)
    )
    per_layer = free.stage_memory[0] // 2
    with pytest.raises(ValueError) as error:
        kh.placement.plan(
            model,
            ["/cpu:0", "/cpu:1"],
            device_memory=[per_layer, 2 * per_layer],
            layer_costs=_equal_costs(model),
        )
    assert f"/cpu:1 lacks {per_layer} bytes" in str(error.value)


def test_branching_models_are_refused_with_the_reason():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4)(inputs)
    outputs = keras.layers.Add()([hidden, keras.layers.Dense(4)(hidden)])
    with pytest.raises(ValueError, match="not a chain of layers"):
        kh.placement.plan(keras.Model(inputs, outputs), ["/cpu:0"])


def test_bad_arguments_name_the_value():
    model = _mlp(layers=2)
    three = ["/cpu:0", "/cpu:1", "/cpu:2"]
    with pytest.raises(ValueError, match="`devices`"):
        kh.placement.plan(model, three, use_all_devices=True)
    with pytest.raises(ValueError, match="`devices`"):
        kh.placement.plan(model, [])
    # More devices than layers: one is left out.
    assert len(kh.placement.plan(model, three).unused_devices) == 1
    with pytest.raises(ValueError, match="`device_speeds`"):
        kh.placement.plan(model, ["/cpu:0"], device_speeds=[0.0])
    with pytest.raises(ValueError, match="no cost for layers"):
        kh.placement.plan(model, ["/cpu:0"], layer_costs={})


def test_profiled_costs_are_measured_seconds():
    model = _mlp(layers=3, width=32)
    plan = kh.placement.plan(
        model, ["/cpu:0", "/cpu:1"], profile=True, batch_size=16
    )
    assert all(0 < s < 1.0 for s in plan.stage_seconds)
    assert sum(len(stage.layers) for stage in plan.stages) == 3


def _train(model, steps=4):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return history.history["loss"]


def test_applied_plan_hints_the_layers_in_place_and_trains_alike():
    reference = _mlp(layers=4)
    model = _mlp(layers=4)
    plan = kh.placement.plan(
        model, ["/device:CPU:0", "/device:CPU:1"], device_speeds=[1.0, 1.0]
    )
    assert plan.apply(model) is model
    hints = [layer.placement_hint for layer in placement.chain_layers(model)]
    assert [h["device"] for h in hints] == ["/device:CPU:0"] * 2 + [
        "/device:CPU:1"
    ] * 2
    assert [h["stage"] for h in hints] == [0, 0, 1, 1]
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    step, traced = _loss_and_grads(model, x, np.zeros((4, 8), "float32"))
    last = placement.chain_layers(model)[-1].name
    ops = [
        op
        for op in traced.graph.get_operations()
        if op.type == "MatMul" and last in op.name
    ]
    assert ops and all(op.device.endswith("CPU:1") for op in ops)
    _train(reference)
    _train(model)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_place_with_a_plans_hints_copies_onto_the_devices():
    reference = _mlp(layers=4)
    model = _mlp(layers=4)
    plan = kh.placement.plan(
        model, ["/device:CPU:0", "/device:CPU:1"], device_speeds=[1.0, 1.0]
    )
    placed = kh.layers.place(model, plan.hints())
    wrappers = [layer for layer in placed.layers if isinstance(layer, Placed)]
    assert [w.stage for w in wrappers] == [0, 0, 1, 1]
    assert "CPU:1" in _device_of(wrappers[-1].layer.kernel)
    _train(reference)
    _train(placed)
    for got, want in zip(placed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # A copy: the original keeps its initial weights.
    for got, want in zip(model.get_weights(), _mlp(layers=4).get_weights()):
        np.testing.assert_array_equal(got, want)


def test_hint_can_be_removed():
    layer = kh.layers.hint(keras.layers.Dense(2), "CPU:1", stage=3)
    assert layer.placement_hint == {"device": "/device:CPU:1", "stage": 3}
    kh.layers.hint(layer, None)
    assert not hasattr(layer, "placement_hint")
    assert layer(np.ones((1, 3), "float32")).shape == (1, 2)
    with pytest.raises(TypeError, match="keras.layers.Layer"):
        kh.layers.hint("dense", "CPU:0")


# --- device hints -------------------------------------------------------------


def _device_of(variable):
    # A Keras 3 variable holds a tf.Variable in `.value`; tf-keras' is one.
    value = getattr(variable, "value", None)
    return variable.device if callable(value) else value.device


def _hinted(device="/device:CPU:1", **kwargs):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    hidden = Placed(
        keras.layers.Dense(4, activation="tanh"), device=device, **kwargs
    )(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def _unhinted():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    hidden = keras.layers.Dense(4, activation="tanh")(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def _loss_and_grads(model, x, y):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    return step, step.get_concrete_function(x, y)


def test_placed_layer_runs_forward_and_backward_on_its_device():
    x = np.random.default_rng(0).normal(size=(7, 6)).astype("float32")
    y = np.ones((7, 1), "float32")
    model = _hinted()
    placed = model.layers[2]
    for weight in placed.layer.weights:
        assert "CPU:1" in _device_of(weight)
    step, traced = _loss_and_grads(model, x, y)
    backward = [
        op
        for op in traced.graph.get_operations()
        if op.name.startswith("gradient_tape/")
        and op.type in ("MatMul", "BiasAddGrad", "TanhGrad")
    ]
    inner = [op for op in backward if op.device]
    assert sorted(op.type for op in inner) == [
        "BiasAddGrad",
        "MatMul",
        "MatMul",
        "TanhGrad",
    ]
    assert all(op.device.endswith("CPU:1") for op in inner)
    assert all("dense_" in op.name or "placed" in op.name for op in inner)
    assert len(backward) > len(inner)  # the other layers' are unplaced
    # Activations cross to CPU:1 and back with the same numbers.
    reference = _unhinted()
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(model(x), reference(x), rtol=1e-6)
    loss, grads = step(x, y)
    ref_step, _ = _loss_and_grads(reference, x, y)
    ref_loss, ref_grads = ref_step(x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_unknown_device_raises_with_the_available_devices():
    layer = Placed(keras.layers.Dense(2), device="/device:GPU:7")
    with pytest.raises(ValueError) as error:
        layer(np.ones((1, 3), "float32"))
    message = str(error.value)
    assert "'/device:GPU:7'" in message and "/device:CPU:0" in message
    with pytest.raises(ValueError, match="`device`"):
        Placed(keras.layers.Dense(2), device=3)
    with pytest.raises(ValueError, match="`stage`"):
        Placed(keras.layers.Dense(2), stage=-1)


def test_config_round_trip_keeps_hints(tmp_path):
    model = _hinted(stage=2)
    path = str(tmp_path / "hinted.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    placed = loaded.layers[2]
    assert isinstance(placed, Placed)
    assert (placed.device, placed.stage) == ("/device:CPU:1", 2)
    x = np.ones((3, 6), "float32")
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


def test_saved_hint_for_a_missing_device_loads_with_a_warning(tmp_path):
    model = _hinted()
    x = np.ones((3, 6), "float32")
    expected = model(x)
    # Planned on a machine with 4 GPUs; this one has none.
    model.layers[2].device = "/device:GPU:3"
    path = str(tmp_path / "gpu.keras")
    model.save(path)
    with pytest.warns(UserWarning, match="/device:GPU:3"):
        loaded = keras.saving.load_model(path)
    assert loaded.layers[2].get_config()["device"] == "/device:GPU:3"
    np.testing.assert_allclose(loaded(x), expected, rtol=1e-6)
    assert np.isfinite(_train_small(loaded))


def _train_small(model):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model.fit(x, y, batch_size=8, verbose=0).history["loss"][-1]


def test_dtype_policy_per_stage_computes_in_bfloat16():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    stage = Placed(
        keras.layers.Dense(8, activation="tanh"),
        device="/device:CPU:1",
        dtype_policy="mixed_bfloat16",
    )
    hidden = stage(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    model = keras.Model(inputs, outputs)
    assert stage.layer.compute_dtype == "bfloat16"
    assert stage.layer.kernel.dtype == "float32"  # variables stay float32
    others = [model.layers[1], model.layers[3]]
    assert [layer.compute_dtype for layer in others] == ["float32"] * 2
    assert model(np.ones((2, 6), "float32")).dtype == "float32"
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) * 0.3).astype("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    losses = model.fit(x, y, batch_size=16, epochs=4, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_dtype_policy_needs_an_unbuilt_layer():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    with pytest.raises(ValueError, match="already built"):
        Placed(dense, dtype_policy="mixed_bfloat16")


def test_place_helper_hints_named_layers():
    model = _mlp(layers=3)
    names = [layer.name for layer in model.layers]
    placed = kh.layers.place(model, {names[1]: "CPU:1", model.layers[2]: None})
    wrappers = [layer for layer in placed.layers if isinstance(layer, Placed)]
    assert [(w.layer.name, w.device) for w in wrappers] == [
        (names[1], "/device:CPU:1"),
        (names[2], None),
    ]
    x = np.ones((2, 8), "float32")
    np.testing.assert_allclose(placed(x), model(x), rtol=1e-6)
    with pytest.raises(ValueError, match="nope"):
        kh.layers.place(model, {"nope": "CPU:0"})


# --- composition with data parallelism ----------------------------------------


def test_device_hints_under_mirrored_strategy_raise_at_call_time():
    strategy = kh.testing.mirrored(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _hinted()
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 6), "float32")
    with pytest.raises(ValueError, match="defeats data parallelism"):
        model.fit(x, np.ones((8, 1), "float32"), batch_size=4, verbose=0)


def test_dtype_policy_without_device_works_under_mirrored_strategy():
    strategy = kh.testing.mirrored(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _hinted(device=None, dtype_policy="mixed_bfloat16")
        assert model.layers[2].layer.compute_dtype == "bfloat16"
    assert np.isfinite(_train_small(model))
    with strategy.scope():
        model = _hinted(device=None, dtype_policy="mixed_bfloat16")
        hetero = kh.HeteroModel.from_model(model)
        hetero.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(2)
    data = kh.data.shard(
        tf.data.Dataset.from_tensor_slices(
            (
                rng.normal(size=(16, 6)).astype("float32"),
                rng.normal(size=(16, 1)).astype("float32"),
            )
        ),
        8,
        strategy=strategy,
    )
    losses = hetero.fit(data, epochs=1, verbose=0).history["loss"]
    assert np.isfinite(losses[-1])


def test_device_hints_with_a_single_device_strategy_work():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = _hinted()
    assert np.isfinite(_train_small(model))


# --- choosing a layout -------------------------------------------------------


def _layout_model(layers=8, width=64):
    keras.utils.set_random_seed(2)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, name=f"dense_{i}") for i in range(layers)]
    )


def _costs(model, seconds=0.02):
    return {layer.name: seconds for layer in model.layers}


TWO_BY_TWO = [
    [("/cpu:0", 1.0), ("/cpu:1", 2.0)],
    [("/cpu:0", 1.0), ("/cpu:1", 1.0)],
]


def test_layout_cost_model_follows_the_formulas():
    model = _layout_model()
    weights = sum(w.numpy().nbytes for w in model.trainable_weights)
    choice = kh.placement.plan_layout(
        model,
        TWO_BY_TWO,
        batch_size=64,
        microbatches=4,
        layer_costs=_costs(model),
        network_bandwidth=1e9,
    )
    data = choice.layouts["data parallel"]
    assert data.compute_seconds == pytest.approx(0.16 / 5.0)
    assert data.communication_seconds == pytest.approx(
        2 * 3 / 4 * weights / 1e9
    )
    assert data.shares == pytest.approx([0.2, 0.4, 0.2, 0.2])
    replicated = choice.layouts["replicated pipelines"]
    times = [
        kh.placement.pipeline_seconds(p.stage_seconds, 4)
        for p in replicated.plans
    ]
    assert replicated.compute_seconds == pytest.approx(
        1 / (1 / times[0] + 1 / times[1])
    )
    assert replicated.shares == pytest.approx(
        [times[1] / sum(times), times[0] / sum(times)]
    )
    assert replicated.communication_seconds == pytest.approx(weights / 1e9)
    pipeline = choice.layouts["pipeline"]
    assert pipeline.communication_seconds == 0.0
    assert pipeline.step_seconds == pytest.approx(
        kh.placement.pipeline_seconds(pipeline.plans[0].stage_seconds, 4)
    )
    assert {s.device for s in pipeline.plans[0].stages} <= {
        "/job:worker/task:0/device:CPU:0",
        "/job:worker/task:0/device:CPU:1",
        "/job:worker/task:1/device:CPU:0",
        "/job:worker/task:1/device:CPU:1",
    }
    assert choice.best is min(
        choice.layouts.values(), key=lambda layout: layout.step_seconds
    )
    assert kh.placement.pipeline_seconds([1.0, 1.0], 4) == 1.25


def test_each_layout_wins_where_it_should():
    model = _layout_model()
    costs = _costs(model)
    fast_network = kh.placement.plan_layout(
        model, TWO_BY_TWO, batch_size=64, layer_costs=costs,
        network_bandwidth=1e12,
    )  # fmt: skip
    assert fast_network.best.kind == "data parallel"
    # A slow link between one worker's devices: activations (16 KiB per
    # hop) cost less than the all-reduce of 130 KiB of weights.
    slow_link = kh.placement.plan_layout(
        model, TWO_BY_TWO[:1], batch_size=64, layer_costs=costs,
        bandwidth=1e6, microbatches=8,
    )  # fmt: skip
    assert slow_link.best.kind == "pipeline"
    assert slow_link.layouts["pipeline"].reason is None
    # Over two workers the pipeline is predicted, never chosen.
    slow_network = kh.placement.plan_layout(
        model, TWO_BY_TWO, batch_size=64, layer_costs=costs,
        network_bandwidth=1e6, microbatches=8,
    )  # fmt: skip
    across = slow_network.layouts["pipeline"]
    assert across.step_seconds < slow_network.best.step_seconds
    assert "spans workers" in across.reason
    assert slow_network.best.kind != "pipeline"
    assert "not run: spans workers" in slow_network.summary()
    # The model fits no single device, but each worker's pair.
    weights = sum(w.numpy().nbytes for w in model.trainable_weights)
    small = [
        [("/cpu:0", 1.0, 3 * weights), ("/cpu:1", 1.0, 3 * weights)]
        for _ in range(2)
    ]
    no_fit = kh.placement.plan_layout(
        model, small, batch_size=64, layer_costs=costs,
        network_bandwidth=1e10, microbatches=8,
    )  # fmt: skip
    assert no_fit.layouts["data parallel"].step_seconds == math.inf
    assert "does not fit" in no_fit.layouts["data parallel"].reason
    assert no_fit.best.kind == "replicated pipelines"
    text = no_fit.summary()
    assert "replicated pipelines*" in text and "does not fit" in text


def test_layout_apply_sets_up_the_best():
    model = _layout_model(layers=4, width=8)
    costs = _costs(model)
    data = kh.placement.plan_layout(
        model, [["/cpu:0", "/cpu:1"]], layer_costs=costs, bandwidth=1e15
    )
    assert data.best.kind == "data parallel"
    hetero = data.apply(model)
    assert isinstance(hetero, kh.HeteroModel)
    assert not any(isinstance(layer, Placed) for layer in hetero.layers)
    model = _layout_model()
    weights = sum(w.numpy().nbytes for w in model.trainable_weights)
    pair = [("/cpu:0", 1.0, 3 * weights), ("/cpu:1", 1.0, 3 * weights)]
    pipelines = kh.placement.plan_layout(
        model,
        [pair, pair],
        batch_size=64,
        layer_costs=_costs(model),
        network_bandwidth=1e10,
        microbatches=2,
    )
    assert pipelines.best.kind == "replicated pipelines"
    placed = pipelines.apply(model, worker=1)
    assert placed.get_config()["pipeline_microbatches"] == 2
    wrappers = [layer for layer in placed.layers if isinstance(layer, Placed)]
    assert sorted({w.device for w in wrappers}) == ["/cpu:0", "/cpu:1"]
    x = np.ones((2, 64), "float32")
    np.testing.assert_allclose(placed(x), model(x), rtol=1e-6)
    with pytest.raises(ValueError, match="`worker`"):
        pipelines.apply(model, worker=2)


def test_layout_bad_arguments_name_the_value():
    model = _layout_model(layers=2, width=4)
    with pytest.raises(ValueError, match="`cluster`"):
        kh.placement.plan_layout(model, [])
    with pytest.raises(ValueError, match="`cluster`"):
        kh.placement.plan_layout(model, ["/cpu:0"])
    with pytest.raises(ValueError, match="`cluster`"):
        kh.placement.plan_layout(model, [[("/cpu:0", 0.0)]])
    with pytest.raises(ValueError, match="`microbatches`"):
        kh.placement.plan_layout(model, [["/cpu:0"]], microbatches=0)
