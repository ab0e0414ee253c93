"""Real unequal devices: CPU quotas (Linux cgroups) and core pinning for
worker processes (`kh.testing.CpuQuota`, `run_workers(cpu_quotas=...)`).

Speeds are compared as ratios measured in the same run, never as absolute
times. A process's rate is its CPU seconds per wall second: the fraction of
one core it got, which a quota caps exactly and other load on the machine
can only lower.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import keras_hetero as kh
from keras_hetero.testing import cpu_quota

GROUP_ENV = "KH_CPU_QUOTA_GROUP"
# Test 4's model: compute per row dominates a step's fixed costs.
FEATURES = 256
WIDTH = 1024
ROWS_PER_REPLICA = 128


@pytest.fixture(scope="module")
def cgroups():
    available, reason = kh.testing.cpu_quota_available()
    if not available:
        pytest.skip(reason)


def _name():
    return f"kh-test-{uuid.uuid4().hex[:8]}"


def _burner():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/schedstat") as schedstat:
        return int(schedstat.read().split()[0]) / 1e9


def _rates(pids, seconds=1.0):
    """Each process's CPU seconds per wall second over `seconds`."""
    start = time.monotonic(), [_cpu_seconds(pid) for pid in pids]
    time.sleep(seconds)
    end = time.monotonic(), [_cpu_seconds(pid) for pid in pids]
    wall = end[0] - start[0]
    return [(b - a) / wall for a, b in zip(start[1], end[1])]


def _stop(*processes):
    for process in processes:
        process.kill()
        process.wait()


def test_quota_caps_a_process_and_changes_while_it_runs(cgroups):
    # An uncapped burner on an idle core runs at 1.0; other load on the
    # machine lowers that, so a capped rate is checked as a fraction of one
    # core, and the uncapped comparison is made between two burners.
    capped = _burner()
    free = None
    try:
        with kh.testing.CpuQuota(_name(), 0.1) as quota:
            quota.add_process(capped.pid)
            (tenth,) = _rates([capped.pid])
            quota.set(0.25)
            (quarter,) = _rates([capped.pid])
            assert 0.08 <= tenth <= 0.12, (tenth, quarter)
            assert 0.2 <= quarter <= 0.3, (tenth, quarter)
            assert quota.fraction == 0.25
            assert quota.processes() == {capped.pid}
            quota.set(None)
            free = _burner()
            uncapped, free_rate = _rates([capped.pid, free.pid])
            # As fast as a burner that never had a cap (both get the same
            # share of whatever else runs).
            assert uncapped > 0.75 * free_rate, (uncapped, free_rate)
            assert quota.fraction is None
    finally:
        _stop(*[p for p in (capped, free) if p is not None])


def test_group_is_removed_with_members_dead_or_alive(cgroups):
    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    alive = _burner()
    try:
        quota = kh.testing.CpuQuota(_name(), 0.5)
        quota.add_process(crashed.pid)
        quota.add_process(alive.pid)
        assert crashed.wait() == 3
        quota.remove()
        assert not os.path.exists(quota.path)
        assert alive.poll() is None  # moved out, not killed
        quota.remove()  # a second time: nothing to do
    finally:
        _stop(alive)


def test_group_is_removed_when_the_block_raises(cgroups):
    with pytest.raises(RuntimeError, match="the test fails"):
        with kh.testing.CpuQuota(_name(), 0.5) as quota:
            assert os.path.isdir(quota.path)
            raise RuntimeError("the test fails")
    assert not os.path.exists(quota.path)


# Loads cpu_quota.py without TensorFlow (a fresh interpreter importing it
# costs ~8 s of CPU here): its imports from the package are Keras, for
# the callbacks' base class, and the argument checks.
_EXIT_WITHOUT_REMOVE = """
import importlib.util, os, sys, types
compat = types.ModuleType("keras_hetero._compat")
compat.keras = types.SimpleNamespace(
    callbacks=types.SimpleNamespace(Callback=object)
)
# The package without its `__init__` (no TensorFlow): `_checks` is the
# real module, standard library only.
package = types.ModuleType("keras_hetero")
package.__path__ = [os.path.dirname(os.path.dirname(sys.argv[1]))]
sys.modules.update({"keras_hetero": package, "keras_hetero._compat": compat})
spec = importlib.util.spec_from_file_location("cpu_quota", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.CpuQuota(sys.argv[2], 0.5).path, flush=True)
raise RuntimeError("the test process fails")
"""


def test_group_is_removed_at_exit_of_a_failing_process(cgroups):
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _EXIT_WITHOUT_REMOVE,
            cpu_quota.__file__,
            _name(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "the test process fails" in result.stderr
    path = result.stdout.strip()
    assert path.startswith("/")
    assert not os.path.exists(path)


def _placement_worker():
    """Worker: its cores and group; worker 1 crashes after saying where."""
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(f"group={os.environ[GROUP_ENV]}", flush=True)
    if index == 1:
        raise RuntimeError("worker 1 crashes on purpose")
    quota = kh.testing.CpuQuota.attach()
    return {
        "cores": sorted(os.sched_getaffinity(0)),
        "member": os.getpid() in quota.processes(),
        "fraction": quota.fraction,
    }


@pytest.mark.slow
def test_run_workers_pins_caps_and_removes_groups_after_a_crash(cgroups):
    with kh.testing.CpuQuota(_name(), 0.5) as callers:
        results = kh.testing.run_workers(
            _placement_worker,
            2,
            timeout=60,
            check=False,
            cpu_quotas=[callers, 0.3],
            cores="auto",
        )
        first, second = results
        assert first.exit_code == 0, first.output
        assert first.value == {
            "cores": [sorted(os.sched_getaffinity(0))[0]],
            "member": True,
            "fraction": 0.5,
        }
        assert second.exit_code == 1
        assert "worker 1 crashes on purpose" in second.output
        paths = [re.search(r"group=(\S+)", r.output).group(1) for r in results]
        assert paths[0] == callers.path
        assert os.path.isdir(callers.path)  # the caller's to remove
        assert paths[1] != callers.path
        assert not os.path.exists(paths[1])
    assert not os.path.exists(callers.path)


def _thread_names():
    names = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/comm") as comm:
                names[int(entry)] = comm.read().strip()
        except OSError:  # the thread ended
            pass
    return names


def _wide_model(keras, model_class):
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    hidden = keras.layers.Dense(WIDTH, activation="relu")(hidden)
    model = model_class(inputs, keras.layers.Dense(1)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.001), loss="mse", jit_compile=False
    )
    return model


def _wide_data(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    return x, x[:, :1] * 0.5


def _compute_throttle_worker(slow_step, steps):
    """Worker: `fit` with its kernel threads capped from `slow_step` on."""
    keras = kh.keras
    stamps = []

    class Stamps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    model = _wide_model(keras, keras.Model)
    x, y = _wide_data(steps * ROWS_PER_REPLICA)
    throttle = kh.testing.ThrottleCompute()
    model.fit(
        x,
        y,
        batch_size=ROWS_PER_REPLICA,
        epochs=1,
        verbose=0,
        callbacks=[
            throttle,
            kh.testing.ThrottleAt(slow_step, 0.2),
            Stamps(),
        ],
    )
    quota = kh.testing.CpuQuota.attach()
    capped = quota.threads()
    return {
        "names": _thread_names(),
        "capped": sorted(capped),
        "moved": throttle.thread_ids,
        "fraction": quota.fraction,
        "step_seconds": np.diff(stamps).tolist(),
    }


@pytest.mark.slow
def test_compute_throttle_caps_only_the_kernel_threads(cgroups):
    slow_step, steps = 12, 24
    (result,) = kh.testing.run_workers(
        _compute_throttle_worker,
        1,
        timeout=120,
        args=(slow_step, steps),
        cpu_quotas=[None],
        cores="auto",
        throttle="compute",
    )
    value = result.value
    compute = {
        tid for tid, name in value["names"].items() if name == "tf_Compute"
    }
    assert compute, value["names"]
    capped = set(value["capped"])
    # Every kernel thread, and no other thread alive, is in the group.
    assert compute <= capped & set(value["moved"])
    assert capped & set(value["names"]) == compute
    assert len(value["names"]) > len(compute)
    assert value["fraction"] == pytest.approx(0.2)
    # step_seconds[i] is batch i + 1; the cap comes before batch slow_step.
    seconds = value["step_seconds"]
    before = np.median(seconds[2 : slow_step - 1])
    after = np.median(seconds[slow_step:])
    print(f"compute throttle: {before * 1e3:.1f} -> {after * 1e3:.1f} ms/step")
    assert after > 1.5 * before, seconds


def _runqueue_seconds():
    """Seconds this process's threads have waited, runnable, for a core:
    taken by other load, or (a capped process) held back by its quota."""
    total = 0
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/schedstat") as schedstat:
                total += int(schedstat.read().split()[1])
        except OSError:  # the thread ended
            pass
    return total / 1e9


def _hetero_fit_worker(steps):
    """Worker: MWMS `fit` of a HeteroModel; each step's seconds per row of
    every replica (`model.step_stats`), and how much of `fit` its threads
    waited for a core taken by other load."""
    import tensorflow as tf

    keras = kh.keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _wide_model(keras, kh.HeteroModel)
    global_batch = ROWS_PER_REPLICA * strategy.num_replicas_in_sync
    examples = tf.data.Dataset.from_tensor_slices(
        _wide_data(steps * global_batch)
    )
    data = kh.data.shard(examples, global_batch, strategy=strategy)
    seconds_per_row = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stats = self.model.step_stats
            seconds_per_row.append(stats.seconds_per_row.tolist())

    start = time.perf_counter(), _runqueue_seconds()
    model.fit(data, epochs=1, verbose=0, callbacks=[Record()])
    wall = time.perf_counter() - start[0]
    waited = _runqueue_seconds() - start[1]
    return {"seconds_per_row": seconds_per_row, "waited": waited / wall}


@pytest.mark.slow
def test_capped_worker_computes_slower_under_multi_worker_mirrored(cgroups):
    results = kh.testing.run_workers(
        _hetero_fit_worker,
        2,
        timeout=180,
        args=(30,),
        cpu_quotas=[1.0, 0.3],
        cores="auto",
    )
    # Every worker has every replica's numbers; skip the warm-up steps.
    seconds_per_row = np.array(results[0].value["seconds_per_row"])[3:]
    assert seconds_per_row.shape == (27, 2)
    median = np.median(seconds_per_row, axis=0)
    ratio = median[1] / median[0]
    waited = [round(r.value["waited"], 2) for r in results]
    print(f"capped / uncapped compute seconds per row: {ratio:.2f}")
    print(f"seconds waiting for a busy core per second of fit: {waited}")
    # Capacity ratio 1 / 0.3, less what other load on its core takes from
    # the uncapped worker: measured 1.6-2.3 with it waiting 0.4-0.7 s per
    # second for its core (a 2-core machine at load 4-6), 1.28 at 0.72.
    if ratio <= 1.5 and waited[0] > 0.3:
        pytest.skip(
            f"The uncapped worker's core is busy with other work (it waited "
            f"{waited[0]} s per second for it): ratio {ratio:.2f} measures "
            "that load, not the quota."
        )
    assert ratio > 1.5, (ratio, waited, seconds_per_row)


@pytest.mark.parametrize(
    "fraction", [0, -0.5, "0.4", True, math.nan, [0.5]], ids=repr
)
def test_invalid_fraction_names_the_value(fraction):
    expected = re.escape(f"fraction={fraction!r}")
    with pytest.raises(ValueError, match=expected):
        kh.testing.CpuQuota("kh-never-made", fraction)
    with pytest.raises(ValueError, match=expected):
        kh.testing.ThrottleAt(3, fraction)
    with pytest.raises(ValueError, match=re.escape("cpu_quotas=[1.0, ")):
        kh.testing.run_workers(print, 2, cpu_quotas=[1.0, fraction])


def test_other_invalid_arguments():
    with pytest.raises(ValueError, match="below the kernel's minimum"):
        kh.testing.CpuQuota("kh-never-made", 0.05)
    with pytest.raises(ValueError, match=r"period_us=500\b"):
        kh.testing.CpuQuota("kh-never-made", 0.5, period_us=500)
    with pytest.raises(ValueError, match=re.escape("name='a/b'")):
        kh.testing.CpuQuota("a/b", 0.5)
    with pytest.raises(ValueError, match=re.escape("step=-1")):
        kh.testing.ThrottleAt(-1, 0.5)
    with pytest.raises(ValueError, match=re.escape("cpu_quotas=[0.5]")):
        kh.testing.run_workers(print, 2, cpu_quotas=[0.5])
    with pytest.raises(ValueError, match=re.escape("cores=[0, 99]")):
        kh.testing.run_workers(print, 2, cores=[0, 99])
    with pytest.raises(ValueError, match=re.escape("throttle='gpu'")):
        kh.testing.run_workers(print, 1, throttle="gpu")


def test_attach_without_a_group_says_so(monkeypatch):
    monkeypatch.delenv(GROUP_ENV, raising=False)
    with pytest.raises(RuntimeError, match=GROUP_ENV):
        kh.testing.CpuQuota.attach()
