"""Naming the worker behind a slow link: the HTTP/2 probe against a real
TensorFlow server, the blame rule, the exchange of probe rows between
workers, and the StragglerDetector event that carries the result. (The
end-to-end case, a slowed link between hosts in namespaces, is in
test_network_faults.py.)"""

import itertools
import logging
import math
import socket
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import keras_hetero as kh
from keras_hetero import _compat
from keras_hetero.stragglers import links


def _free_port():
    return kh.testing.free_ports(1)[0]


def _tf_server():
    """Starts a one-worker TensorFlow server; returns its port."""
    port = _free_port()
    tf.distribute.Server(
        tf.train.ClusterSpec({"worker": [f"127.0.0.1:{port}"]}),
        job_name="worker",
        task_index=0,
        start=True,
    )
    return port


def test_probe_times_a_tensorflow_server_and_inf_where_nothing_answers():
    port = _tf_server()
    seconds = [links.probe_seconds(f"127.0.0.1:{port}") for _ in range(5)]
    assert all(0 < s < 1.0 for s in seconds), seconds
    # Nothing listens: refused at once.
    assert links.probe_seconds(f"127.0.0.1:{_free_port()}") == math.inf
    # Something accepts and never answers (a link that drops the bytes).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        started = time.monotonic()
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        assert links.probe_seconds(address, timeout=0.3) == math.inf
        assert time.monotonic() - started < 2.0


def test_probe_carries_its_padding_through_a_slow_path():
    """Through a relay that paces bytes, a probe with padding takes the
    bandwidth's time; one without padding does not."""
    port = _tf_server()
    relay = socket.socket()
    relay.bind(("127.0.0.1", 0))
    relay.listen(4)
    bandwidth = 1e6  # bytes per second towards the server

    def pipe(source, sink, paced):
        try:
            while data := source.recv(65536):
                if paced:
                    time.sleep(len(data) / bandwidth)
                sink.sendall(data)
        except OSError:
            pass

    def serve():
        while True:
            try:
                client, _ = relay.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            for args in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=pipe, args=args, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    address = "127.0.0.1:%d" % relay.getsockname()[1]
    try:
        padded = links.probe_seconds(address, payload_bytes=65536)
        bare = links.probe_seconds(address, payload_bytes=0)
    finally:
        relay.close()
    assert padded >= 65536 / bandwidth * 0.9, padded  # 65 ms at 1 MB/s
    assert bare < padded / 2, (bare, padded)


@pytest.mark.parametrize(
    "seconds, reference, slow, named",
    [
        # A relay in front of worker 1 (2 workers): only probes to it.
        ({(0, 1): 0.1, (1, 0): 0.0003}, {}, [(0, 1)], (1,)),
        # The same, against a measured reference.
        (
            {(0, 1): 0.1, (1, 0): 0.0004},
            {(0, 1): 0.0003, (1, 0): 0.0003},
            [(0, 1)],
            (1,),
        ),
        # Worker 2's own link slow both ways, 3 workers.
        (
            {
                (0, 1): 0.001,
                (1, 0): 0.001,
                (0, 2): 0.2,
                (2, 0): 0.2,
                (1, 2): 0.2,
                (2, 1): 0.2,
            },
            {},
            [(0, 2), (1, 2), (2, 0), (2, 1)],
            (2,),
        ),
        # A cut link answers nothing: infinitely slow.
        ({(0, 1): math.inf, (1, 0): 0.001}, {}, [(0, 1)], (1,)),
        # One link, slow both ways: the two ends cannot be told apart.
        (
            {(0, 1): 0.1, (1, 0): 0.1},
            {(0, 1): 0.001, (1, 0): 0.001},
            [(0, 1), (1, 0)],
            (0, 1),
        ),
        # Healthy: small jitter is not slow (factor and excess).
        (
            {(0, 1): 0.002, (1, 0): 0.0004},
            {(0, 1): 0.0003, (1, 0): 0.0003},
            [],
            (),
        ),
    ],
)
def test_slow_pairs_and_the_workers_behind_them(
    seconds, reference, slow, named
):
    pairs = links.slow_pairs(seconds, reference)
    assert pairs == slow
    assert links.behind(pairs) == named


class _Store:
    """The coordination service's key-value store, in memory."""

    def __init__(self):
        self.values, self.lock = {}, threading.Condition()

    def set(self, key, value):
        with self.lock:
            self.values[key] = value
            self.lock.notify_all()

    def get(self, key, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000
        with self.lock:
            while key not in self.values:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(left)
            return self.values[key]


@pytest.fixture
def store(monkeypatch):
    store = _Store()
    monkeypatch.setattr(_compat, "set_coordination_value", store.set)
    monkeypatch.setattr(_compat, "get_coordination_value", store.get)
    # One process plays every worker: one fit number for all.
    monkeypatch.setattr(links, "_fits", itertools.repeat(0))
    return store


def _prober(slowed):
    """A probe: 100 ms to an address in `slowed`, 0.3 ms elsewhere."""
    return lambda address: 0.1 if address in slowed else 0.0003


def test_rounds_exchange_rows_and_every_worker_names_the_same_one(store):
    addresses = ["h0:1", "h1:1", "h2:1"]
    slowed = set()
    rounds = [
        links.LinkRounds(task, addresses, probe=_prober(slowed))
        for task in range(3)
    ]
    numbers = [r.start(reference=True) for r in rounds]
    references = [r.result(n, timeout=10) for r, n in zip(rounds, numbers)]
    assert all(result[1:] == ([], ()) for result in references), references
    assert len(rounds[0].reference) == 6  # every worker's row
    slowed.add("h1:1")  # the path to worker 1 only, as behind a relay
    numbers = [r.start() for r in rounds]
    results = [r.result(n, timeout=10) for r, n in zip(rounds, numbers)]
    for seconds, pairs, named in results:
        assert pairs == [(0, 1), (2, 1)]
        assert named == (1,)
        assert seconds[(0, 1)] == pytest.approx(0.1)
    for r in rounds:
        r.close()


def test_a_round_goes_on_without_a_worker_that_never_publishes(store):
    addresses = ["h0:1", "h1:1", "h2:1"]
    # Workers 0 and 1 only; worker 2's row never comes (cut, or slower
    # than the wait).
    rounds = [
        links.LinkRounds(
            task, addresses, probe=_prober({"h2:1"}), wait_seconds=0.3
        )
        for task in range(2)
    ]
    numbers = [r.start() for r in rounds]
    started = time.monotonic()
    results = [r.result(n, timeout=10) for r, n in zip(rounds, numbers)]
    assert time.monotonic() - started < 5
    for seconds, pairs, named in results:
        assert sorted(seconds) == [(0, 1), (0, 2), (1, 0), (1, 2)]
        assert pairs == [(0, 2), (1, 2)] and named == (2,)


class _Worker0:
    """StragglerDetector on worker 0 of 2 with fake probes (100 ms to a
    slowed address) and worker 1's rows already in the store (its path to
    worker 0 is fast)."""

    def __init__(self, store, monkeypatch, state=None):
        self.stats, self.slowed, self.made = [], set(), []
        stats = self.stats

        class Model:
            @property
            def step_stats(self):
                return stats[-1]

        def make_links(detector):
            self.made.append(
                links.LinkRounds(
                    0, ["h0:1", "h1:1"], probe=_prober(self.slowed)
                )
            )
            return self.made[-1]

        monkeypatch.setattr(
            kh.callbacks.StragglerDetector, "_make_links", make_links
        )
        for number in range(2):
            store.set(f"keras_hetero/links/0/{number}/1", '{"0": 0.0003}')
        self.detector = kh.callbacks.StragglerDetector(window=3, patience=2)
        if state is not None:
            self.detector.set_state(state)
        self.detector.set_model(Model())
        self.detector.on_train_begin()

    def steps(self, count, call, compute):
        for _ in range(count):
            self.stats.append(
                kh.StepStats(
                    step=len(self.stats) + 1,
                    steps=1,
                    rows=np.array([4, 4]),
                    compute_seconds=np.array([compute, compute]),
                    devices=["/job:worker/task:0/CPU:0"] * 2,
                    call_seconds=call,
                )
            )
            self.detector.on_train_batch_begin(0)
            self.detector.on_train_batch_end(0)


def test_detector_holds_the_slow_link_event_until_the_probes_name_the_worker(
    store, caplog, monkeypatch
):
    worker = _Worker0(store, monkeypatch)
    detector, made, slowed, steps = (
        worker.detector,
        worker.made,
        worker.slowed,
        worker.steps,
    )
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        steps(5, 0.030, 0.020)  # the baseline, and the reference probes
        assert made[0].result(0, timeout=10) is not None
        slowed.add("h1:1")
        steps(4, 0.080, 0.020)
        # The event fired and waits for its probe round.
        assert made[0].result(1, timeout=10) is not None
        steps(1, 0.080, 0.020)
    assert [e.kind for e in detector.communication_events] == ["communication"]
    event = detector.communication_events[0]
    assert event.workers == (1,)
    assert event.slow_links == ((0, 1, pytest.approx(0.1), 0.0003),)
    assert "put worker(s) [1] behind the slow link" in caplog.text
    assert "0->1 100.0 ms (0.3 ms at the start)" in caplog.text
    detector.on_train_end()


def test_a_run_resumed_on_a_slow_link_compares_with_the_fastest_probe(
    store, monkeypatch
):
    # The baseline comes from the checkpoint: no healthy probe round in
    # this fit, the first round is the event's.
    state = {
        "scores": None,
        "steps": 0,
        "communication": {"baseline": 0.010, "slow": False},
    }
    worker = _Worker0(store, monkeypatch, state=state)
    worker.slowed.add("h1:1")
    worker.steps(4, 0.080, 0.020)
    assert worker.made[0].result(0, timeout=10) is not None
    worker.steps(1, 0.080, 0.020)
    (event,) = worker.detector.communication_events
    assert worker.made[0].reference == {}
    assert event.workers == (1,)
    assert event.slow_links == ((0, 1, pytest.approx(0.1), None),)
    worker.detector.on_train_end()


def test_an_event_whose_probes_find_no_slow_path_says_so(
    store, caplog, monkeypatch
):
    worker = _Worker0(store, monkeypatch)  # nothing slowed: input, say
    with caplog.at_level(logging.WARNING, logger="keras_hetero"):
        worker.steps(5, 0.030, 0.020)
        worker.steps(4, 0.080, 0.020)
        assert worker.made[0].result(1, timeout=10) is not None
        worker.steps(1, 0.080, 0.020)
    (event,) = worker.detector.communication_events
    assert event.workers == () and event.slow_links == ()
    assert "found no slow path" in caplog.text
    worker.detector.on_train_end()


def test_probe_links_false_makes_no_probes(monkeypatch):
    monkeypatch.setattr(links, "LinkRounds", None)  # would fail if made
    detector = kh.callbacks.StragglerDetector(probe_links=False)
    assert detector._make_links() is None


def test_detector_does_not_probe_outside_multi_worker_training():
    class Model:
        distribute_strategy = tf.distribute.get_strategy()

    detector = kh.callbacks.StragglerDetector()
    assert detector.probe_links is True
    detector.set_model(Model())
    assert detector._make_links() is None  # no TF_CONFIG, default strategy
