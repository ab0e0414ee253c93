"""One device description (`keras_hetero.devices`) and the emulated fleet
of `kh.testing` (a test seam) that goes through it."""

import json

import pytest

import keras_hetero as kh
from keras_hetero import devices
from keras_hetero import precision
from keras_hetero.doctor import devices as doctor_devices
from keras_hetero.doctor import host as host_lib
from tests.support import helpers


def test_a_cpu_describes_itself_as_the_host_cpu():
    described = devices.describe("/device:CPU:0")
    assert (described.kind, described.model) == ("CPU", "host CPU")
    assert described.compute_capability is None
    assert described.bfloat16 is False
    assert described.emulated is False
    assert described.memory_bytes > 0


@pytest.mark.parametrize(
    "fleet, expected",
    [
        ("A100", ("GPU", "A100-SXM4-80GB", (8, 0), 80 << 30, True)),
        ("T4", ("GPU", "Tesla T4", (7, 5), 16 << 30, False)),
        ("H100", ("GPU", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, True)),
        ("CPU", ("CPU", "host CPU", None, None, False)),
    ],
)
def test_an_emulated_device_is_described_as_its_fleet_entry(fleet, expected):
    with kh.testing.emulated_fleet(fleet):
        described = devices.describe("/device:CPU:0")
    assert (
        described.kind,
        described.model,
        described.compute_capability,
        described.memory_bytes,
        described.bfloat16,
    ) == expected
    assert described.name == "/device:CPU:0"  # the ops still run there
    assert described.emulated


def test_a_list_gives_each_worker_its_entry():
    def worker(index):
        config = {
            "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": index},
        }
        return {
            devices.EMULATE_ENV: json.dumps(["A100", "T4"]),
            "TF_CONFIG": json.dumps(config),
        }

    assert devices.emulated_entry(worker(0))["model"] == "A100-SXM4-80GB"
    assert devices.emulated_entry(worker(1))["model"] == "Tesla T4"
    config = json.loads(worker(0)["TF_CONFIG"])
    config["cluster"]["worker"].append("127.0.0.1:3")
    config["task"]["index"] = 2
    too_few = {**worker(0), "TF_CONFIG": json.dumps(config)}
    with pytest.raises(
        ValueError, match="one per worker, but this is worker 2"
    ):
        devices.emulated_entry(too_few)


def test_the_seam_restores_the_environment_and_checks_entries():
    assert devices.emulated_entry() is None
    with kh.testing.emulated_fleet(
        {"kind": "gpu", "compute_capability": [7, 0]}
    ):
        described = devices.describe("/device:CPU:0")
        assert (described.kind, described.compute_capability) == ("GPU", (7, 0))
    assert devices.emulated_entry() is None
    with pytest.raises(ValueError, match="'P100'"):
        with kh.testing.emulated_fleet(["A100", "P100"]):
            pass
    assert devices.emulated_entry() is None


def test_a_description_round_trips_through_json():
    with kh.testing.emulated_fleet("T4"):
        described = devices.describe("/device:CPU:0")
    values = json.loads(json.dumps(described.to_dict()))
    assert devices.DeviceDescription.from_dict(values) == described


@pytest.mark.parametrize(
    "fleet, expected",
    [
        (["A100", "T4"], "mixed_float16"),
        (["A100", "T4", "CPU"], "float32"),
        (["A100", "CPU"], "float32"),
        (["H100", "A100"], "mixed_bfloat16"),
        (["T4", "V100"], "mixed_float16"),
    ],
)
def test_auto_rule_from_descriptions(fleet, expected):
    described = []
    for entry in fleet:
        with kh.testing.emulated_fleet(entry):
            described.append(devices.describe("/device:CPU:0"))
    assert precision.auto_precision(described) == expected


def test_auto_reads_the_description_of_the_strategys_devices():
    strategy = helpers.mirrored(["/device:CPU:0", "/device:CPU:1"])
    for fleet, expected in (
        ("A100", "mixed_bfloat16"),
        ("T4", "mixed_float16"),
    ):
        with kh.testing.emulated_fleet(fleet):
            assert precision.resolve("auto", strategy) == expected
    assert precision.resolve("auto", strategy) == "float32"


def test_the_doctor_reads_the_same_description():
    host = host_lib.host_report()
    with kh.testing.emulated_fleet("T4"):
        report = doctor_devices.describe("/device:CPU:0", host)
    assert report.kind == "GPU"
    assert report.description == "Tesla T4 (cc 7.5) [emulated]"
    assert report.memory_bytes == 16 << 30
    assert precision.auto_precision([report]) == "mixed_float16"
    plain = doctor_devices.describe("/device:CPU:0", host)
    assert (plain.kind, plain.description) == ("CPU", "host CPU")
    assert plain.memory_bytes == host.memory_bytes
