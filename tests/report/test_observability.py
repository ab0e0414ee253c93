"""HeteroTensorBoard, RunReport / kh.report and the progress output."""

import base64
import contextlib
import io
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _distribute
from keras_hetero._compat import keras
from tests.conftest import DEVICES
from tests.support import helpers
from tests.support import training_workers

GLOBAL_BATCH = 16
STEPS = 12
UPDATE_FREQ = 4


class Recorder(keras.callbacks.Callback):
    """Keeps `model.step_stats` of every step, keyed by its step."""

    def on_train_begin(self, logs=None):
        self.stats = {}

    def on_train_batch_end(self, batch, logs=None):
        stats = self.model.step_stats
        self.stats[stats.step] = stats


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One fit with every observer: SIMULATED replica 0 is 4x slower."""
    out = tmp_path_factory.mktemp("run")
    strategy = helpers.mirrored(DEVICES[:2])
    model = helpers.slow_model(strategy, [0.002, 0.0005])
    data = kh.data.shard(
        helpers.examples(rows=GLOBAL_BATCH * STEPS),
        GLOBAL_BATCH,
        strategy=strategy,
    )
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=3, warmup_steps=1, window=3
    )
    # A replica slower from the start is the rebalancer's, not an event,
    # unless the relative score has a threshold of its own: the report
    # must show events.
    detector = kh.callbacks.StragglerDetector(
        patience=2, window=3, relative_threshold=0.7
    )
    checkpoint = kh.callbacks.ElasticCheckpoint(
        out / "checkpoints", save_every=5, async_save=False
    )
    board = kh.callbacks.HeteroTensorBoard(
        out / "logs", update_freq=UPDATE_FREQ
    )
    report = kh.callbacks.RunReport(out / "report")
    recorder = Recorder()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        # Observers first on purpose: HeteroModel.fit runs them last.
        history = model.fit(
            data,
            epochs=1,
            verbose=2,
            callbacks=[
                board,
                report,
                recorder,
                rebalancer,
                detector,
                checkpoint,
            ],
        )
    return {
        "out": out,
        "data": data,
        "rebalancer": rebalancer,
        "detector": detector,
        "checkpoint": checkpoint,
        "report": report,
        "stats": recorder.stats,
        "history": history.history,
        "printed": printed.getvalue(),
    }


def read_scalars(directory):
    """`{(tag, step): value}` and the plugin of each tag, from event files."""
    values, plugins = {}, {}
    for path in sorted(pathlib.Path(directory).glob("events.out.tfevents*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                key = (value.tag, event.step)
                values[key] = float(tf.make_ndarray(value.tensor))
                if value.metadata.plugin_data.plugin_name:
                    plugins[value.tag] = value.metadata.plugin_data.plugin_name
    return values, plugins


# --- TensorBoard -------------------------------------------------------------


def test_tensorboard_rows_seconds_shares_match_step_stats(run):
    values, plugins = read_scalars(run["out"] / "logs" / "hetero")
    written = sorted({step for _, step in values})
    steps = list(range(UPDATE_FREQ, STEPS + 1, UPDATE_FREQ))
    assert set(steps) <= set(written)
    for step in steps:
        stats = run["stats"][step]
        for replica in range(2):
            rows = stats.rows[replica]
            seconds = stats.compute_seconds[replica]
            expected = {
                "rows": rows,
                "compute_seconds": seconds,
                "seconds_per_row": seconds / rows,
                "share": rows / stats.rows.sum(),
            }
            for name, want in expected.items():
                tag = f"{name}/replica_{replica}"
                assert values[(tag, step)] == pytest.approx(want, rel=1e-6)
                assert plugins[tag] == "scalars"
    # Not written between update steps.
    assert ("rows/replica_0", UPDATE_FREQ - 1) not in values


def test_tensorboard_has_straggler_scores_and_checkpoint_times(run):
    values, _ = read_scalars(run["out"] / "logs" / "hetero")
    final = run["detector"].scalars()
    assert set(final) == {
        "straggler/relative_0",
        "straggler/individual_0",
        "straggler/relative_1",
        "straggler/individual_1",
        "straggler/flagged",
        "straggler/communication",
    }
    for tag, want in final.items():
        assert values[(tag, STEPS)] == pytest.approx(want, rel=1e-6)
    saves = run["checkpoint"].saves
    # Every 5 steps, and the final one at the end of fit.
    assert [step for step, _, _ in saves] == [5, 10, 12]
    for step, blocking, written in saves:
        assert values[("checkpoint/blocking_seconds", step)] == pytest.approx(
            blocking, rel=1e-6
        )
        assert values[("checkpoint/write_seconds", step)] == pytest.approx(
            written, rel=1e-6
        )


def test_tensorboard_update_freq_epoch(tmp_path):
    strategy = helpers.mirrored(DEVICES[:2])
    model = helpers.slow_model(strategy, 0.0)
    data = kh.data.shard(helpers.examples(rows=64), 16, strategy=strategy)
    recorder = Recorder()
    board = kh.callbacks.HeteroTensorBoard(tmp_path, update_freq="epoch")
    model.fit(data, epochs=2, verbose=0, callbacks=[recorder, board])
    values, _ = read_scalars(tmp_path / "hetero")
    assert sorted({step for _, step in values}) == [4, 8]
    assert values[("rows/replica_1", 8)] == recorder.stats[8].rows[1]


@pytest.mark.parametrize("update_freq", [0, -3, True, 2.5, "batch"])
def test_tensorboard_rejects_bad_update_freq(update_freq):
    with pytest.raises(ValueError, match="update_freq"):
        kh.callbacks.HeteroTensorBoard("logs", update_freq=update_freq)


def test_only_the_chief_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(_distribute, "is_chief", lambda strategy: False)
    strategy = helpers.mirrored(DEVICES[:2])
    model = helpers.slow_model(strategy, 0.0)
    data = kh.data.shard(helpers.examples(rows=64), 16, strategy=strategy)
    board = kh.callbacks.HeteroTensorBoard(tmp_path / "logs", update_freq=1)
    report = kh.callbacks.RunReport(tmp_path / "report")
    model.fit(data, epochs=1, verbose=0, callbacks=[board, report])
    assert not (tmp_path / "logs").exists()
    assert not (tmp_path / "report").exists()
    assert report.records is None


@pytest.mark.slow
@pytest.mark.both_flavours
def test_only_the_chief_writes_with_two_worker_processes(tmp_path):
    results = kh.testing.run_workers(
        training_workers.observe_mwms, 2, timeout=240, args=(str(tmp_path),)
    )
    chief, other = (result.value for result in results)
    assert chief["report"] == str(tmp_path / "report" / "report.html")
    assert other["report"] is None
    assert chief["rows"] == other["rows"]
    events = list((tmp_path / "logs" / "hetero").glob("events.out.*"))
    assert len(events) == 1
    values, _ = read_scalars(tmp_path / "logs" / "hetero")
    # helpers.examples(): 72 rows in global batches of 8 -> 9 steps.
    assert sorted({step for _, step in values}) == [2, 4, 6, 8]
    assert values[("rows/replica_1", 8)] == 4


# --- RunReport and kh.report --------------------------------------------------


def test_report_records_match_step_stats(run):
    records = run["report"].records
    np.testing.assert_array_equal(records.steps, np.arange(1, STEPS + 1))
    for index, step in enumerate(records.steps):
        stats = run["stats"][step]
        np.testing.assert_array_equal(records.rows[index], stats.rows)
        np.testing.assert_allclose(
            records.compute_seconds[index], stats.compute_seconds
        )
    assert np.isnan(records.step_seconds[0])
    assert np.all(records.step_seconds[1:] > 0)
    assert records.devices == run["stats"][STEPS].devices
    detector_events = run["detector"].events
    assert [e.replica for e in records.events] == [
        e.replica for e in detector_events
    ]
    assert [e.step for e in records.events] == [e.step for e in detector_events]
    assert [s for s, _, _ in records.checkpoints] == [5, 10, 12]
    changes = run["rebalancer"].changes
    assert [step for step, _ in records.share_changes] == [
        step for step, _, _ in changes
    ]


def test_report_png_shows_every_replicas_series(run):
    records = run["report"].records
    figure = kh.report.plot(records)
    times, shares = figure.axes
    for axes, series in (
        (times, records.compute_seconds),
        (shares, records.shares),
    ):
        lines = {
            line.get_label(): line
            for line in axes.get_lines()
            if line.get_label().startswith("replica")
        }
        assert sorted(lines) == ["replica 0", "replica 1"]
        for replica in range(2):
            line = lines[f"replica {replica}"]
            np.testing.assert_array_equal(line.get_xdata(), records.steps)
            np.testing.assert_allclose(line.get_ydata(), series[:, replica])
    # The SIMULATED 4x slower replica ends with the smaller share.
    assert records.shares[-1, 0] < 0.4

    import matplotlib.image

    png = pathlib.Path(run["report"].files.png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # Not blank: the lines are drawn in colour.
    assert len(np.unique(image.reshape(-1, image.shape[2]), axis=0)) > 20


def test_report_html_is_self_contained_with_image_and_events(run):
    files = run["report"].files
    page = pathlib.Path(files.html).read_text()
    encoded = base64.b64encode(pathlib.Path(files.png).read_bytes()).decode()
    assert f'src="data:image/png;base64,{encoded}"' in page
    for external in ('src="http', "<link", "<script", "url("):
        assert external not in page
    events = run["report"].records.events
    assert events
    assert f"{len(events)} straggler event(s)" in page
    for event in events:
        cells = f"<td>{event.step}</td><td>{event.replica}</td>"
        assert cells in page
    assert "<td>5</td><td>" in page.split("<h2>Checkpoints</h2>")[1]


def _records(write_seconds=0.5):
    event = kh.callbacks.StragglerEvent(
        step=3,
        replica=2,
        worker=0,
        device="/cpu:2",
        relative_score=0.4,
        individual_score=0.9,
        kind="straggler",
    )
    return kh.report.Records(
        steps=np.array([1, 2, 3, 4]),
        rows=np.array([[4, 4, 8], [4, 4, 8], [5, 5, 6], [6, 6, 4]], float),
        compute_seconds=np.array(
            [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3], [0.1, 0.2, 0.9], [0, 0, 0.2]]
        ),
        step_seconds=np.array([np.nan, 0.31, 0.92, 0.21]),
        devices=["/cpu:0", "/cpu:1", "/cpu:2"],
        events=[event],
        checkpoints=[(2, 0.01, write_seconds)],
        share_changes=[(3, np.array([0.3, 0.3, 0.4]))],
    )


def test_write_from_records_without_tensorflow_state(tmp_path):
    records = _records(write_seconds=None)
    files = kh.report.write(records, tmp_path / "new" / "dir")
    assert files.png == str(tmp_path / "new" / "dir" / "report.png")
    page = pathlib.Path(files.html).read_text()
    assert "<td>3</td><td>2</td><td>/cpu:2</td><td>straggler</td>" in page
    assert "<td>2</td><td>0.010</td><td>in flight</td>" in page
    assert "<td>0.300 0.300 0.400</td>" in page
    lines = kh.report.plot(records).axes[1].get_lines()
    np.testing.assert_allclose(lines[2].get_ydata(), [0.5, 0.5, 0.375, 0.25])


def test_write_rejects_empty_records(tmp_path):
    empty = kh.report.Records(
        steps=np.zeros([0]),
        rows=np.zeros([0, 2]),
        compute_seconds=np.zeros([0, 2]),
        step_seconds=np.zeros([0]),
        devices=["a", "b"],
    )
    with pytest.raises(ValueError, match="records"):
        kh.report.write(empty, tmp_path)


def test_run_report_rejects_bad_every_n_steps():
    with pytest.raises(ValueError, match="every_n_steps"):
        kh.callbacks.RunReport("report", every_n_steps=0)


def test_without_matplotlib_import_works_and_drawing_names_the_extra(
    tmp_path,
):
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "import keras_hetero as kh\n"
        "for make in (lambda: kh.callbacks.RunReport('r'),\n"
        "             lambda: kh.report.plot(None)):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as error:\n"
        "        assert 'matplotlib>=3.8' in str(error), error\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


# --- progress output ---------------------------------------------------------


def test_progress_prints_each_share_change_and_epoch_shares(run):
    printed = run["printed"]
    changes = run["rebalancer"].changes
    assert changes
    lines = [
        line
        for line in printed.splitlines()
        if line.startswith("ShardRebalancer: step ")
    ]
    assert len(lines) == len(changes)
    for line, (step, start, shares) in zip(lines, changes):
        shares = np.asarray(shares) / np.sum(shares)
        assert line.startswith(
            f"ShardRebalancer: step {step}: shares "
            + " ".join(f"{share:.3f}" for share in shares)
        )
        assert line.endswith(f"from batch {start[1]}")
    final = run["data"].shares
    for replica in range(2):
        assert f"share/replica_{replica}: {final[replica]:.4f}" in printed
    assert run["history"]["share/replica_0"][-1] == pytest.approx(final[0])


def test_no_share_lines_when_not_verbose():
    strategy = helpers.mirrored(DEVICES[:2])
    model = helpers.slow_model(strategy, [0.002, 0.0005])
    data = kh.data.shard(helpers.examples(rows=16 * 8), 16, strategy=strategy)
    rebalancer = kh.callbacks.ShardRebalancer(
        data, every_n_steps=2, warmup_steps=1, window=2
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.fit(data, epochs=1, verbose=0, callbacks=[rebalancer])
    assert rebalancer.changes
    assert "ShardRebalancer" not in printed.getvalue()
