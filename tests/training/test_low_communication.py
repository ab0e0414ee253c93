"""Low-communication training (`kh.LowCommunication`): local steps, a
row-weighted pseudo-gradient every `sync_every` steps, an outer optimizer.

The reference is the algorithm written out with one plain Keras model per
replica (`_diloco_reference`)."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero._compat import keras
from keras_hetero.training import runtime
from tests.conftest import DEVICES
from tests.support import helpers

SHARES = [0.75, 0.25]


def _inner_optimizer():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def _outer_optimizer():
    return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)


def _replica_batches(shares, epochs):
    """Per epoch, per global batch: each replica's (x, y) rows."""
    x, y, _, _ = helpers.arrays()
    epochs_out = []
    for _ in range(epochs):
        batches = []
        for start in range(0, len(x), helpers.GLOBAL_BATCH):
            bx = x[start : start + helpers.GLOBAL_BATCH]
            by = y[start : start + helpers.GLOBAL_BATCH]
            rows = kh.data.rows_from_shares(np.asarray(shares), len(bx))
            edges = np.concatenate([[0], np.cumsum(rows)])
            batches.append(
                [(bx[a:b], by[a:b]) for a, b in zip(edges[:-1], edges[1:])]
            )
        epochs_out.append(batches)
    return epochs_out


def _diloco_reference(sync_every, shares=SHARES, epochs=2, outer=None):
    """The algorithm with one Keras model per replica (no strategy)."""
    start = helpers.initial_weights()
    replicas = []
    for _ in shares:
        model = keras.Model(*helpers.layers())
        model.compile(optimizer=_inner_optimizer(), loss="mse")
        model.set_weights(start)
        replicas.append(model)
    anchors = [tf.Variable(v) for v in replicas[0].get_weights()]
    outer = outer or _outer_optimizer()
    rows = np.zeros(len(shares))
    steps = 0

    def synchronise():
        nonlocal steps
        total = rows.sum()
        pseudo = []
        for index, anchor in enumerate(anchors):
            delta = sum(
                rows[r] / total * (anchor.numpy() - m.get_weights()[index])
                for r, m in enumerate(replicas)
            )
            pseudo.append(tf.constant(delta, tf.float32))
        outer.apply_gradients(zip(pseudo, anchors))
        for model in replicas:
            model.set_weights([a.numpy() for a in anchors])
        rows[:] = 0
        steps = 0

    for batches in _replica_batches(shares, epochs):
        for batch in batches:
            for r, (bx, by) in enumerate(batch):
                if len(bx):
                    replicas[r].train_on_batch(bx, by)
                rows[r] += len(bx)
            steps += 1
            if steps == sync_every:
                synchronise()
        if steps:
            synchronise()  # the round ends at the epoch's end
    return [a.numpy() for a in anchors]


def _model(strategy, mode, steps_per_execution=1, **kwargs):
    with strategy.scope():
        model = kh.HeteroModel(
            *helpers.layers(), low_communication=mode, **kwargs
        )
        model.compile(
            optimizer=_inner_optimizer(),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
        model.set_weights(helpers.initial_weights())
    return model


def _fit(model, strategy, shares=SHARES, epochs=2, **kwargs):
    data = kh.data.shard(
        helpers.examples(),
        helpers.GLOBAL_BATCH,
        strategy=strategy,
        shares=shares,
    )
    return model.fit(data, epochs=epochs, verbose=0, **kwargs)


@pytest.mark.parametrize("shares", [SHARES, [0.5, 0.5]], ids=["75_25", "50_50"])
def test_one_inner_step_and_outer_sgd_1_equals_synchronous_training(shares):
    strategy = helpers.mirrored(DEVICES[:2])
    mode = kh.LowCommunication(1, outer_optimizer=keras.optimizers.SGD(1.0))
    model = _model(strategy, mode)
    _fit(model, strategy, shares)
    with strategy.scope():
        synchronous = helpers.hetero_model()
    _fit(synchronous, strategy, shares)
    reference, _ = helpers.reference_fit()
    helpers.assert_weights_close(model.get_weights(), reference.get_weights())
    helpers.assert_weights_close(model.get_weights(), synchronous.get_weights())


@pytest.mark.parametrize(
    "sync_every, steps_per_execution", [(2, 1), (3, 1), (2, 2)]
)
def test_local_steps_and_nesterov_outer_step_match_the_algorithm(
    sync_every, steps_per_execution
):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(
        strategy, kh.LowCommunication(sync_every), steps_per_execution
    )
    _fit(model, strategy)
    expected = _diloco_reference(sync_every)
    helpers.assert_weights_close(model.get_weights(), expected, rtol=1e-4)
    # The outer step moved the weights: not what H local steps alone give.
    plain = _diloco_reference(sync_every, outer=keras.optimizers.SGD(1.0))
    assert not np.allclose(model.get_weights()[0], plain[0], rtol=1e-3)


def test_three_replicas_with_an_empty_one():
    strategy = helpers.mirrored(DEVICES[:3])
    shares = [0.6, 0.4, 0.0]
    model = _model(strategy, kh.LowCommunication(2))
    _fit(model, strategy, shares)
    expected = _diloco_reference(2, shares=shares)
    helpers.assert_weights_close(model.get_weights(), expected, rtol=1e-4)


class _ReplicaWeights(keras.callbacks.Callback):
    """After each batch: whether the replicas' first weights agree."""

    def __init__(self):
        super().__init__()
        self.agree, self.stats = [], []

    def on_train_batch_end(self, batch, logs=None):
        weight = self.model.trainable_variables[0]
        weight = getattr(weight, "_value", weight)  # Keras 3: the tf.Variable
        strategy = self.model.distribute_strategy
        copies = [
            v.numpy() for v in strategy.experimental_local_results(weight)
        ]
        self.agree.append(np.allclose(copies[0], copies[1]))
        if batch is not None:
            self.stats.append(self.model.step_stats)


def test_replicas_train_apart_between_synchronisations_without_collectives(
    monkeypatch,
):
    calls, synchronising = [], [False]
    for name in ("all_reduce", "all_gather", "merge_call"):
        original = getattr(tf.distribute.ReplicaContext, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if _name == "merge_call":  # which one: the optimizer's, or not
                function = args[0] if args else kwargs.get("merge_fn")
                _name = "merge_call " + getattr(function, "__name__", "")
            calls.append((_name, synchronising[0]))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(tf.distribute.ReplicaContext, name, counted)
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, kh.LowCommunication(3))
    watch = _ReplicaWeights()
    local = runtime.local_training(model)
    synchronise = local._synchronise

    def marked(*args):
        synchronising[0] = True
        try:
            return synchronise(*args)
        finally:
            synchronising[0] = False

    monkeypatch.setattr(local, "_synchronise", marked)
    _fit(model, strategy, epochs=1, callbacks=[watch])
    # Rounds end after step 3 and at the epoch's end (after its last batch).
    assert watch.agree == [False, False, True, False, False]
    watch.on_train_batch_end(None)
    assert watch.agree[-1]
    # The step's trace has no collective (its only merge_call is the
    # optimizer's per-replica update); the synchronisation has them.
    in_step = {name for name, sync in calls if not sync}
    # tf-keras metrics read in a merge_call (`merge_fn_wrapper`) would
    # all-reduce every metric variable at every step.
    assert not any("merge_fn_wrapper" in name for name in in_step)
    assert ("all_reduce", True) in calls
    # The epoch's last round (steps 4 and 5), synchronised at its end.
    stats = model.step_stats
    assert (stats.steps, stats.measured_steps) == (0, 2)
    assert stats.rows.tolist() == [12 + 6, 4 + 2]
    assert [(s.steps, s.measured_steps) for s in watch.stats] == [
        (1, 0),
        (1, 0),
        (1, 3),
        (1, 0),
        (1, 0),
    ]
    assert watch.stats[2].rows.tolist() == [12 * 3, 4 * 3]
    # Waits at the synchronisation before (none before the first).
    assert watch.stats[2].wait_seconds.tolist() == [0.0, 0.0]
    assert stats.wait_seconds.shape == (2,) and np.all(stats.wait_seconds >= 0)
    assert np.any(stats.wait_seconds > 0)


@pytest.mark.parametrize(
    "compression, rtol", [("fp16", 1e-2), ("bf16", 5e-2), ("int8", 5e-2)]
)
def test_compressed_pseudo_gradient_stays_close(compression, rtol):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, kh.LowCommunication(2, compression=compression))
    _fit(model, strategy)
    expected = _diloco_reference(2)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


def test_one_device_without_strategy():
    model = kh.HeteroModel(
        *helpers.layers(), low_communication=kh.LowCommunication(2)
    )
    model.compile(optimizer=_inner_optimizer(), loss="mse")
    model.set_weights(helpers.initial_weights())
    _fit(model, tf.distribute.get_strategy(), shares=[1.0])
    expected = _diloco_reference(2, shares=[1.0])
    helpers.assert_weights_close(model.get_weights(), expected, rtol=1e-4)


def test_config_and_keras_file_keep_the_mode_and_the_outer_state(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    mode = kh.LowCommunication(2, compression="bf16")
    model = _model(strategy, mode)
    _fit(model, strategy, epochs=1)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(
        loaded.hetero_settings.low_communication, kh.LowCommunication
    )
    restored = loaded.hetero_settings.low_communication
    assert (restored.sync_every, restored.compression) == (2, "bf16")
    outer = restored.outer_optimizer()
    assert isinstance(outer, keras.optimizers.SGD)
    assert outer.nesterov and np.isclose(float(outer.momentum), 0.9)
    helpers.assert_weights_close(loaded.get_weights(), model.get_weights())
    clone = kh.HeteroModel.from_config(model.get_config())
    assert clone.hetero_settings.low_communication.sync_every == 2


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(sync_every=0), ValueError, "sync_every"),
        (dict(sync_every=2, compression="int4"), ValueError, "int4"),
        (dict(sync_every=2, outer_optimizer="sgd"), TypeError, "'sgd'"),
    ],
)
def test_bad_arguments_are_named(arguments, error, match):
    with pytest.raises(error, match=match):
        kh.LowCommunication(**arguments)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(accumulation_steps=2), "accumulation_steps=2"),
        (dict(gradient_compression="fp16"), "gradient_compression='fp16'"),
        (dict(low_communication=2), "Expected a `kh.LowCommunication`"),
    ],
)
def test_combinations_that_cannot_work_are_refused(kwargs, match):
    kwargs.setdefault("low_communication", kh.LowCommunication(2))
    with pytest.raises((ValueError, TypeError), match=match):
        kh.HeteroModel(*helpers.layers(), **kwargs)


def test_sync_every_must_be_a_multiple_of_steps_per_execution():
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, kh.LowCommunication(3), steps_per_execution=2)
    with pytest.raises(ValueError, match="multiple of `steps_per_execution=2`"):
        _fit(model, strategy)


def test_central_storage_is_refused_at_compile():
    strategy = tf.distribute.experimental.CentralStorageStrategy(DEVICES[:2])
    with pytest.raises(ValueError, match="CentralStorageStrategy keeps one"):
        _model(strategy, kh.LowCommunication(2))


def test_jit_compile_on_one_device_trains_the_same():
    def trained(jit_compile):
        model = kh.HeteroModel(
            *helpers.layers(), low_communication=kh.LowCommunication(2)
        )
        model.compile(
            optimizer=_inner_optimizer(), loss="mse", jit_compile=jit_compile
        )
        model.set_weights(helpers.initial_weights())
        _fit(model, tf.distribute.get_strategy(), shares=[1.0])
        return model

    compiled = trained(True)
    helpers.assert_weights_close(
        compiled.get_weights(), trained(False).get_weights()
    )
    assert np.isnan(compiled.step_stats.compute_seconds).all()


def test_float16_loss_scaling_is_refused():
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = kh.HeteroModel(
            *helpers.layers(), low_communication=kh.LowCommunication(2)
        )
        model.compile(optimizer="sgd", loss="mse")
    finally:
        keras.mixed_precision.set_global_policy(policy)
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        model.fit(np.zeros((8, helpers.FEATURES)), np.zeros((8, 1)), verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_workers, shares, sync_every, spe",
    [
        pytest.param(2, [0.75, 0.25], 1, 1, marks=pytest.mark.extended),
        pytest.param(2, [0.75, 0.25], 3, 1, marks=pytest.mark.both_flavours),
        (3, [0.5, 0.3, 0.2], 2, 2),
    ],
    ids=["2w-sync_every_1", "2w-sync_every_3", "3w-sync_every_2-spe_2"],
)
def test_multi_worker_processes_match_the_algorithm(
    num_workers, shares, sync_every, spe
):
    from tests.support import training_workers

    anchor = sync_every == 1
    results = kh.testing.run_workers(
        training_workers.low_communication_mwms,
        num_workers,
        timeout=300,
        args=(shares, sync_every, anchor, spe),
    )
    if anchor:  # outer SGD(1.0) after one local step: synchronous training
        expected = helpers.reference_fit()[0].get_weights()
    else:
        expected = _diloco_reference(sync_every, shares=shares)
    rounds_per_epoch = -(-5 // sync_every)  # 5 batches; the epoch ends one
    for result in results:
        value = result.value
        helpers.assert_weights_close(value["weights"], expected, rtol=1e-4)
        assert value["synchronisations"] == 2 * rounds_per_epoch
        # tf-keras reads the 4 metric variables (loss and mae: total and
        # count) across workers at each of the 2 epoch ends; a read in the
        # step's trace (a collective every step) would add 8 more.
        epoch_end_reads = 8 if kh.FLAVOUR == "tf-keras" else 0
        assert value["metric_reduces_in_fit"] == epoch_end_reads
        if spe == 1 or kh.FLAVOUR == "tf-keras":
            assert value["input_reduces_in_fit"] == 0  # no per-step check
        else:
            # Keras 3 runs k > 1 steps per call with `get_next_as_optional`,
            # which always checks (docs/low-communication.md).
            assert value["input_reduces_in_fit"] > 0
        # The last round's rows, of every worker, on every worker.
        last_round = 5 - sync_every * (rounds_per_epoch - 1)
        assert value["steps"] == last_round
    evaluations = [r.value["evaluation"]["loss"] for r in results]
    assert evaluations == pytest.approx([evaluations[0]] * num_workers)


@pytest.mark.slow
def test_rebalancer_sizes_rows_by_speed_and_removes_the_wait():
    # SIMULATED: worker 1 takes 3x the seconds per row. With equal shares
    # the fast worker waits for it at every synchronisation; the rebalancer
    # gives it 3/4 of the rows and the waits shrink.
    from tests.support import training_workers

    fixed, balanced = (
        kh.testing.run_workers(
            training_workers.low_communication_rebalance_mwms,
            2,
            timeout=300,
            args=(rebalance,),
        )[0].value
        for rebalance in (False, True)
    )
    assert fixed["shares"] == [0.5, 0.5]
    assert balanced["shares"][0] == pytest.approx(0.75, abs=0.05)
    # Equal shares: worker 0 waits about 2/3 of worker 1's round time.
    assert fixed["waits"][0] > 3 * fixed["waits"][1]
    assert balanced["waits"][0] < 0.5 * fixed["waits"][0]


def test_run_report_and_tensorboard_record_the_rounds(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = _model(strategy, kh.LowCommunication(2))
    report = kh.callbacks.RunReport(tmp_path / "report")
    board = kh.callbacks.HeteroTensorBoard(tmp_path / "logs")
    _fit(model, strategy, callbacks=[report, board])
    records = report.records
    # Two rounds of 2 steps per epoch are recorded at their
    # synchronisations (the epoch-end round's numbers come at epoch end).
    assert records.steps.tolist() == [2, 4, 7, 9]
    assert records.rows.tolist() == [[12, 4]] * 4  # per step
    assert records.wait_seconds.shape == (4, 2)
    assert np.all(np.isfinite(records.wait_seconds))
    assert os.path.exists(report.files.png)


def test_keras_file_mid_training_goes_on_with_the_outer_state(tmp_path):
    def model():
        built = kh.HeteroModel(
            *helpers.layers(), low_communication=kh.LowCommunication(2)
        )
        built.compile(optimizer=_inner_optimizer(), loss="mse")
        built.set_weights(helpers.initial_weights())
        return built

    one_device = tf.distribute.get_strategy()
    straight = model()
    _fit(straight, one_device, shares=[1.0], epochs=2)
    first = model()
    _fit(first, one_device, shares=[1.0], epochs=1)
    path = str(tmp_path / "half.keras")
    first.save(path)
    loaded = keras.saving.load_model(path)
    _fit(loaded, one_device, shares=[1.0], epochs=1)
    helpers.assert_weights_close(loaded.get_weights(), straight.get_weights())


def test_mixed_bfloat16_trains_close_to_float32():
    strategy = helpers.mirrored(DEVICES[:2])
    expected = _diloco_reference(2)
    policy = keras.mixed_precision.global_policy()
    kh.set_precision("mixed_bfloat16")
    try:
        model = _model(
            strategy, kh.LowCommunication(2), precision="mixed_bfloat16"
        )
    finally:
        keras.mixed_precision.set_global_policy(policy)
    assert model.layers[-1].compute_dtype == "bfloat16"
    _fit(model, strategy)
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def test_hetero_sequential_with_low_communication():
    strategy = helpers.mirrored(DEVICES[:2])
    with strategy.scope():
        inputs, outputs = helpers.layers()
        functional = keras.Model(inputs, outputs)
        model = kh.HeteroSequential(
            [keras.Input((helpers.FEATURES,)), *functional.layers[1:]],
            low_communication=kh.LowCommunication(2),
        )
        model.compile(optimizer=_inner_optimizer(), loss="mse")
        model.set_weights(helpers.initial_weights())
    _fit(model, strategy)
    helpers.assert_weights_close(
        model.get_weights(), _diloco_reference(2), rtol=1e-4
    )


def test_a_subclassed_model_must_be_built_first():
    class Subclassed(kh.HeteroModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

    model = Subclassed(low_communication=kh.LowCommunication(2))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((8, 3), "float32"), np.zeros((8, 1), "float32")
    with pytest.raises(ValueError, match="must be built before `fit`"):
        model.fit(x, y, verbose=0)
    model(x)  # Keras 3's `build(shape)` creates no weights of a subclass
    model.fit(x, y, verbose=0)
