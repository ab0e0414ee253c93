"""Which worker is behind a slow link: probes between the workers.

The time outside compute (`communication.CommunicationTracker`) shows that
a link is slow, not which: in an all-reduce every worker waits for the
slowest transfer alike. So each worker also measures the path to every
other worker's TensorFlow server itself. A probe opens a TCP connection to
the peer's `TF_CONFIG` address, sends the HTTP/2 client preface, 64 KiB of
frames of an unknown type (which HTTP/2 servers must read and skip: the
probe sees the link's bandwidth as well as its latency) and a PING, and
times the wait for the PING's acknowledgement: the gRPC server of the
peer's TensorFlow runtime answers it, with no request made of TF.

The workers exchange their probe rows through TensorFlow's coordination
service (a round at the detector's baseline, and one at each slow-link
event), and each finds, from the same matrix, the fewest workers that
every slow probe touches: the workers behind the slow links.
"""

import dataclasses
import itertools
import json
import logging
import math
import os
import queue
import socket
import statistics
import struct
import threading
import time

import numpy as np

from keras_hetero import _compat

logger = logging.getLogger("keras_hetero")

PROBE_BYTES = 65536
"""Bytes of padding each probe carries to the peer (bandwidth shows)."""

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _PING, _UNKNOWN = 0x4, 0x6, 0xFA
_ACK = 0x1
_MAX_FRAME = 16384  # HTTP/2's default SETTINGS_MAX_FRAME_SIZE

# Counts the fits of this process: the exchange keys of one fit are not
# those of the next (the coordination service outlives a fit).
_fits = itertools.count()


def _frame(kind, flags, payload):
    header = struct.pack(">I", len(payload))[1:] + bytes([kind, flags])
    return header + struct.pack(">I", 0) + payload


def probe_seconds(address, payload_bytes=PROBE_BYTES, timeout=2.0):
    """Seconds from sending a probe to a gRPC server until its PING ack.

    Args:
        address: `"host:port"` of a gRPC (TensorFlow) server.
        payload_bytes: Padding bytes sent before the PING, >= 0. Defaults
            to `PROBE_BYTES`.
        timeout: Seconds to wait in all, > 0. Defaults to `2.0`.

    Returns:
        The seconds, or `math.inf` if the server cannot be reached or does
        not answer within `timeout` (a cut link is an infinitely slow one).

    Example:

    >>> probe_seconds("127.0.0.1:1", timeout=0.5)  # nothing listens there
    inf
    """
    host, _, port = address.rpartition(":")
    opaque = os.urandom(8)
    data = [_PREFACE, _frame(_SETTINGS, 0, b"")]
    for start in range(0, payload_bytes, _MAX_FRAME):
        size = min(_MAX_FRAME, payload_bytes - start)
        data.append(_frame(_UNKNOWN, 0, bytes(size)))
    data.append(_frame(_PING, 0, opaque))
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            started = time.perf_counter()
            s.sendall(b"".join(data))
            buffer = b""
            while True:
                s.settimeout(max(deadline - time.monotonic(), 1e-3))
                chunk = s.recv(65536)
                if not chunk:
                    return math.inf
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags = buffer[3], buffer[4]
                    payload = buffer[9 : 9 + length]
                    buffer = buffer[9 + length :]
                    if kind == _PING and flags & _ACK and payload == opaque:
                        return time.perf_counter() - started
    except (OSError, ValueError):
        return math.inf


def slow_pairs(seconds, reference, factor=3.0, min_excess_seconds=0.005):
    """The probes (`(from, to)` worker pairs) that are slow.

    Args:
        seconds: `{(from, to): seconds}` of one round (`math.inf`: no
            answer).
        reference: `{(from, to): seconds}` of the healthy round; a pair
            missing from it is compared with the fastest probe of
            `seconds`.
        factor: How many times its reference a slow probe takes. Defaults
            to `3.0`.
        min_excess_seconds: Seconds it must also exceed its reference by.
            Defaults to `0.005`.

    Returns:
        The sorted list of slow pairs.

    Example:

    >>> slow_pairs({(0, 1): 0.1, (1, 0): 0.0003}, {})
    [(0, 1)]
    """
    finite = [s for s in seconds.values() if math.isfinite(s)]
    fastest = min(finite) if finite else 0.0
    slow = []
    for pair, value in seconds.items():
        base = reference.get(pair, fastest)
        if not math.isfinite(base):
            base = fastest
        if value > max(factor * base, base + min_excess_seconds):
            slow.append(pair)
    return sorted(slow)


def behind(pairs):
    """The fewest workers that every slow pair touches.

    Greedy: the worker on most slow pairs, ties broken by the worker most
    probes *to* were slow (with a relay or a slow inbound path, only the
    probes to the slow worker are slow), remaining ties all named (two
    workers whose one link is slow both ways cannot be told apart).

    Args:
        pairs: `(from, to)` worker pairs, e.g. `slow_pairs(...)`.

    Returns:
        The sorted tuple of worker indices (empty for no pairs).

    Example:

    >>> behind([(0, 2), (1, 2), (2, 0), (2, 1)])
    (2,)
    >>> behind([(0, 1)])
    (1,)
    >>> behind([(0, 1), (1, 0)])
    (0, 1)
    """
    left, named = set(pairs), set()
    while left:
        ranks = {}
        for pair in left:
            for w in pair:
                touching, towards = ranks.get(w, (0, 0))
                ranks[w] = (touching + 1, towards + (pair[1] == w))
        best = max(ranks.values())
        chosen = {w for w, rank in ranks.items() if rank == best}
        named |= chosen
        left = {pair for pair in left if not chosen & set(pair)}
    return tuple(sorted(named))


class LinkRounds:
    """Probe rounds of one worker, run in a thread of their own.

    A round probes every other worker (median of `repeats` probes each),
    publishes the row in the coordination service, reads the others' rows
    of the same round (waiting up to `wait_seconds` in all) and, from the
    matrix, finds the slow pairs and the workers behind them, against the
    last reference round (`.reference`, `{(from, to): seconds}`).

    Args:
        task: This worker's global index.
        addresses: Every worker's `"host:port"`, in global order.
        repeats: Probes per peer and round. Defaults to `3`.
        wait_seconds: Seconds a round waits for the others' rows.
            Defaults to `10.0`.
        probe: A function of an address returning seconds. Defaults to
            `probe_seconds` (tests pass a fake).
    """

    def __init__(
        self,
        task,
        addresses,
        *,
        repeats=3,
        wait_seconds=10.0,
        probe=probe_seconds,
    ):
        self.task = int(task)
        self.addresses = list(addresses)
        self.repeats = int(repeats)
        self.wait_seconds = float(wait_seconds)
        self.probe = probe
        self._fit = next(_fits)
        self._rounds = 0
        self.reference = {}
        self._results = {}
        self._queue = queue.Queue()
        self._done = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name="keras_hetero-links", daemon=True
        )
        self._thread.start()

    def start(self, reference=False):
        """Queues a round (`reference=True`: the healthy one the later
        rounds compare with); returns its number. Every worker starts the
        same rounds in the same order: the numbers match across workers."""
        number = self._rounds
        self._rounds += 1
        self._queue.put((number, reference))
        return number

    def result(self, number, timeout=0.0):
        """Round `number`'s `(seconds, slow_pairs, behind)`, or None if it
        has not finished within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._done:
            while number not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._done.wait(left)
            return self._results[number]

    def close(self, wait=2.0):
        """Ends the thread after its queued rounds, waiting up to `wait`
        seconds for it (a round waits on the others for at most
        `wait_seconds`)."""
        self._queue.put(None)
        self._thread.join(wait)

    def _key(self, number, task):
        return f"keras_hetero/links/{self._fit}/{number}/{task}"

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            number, reference = item
            result = self._round(number, reference)
            with self._done:
                self._results[number] = result
                self._done.notify_all()

    def _round(self, number, reference):
        row = {}
        for peer, address in enumerate(self.addresses):
            if peer != self.task:
                row[peer] = statistics.median(
                    self.probe(address) for _ in range(self.repeats)
                )
        # JSON's Infinity (Python's json reads and writes it) for no answer.
        text = json.dumps({str(p): s for p, s in row.items()})
        try:
            _compat.set_coordination_value(self._key(number, self.task), text)
        except Exception:  # no coordination service: this row only
            pass
        seconds = {(self.task, p): s for p, s in row.items()}
        deadline = time.monotonic() + self.wait_seconds
        for other in range(len(self.addresses)):
            if other == self.task:
                continue
            wait = max(int(1000 * (deadline - time.monotonic())), 1)
            key = self._key(number, other)
            text = _compat.get_coordination_value(key, wait)
            if text is None:
                continue  # unreachable, or slower than the wait
            for peer, value in json.loads(text).items():
                seconds[(other, int(peer))] = value
        if reference:
            self.reference = dict(seconds)
            return seconds, [], ()
        pairs = slow_pairs(seconds, self.reference)
        return seconds, pairs, behind(pairs)


class SlowLinkWatch:
    """`StragglerDetector`'s slow links in one `fit`: follows each step's
    time outside compute (a `communication.CommunicationTracker`) and, with
    `LinkRounds` probes, holds a slow-link event until its probe round
    names the workers behind the link; logs every event (logger
    `keras_hetero`) and keeps it in `events`.

    Args:
        tracker: The `communication.CommunicationTracker` of this `fit`.
        rounds: The `LinkRounds` of this worker, or None (no probes).
    """

    def __init__(self, tracker, rounds):
        self.tracker, self.rounds = tracker, rounds
        self.events = []
        self._pending = None

    def step(self, step, call, seconds, steps, changed):
        """Takes the call that ended at global step `step`.

        Args:
            step: Steps done in this `fit`.
            call: The train function call's host seconds, or None (a plain
                model: nothing to follow).
            seconds: Each replica's compute seconds (NaN: not measured).
            steps: Steps the call ran.
            changed: Whether a replica's straggler state changed now.
        """
        # fmax skips NaN (unmeasured) without nanmax's copy.
        compute = (
            np.fmax.reduce(seconds) if np.isfinite(seconds).any() else None
        )
        if call is None or compute is None:
            return  # plain model, or XLA (no clocks)
        measuring = self.tracker.baseline is None
        event = self.tracker.step(step, call, compute, steps)
        set_now = measuring and self.tracker.baseline is not None
        if self.rounds is not None and set_now:
            # The healthy reference of the probes, with the baseline.
            self.rounds.start(reference=True)
        if self._pending is not None:
            self._release(wait=0.0, now=event is not None)
        if event is None:
            return
        if event.kind == "communication" and self.rounds is not None:
            self._pending = (event, self.rounds.start(), changed)
            return
        self._report(event, changed)

    def close(self):
        """Reports a held event (its probes end within their wait: the
        others' rows) and closes the probes."""
        if self._pending is not None:
            self._release(wait=self.rounds.wait_seconds + 10)
        if self.rounds is not None:
            self.rounds.close()
            self.rounds = None

    def _release(self, wait, now=False):
        """Reports the held slow-link event once its probe round is in
        (or `now`, with what is known)."""
        event, number, changed = self._pending
        result = self.rounds.result(number, timeout=wait)
        if result is None and not (now or wait):
            return  # not in yet: asked again at the next batch end
        self._pending = None
        if result is not None:
            seconds, pairs, workers = result
            reference = self.rounds.reference
            event = dataclasses.replace(
                event,
                workers=workers,
                slow_links=tuple(
                    (a, b, seconds[(a, b)], reference.get((a, b)))
                    for a, b in pairs
                ),
            )
        self._report(event, changed, probed=result is not None)

    def _report(self, event, changed, probed=False):
        self.events.append(event)
        if event.kind == "communication":
            logger.warning(
                "StragglerDetector: steps are slowed by communication at "
                "step %d: %.1f ms per step outside compute (%.1f ms at the "
                "start), compute %.1f ms per step%s; a slow network link "
                "(or input), not a slow device: shares are left alone.%s",
                event.step,
                1000 * event.outside_seconds,
                1000 * event.baseline_seconds,
                1000 * event.compute_seconds,
                "" if not changed else ", and a replica changed speed",
                _behind_text(event, probed),
            )
        else:
            logger.warning(
                "StragglerDetector: steps are no longer slowed by "
                "communication at step %d: %.1f ms per step outside compute "
                "(%.1f ms at the start).",
                event.step,
                1000 * event.outside_seconds,
                1000 * event.baseline_seconds,
            )


def _behind_text(event, probed):
    if not probed:
        return ""
    if not event.workers:
        return (
            " Probes between the workers found no slow path (the time may "
            "be the input's, or on a path the probes do not take)."
        )
    probes = ", ".join(
        f"{a}->{b} {_ms(seconds)}"
        + ("" if reference is None else f" ({_ms(reference)} at the start)")
        for a, b, seconds, reference in event.slow_links
    )
    return (
        f" Probes between the workers put worker(s) {list(event.workers)} "
        f"behind the slow link (slow probes: {probes})."
    )


def _ms(seconds):
    if seconds == float("inf"):
        return "no answer"
    return f"{1000 * seconds:.1f} ms"
