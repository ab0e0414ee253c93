"""Layout (c), one pipeline per worker replicated across workers, under
MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1."""

import pytest

import keras_hetero as kh
from tests.support import helpers
from tests.support import placement_workers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("microbatches", [1, 2])
def test_replicated_pipelines_equal_single_device(microbatches):
    shares = [0.75, 0.25]
    results = kh.testing.run_workers(
        placement_workers.replicated_pipeline_mwms,
        2,
        timeout=300,
        args=(shares, microbatches),
    )
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    for result in results:
        value = result.value
        assert value["num_replicas"] == 2
        # Each worker's two layers on its own two CPUs.
        assert sorted(value["devices"]) == ["/device:CPU:0", "/device:CPU:1"]
        helpers.assert_weights_close(value["weights"], reference.get_weights())
        assert value["loss"] == pytest.approx(
            reference_history["loss"], rel=1e-5
        )
