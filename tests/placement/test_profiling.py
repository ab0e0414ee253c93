"""`kh.placement.profile` and plans made from a `Profile`.

The timing tests use `kh.testing.SimulatedSpeed` layers (a sleep per row,
twice as long on /cpu:1): the recovered costs and speeds are simulated
figures. Sleeps of 80 ms and more keep them within 10% on a busy 2-core
host, where a woken thread can wait 3-5 ms for a core.
"""

import itertools
import math
import random

import numpy as np
import pytest

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.placement import partition
from keras_hetero.placement import search as _placement_search

ROWS = 16
FAST, SLOW = "/cpu:0", "/cpu:1"
# Simulated seconds per batch of each SimulatedSpeed layer on FAST; SLOW
# takes twice as long.
SIMULATED = (0.08, 0.08, 0.16)
# About what a Dense(8) takes, small next to the sleeps.
DENSE_SECONDS = 1e-4


def _simulated_model():
    layers = [keras.Input((8,))]
    for index, seconds in enumerate(SIMULATED):
        per_row = seconds / ROWS
        layers += [
            keras.layers.Dense(8, name=f"dense_{index}"),
            kh.testing.SimulatedSpeed(
                {"CPU:0": per_row, "CPU:1": 2 * per_row},
                name=f"simulated_{index}",
            ),
        ]
    return keras.Sequential(layers)


def _true_costs():
    """`{layer: seconds on FAST}` of `_simulated_model`, FAST being 1.0."""
    costs = {}
    for index, seconds in enumerate(SIMULATED):
        costs[f"dense_{index}"] = DENSE_SECONDS
        costs[f"simulated_{index}"] = seconds
    return costs


@pytest.fixture(scope="module")
def simulated():
    """`(model, its profile on FAST and SLOW)`, measured once."""
    model = _simulated_model()
    x = np.random.default_rng(0).normal(size=(ROWS, 8)).astype("float32")
    y = np.zeros((ROWS, 8), "float32")
    measured = kh.placement.profile(model, [FAST, SLOW], (x, y), warmup=1)
    return model, measured


def test_profile_recovers_simulated_seconds_and_speeds(simulated):
    _, measured = simulated
    errors = {}
    for index, seconds in enumerate(SIMULATED):
        name = f"simulated_{index}"
        for device, factor in ((FAST, 1), (SLOW, 2)):
            got = measured.seconds[device][name]
            errors[f"{name} on {device}"] = got / (factor * seconds) - 1
        errors[f"{name} cost"] = measured.layer_costs()[name] / seconds - 1
    speeds = measured.device_speeds()
    assert speeds[FAST] == 1.0
    errors["speed of /cpu:1"] = speeds[SLOW] / 0.5 - 1
    print(
        "simulated recovery errors: "
        + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items())
    )
    assert all(abs(error) < 0.10 for error in errors.values()), errors
    assert measured.devices == [FAST, SLOW]
    assert measured.batch_size == ROWS
    assert measured.layer_names == list(_true_costs())
    assert measured.param_bytes["dense_0"] == (8 * 8 + 8) * 4
    assert measured.param_bytes["simulated_0"] == 0
    assert set(measured.activation_bytes.values()) == {ROWS * 8 * 4}
    assert measured.device_memory == {FAST: None, SLOW: None}
    assert "simulated_2" in measured.summary()


def test_plan_from_profile_equals_plan_from_true_costs(simulated):
    model, measured = simulated
    want = kh.placement.plan(
        model,
        [FAST, SLOW],
        layer_costs=_true_costs(),
        device_speeds=[1.0, 0.5],
        batch_size=ROWS,
    )
    got = kh.placement.plan(model, [FAST, SLOW], profile=measured)
    # /cpu:1 takes 0.08 s of work at half speed, /cpu:0 the other 0.24 s
    # (the next best split's bottleneck is 0.32 s).
    assert want.stages == [
        (SLOW, ["dense_0", "simulated_0", "dense_1"]),
        (FAST, ["simulated_1", "dense_2", "simulated_2"]),
    ]
    assert got.stages == want.stages
    np.testing.assert_allclose(got.stage_seconds, want.stage_seconds, rtol=0.1)


def test_plan_layout_takes_speeds_and_memory_from_profile(simulated):
    model, measured = simulated
    speeds = measured.device_speeds()
    choice = kh.placement.plan_layout(
        model, [[FAST, SLOW]], profile=measured, microbatches=1
    )
    assert [d.speed for d in choice.cluster[0]] == [speeds[FAST], speeds[SLOW]]
    data = choice.layouts["data parallel"]
    np.testing.assert_allclose(
        data.shares, [1 / (1 + speeds[SLOW]), speeds[SLOW] / (1 + speeds[SLOW])]
    )
    # The whole model on both at once: 1 / (1 / T_fast + 1 / T_slow).
    totals = [sum(measured.seconds[d].values()) for d in (FAST, SLOW)]
    assert data.compute_seconds == pytest.approx(1 / sum(1 / t for t in totals))
    pipeline = choice.layouts["pipeline"].plans[0]
    assert (
        pipeline.stages
        == kh.placement.plan(model, [FAST, SLOW], profile=measured).stages
    )
    # Explicit speeds and memory win; one profile per worker is accepted.
    explicit = kh.placement.plan_layout(
        model,
        [[(FAST, 1.0), (SLOW, 1.0, 10**9)]],
        profile=[measured],
        microbatches=1,
    )
    assert explicit.cluster[0][1] == kh.placement.Device(SLOW, 1.0, 10**9)
    assert explicit.layouts["data parallel"].shares == [0.5, 0.5]
    with pytest.raises(ValueError, match="one per worker"):
        kh.placement.plan_layout(model, [[FAST]], profile=[measured] * 2)
    with pytest.raises(ValueError, match=r"'/cpu:2'.*did not measure"):
        kh.placement.plan_layout(model, [[FAST, "/cpu:2"]], profile=measured)


def test_profile_round_trips_through_json(simulated, tmp_path):
    model, measured = simulated
    path = tmp_path / "profile.json"
    path.write_text(measured.to_json())
    loaded = kh.placement.Profile.from_json(path.read_text())
    assert loaded == measured
    assert loaded.device_speeds() == measured.device_speeds()
    assert (
        kh.placement.plan(model, [FAST, SLOW], profile=loaded).stages
        == kh.placement.plan(model, [FAST, SLOW], profile=measured).stages
    )
    with pytest.raises(ValueError, match="`text`"):
        kh.placement.Profile.from_json('{"devices": []}')
    with pytest.raises(ValueError, match="`text`"):
        kh.placement.Profile.from_json("not json")
    broken = measured.to_json().replace('"simulated_2": ', '"other": ', 1)
    with pytest.raises(ValueError, match="Invalid `Profile`"):
        kh.placement.Profile.from_json(broken)


# --- plans from a profile, without timing ------------------------------------


def _two_layers():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, name="a"),
            keras.layers.Dense(8, name="b"),
        ]
    )


def _crossed_profile(batch_size=ROWS):
    """Layer `a` is 10x faster on /cpu:0, `b` on /cpu:1: equal totals."""
    return kh.placement.Profile(
        devices=[FAST, SLOW],
        layer_names=["a", "b"],
        seconds={FAST: {"a": 0.001, "b": 0.01}, SLOW: {"a": 0.01, "b": 0.001}},
        param_bytes={"a": 288, "b": 288},
        activation_bytes={"a": 512, "b": 512},
        device_memory={FAST: None, SLOW: 10**6},
        batch_size=batch_size,
    )


def test_plan_uses_each_devices_own_seconds():
    model, measured = _two_layers(), _crossed_profile()
    assert measured.device_speeds() == {FAST: 1.0, SLOW: 1.0}
    assert measured.layer_costs() == pytest.approx({"a": 0.0055, "b": 0.0055})
    got = kh.placement.plan(model, [FAST, SLOW], profile=measured)
    assert got.stages == [(FAST, ["a"]), (SLOW, ["b"])]
    assert got.stage_seconds == pytest.approx([0.001, 0.001 + 512 / 1e10])
    assert got.device_memory == [None, 10**6]
    # One speed per device cannot tell the devices apart: 5.5 ms a stage.
    uniform = kh.placement.plan(
        model, [FAST, SLOW], profile=measured, device_speeds=[1.0, 1.0]
    )
    assert uniform.bottleneck_seconds > 0.005
    # A device given a speed takes layer_costs / speed; the others theirs.
    mixed = kh.placement.plan(
        model, [FAST, SLOW], profile=measured, device_speeds=[None, 5.5]
    )
    assert mixed.stages == [(FAST, ["a"]), (SLOW, ["b"])]
    assert mixed.stage_seconds[1] == pytest.approx(0.001, rel=1e-3)


def test_explicit_arguments_win_over_the_profile():
    model, measured = _two_layers(), _crossed_profile()
    got = kh.placement.plan(
        model,
        [FAST, SLOW],
        profile=measured,
        device_speeds=[2.0, 2.0],
        device_memory=[None, None],
        layer_costs={"a": 0.004, "b": 0.004},
    )
    assert got.device_speeds == [2.0, 2.0]
    assert got.device_memory == [None, None]
    assert max(got.stage_seconds) == pytest.approx(0.002, rel=1e-3)
    # Memory: 4 copies of the measured weights plus the activations.
    assert sum(got.stage_memory) == 2 * (4 * 288 + 512)
    # Another batch size scales seconds and activations with the rows.
    doubled = kh.placement.plan(
        model, [FAST, SLOW], profile=measured, batch_size=2 * ROWS
    )
    assert doubled.stage_seconds[0] == pytest.approx(0.002)
    assert sum(doubled.stage_memory) == 2 * (4 * 288 + 1024)


def test_plan_refuses_a_profile_that_does_not_fit():
    model, measured = _two_layers(), _crossed_profile()
    with pytest.raises(ValueError, match=r"\['/cpu:2'\].*did not measure"):
        kh.placement.plan(model, [FAST, "/cpu:2"], profile=measured)
    # With its speed given, an unprofiled device is fine.
    kh.placement.plan(
        model, [FAST, "/cpu:2"], profile=measured, device_speeds=[None, 1.0]
    )
    with pytest.raises(ValueError, match="profile of the layers"):
        kh.placement.plan(
            keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]),
            [FAST],
            profile=measured,
        )
    with pytest.raises(TypeError, match="`profile`"):
        kh.placement.plan(model, [FAST], profile="profile.json")
    with pytest.raises(ValueError, match="Invalid `Profile`.*seconds"):
        kh.placement.Profile(
            **{**vars(measured), "seconds": {FAST: {"a": 1.0}, SLOW: {}}}
        )


# --- measuring ---------------------------------------------------------------


def test_profile_measures_functional_models_with_a_nested_model():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, name="first")(inputs)
    block = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(3)],
        name="block",
    )
    model = keras.Model(inputs, block(hidden))
    x = np.ones((3, 6))  # float64: cast to the model's float32
    measured = kh.placement.profile(model, [FAST], x, repeats=1, warmup=0)
    # A nested model is one layer, as `plan` places top-level layers.
    assert measured.layer_names == ["first", "block"]
    assert measured.param_bytes == {
        "first": (6 * 4 + 4) * 4,
        "block": (4 * 5 + 5 + 5 * 3 + 3) * 4,
    }
    assert measured.activation_bytes == {"first": 3 * 4 * 4, "block": 3 * 3 * 4}
    assert all(s > 0 for s in measured.seconds[FAST].values())


def test_profile_builds_an_unbuilt_sequential_model():
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
    x = np.ones((4, 5), "float32")
    measured = kh.placement.profile(model, ["CPU:2"], x, repeats=1, warmup=0)
    assert measured.devices == ["CPU:2"]
    assert len(measured.layer_names) == 2
    assert measured.param_bytes[measured.layer_names[0]] == (5 * 3 + 3) * 4
    assert measured.find_device("/job:worker/task:1/device:CPU:2") == "CPU:2"
    # The model's weights are untouched; its input keeps a free batch size.
    assert model.inputs[0].shape[0] is None


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)


def test_profile_errors_name_the_bad_value():
    model = _two_layers()
    x = np.ones((4, 8), "float32")

    def measure(devices=(FAST,), batch=x, on=model, **kwargs):
        return kh.placement.profile(on, list(devices), batch, **kwargs)

    with pytest.raises(ValueError, match=r"'/cpu:9', which this process"):
        measure(devices=[FAST, "/cpu:9"])
    with pytest.raises(ValueError, match=r"'/gpu:0', which this process"):
        measure(devices=["/gpu:0"])
    with pytest.raises(ValueError, match="`devices`.*non-empty"):
        measure(devices=[])
    with pytest.raises(ValueError, match="one device"):
        measure(devices=["/cpu:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="no job or task"):
        measure(devices=["/job:worker/task:0/device:CPU:0"])
    with pytest.raises(ValueError, match="`devices`"):
        measure(devices=["nonsense"])
    with pytest.raises(ValueError, match=r"empty batch.*\(0, 8\)"):
        measure(batch=(np.ones((0, 8)), np.ones((0, 1))))
    with pytest.raises(ValueError, match="`batch`"):
        measure(batch=3.0)
    with pytest.raises(ValueError, match="`batch`.*'a' of the model fails"):
        measure(batch=np.ones((4, 5), "float32"))
    unbuildable = keras.Sequential(
        [keras.layers.Dense(4), keras.layers.Reshape((3, 3))]
    )
    with pytest.raises(ValueError, match=r"`model`.*not built.*shape \(4, 8\)"):
        measure(on=unbuildable)
    with pytest.raises(ValueError, match="`model`"):
        measure(on=_Subclassed())
    with pytest.raises(ValueError, match="`repeats`"):
        measure(repeats=0)
    with pytest.raises(ValueError, match="`warmup`"):
        measure(warmup=-1)


# --- the search with per-device seconds, pure Python ------------------------


def _brute_force(device_costs, memory, inputs, capacity, keep_order):
    """`(bottleneck, sum of stages)` over every order, subset and split."""
    layers, devices = len(memory), len(device_costs)
    best = (math.inf, math.inf)
    orders = (
        [range(devices)]
        if keep_order
        else [
            order
            for size in range(1, min(devices, layers) + 1)
            for order in itertools.permutations(range(devices), size)
        ]
    )
    for order in orders:
        order = list(order)
        for cuts in itertools.combinations(range(1, layers), len(order) - 1):
            edges = (0, *cuts, layers)
            seconds = []
            for index, device in enumerate(order):
                start, end = edges[index], edges[index + 1]
                limit = capacity[device]
                if limit is not None and sum(memory[start:end]) > limit:
                    break
                seconds.append(
                    sum(device_costs[device][start:end]) + inputs[start]
                )
            else:
                value = (max(seconds), sum(seconds))
                if _placement_search.is_better(value, best):
                    best = value
    return best


def test_search_with_per_device_seconds_equals_brute_force():
    rng = random.Random(7)
    checked = 0
    for _ in range(150):
        layers, devices = rng.randint(1, 6), rng.randint(1, 3)
        device_costs = [
            [rng.uniform(0.1, 5.0) for _ in range(layers)]
            for _ in range(devices)
        ]
        memory = [rng.randint(1, 10) for _ in range(layers)]
        inputs = [0.0] + [rng.uniform(0.0, 1.0) for _ in range(layers - 1)]
        capacity = [
            rng.choice([None, rng.randint(5, 30)]) for _ in range(devices)
        ]
        speeds = [1.0] * devices
        want = _brute_force(device_costs, memory, inputs, capacity, False)
        found, _ = _placement_search.search(
            [0.0] * layers,
            memory,
            inputs,
            speeds,
            capacity,
            device_costs=device_costs,
        )
        if want[0] == math.inf:
            assert found is None
            continue
        got = _placement_search.bottleneck_and_total(
            found, None, inputs, speeds, device_costs
        )
        assert got == pytest.approx(want, rel=1e-9)
        if devices <= layers:
            fixed = _brute_force(device_costs, memory, inputs, capacity, True)
            if fixed[0] < math.inf:
                bounds = partition(
                    [0.0] * layers,
                    memory,
                    inputs,
                    speeds,
                    capacity,
                    device_costs=device_costs,
                )
                stages = [(d, s, e) for d, (s, e) in enumerate(bounds)]
                bottleneck, _ = _placement_search.bottleneck_and_total(
                    stages, None, inputs, speeds, device_costs
                )
                assert bottleneck == pytest.approx(fixed[0], rel=1e-9)
        checked += 1
    assert checked > 80
