"""kh.testing's exactly-once ledger: what `Ledger` writes in a real `fit`,
and that `read_ledger` merges restarts as a resume counts them and names
every missing, repeated and unexpected example."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import helpers

ROWS, BATCH = 40, 8


def _fit(folder, shares, steps_per_execution=1, epochs=2, callbacks=()):
    strategy = helpers.mirrored(DEVICES[: len(shares)])
    ledger = kh.testing.Ledger(folder)
    with strategy.scope():
        model = helpers.id_model(
            ledger, 0.0, steps_per_execution=steps_per_execution
        )
    data = kh.data.shard(
        helpers.id_examples(ROWS),
        BATCH,
        strategy=strategy,
        shares=shares,
        shuffle=True,
        seed=3,
    )
    model.fit(data, epochs=epochs, verbose=0, callbacks=[ledger, *callbacks])
    return model


@pytest.mark.parametrize(
    "shares, steps_per_execution",
    [([1.0], 1), ([3.0, 1.0], 1), ([1.0, 2.0, 0.0], 1), ([3.0, 1.0], 5)],
    ids=["one-device", "3:1", "1:2:0", "3:1-5_per_call"],
)
def test_a_fit_writes_every_example_once_per_epoch(
    tmp_path, shares, steps_per_execution
):
    _fit(str(tmp_path), shares, steps_per_execution)
    report = kh.testing.read_ledger(str(tmp_path), ids=range(ROWS))
    report.assert_exactly_once()
    assert report.finished == [0, 1]
    assert report.restored == [0]
    # One line per call: with 5 steps per call, steps 5 and 10 hold five
    # steps' rows each.
    per_call = BATCH * steps_per_execution
    calls = range(steps_per_execution, 10 + 1, steps_per_execution)
    assert {s: len(ids) for s, ids in report.steps.items()} == {
        s: per_call for s in calls
    }
    # The epochs are shuffled: their orders differ.
    first = sum((report.steps[s] for s in calls if s <= 5), [])
    assert sorted(first) != sorted(range(ROWS // 2))
    assert "2 finished epoch(s)" in report.summary()


def test_evaluate_and_predict_record_nothing(tmp_path):
    model = _fit(str(tmp_path), [1.0], epochs=1)
    before = open(tmp_path / "attempt0-worker0.jsonl").read()
    x, y, _, ids = helpers.arrays(ROWS)
    model.evaluate({"x": x, "id": ids}, y, verbose=0)
    model.predict({"x": x, "id": ids}, verbose=0)
    assert open(tmp_path / "attempt0-worker0.jsonl").read() == before


def test_a_resume_from_a_checkpoint_is_merged_and_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 7:
                self.model.stop_training = True

    save = kh.callbacks.ElasticCheckpoint(ckpt, save_every=1, async_save=False)
    out = str(tmp_path / "ledger")
    _fit(out, [3.0, 1.0], callbacks=[save, StopAt()])
    # A later attempt resumes after step 7 (the same process here; a
    # launcher sets KERAS_HETERO_RESTART).
    os.environ["KERAS_HETERO_RESTART"] = "1"
    try:
        save = kh.callbacks.ElasticCheckpoint(ckpt, save_every=1)
        _fit(out, [3.0, 1.0], callbacks=[save])
    finally:
        del os.environ["KERAS_HETERO_RESTART"]
    report = kh.testing.read_ledger(out, ids=range(ROWS))
    assert report.restored == [0, 7]
    assert sorted(report.steps) == list(range(1, 11))
    report.assert_exactly_once()
    assert report.finished == [0, 1]


def _write(folder, name, *records):
    with open(os.path.join(folder, name), "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _step(step, epoch, ids):
    return {"step": step, "epoch": epoch, "ids": list(ids)}


def _killed_run(folder, second_start):
    """Two workers, 3 steps per epoch of ids 0-11 (2 per worker and step);
    attempt 0 trains steps 1-5 and is killed, attempt 1 starts after
    `second_start` and trains to step 6 as if resuming there."""
    order = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    for worker in (0, 1):

        def rows(step, worker=worker):
            return order[(step - 1) % 3][2 * worker : 2 * worker + 2]

        name = f"attempt0-worker{worker}.jsonl"
        _write(folder, name, {"start": 0})
        _write(folder, name, *(_step(s, 0, rows(s)) for s in range(1, 4)))
        _write(folder, name, {"epoch_end": 0, "step": 3})
        _write(folder, name, *(_step(s, 1, rows(s)) for s in (4, 5)))
        name = f"attempt1-worker{worker}.jsonl"
        _write(folder, name, {"start": second_start})
        _write(
            folder,
            name,
            *(
                _step(s, 1 if s > 3 else 0, rows(s))
                for s in range(second_start + 1, 7)
            ),
        )
        _write(folder, name, {"epoch_end": 1, "step": 6})


def test_the_reader_counts_each_attempt_up_to_the_next_ones_resume(tmp_path):
    _killed_run(str(tmp_path), second_start=4)
    report = kh.testing.read_ledger(str(tmp_path), ids=range(12))
    assert report.restored == [0, 4]
    assert sorted(report.steps) == [1, 2, 3, 4, 5, 6]
    # Step 5 of attempt 0 was trained again by attempt 1: counted once.
    assert report.steps[5] == [4, 5, 6, 7]
    report.assert_exactly_once()


def test_the_reader_names_missing_and_repeated_examples(tmp_path):
    # Attempt 1 claims to resume after step 5 but trains step 5's rows
    # again as step 6 (a resume on the wrong examples): 8-11 never trained
    # in epoch 1, 4-7 twice.
    folder = str(tmp_path)
    _killed_run(folder, second_start=5)
    for worker in (0, 1):
        path = os.path.join(folder, f"attempt1-worker{worker}.jsonl")
        lines = open(path).read().splitlines()
        record = json.loads(lines[1])
        record["ids"] = [4 + 2 * worker, 5 + 2 * worker]
        lines[1] = json.dumps(record)
        open(path, "w").write("\n".join(lines) + "\n")
    report = kh.testing.read_ledger(folder, ids=range(12))
    assert not report.exactly_once
    assert report.missing == {1: [8, 9, 10, 11]}
    assert report.duplicated == {1: [4, 5, 6, 7]}
    assert report.counts() == (4, 4, 0)
    with pytest.raises(AssertionError, match=r"epoch 1: 4 missing: \[8,"):
        report.assert_exactly_once()


def test_an_unfinished_epoch_is_checked_for_repeats_only(tmp_path):
    folder = str(tmp_path)
    _write(folder, "attempt0-worker0.jsonl", {"start": 0}, _step(1, 0, [2, 5]))
    report = kh.testing.read_ledger(folder, ids=range(8))
    assert report.finished == [] and report.exactly_once
    assert "partial epoch(s) [0]" in report.summary()
    _write(folder, "attempt0-worker0.jsonl", _step(2, 0, [5, 9]))
    report = kh.testing.read_ledger(folder, ids=range(8))
    assert report.duplicated == {0: [5]} and report.unexpected == {0: [9]}


def test_string_ids_and_a_line_cut_by_a_kill(tmp_path):
    folder = str(tmp_path)
    seen = []
    layer = kh.testing.RecordIds(seen)
    names = tf.constant(["cat.jpg", "dog.jpg"])
    layer([tf.zeros((2, 1)), names], training=True)
    assert seen == [kh.testing.ledger_key(n) for n in ("cat.jpg", "dog.jpg")]
    _write(folder, "attempt0-worker0.jsonl", {"start": 0}, _step(1, 0, seen))
    _write(folder, "attempt0-worker0.jsonl", {"epoch_end": 0, "step": 1})
    with open(os.path.join(folder, "attempt0-worker0.jsonl"), "a") as f:
        f.write('{"step": 2, "epoch": 1, "ids": [12')  # killed mid-line
    report = kh.testing.read_ledger(folder, ids=[b"cat.jpg", "dog.jpg"])
    assert sorted(report.steps) == [1]
    report.assert_exactly_once()


def test_bad_ledgers_and_arguments_are_named(tmp_path):
    folder = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="No ledger file"):
        kh.testing.read_ledger(folder)
    _write(folder, "attempt0-worker0.jsonl", _step(1, 0, [1]))
    with pytest.raises(ValueError, match="before the attempt's `start`"):
        kh.testing.read_ledger(folder)
    os.remove(os.path.join(folder, "attempt0-worker0.jsonl"))
    _write(folder, "attempt0-worker0.jsonl", {"start": 0})
    _write(folder, "attempt0-worker1.jsonl", {"start": 2})
    with pytest.raises(ValueError, match="different steps"):
        kh.testing.read_ledger(folder)
    with open(os.path.join(folder, "attempt0-worker0.jsonl"), "a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match="line 2 of"):
        kh.testing.read_ledger(folder)
    with pytest.raises(ValueError, match="worker=-1"):
        kh.testing.Ledger(folder, worker=-1)
    with pytest.raises(TypeError, match="Expected a `kh.testing.Ledger`"):
        kh.testing.RecordIds({})
    with pytest.raises(TypeError, match="Invalid example id: 1.5"):
        kh.testing.ledger_key(1.5)
    assert kh.testing.ledger_key(np.int64(4)) == 4


def test_worker_and_attempt_come_from_the_launchers_environment(
    tmp_path, monkeypatch
):
    config = {
        "cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
        "task": {"type": "worker", "index": 1},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    monkeypatch.setenv("KERAS_HETERO_RESTART", "3")
    ledger = kh.testing.Ledger(str(tmp_path))
    assert ledger.path.endswith("attempt3-worker2.jsonl")


def test_an_epoch_stopped_mid_way_is_not_finished(tmp_path):
    # Keras ends the epoch a callback stopped too: its missing examples
    # are not missing, but the run's repeats still are.
    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 7:
                self.model.stop_training = True

    _fit(str(tmp_path), [1.0, 1.0], callbacks=[StopAt()])
    report = kh.testing.read_ledger(str(tmp_path), ids=range(ROWS))
    assert report.finished == [0] and sorted(report.epochs) == [0, 1]
    assert len(report.epochs[1]) == 2 * BATCH
    report.assert_exactly_once()
