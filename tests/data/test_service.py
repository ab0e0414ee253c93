"""kh.data.shard(service=...): input through a real tf.data service
(dispatcher and two workers on 127.0.0.1), each training worker pulling
its replicas' rows per step."""

import glob
import os
import signal

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import arrow_workers
from tests.support import helpers


@pytest.fixture(scope="module")
def dispatcher():
    """A dispatcher with two service workers, in this process."""
    server, workers, address = helpers.tf_data_service()
    yield address
    del server, workers


def _replica_ids(strategy, data):
    """Per global batch, each replica's ids."""
    return [
        [
            [int(i) for i in part.numpy()]
            for part in strategy.experimental_local_results(x["id"])
        ]
        for x, _ in data.as_distributed_dataset()
    ]


def test_every_example_once_per_pass_rows_by_shares(dispatcher):
    strategy = helpers.mirrored(DEVICES[:2])
    data = kh.data.shard(
        helpers.id_examples(50),
        16,
        strategy=strategy,
        shares=[3, 1],
        service=dispatcher,
    )
    assert data.reads == "service" and data.num_batches == 4
    for _ in range(2):  # a new service job per pass
        batches = _replica_ids(strategy, data)
        ids = [i for batch in batches for part in batch for i in part]
        assert sorted(ids) == list(range(50))
        rows = [[len(part) for part in batch] for batch in batches]
        assert rows[:3] == [[12, 4]] * 3
        assert sum(rows[3]) == 2
    done = data.reads_done
    assert done["rows"] == 100
    assert [p["rows"] for p in done["passes"].values()] == [50, 50]


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_fit_equals_one_device_on_the_batches_the_service_made(
    dispatcher, tmp_path, steps_per_execution
):
    rows, global_batch = 70, 16
    strategy = helpers.mirrored(DEVICES[:2])
    ledger = kh.testing.Ledger(tmp_path / "ledger")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = helpers.id_model(
            ledger, [0.0, 0.0], steps_per_execution=steps_per_execution
        )
    initial = model.get_weights()
    data = kh.data.shard(
        helpers.id_examples(rows),
        global_batch,
        strategy=strategy,
        shares=[0.7, 0.3],
        service=dispatcher,
    )
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=2, tolerance=0.0
    )
    model.fit(data, epochs=2, verbose=0, callbacks=[ledger, rebalancer])
    report = kh.testing.read_ledger(tmp_path / "ledger", ids=range(rows))
    report.assert_exactly_once()
    assert report.finished == [0, 1]
    x, y, _, ids = helpers.arrays(rows)
    # Every example evaluated once: the mean loss over all of them.
    loss = model.evaluate(data, verbose=0)
    want = np.mean((model.predict({"x": x, "id": ids}, verbose=0) - y) ** 2)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    if steps_per_execution > 1:
        return  # the ledger has a line per call, not per step
    assert len(report.steps) == 2 * 5
    # One device, one step per global batch as the replicas held them.
    reference = helpers.id_model([], 0.0)
    reference.set_weights(initial)
    for batch in report.steps.values():
        batch = np.asarray(batch)
        reference.train_on_batch({"x": x[batch], "id": ids[batch]}, y[batch])
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_file_pipeline_runs_on_the_service_once_per_pass(
    dispatcher, tmp_path
):
    # The user's own pipeline, unchanged: TFRecord files read and parsed by
    # the service's workers, split between them by file.
    paths = arrow_workers.write_id_tfrecords(str(tmp_path / "r"), 60, 4)
    examples = (
        tf.data.TFRecordDataset(paths)
        .map(lambda record: arrow_workers.parse_id_records(record[None]))
        .map(lambda x, y: ({k: v[0] for k, v in x.items()}, y[0]))
        .apply(tf.data.experimental.assert_cardinality(60))
    )
    strategy = helpers.mirrored(DEVICES[:2])
    data = kh.data.shard(examples, 16, strategy=strategy, service=dispatcher)
    for _ in range(2):
        batches = _replica_ids(strategy, data)
        ids = [i for batch in batches for part in batch for i in part]
        assert sorted(ids) == list(range(60))
        assert len(batches) == 4


def test_bad_service_arguments_are_named(dispatcher):
    examples = helpers.id_examples(20)
    with pytest.raises(ValueError, match=r"cannot reach .*127\.0\.0\.1:1'"):
        kh.data.shard(examples, 8, service="grpc://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"service='http://x:5'"):
        kh.data.shard(examples, 8, service="http://x:5")
    with pytest.raises(ValueError, match=r"service=3\.5"):
        kh.data.shard(examples, 8, service=3.5)
    with pytest.raises(ValueError, match=r"does not go with shuffle=True"):
        kh.data.shard(examples, 8, service=dispatcher, shuffle=True)
    unknown = examples.filter(lambda *e: True)
    with pytest.raises(ValueError, match=r"unknown number .*assert_card"):
        kh.data.shard(unknown, 8, service=dispatcher)
    # Stages each service worker would apply to its own part of the data.
    for stage, named in (
        (lambda d: d.take(10), "`take`"),
        (lambda d: d.skip(2), "`skip`"),
        (lambda d: d.repeat(2), "`repeat`"),
        (
            lambda d: d.apply(tf.data.experimental.assert_cardinality(20)).map(
                lambda *e: e
            ),
            "`assert_cardinality` \\(but as the last stage\\)",
        ),
    ):
        with pytest.raises(
            ValueError, match=f"part, not to the whole: {named}"
        ):
            kh.data.shard(stage(examples), 8, service=dispatcher)
    data = kh.data.shard(examples, 8, service=dispatcher)
    with pytest.raises(ValueError, match=r"`cache` has no use"):
        data.cache()
    model = helpers.id_model([], 0.0)
    with pytest.raises(ValueError, match=r"`predict` over a tf.data service"):
        model.predict(data)


def test_reads_own_and_service_are_one_choice(dispatcher, tmp_path):
    directory = tmp_path / "records"
    arrow_workers.write_id_tfrecords(str(directory), 16, 1)
    kh.data.index_tfrecords(directory)
    records = kh.data.from_tfrecords(directory)
    with pytest.raises(ValueError, match=r"does not go with reads='own'"):
        kh.data.shard(records, 8, service=dispatcher, reads="own")


def _checkpoint_positions(directory):
    import json

    return sorted(
        (state["epoch"], state["step_in_epoch"])
        for state in (
            json.load(open(path))
            for path in glob.glob(os.path.join(directory, "*", "state.json"))
        )
    )


class _SignalAt(keras.callbacks.Callback):
    """Sends this process SIGTERM after train step `step` (1-based)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_checkpoints_only_at_epoch_ends_and_resume_there(dispatcher, tmp_path):
    # save_every=1 step: under a service input the saves happen at the
    # epochs' ends only; a signal mid-epoch stops without one, and the
    # restart trains that epoch again from its start: every finished epoch
    # exactly once in the ledger.
    rows, global_batch = 40, 8  # 5 steps per epoch
    folder, ledger_folder = tmp_path / "ckpt", tmp_path / "ledger"

    def run(attempt, signal_at, epochs):
        keras.utils.set_random_seed(2)
        ledger = kh.testing.Ledger(ledger_folder, attempt=attempt)
        model = helpers.id_model(ledger, 0.0)
        data = kh.data.shard(
            helpers.id_examples(rows), global_batch, service=dispatcher
        )
        ckpt = kh.callbacks.ElasticCheckpoint(
            folder, save_every=1, keep=10, exit_on_signal=False
        )
        callbacks = [ledger, ckpt]
        if signal_at is not None:
            callbacks.append(_SignalAt(signal_at))
        model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
        return ckpt

    first = run(0, signal_at=7, epochs=3)  # mid-epoch 1
    assert first.preempted
    assert _checkpoint_positions(folder) == [(1, 0)]
    second = run(1, signal_at=None, epochs=3)
    assert second.restored_from is not None
    assert _checkpoint_positions(folder) == [(1, 0), (2, 0), (3, 0)]
    report = kh.testing.read_ledger(ledger_folder, ids=range(rows))
    report.assert_exactly_once()
    assert report.finished == [0, 1, 2]


def test_a_mid_epoch_checkpoint_is_not_resumed_through_a_service(
    dispatcher, tmp_path
):
    folder = tmp_path / "ckpt"
    model = helpers.id_model([], 0.0)
    data = kh.data.shard(helpers.id_examples(40), 8)
    ckpt = kh.callbacks.ElasticCheckpoint(
        folder, save_every=100, exit_on_signal=False
    )
    model.fit(data, epochs=1, verbose=0, callbacks=[ckpt, _SignalAt(3)])
    assert _checkpoint_positions(folder) == [(0, 4)]  # the next step
    served = kh.data.shard(helpers.id_examples(40), 8, service=dispatcher)
    ckpt = kh.callbacks.ElasticCheckpoint(folder)
    with pytest.raises(ValueError, match=r"saved mid-epoch.*tf.data service"):
        model.fit(served, epochs=1, verbose=0, callbacks=[ckpt])


@pytest.mark.slow
@pytest.mark.both_flavours
def test_two_workers_pull_their_rows_from_one_service_job(dispatcher, tmp_path):
    # Two training processes (MultiWorkerMirroredStrategy), one service job
    # per epoch between them: the service reads every example once per
    # epoch, each example trains once (the ledger), the rows follow the
    # moving shares, and the weights are one device's on the global batches
    # the workers held.
    rows, global_batch = 24 * 6 + 5, 24
    results = kh.testing.run_workers(
        arrow_workers.fit_service_ids_mwms,
        2,
        timeout=240,
        args=(dispatcher, str(tmp_path / "ledger"), rows, global_batch),
    )
    first, second = (r.value for r in results)
    assert first["changes"] == second["changes"] and first["changes"]
    report = kh.testing.read_ledger(tmp_path / "ledger", ids=range(rows))
    report.assert_exactly_once()
    assert report.finished == [0, 1]
    for epoch in (0, 1):
        received = sum(
            w["read"]["passes"][epoch]["rows"] for w in (first, second)
        )
        assert received == rows
    reference = helpers.id_model([], 0.0)
    reference.set_weights(first["initial"])
    x, y, _, ids = helpers.arrays(rows)
    for batch in report.steps.values():
        batch = np.asarray(batch)
        reference.train_on_batch({"x": x[batch], "id": ids[batch]}, y[batch])
    for got, want in zip(first["weights"], reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
