"""ElasticCheckpoint in one process: exact resume, atomicity, bad input."""

import logging
import os
import shutil
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import checkpointing
from keras_hetero._compat import keras
from keras_hetero.checkpointing import schedule
from keras_hetero.checkpointing import storage
from tests.conftest import DEVICES
from tests.support import helpers

BATCH = 8
ROWS = 80  # 10 global batches per epoch


class StopAfter(keras.callbacks.Callback):
    """Stops `fit` after `steps` train steps (a stand-in for a crash that
    happens right after a save)."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.done = 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.steps:
            self.model.stop_training = True


class StepIds(keras.callbacks.Callback):
    """Splits the ids a RecordIds layer saw into train steps."""

    def __init__(self, seen):
        super().__init__()
        self.seen, self.steps, self._mark = seen, [], 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(sorted(self.seen[self._mark :]))
        self._mark = len(self.seen)


def _model(strategy, seen, seed, steps_per_execution=1):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        return helpers.id_model(seen, 0.0, steps_per_execution)


def _data(strategy, shares=None):
    return kh.data.shard(
        helpers.id_examples(ROWS), BATCH, strategy=strategy, shares=shares
    )


def _interrupted_run(strategy, directory, steps, shares=None):
    """Trains until `steps`, saving every step; returns the ids it used."""
    seen = []
    model = _model(strategy, seen, seed=1)
    model.fit(
        _data(strategy, shares),
        epochs=1,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(directory, save_every=1),
            StopAfter(steps),
        ],
    )
    return seen


def _resumed_run(strategy, directory, epochs):
    """A fresh model (other initial weights) fit with a checkpoint in
    `directory`; returns the model and the ids it trained on."""
    seen = []
    model = _model(strategy, seen, seed=2)
    model.fit(
        _data(strategy),
        epochs=epochs,
        verbose=0,
        callbacks=[kh.callbacks.ElasticCheckpoint(directory)],
    )
    return model, seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_mid_epoch_resume_continues_exactly(tmp_path, async_save):
    strategy = helpers.mirrored(DEVICES[:2])
    reference = _model(strategy, [], seed=1)
    initial = reference.get_weights()
    reference.fit(_data(strategy), epochs=2, verbose=0)

    seen = []
    first = _model(strategy, seen, seed=1)
    first.set_weights(initial)
    ckpt = kh.callbacks.ElasticCheckpoint(
        tmp_path, save_every=3, async_save=async_save
    )
    first.fit(
        _data(strategy, [0.75, 0.25]),
        epochs=2,
        verbose=0,
        callbacks=[ckpt, StopAfter(4)],
    )
    assert ckpt.restored_from is None
    assert checkpointing.read_latest(tmp_path) == "ckpt-0000000004"
    trained_before = list(seen)
    assert len(trained_before) == 4 * BATCH

    # A new process would build the model afresh: other initial weights.
    seen.clear()
    second = _model(strategy, seen, seed=99)
    resumed = kh.callbacks.ElasticCheckpoint(tmp_path, save_every=3)
    history = second.fit(
        _data(strategy), epochs=2, verbose=0, callbacks=[resumed]
    )
    assert resumed.restored_from.endswith("ckpt-0000000004")
    epoch0 = trained_before + seen[: ROWS - len(trained_before)]
    epoch1 = seen[ROWS - len(trained_before) :]
    assert sorted(epoch0) == list(range(ROWS))
    assert sorted(epoch1) == list(range(ROWS))
    assert len(history.history["loss"]) == 2
    # Same shares restored (the checkpoint carried them).
    np.testing.assert_allclose(second_shares(resumed), [0.75, 0.25])
    helpers.assert_weights_close(second.get_weights(), reference.get_weights())


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_resume_counts_steps_not_calls(tmp_path, steps_per_execution):
    # Keras calls the batch callbacks once per `steps_per_execution` steps.
    strategy = helpers.mirrored(DEVICES[:2])
    reference = _model(strategy, [], seed=1)
    initial = reference.get_weights()
    reference.fit(_data(strategy), epochs=2, verbose=0)

    seen = []
    first = _model(strategy, seen, 1, steps_per_execution)
    first.set_weights(initial)
    first.fit(
        _data(strategy, [0.75, 0.25]),
        epochs=2,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(
                tmp_path, save_every=steps_per_execution
            ),
            StopAfter(2),
        ],
    )
    trained = 2 * steps_per_execution
    assert checkpointing.read_latest(tmp_path) == (
        storage.checkpoint_name(trained)
    )
    trained_before = list(seen)
    assert len(trained_before) == trained * BATCH

    seen.clear()
    second = _model(strategy, seen, 99, steps_per_execution)
    resumed = kh.callbacks.ElasticCheckpoint(tmp_path)
    second.fit(_data(strategy), epochs=2, verbose=0, callbacks=[resumed])
    epoch0 = trained_before + seen[: ROWS - len(trained_before)]
    assert sorted(epoch0) == list(range(ROWS))
    assert sorted(seen[ROWS - len(trained_before) :]) == list(range(ROWS))
    assert int(second.optimizer.iterations.numpy()) == 2 * ROWS // BATCH
    helpers.assert_weights_close(second.get_weights(), reference.get_weights())


def second_shares(callback):
    state = checkpointing.verify(
        os.path.join(
            callback.directory, checkpointing.read_latest(callback.directory)
        )
    )
    return state["shares"]


def test_resume_with_fewer_replicas_is_exactly_once(tmp_path):
    two = helpers.mirrored(DEVICES[:2])
    before = _interrupted_run(two, tmp_path, 6, shares=[0.25, 0.75])
    seen = []
    one = helpers.mirrored(DEVICES[:1])
    model = _model(one, seen, seed=5)
    resumed = kh.callbacks.ElasticCheckpoint(tmp_path, save_every=1)
    model.fit(_data(one), epochs=1, verbose=0, callbacks=[resumed])
    assert resumed.restored_from is not None
    assert sorted(before + seen) == list(range(ROWS))


def test_truncated_latest_falls_back_to_previous(tmp_path, caplog):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    ckpt = kh.callbacks.ElasticCheckpoint(
        tmp_path, save_every=2, async_save=False, keep=5
    )
    model.fit(
        _data(strategy), epochs=1, verbose=0, callbacks=[ckpt, StopAfter(6)]
    )
    names = checkpointing.list_checkpoints(tmp_path)
    assert names == ["ckpt-0000000002", "ckpt-0000000004", "ckpt-0000000006"]
    data_file = [
        f
        for f in os.listdir(tmp_path / names[-1])
        if f.startswith(storage.TENSORS + ".data")
    ][0]
    path = tmp_path / names[-1] / data_file
    path.write_bytes(path.read_bytes()[:-4])

    seen = []
    resumed_model = _model(strategy, seen, seed=3)
    resumed = kh.callbacks.ElasticCheckpoint(tmp_path, save_every=100)
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        resumed_model.fit(
            _data(strategy), epochs=1, verbose=0, callbacks=[resumed]
        )
    assert resumed.restored_from.endswith("ckpt-0000000004")
    assert "skipping checkpoint ckpt-0000000006" in caplog.text
    assert "truncated" in caplog.text
    assert len(seen) == ROWS - 4 * BATCH


def test_keeps_newest_and_never_leaves_partial_directories(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    ckpt = kh.callbacks.ElasticCheckpoint(
        tmp_path, save_every=1, keep=2, async_save=False
    )
    model.fit(_data(strategy), epochs=1, verbose=0, callbacks=[ckpt])
    assert checkpointing.list_checkpoints(tmp_path) == [
        "ckpt-0000000009",
        "ckpt-0000000010",
    ]
    assert checkpointing.read_latest(tmp_path) == "ckpt-0000000010"
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert leftovers == []
    assert [step for step, _, _ in ckpt.saves] == list(range(1, 11))


def test_async_saves_never_overlap(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    ckpt = kh.callbacks.ElasticCheckpoint(tmp_path, save_every=1, keep=20)
    model.fit(_data(strategy), epochs=1, verbose=0, callbacks=[ckpt])
    steps = [step for step, _, _ in ckpt.saves]
    # Every save is complete on disk, a step that came while one was in
    # flight waited for the next boundary, and the last step is saved.
    assert steps == sorted(set(steps)) and steps[-1] == 10
    names = checkpointing.list_checkpoints(tmp_path)
    assert names == [storage.checkpoint_name(s) for s in steps]
    for name in names:
        checkpointing.verify(os.path.join(tmp_path, name))
    assert all(w is not None for _, _, w in ckpt.saves)


def test_finished_job_restarts_as_a_no_op(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    model.fit(
        _data(strategy),
        epochs=1,
        verbose=0,
        callbacks=[kh.callbacks.ElasticCheckpoint(tmp_path)],
    )
    weights = model.get_weights()
    again, seen = _resumed_run(strategy, tmp_path, epochs=1)
    assert seen == []
    helpers.assert_weights_close(again.get_weights(), weights)


def test_rebalancer_state_travels_with_the_checkpoint(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    data = _data(strategy)
    rebalancer = kh.callbacks.ShardRebalancer(data, every_n_steps=2)
    model.fit(
        data,
        epochs=1,
        verbose=0,
        callbacks=[
            rebalancer,
            kh.callbacks.ElasticCheckpoint(tmp_path, save_every=1),
            StopAfter(5),
        ],
    )
    saved = rebalancer.get_state()
    data = _data(strategy)
    restored = kh.callbacks.ShardRebalancer(data, every_n_steps=2)
    probe = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not probe:
                probe.append(restored.get_state())

    model = _model(strategy, [], seed=1)
    model.fit(
        data,
        epochs=1,
        verbose=0,
        callbacks=[
            restored,
            kh.callbacks.ElasticCheckpoint(tmp_path, save_every=1),
            Probe(),
        ],
    )
    assert probe[0]["steps"] == saved["steps"]
    np.testing.assert_allclose(probe[0]["readings"], saved["readings"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"save_every": "soon"}, "save_every='soon'"),
        ({"save_every": 0}, "save_every=0"),
        ({"save_every": "-5m"}, "save_every='-5m'"),
        ({"keep": 0}, "keep=0"),
        ({"mtbf": "never"}, "mtbf='never'"),
    ],
)
def test_bad_arguments_fail_before_training(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        kh.callbacks.ElasticCheckpoint(tmp_path, **kwargs)


def test_unwritable_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot be written"):
        kh.callbacks.ElasticCheckpoint(blocker / "ckpt")


def test_plain_dataset_is_rejected(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    with pytest.raises(ValueError, match="HeteroDataset"):
        model.fit(
            helpers.id_examples(ROWS).batch(BATCH),
            callbacks=[kh.callbacks.ElasticCheckpoint(tmp_path)],
            verbose=0,
        )


def test_different_model_is_a_clear_error(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    _interrupted_run(strategy, tmp_path, 2)
    with strategy.scope():
        other = helpers.hetero_model()
    data = kh.data.shard(helpers.examples(), BATCH, strategy=strategy)
    with pytest.raises(ValueError, match="does not fit this model"):
        other.fit(
            data,
            verbose=0,
            callbacks=[kh.callbacks.ElasticCheckpoint(tmp_path)],
        )


def test_young_daly_interval_and_parsing():
    assert schedule.parse_save_every(25).steps == 25
    assert schedule.parse_save_every("90s").seconds == 90.0
    assert schedule.parse_save_every("2h").seconds == 7200.0
    assert schedule.parse_save_every("auto").auto
    # sqrt(2 * 2 s * 3600 s) = 120 s; a slow background write bounds it.
    assert schedule.young_daly_interval(2.0, 3600) == pytest.approx(120)
    assert schedule.young_daly_interval(2.0, 3600, minimum=300) == 300


def test_save_after_the_last_step_of_an_epoch_resumes_at_the_next(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    reference = _model(strategy, [], seed=1)
    initial = reference.get_weights()
    reference.fit(_data(strategy), epochs=2, verbose=0)
    model = _model(strategy, [], seed=1)
    model.set_weights(initial)
    # Step 10 ends epoch 0; its save comes before Keras ends the epoch.
    model.fit(
        _data(strategy),
        epochs=2,
        verbose=0,
        callbacks=[
            kh.callbacks.ElasticCheckpoint(tmp_path, save_every=10),
            StopAfter(11),
        ],
    )
    shutil.rmtree(tmp_path / "ckpt-0000000011")
    os.remove(tmp_path / storage.LATEST)
    state = checkpointing.verify(tmp_path / "ckpt-0000000010")
    assert (state["epoch"], state["step_in_epoch"]) == (1, 0)
    again, seen = _resumed_run(strategy, tmp_path, epochs=2)
    assert sorted(seen) == list(range(ROWS))
    helpers.assert_weights_close(again.get_weights(), reference.get_weights())


def test_resume_with_another_global_batch_scales_the_learning_rate(
    tmp_path, caplog
):
    strategy = helpers.mirrored(DEVICES[:2])
    before = _interrupted_run(strategy, tmp_path, 3)
    seen = []
    model = _model(strategy, seen, seed=1)
    bigger = kh.data.shard(helpers.id_examples(ROWS), 12, strategy=strategy)
    with pytest.raises(ValueError, match="global batch size 8; the dataset"):
        model.fit(
            bigger,
            verbose=0,
            callbacks=[kh.callbacks.ElasticCheckpoint(tmp_path)],
        )
    steps = []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(model.step_stats.rows.sum())

    resumed = kh.callbacks.ElasticCheckpoint(
        tmp_path, resize="scale_learning_rate"
    )
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        model.fit(bigger, verbose=0, callbacks=[resumed, Steps()])
    assert float(np.asarray(model.optimizer.learning_rate)) == pytest.approx(
        0.05 * 12 / 8
    )
    assert "linear scaling rule" in caplog.text
    # 56 examples were left: 4 batches of 12 and one of 8.
    assert steps == [12, 12, 12, 12, 8]
    assert sorted(before + seen) == list(range(ROWS))


def test_bad_resize_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="resize='shrink'"):
        kh.callbacks.ElasticCheckpoint(tmp_path, resize="shrink")


def test_shuffled_array_input_resumes_with_the_epoch_order(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    x, y, _, ids = helpers.arrays(ROWS)
    inputs = {"x": x, "id": ids}

    def fit(model, seen, callbacks):
        steps = StepIds(seen)
        model.fit(
            inputs,
            y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            callbacks=[*callbacks, steps],
        )
        return steps.steps

    seen = []
    reference = _model(strategy, seen, seed=1)
    initial = reference.get_weights()
    expected = fit(reference, seen, [])

    seen = []
    first = _model(strategy, seen, seed=1)
    first.set_weights(initial)
    ckpt = kh.callbacks.ElasticCheckpoint(tmp_path, save_every=1)
    before = fit(first, seen, [ckpt, StopAfter(13)])  # epoch 1, step 3
    # A new process: other random state, so another shuffle seed would be
    # drawn; the checkpoint's seed and pass give the epoch its order back.
    seen = []
    second = _model(strategy, seen, seed=99)
    resumed = kh.callbacks.ElasticCheckpoint(tmp_path)
    after = fit(second, seen, [resumed])
    assert resumed.restored_from is not None
    assert expected[0] != expected[10]  # the epochs' orders differ
    assert before + after == expected  # the same global batches
    helpers.assert_weights_close(second.get_weights(), reference.get_weights())


def test_one_replica_shards_arrays_for_the_checkpoint(tmp_path):
    # With one replica fit keeps Keras' adapter, unless an ElasticCheckpoint
    # needs the data position: then it shards the arrays, and resumes.
    strategy = tf.distribute.get_strategy()
    x, y, _, ids = helpers.arrays(ROWS)

    def fit(model, seen, directory, stop=None):
        steps = StepIds(seen)
        callbacks = [kh.callbacks.ElasticCheckpoint(directory, save_every=1)]
        model.fit(
            {"x": x, "id": ids},
            y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            callbacks=[*callbacks, *([StopAfter(stop)] if stop else []), steps],
        )
        return steps.steps

    seen = []
    expected = fit(_model(strategy, seen, seed=1), seen, tmp_path / "a")
    seen = []
    before = fit(_model(strategy, seen, seed=1), seen, tmp_path / "b", stop=7)
    seen = []
    after = fit(_model(strategy, seen, seed=5), seen, tmp_path / "b")
    assert before + after == expected
    in_order = [list(range(i * BATCH, (i + 1) * BATCH)) for i in range(10)]
    assert expected[:10] != in_order  # shuffled (Keras' default)


def test_telemetry_carries_stop_requests_in_the_summed_stats():
    # The carrier of `training.stopping` (the process test with two workers
    # is in test_elastic_processes.py): the request rides in the stats
    # vector, its sum arrives in the totals of the call, and a new fit
    # withdraws it.
    from keras_hetero.training import aggregation
    from keras_hetero.training import telemetry

    strategy = helpers.mirrored(DEVICES[:2])
    carrier = telemetry.Telemetry(strategy, DEVICES[:2], carries_stop=True)

    @tf.function
    def call():
        def step():
            stats = telemetry.stats_vector(2, tf.constant(3), 0.5)
            stats = carrier.with_stop_request(stats)
            (summed,) = aggregation.all_reduce_sum([stats])
            carrier.record(summed)

        strategy.run(step)

    def requests_after_a_call():
        call()
        carrier.snapshot()
        return carrier.stop_requests()

    carrier.reset()
    assert requests_after_a_call() == 0
    carrier.request_stop()
    assert requests_after_a_call() == 2  # one per replica
    assert carrier.step_stats().rows.tolist() == [3, 3]
    carrier.reset()
    assert requests_after_a_call() == 0


def test_auto_interval_follows_the_observed_time_between_restarts(
    tmp_path, monkeypatch
):
    from keras_hetero.checkpointing import callback as module

    strategy = helpers.mirrored(DEVICES[:2])
    first = kh.callbacks.ElasticCheckpoint(tmp_path, save_every=5, mtbf="1h")
    model = _model(strategy, [], seed=1)
    model.fit(_data(strategy), epochs=1, verbose=0, callbacks=[first])
    assert first.observed_mtbf is None  # no restart yet
    record = checkpointing.verify(tmp_path / "ckpt-0000000010")["failures"]
    assert record["restores"] == 0
    since = record["since"]

    def restarted(age):
        # A new process restores: the job restarted once more.
        monkeypatch.setattr(module, "_PROCESS", f"after {age}")
        callback = kh.callbacks.ElasticCheckpoint(tmp_path, mtbf="1h")
        _model(strategy, [], seed=1).fit(
            _data(strategy), epochs=2, verbose=0, callbacks=[callback]
        )
        return callback

    second = restarted(1)
    assert second.observed_mtbf == pytest.approx(time.time() - since, abs=5)
    assert second._failures["restores"] == 1
    # A checkpoint the same process wrote is not a restart; another is.
    monkeypatch.setattr(module, "_PROCESS", "after 1")
    same = kh.callbacks.ElasticCheckpoint(tmp_path)
    _model(strategy, [], seed=1).fit(
        _data(strategy), epochs=2, verbose=0, callbacks=[same]
    )
    assert same._failures["restores"] == 1
    third = restarted(2)
    assert third._failures == {"since": since, "restores": 2}
    # Young/Daly from the shorter of the prior and the observed MTBF:
    # restarts every ~30 s at a 0.02 s save cost give sqrt(2 * 0.02 * 30)
    # = 1.1 s between saves, not the prior's sqrt(2 * 0.02 * 3600) = 12 s.
    third._writer.cost, third._writer.write_seconds = 0.02, 0.01
    third._failures = {"since": time.time() - 60.0, "restores": 2}
    assert third.observed_mtbf == pytest.approx(30.0, abs=0.5)
    assert third.interval == pytest.approx((2 * 0.02 * 30) ** 0.5, rel=0.02)
    third._failures = {"since": time.time() - 36000.0, "restores": 1}
    assert third.interval == pytest.approx((2 * 0.02 * 3600) ** 0.5)


def _uninterrupted(strategy):
    """`(initial weights, final weights)` of 2 epochs without a stop."""
    reference = _model(strategy, [], seed=1)
    initial = reference.get_weights()
    reference.fit(_data(strategy), epochs=2, verbose=0)
    return initial, reference.get_weights()


def _fit_with(strategy, callback, seed, stop=None, initial=None):
    seen = []
    model = _model(strategy, seen, seed=seed)
    if initial is not None:
        model.set_weights(initial)
    model.fit(
        _data(strategy),
        epochs=2,
        verbose=0,
        callbacks=[callback] + ([StopAfter(stop)] if stop else []),
    )
    return model, seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_local_copy_restores_with_the_shared_directory_gone(
    tmp_path, caplog, async_save
):
    strategy = helpers.mirrored(DEVICES[:2])
    initial, reference = _uninterrupted(strategy)
    shared, local = tmp_path / "shared", tmp_path / "local"
    first = kh.callbacks.ElasticCheckpoint(
        shared, save_every=3, async_save=async_save, local_directory=local
    )
    _, before = _fit_with(strategy, first, 1, stop=7, initial=initial)
    # Both places hold the same saves (steps 3, 6 and the stop's 7; async
    # skips 6 if 3 is still being written).
    names = checkpointing.list_checkpoints(shared)
    assert names[-1] == "ckpt-0000000007" and names[0] == "ckpt-0000000003"
    assert checkpointing.list_checkpoints(local) == names
    shutil.rmtree(shared)  # the shared storage is gone
    resumed = kh.callbacks.ElasticCheckpoint(
        shared, save_every=3, local_directory=local
    )
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        model, after = _fit_with(strategy, resumed, 99)
    assert resumed.restored_from == str(local / "ckpt-0000000007")
    assert "step 7 from the local copy" in caplog.text
    assert sorted(before + after[: ROWS - len(before)]) == list(range(ROWS))
    helpers.assert_weights_close(model.get_weights(), reference)


def test_a_stale_local_copy_is_never_used(tmp_path, caplog):
    strategy = helpers.mirrored(DEVICES[:2])
    initial, reference = _uninterrupted(strategy)
    shared, local = tmp_path / "shared", tmp_path / "local"
    first = kh.callbacks.ElasticCheckpoint(
        shared, save_every=2, local_directory=local
    )
    _fit_with(strategy, first, 1, stop=4, initial=initial)
    # A run without local copies moves the shared checkpoints on to step 9
    # (e.g. on another machine): the local copy (step 4) is stale.
    second = kh.callbacks.ElasticCheckpoint(shared, save_every=5)
    _fit_with(strategy, second, 2, stop=5)
    assert checkpointing.read_latest(shared) == "ckpt-0000000009"
    third = kh.callbacks.ElasticCheckpoint(
        shared, save_every=2, local_directory=local
    )
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        model, _ = _fit_with(strategy, third, 3)
    assert third.restored_from == str(shared / "ckpt-0000000009")
    assert "ckpt-0000000004 (step 4) is older than" in caplog.text
    assert "not used" in caplog.text
    helpers.assert_weights_close(model.get_weights(), reference)


def test_a_full_local_disk_is_named_and_training_goes_on(
    tmp_path, caplog, monkeypatch
):
    import errno

    strategy = helpers.mirrored(DEVICES[:2])
    shared, local = tmp_path / "shared", tmp_path / "local"
    real_write = storage.write

    def write(directory, step, arrays, state):
        if str(directory) == str(local) and step >= 4:
            # As a full disk does: the copy fails part-way.
            os.makedirs(os.path.join(directory, ".tmp-ckpt-partial"))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(directory, step, arrays, state)

    monkeypatch.setattr(storage, "write", write)
    callback = kh.callbacks.ElasticCheckpoint(
        shared, save_every=2, local_directory=local
    )
    with caplog.at_level(logging.ERROR, logger="keras_hetero"):
        _fit_with(strategy, callback, 1)
    assert checkpointing.list_checkpoints(local) == ["ckpt-0000000002"]
    assert not [n for n in os.listdir(local) if n.startswith(".tmp")]
    assert checkpointing.read_latest(shared) == "ckpt-0000000020"
    assert f"local_directory={str(local)!r}" in caplog.text
    assert "No space left on device" in caplog.text
    assert caplog.text.count("cannot write the local copy") == 1


def test_local_directory_errors_name_the_value(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="local_directory=.*cannot be written"):
        kh.callbacks.ElasticCheckpoint(
            tmp_path / "shared", local_directory=blocker / "sub"
        )


def test_local_copies_on_several_workers_need_saves_every_n_steps(
    tmp_path, monkeypatch
):
    # Two workers stand in for MultiWorkerMirrored here (the real two-worker
    # case is in test_elastic_processes.py): a timed interval, decided on the
    # chief alone, would give each worker's copies other steps.
    from keras_hetero import _distribute

    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, [], seed=1)
    monkeypatch.setattr(_distribute, "is_multi_worker", lambda s: True)
    monkeypatch.setattr(_distribute, "num_workers", lambda s: 2)
    for every in ("auto", "30s"):
        callback = kh.callbacks.ElasticCheckpoint(
            tmp_path / "shared",
            save_every=every,
            local_directory=tmp_path / "local",
        )
        with pytest.raises(
            ValueError, match=f"save_every='{every}'.*2 workers.*steps"
        ):
            model.fit(_data(strategy), verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 0
