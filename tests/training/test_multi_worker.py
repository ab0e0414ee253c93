"""MultiWorkerMirroredStrategy with real worker processes on 127.0.0.1."""

import numpy as np
import pytest

import keras_hetero as kh
from tests.support import helpers
from tests.support import training_workers

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "num_workers, shares, steps_per_execution",
    [
        pytest.param(2, [0.75, 0.25], 1, marks=pytest.mark.both_flavours),
        (2, [1.0, 0.0], 1),
        (3, [0.5, 0.3, 0.2], 1),
        # 5 batches per epoch: calls of 2, 2 and 1 steps.
        pytest.param(3, [0.5, 0.3, 0.2], 2, marks=pytest.mark.both_flavours),
    ],
    ids=["2w-75_25", "2w-100_0", "3w-50_30_20", "3w-50_30_20-2_per_call"],
)
def test_fit_evaluate_predict_match_single_device(
    num_workers, shares, steps_per_execution
):
    results = kh.testing.run_workers(
        training_workers.train_mwms,
        num_workers,
        timeout=300,
        args=(shares, 2, True, True, steps_per_execution),
    )
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    expected_eval = reference.evaluate(
        helpers.examples(sample_weights=True).batch(helpers.GLOBAL_BATCH),
        return_dict=True,
        verbose=0,
    )
    x, _, _, _ = helpers.arrays()
    expected_predictions = reference.predict(x, verbose=0)
    for result in results:
        value = result.value
        assert value["num_replicas"] == num_workers
        helpers.assert_weights_close(value["weights"], reference.get_weights())
        for key in ("loss", "mae"):
            assert value["history"][key] == pytest.approx(
                reference_history[key], rel=1e-5
            )
            assert value["evaluation"][key] == pytest.approx(
                expected_eval[key], rel=1e-5
            )
        np.testing.assert_allclose(
            value["predictions"], expected_predictions, rtol=1e-5, atol=1e-6
        )
        # Every worker sees every replica's rows (last, partial batch: 8;
        # with 2 steps per call the last call has only that batch).
        expected_rows = kh.data.rows_from_shares(
            kh.data.validate_shares(shares, num_workers), 8
        )
        assert value["rows"].tolist() == expected_rows.tolist()
        assert len(value["devices"]) == num_workers
        assert len(set(value["devices"])) == num_workers
        # No per-step "does every worker have data" collective: a
        # `kh.data.shard` input gives every replica an element per step.
        # (Keras 3 with k > 1 steps per call reads `get_next_as_optional`,
        # which always checks.)
        if steps_per_execution == 1 or kh.FLAVOUR == "tf-keras":
            assert value["input_reduces_in_fit"] == 0


@pytest.mark.both_flavours
def test_bucketed_all_reduce_between_workers_matches_single_device():
    # 16 bytes a bucket: three collectives per step between the workers,
    # the telemetry and metrics in the last (tests/training/test_buckets.py).
    shares = [0.75, 0.25]
    results = kh.testing.run_workers(
        training_workers.train_mwms,
        2,
        timeout=300,
        args=(shares, 2, True, True, 1, 16),
    )
    reference, reference_history = helpers.reference_fit(
        sample_weights=True, regularizer=True
    )
    for result in results:
        value = result.value
        helpers.assert_weights_close(value["weights"], reference.get_weights())
        for key in ("loss", "mae"):
            assert value["history"][key] == pytest.approx(
                reference_history[key], rel=1e-5
            )
        assert value["rows"].tolist() == [6, 2]  # the last batch: 8 rows


@pytest.mark.both_flavours
def test_each_example_reaches_exactly_one_replica_once():
    shares = [0.7, 0.3]
    results = kh.testing.run_workers(
        training_workers.seen_ids_mwms, 2, timeout=180, args=(shares,)
    )
    per_worker = [r.value for r in results]
    assert len(per_worker[0]) == len(per_worker[1])
    seen = []
    for step_parts in zip(*per_worker):
        # Global replica order: worker 0's rows come first in each batch.
        batch = [
            row
            for worker_parts in step_parts
            for part in worker_parts
            for row in part
        ]
        assert batch == sorted(batch)
        seen.extend(batch)
    assert sorted(seen) == list(range(helpers.ROWS))


@pytest.mark.parametrize(
    "kind, steps_per_execution, rows",
    [
        ("tf.data", 1, 72),
        pytest.param("tf.data", 3, 96, marks=pytest.mark.both_flavours),
        ("tf.data", 3, 72),
        pytest.param("shard", 1, 72, marks=pytest.mark.both_flavours),
        ("shard", 3, 96),
    ],
    ids=[
        "tf.data",
        "tf.data-3_per_call",
        "tf.data-3_per_call_5_steps",
        "shard",
        "shard-3_per_call",
    ],
)
def test_epoch_boundaries_read_what_keras_own_iterators_read(
    kind, steps_per_execution, rows
):
    # `_compat.epochs`: one iterator across epochs where each epoch reads a
    # whole pass (a call's steps dividing it), shuffled each pass as before;
    # no iterator destroyed on the training thread.
    results = kh.testing.run_workers(
        training_workers.epoch_boundaries_mwms,
        2,
        timeout=300,
        args=(kind, steps_per_execution, rows),
    )
    steps = -(-rows // 16)
    for result in results:
        before, after = result.value["before"], result.value["after"]
        assert len(after["seen"]) == 3 * -(-steps // steps_per_execution)
        np.testing.assert_allclose(after["seen"], before["seen"], rtol=1e-6)
        helpers.assert_weights_close(
            after["weights"], before["weights"], rtol=1e-6, atol=1e-7
        )
        assert after["on_training_thread"] == 0
        # tf-keras shortens an epoch's last call: any call length works.
        if steps % steps_per_execution == 0 or kh.FLAVOUR == "tf-keras":
            assert after["made"] == 1
        else:
            assert after["made"] >= 3
