"""The multi-host rendezvous: a small TCP server in the launcher with
`--node-rank 0`, and the JSON-lines protocol the hosts' launchers speak.

Protocol (one JSON object per line, both ways, over one TCP connection that
each host's launcher keeps open for the whole job):

1. Authentication, both ways, with the shared token (never sent): the host
   sends `hello` with a random nonce; the server answers `challenge` with
   its nonce and `HMAC(token, "server", both nonces)`; the host answers
   `auth` with `HMAC(token, "client", both nonces)` and checks the server's.
   A wrong token ends the connection with an `error` on both sides.
2. `join`: the host's rank, address, one device list per worker and its job
   (script digest, arguments, versions, devices per worker). The server
   answers `welcome`, or `error` (a bad rank or a job that differs from
   rank 0's: fatal; a rank already connected: `retry`).
3. Rounds: when the hosts are there (`policy.decide_round`), the server
   sends `prepare`; each member answers `ports` (free ports on its
   address); the server assigns the workers (`policy.assign_workers`) and
   sends each member `start` with the cluster and its workers. A member
   reports `failed` when one of its workers exits non-zero and `finished`
   with its workers' exit codes; the server sends `stop` to every member
   on a failure, a lost host, or to admit a host that joined meanwhile;
   after each round, `ended` with the attempt; at the end `done` with the
   exit code.
4. `heartbeat` every second both ways: a connection silent for
   `HEARTBEAT_TIMEOUT` seconds counts as lost (a host that lost power or
   its network; a killed launcher's connection closes at once).

The server's state lives in one thread (`_loop`): connection threads only
turn lines into events.
"""

import dataclasses
import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import threading
import time

from keras_hetero.launcher import policy
from keras_hetero.launcher.group import Attempt
from keras_hetero.launcher.group import _say
from keras_hetero.launcher.group import _status

TOKEN_ENV = "KERAS_HETERO_RDZV_TOKEN"
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = 15.0
HANDSHAKE_SECONDS = 10.0
_MAX_LINE = 1 << 20  # a join message is a few hundred bytes
_PROTOCOL = 1


class RendezvousError(ConnectionError):
    """The connection to the rendezvous broke the protocol (a stray or
    half-closed connection; the host tries again)."""


class RendezvousRefused(ValueError):
    """The rendezvous and this host do not hold the same token, or speak
    another protocol version (trying again would not help)."""


def read_token(token=None, token_file=None, environ=None):
    """The shared rendezvous token, as bytes.

    Args:
        token: The token itself. Defaults to None (read `token_file`, else
            the `KERAS_HETERO_RDZV_TOKEN` environment variable).
        token_file: A file holding it (surrounding whitespace is ignored).
            Defaults to None.
        environ: The environment to read. Defaults to `os.environ`.

    Returns:
        The token's bytes.

    Raises:
        ValueError: If there is no token, it is empty, or the file cannot
            be read (the token itself is never shown).
    """
    if token is None and token_file is not None:
        try:
            with open(token_file, "rb") as f:
                token = f.read().strip()
        except OSError as error:
            raise ValueError(
                "Invalid value for argument `rdzv_token_file`. Received: "
                f"rdzv_token_file={token_file!r}, which cannot be read "
                f"({error.strerror})."
            ) from None
        if not token:
            raise ValueError(
                "Invalid value for argument `rdzv_token_file`. Received: "
                f"rdzv_token_file={token_file!r}, which is empty. Expected "
                "a file holding the shared secret."
            )
    if token is None:
        token = (os.environ if environ is None else environ).get(TOKEN_ENV)
    if isinstance(token, str):
        token = token.strip().encode()
    if not token:
        raise ValueError(
            f"No rendezvous token: set {TOKEN_ENV} (or pass "
            "--rdzv-token-file) to the same secret on every host, e.g. "
            "`openssl rand -hex 16`. It keeps processes that do not know "
            "it out of the job."
        )
    return bytes(token)


class Channel:
    """One connection of the protocol: JSON lines over a TCP socket.

    Args:
        sock: A connected socket.
    """

    def __init__(self, sock):
        self.sock = sock
        self._lines = sock.makefile("rb")
        self._send_lock = threading.Lock()
        try:
            address = sock.getpeername()
            self.peer = f"{address[0]}:{address[1]}"
        except OSError:
            self.peer = "?"

    def send(self, message):
        """Sends one message (a dict with a `type`)."""
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            self.sock.sendall(data)

    def receive(self):
        """The next message, or None when the peer closed the connection.

        Raises:
            RendezvousError: For a line that is too long or not a JSON
                object with a `type`.
            OSError: If the connection failed (or timed out).
        """
        line = self._lines.readline(_MAX_LINE + 1)
        if not line:
            return None
        if len(line) > _MAX_LINE:
            raise RendezvousError(f"{self.peer} sent an over-long line")
        try:
            message = json.loads(line)
        except ValueError:
            raise RendezvousError(
                f"{self.peer} sent a line that is not JSON"
            ) from None
        if not isinstance(message, dict) or "type" not in message:
            raise RendezvousError(f"{self.peer} sent a message without type")
        return message

    def close(self, finish=False):
        """Closes the connection; `finish`: only stop sending (the peer
        reads what was sent, then closes its side)."""
        try:
            self.sock.shutdown(socket.SHUT_WR if finish else socket.SHUT_RDWR)
        except OSError:
            pass
        if not finish:
            self.sock.close()


def _proof(token, side, client_nonce, server_nonce):
    text = f"keras-hetero-rdzv|{side}|{client_nonce}|{server_nonce}"
    return hmac.new(token, text.encode(), hashlib.sha256).hexdigest()


def client_handshake(channel, token):
    """Authenticates this host to the server and the server to this host.

    Raises:
        RendezvousRefused: If the server holds another token (or is
            another job's rendezvous) or refused this host's protocol.
        RendezvousError: If the connection closed or broke the protocol.
    """
    client_nonce = secrets.token_hex(16)
    channel.send(
        {"type": "hello", "nonce": client_nonce, "protocol": _PROTOCOL}
    )
    challenge = channel.receive()
    if challenge is None:
        raise RendezvousError("the rendezvous closed the connection")
    if challenge["type"] == "error":
        raise RendezvousRefused(str(challenge.get("message")))
    server_nonce = str(challenge.get("nonce"))
    # The host's proof goes first, so a server holding another token
    # logs the refusal too.
    channel.send(
        {
            "type": "auth",
            "proof": _proof(token, "client", client_nonce, server_nonce),
        }
    )
    expected = _proof(token, "server", client_nonce, server_nonce)
    if not hmac.compare_digest(str(challenge.get("proof")), expected):
        raise RendezvousRefused(
            f"the rendezvous at {channel.peer} holds another token than this "
            f"host ({TOKEN_ENV} or --rdzv-token-file must be the same secret "
            "on every host), or is another job's rendezvous"
        )


def server_handshake(channel, token):
    """Checks a new connection's token proof (see `client_handshake`).

    Returns:
        None if the peer knows the token, else why it was refused
        (`"wrong token"`, another protocol, or no greeting); the peer got
        an `error` where it spoke the protocol.
    """
    hello = channel.receive()
    if hello is None or hello["type"] != "hello":
        return "it did not greet (not a keras-hetero launcher?)"
    client_nonce = str(hello.get("nonce", ""))[:64]
    if hello.get("protocol") != _PROTOCOL:
        channel.send(
            {
                "type": "error",
                "message": "the rendezvous speaks protocol "
                f"{_PROTOCOL}, this host {hello.get('protocol')!r}: install "
                "the same keras-hetero version on every host",
            }
        )
        return f"it speaks protocol {hello.get('protocol')!r}"
    server_nonce = secrets.token_hex(16)
    channel.send(
        {
            "type": "challenge",
            "nonce": server_nonce,
            "proof": _proof(token, "server", client_nonce, server_nonce),
        }
    )
    auth = channel.receive()
    expected = _proof(token, "client", client_nonce, server_nonce)
    if (
        auth is None
        or auth["type"] != "auth"
        or not hmac.compare_digest(str(auth.get("proof")), expected)
    ):
        try:  # a host with another token may have hung up already
            channel.send(
                {
                    "type": "error",
                    "message": "the rendezvous refused this host: wrong "
                    f"token ({TOKEN_ENV} or --rdzv-token-file must be the "
                    "same secret on every host)",
                }
            )
        except OSError:
            pass
        return "wrong token"
    return None


class _Host:
    """A joined host, as the server sees it."""

    def __init__(self, channel, message, now):
        self.channel = channel
        self.address = str(message.get("address"))
        self.slots = list(message.get("slots") or [None])
        self.name = str(message.get("hostname", ""))
        self.last_seen = now


class _Hosts(dict):
    """The joined hosts by rank (`_Host`s), and why others were refused:
    the joins the server checks and admits."""

    def __init__(self, max_hosts, job, count, job_rank=0):
        super().__init__()
        self.max_hosts, self.job, self.count = max_hosts, job, count
        self.job_rank = job_rank  # the host whose job the others match
        self.refused = {}  # rank -> why its job was refused
        self.wrong_token = []  # peers refused for a wrong token

    def rank_of(self, channel):
        """The rank whose connection is `channel`, or None."""
        for rank, host in self.items():
            if host.channel is channel:
                return rank
        return None

    def refusal(self, rank, message):
        """`(why a join is refused, whether the host may retry)`; `(None,
        False)` for a welcome join."""
        if (
            isinstance(rank, bool)
            or not isinstance(rank, int)
            or not 0 <= rank < self.max_hosts
        ):
            return (
                "Invalid value for argument `node_rank`. Received: "
                f"node_rank={rank!r}. Expected a rank in "
                f"[0, {self.max_hosts - 1}] (--nnodes {self.count})."
            ), False
        error = policy.job_mismatch(
            self.job,
            message.get("job") or {},
            rank=rank,
            reference_rank=self.job_rank,
        )
        if error is not None:
            self.refused[rank] = error
            return error, False
        if rank in self:
            return (
                f"Host rank {rank} is already in the group (from "
                f"{self[rank].address}): each host needs its own "
                "--node-rank."
            ), True
        return None, False

    def admit(self, rank, channel, message, now):
        """Adds the host that joined as `rank`; returns its `_Host`."""
        self.refused.pop(rank, None)
        self[rank] = _Host(channel, message, now)
        return self[rank]

    def refusals(self, missing):
        """Why the `missing` ranks are not here, as far as the server knows
        (their joins refused, connections with a wrong token)."""
        text = "".join(
            f" Host rank {rank} was refused: {self.refused[rank]}"
            for rank in missing
            if rank in self.refused
        )
        if self.wrong_token:
            text += (
                f" {len(self.wrong_token)} connection(s) were refused for a "
                f"wrong token (from {sorted(set(self.wrong_token))})."
            )
        return text


class _Listener:
    """The server's socket: accepts connections, authenticates each
    (`server_handshake`) and turns its lines into events on `events`:
    `("refused", channel, why)`, `("join", channel, message)`,
    `("message", channel, message)`, `("closed", channel)`.

    Raises:
        ValueError: If the port is in use or the address is not local.
    """

    def __init__(self, bind, port, token):
        self.token = token
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((bind, port))
        except OSError as error:
            self._listener.close()
            raise ValueError(
                "Invalid value for argument `rdzv_endpoint`: the rendezvous "
                f"cannot listen on {bind}:{port} ({error.strerror}). "
                + (
                    "Another process (another job's rendezvous?) has that "
                    "port: pick another port for --rdzv-endpoint."
                    if error.errno in (98, 48)  # EADDRINUSE (Linux, macOS)
                    else "Expected --rdzv-bind to be an address of this "
                    "host (or 0.0.0.0)."
                )
            ) from None
        self._listener.listen(64)
        self._listener.settimeout(0.5)
        self.address = f"{bind}:{port}"
        self.events = queue.Queue()
        self._threads = []
        self._closed = False

    def start(self):
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self, wait):
        self._closed = True
        for thread in self._threads:
            thread.join(wait)
        self._listener.close()

    def _accept(self):
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(
                target=self._connection, args=(sock,), daemon=True
            ).start()

    def _connection(self, sock):
        channel = Channel(sock)
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            refused = server_handshake(channel, self.token)
            if refused is not None:
                self.events.put(("refused", channel, refused))
                return
            join = channel.receive()
            if join is None or join["type"] != "join":
                return
            sock.settimeout(None)
            self.events.put(("join", channel, join))
            while True:
                message = channel.receive()
                if message is None:
                    break
                self.events.put(("message", channel, message))
        except (OSError, RendezvousError):
            pass
        finally:
            self.events.put(("closed", channel))


def _round_attempt(workers, finished, failure, lost_ranks):
    """The `Attempt` a round ended with: each worker's exit code (None for
    one whose host was lost or did not report), which failed, which were
    lost with their host."""
    codes = []
    for worker in workers:
        local = finished.get(worker.rank)
        lost = local is None or worker.local_index >= len(local)
        codes.append(None if lost else local[worker.local_index])
    failed = ()
    if failure is not None:
        index, _, rank = failure
        failed = (
            (index,)
            if index is not None
            else tuple(w.index for w in workers if w.rank == rank)
        )
    return Attempt(
        len(workers),
        tuple(codes),
        failed,
        tuple(w.rank for w in workers),
        tuple(w.index for w in workers if w.rank in lost_ranks),
    )


class RendezvousServer:
    """The rendezvous of a multi-host job (in the launcher of rank 0, or
    with `--rdzv-backend etcd` in the one holding the role: `etcd.py`).

    It gathers the hosts, starts rounds of workers across them, and
    restarts the group on a failure, a lost host, or to admit a host that
    joined while a round ran. See the module docstring for the protocol.

    Args:
        bind: The local address to listen on.
        port: The port.
        token: The shared token (bytes).
        min_hosts: The fewest hosts a round may have.
        max_hosts: The most; ranks are `0..max_hosts-1`.
        job: Rank 0's job (`hosts.job_description`); other hosts must
            match it.
        timeout: Seconds to wait for `min_hosts` when gathering.
        last_call: Seconds without a new host before a round starts with
            fewer than `max_hosts` (or before a running group is restarted
            to admit new hosts).
        max_restarts: Restarts after failures (admissions do not count).
        grace_seconds: The hosts' grace period when stopping workers (the
            server waits that long plus a margin for their exit codes).
        output: A text stream for `[rendezvous]` lines.
        rank: The rank of the host serving (its `job` is the reference).
            Defaults to `0`.
        state: `{"round", "failures"}` to continue from (a server taking
            over a running job). Defaults to None (a new job).
        record: Called with `state=` at each round's start and end and with
            `done=` at the job's end, for a server that takes over.
            Defaults to None.

    Raises:
        ValueError: If the port is in use or the address is not local.
    """

    def __init__(
        self,
        bind,
        port,
        token,
        *,
        min_hosts,
        max_hosts,
        job,
        timeout,
        last_call,
        max_restarts,
        grace_seconds,
        output,
        rank=0,
        state=None,
        record=None,
    ):
        self.min_hosts, self.max_hosts = min_hosts, max_hosts
        self.token, self.job = token, job
        self.timeout, self.last_call = timeout, last_call
        self.max_restarts = max_restarts
        self.grace_seconds = grace_seconds
        self.output = output
        self._listener = _Listener(bind, port, token)
        self.address = self._listener.address
        self._events = self._listener.events
        self._hosts = _Hosts(max_hosts, job, self._count(), rank)
        self._state = "gather"
        self._record = record or (lambda **_: None)
        state = state or {}
        self._round = int(state.get("round", 0))  # the next round to start
        self._members = ()
        self._workers = ()
        self._ports = {}
        self._finished = {}
        self._lost = []
        self._failure = None
        self._stop_reason = None
        self._failures = int(state.get("failures", 0))
        self._deadline = 0.0
        now = time.monotonic()
        self._gather_began = self._last_join = self._last_beat = now
        self._said_waiting = now
        self.attempts = []
        self.exit_code = None
        self._done = None  # the message that ended the job
        self._threads = []
        self._closed = False

    def start(self):
        """Starts serving (in background threads)."""
        _say(
            self.output,
            f"[rendezvous] listening on {self.address} for "
            f"{self._count()} host(s)",
        )
        self._listener.start()
        thread = threading.Thread(target=self._loop, daemon=True)
        thread.start()
        self._threads.append(thread)

    def shutdown(self, exit_code, message):
        """Ends the job on every host with `exit_code` (from another thread,
        e.g. when rank 0's launcher is interrupted)."""
        self._events.put(("shutdown", exit_code, message))

    def close(self, wait=5.0):
        """Stops serving; waits up to `wait` seconds for the loop to send
        its last messages."""
        if self._state != "done":
            self.shutdown(1, "the rendezvous was closed")
        deadline = time.monotonic() + wait
        while self._state != "done" and time.monotonic() < deadline:
            time.sleep(0.05)
        self.abandon(wait)

    def abandon(self, wait=5.0):
        """Stops serving without ending the job (this host leaves an etcd
        rendezvous): the hosts lose their connections and find the next
        server. `close` ends the job first, then does this."""
        self._closed = True
        for thread in self._threads:
            thread.join(wait)
        self._listener.close(wait)
        for host in list(self._hosts.values()):
            host.channel.close()

    # --- the state machine -------------------------------------------------

    def _loop(self):
        # Runs until `close()`: after the end it still tells a host that
        # joins late how the job ended.
        try:
            while not self._closed:
                try:
                    event = self._events.get(timeout=0.1)
                except queue.Empty:
                    event = None
                if event is not None:
                    self._handle(event)
                if self._state != "done":
                    self._tick(time.monotonic())
        except Exception as error:
            # A bug here must end the job on every host, not leave the
            # hosts waiting for a rendezvous that no longer answers.
            self._stop_all()
            self._finish(1, f"the rendezvous failed: {error!r}")
            raise

    def _handle(self, event):
        kind, now = event[0], time.monotonic()
        if self._state == "done" and kind != "join":
            return
        if kind == "shutdown":
            self._stop_all()
            self._finish(event[1], event[2])
        elif kind == "refused":
            channel, why = event[1], event[2]
            if why == "wrong token":
                self._hosts.wrong_token.append(channel.peer.rpartition(":")[0])
            _say(
                self.output,
                f"[rendezvous] refused a connection from {channel.peer}: {why}",
            )
            channel.close()
        elif kind == "join":
            self._join(event[1], event[2], now)
        elif kind == "closed":
            rank = self._hosts.rank_of(event[1])
            if rank is not None:
                self._lose(rank, "its launcher's connection closed")
        elif kind == "message":
            rank = self._hosts.rank_of(event[1])
            if rank is not None:
                self._hosts[rank].last_seen = now
                self._message(rank, event[2])

    def _join(self, channel, message, now):
        rank = message.get("rank")
        if self._state == "done":
            try:
                channel.send({"type": "welcome"})
                channel.send(self._done)
            except OSError:
                pass
            channel.close(finish=True)
            return
        error, retry = self._hosts.refusal(rank, message)
        if error is not None:
            _say(
                self.output,
                f"[rendezvous] refused host rank {rank!r} from "
                f"{channel.peer}: {error}",
            )
            try:
                channel.send(
                    {"type": "error", "message": error, "retry": retry}
                )
            except OSError:
                pass
            channel.close(finish=True)
            return
        host = self._hosts.admit(rank, channel, message, now)
        self._last_join = now
        _say(
            self.output,
            f"[rendezvous] host rank {rank} ({host.name}) joined from "
            f"{host.address} with {len(host.slots)} worker(s)",
        )
        self._send(rank, {"type": "welcome"})

    def _message(self, rank, message):
        kind = message["type"]
        if message.get("round") != self._round:
            return  # heartbeats, and replies about an earlier round
        if kind == "ports" and self._state == "ports":
            self._ports[rank] = [int(p) for p in message.get("ports", [])]
        elif kind == "failed" and self._state == "running":
            self._failure = (message.get("worker"), message.get("code"), rank)
            _say(
                self.output,
                f"[rendezvous] worker {message.get('worker')} on host rank "
                f"{rank} exited with {message.get('code')}; stopping the "
                "group",
            )
            self._stop("failure")
        elif kind == "finished" and rank in self._members:
            codes = list(message.get("codes", []))
            self._finished[rank] = codes
            if self._state != "running":
                return
            bad = [c for c in codes if c != 0]
            if bad:
                local = codes.index(bad[0])
                worker = [w.index for w in self._workers if w.rank == rank]
                self._failure = (worker[local], bad[0], rank)
                self._stop("failure")
            elif set(self._finished) >= set(self._members):
                self._end_round()

    def _tick(self, now):
        if now - self._last_beat >= HEARTBEAT_SECONDS:
            self._last_beat = now
            for rank in list(self._hosts):
                self._send(rank, {"type": "heartbeat"})
        for rank, host in list(self._hosts.items()):
            if now - host.last_seen > HEARTBEAT_TIMEOUT:
                self._lose(rank, f"silent for {HEARTBEAT_TIMEOUT:.0f} s")
        quiet = now - max(self._last_join, self._gather_began)
        if self._state == "gather":
            self._gather(now, quiet)
        elif self._state == "ports":
            if set(self._ports) >= set(self._members):
                self._start_round()
            elif now > self._deadline:
                for rank in set(self._members) - set(self._ports):
                    self._lose(rank, "it did not answer with ports")
        elif self._state == "running":
            if policy.should_admit(
                self._members,
                self._hosts,
                self.max_hosts,
                quiet=now - self._last_join,
                last_call=self.last_call,
            ):
                new = sorted(set(self._hosts) - set(self._members))
                _say(
                    self.output,
                    f"[rendezvous] host rank(s) {new} joined: restarting the "
                    "group to admit them",
                )
                self._stop("admit")
        elif self._state == "stopping":
            waiting = set(self._members) - set(self._finished)
            if not waiting & set(self._hosts):
                self._end_round()
            elif now > self._deadline:
                for rank in waiting & set(self._hosts):
                    self._lose(rank, "its workers did not stop")

    def _gather(self, now, quiet):
        decision = policy.decide_round(
            self._hosts,
            self.min_hosts,
            self.max_hosts,
            waited=now - self._gather_began,
            quiet=quiet,
            timeout=self.timeout,
            last_call=self.last_call,
        )
        if decision.action == "start":
            self._members = decision.hosts
            self._ports = {}
            self._state = "ports"
            self._deadline = now + 30.0
            for rank in self._members:
                self._send(rank, {"type": "prepare", "round": self._round})
        elif decision.action == "fail":
            self._finish(1, self._timeout_message(decision.missing), "timeout")
        elif now - self._said_waiting >= 10.0:
            self._said_waiting = now
            left = self.timeout - (now - self._gather_began)
            _say(
                self.output,
                f"[rendezvous] waiting for host rank(s) "
                f"{list(decision.missing)} ({len(self._hosts)} of "
                f"{self._count()} joined; {max(left, 0):.0f} s left)",
            )

    def _timeout_message(self, missing):
        message = (
            f"Host rank(s) {list(missing)} did not join the rendezvous at "
            f"{self.address} within {self.timeout:g} s "
            f"({len(self._hosts)} joined: {sorted(self._hosts)}; at least "
            f"{self.min_hosts} needed)."
        )
        return message + self._hosts.refusals(missing)

    def _start_round(self):
        try:
            self._workers = policy.assign_workers(
                {
                    rank: (
                        self._hosts[rank].address,
                        self._ports[rank],
                        self._hosts[rank].slots,
                    )
                    for rank in self._members
                }
            )
        except ValueError as error:
            self._finish(2, str(error))
            return
        cluster = [w.address for w in self._workers]
        ranks = [w.rank for w in self._workers]
        _say(
            self.output,
            f"[rendezvous] attempt {self._round}: {len(cluster)} worker(s) "
            f"on host rank(s) {list(self._members)} (worker host ranks "
            f"{ranks})",
        )
        for rank in self._members:
            self._send(
                rank,
                {
                    "type": "start",
                    "round": self._round,
                    "cluster": cluster,
                    "hosts": ranks,
                    "workers": [
                        {"index": w.index, "devices": w.devices}
                        for w in self._workers
                        if w.rank == rank
                    ],
                },
            )
        self._state = "running"
        self._finished, self._lost = {}, []
        self._failure = self._stop_reason = None
        # If this server's host is lost, the round counts as a failure.
        self._record(
            state={"round": self._round + 1, "failures": self._failures + 1}
        )

    def _stop(self, reason):
        self._stop_reason = reason
        self._state = "stopping"
        self._deadline = time.monotonic() + self.grace_seconds + 30.0
        self._stop_all()

    def _stop_all(self):
        if self._state in ("running", "stopping"):
            # After a failure (a worker's, or a lost host's: code None) the
            # others wait in a collective that cannot finish: they stop at
            # once (`policy.stop_grace`); to let a host in, with grace.
            grace = self.grace_seconds
            if self._stop_reason == "failure" and self._failure is not None:
                grace = policy.stop_grace([self._failure[1]], grace)
            for rank in self._members:
                self._send(
                    rank,
                    {"type": "stop", "round": self._round, "grace": grace},
                )

    def _lose(self, rank, why):
        host = self._hosts.pop(rank)
        host.channel.close()
        _say(self.output, f"[rendezvous] lost host rank {rank}: {why}")
        if rank not in self._members:
            return
        if self._state == "ports":
            self._begin_gathering()  # no worker started yet
        elif self._state == "running":
            self._lost.append(rank)
            self._failure = (None, None, rank)
            self._stop("failure")
        elif self._state == "stopping":
            self._lost.append(rank)

    def _end_round(self):
        attempt = _round_attempt(
            self._workers, self._finished, self._failure, self._lost
        )
        self.attempts.append(attempt)
        for rank in list(self._hosts):
            self._send(
                rank,
                {"type": "ended", "attempt": dataclasses.asdict(attempt)},
            )
        self._round += 1
        if self._failure is None and self._stop_reason is None:
            self._finish(0, None)
            return
        if self._failure is not None:
            self._failures += 1
            code = self._failure[1]
            status = 1 if code is None else _status(code)
            if self._failures > self.max_restarts:
                self._finish(
                    status,
                    f"no restarts left (--max-restarts {self.max_restarts}); "
                    f"exit {status}",
                )
                return
        self._record(state={"round": self._round, "failures": self._failures})
        self._begin_gathering()

    def _begin_gathering(self):
        self._state = "gather"
        self._members = ()
        self._gather_began = self._said_waiting = time.monotonic()

    def _finish(self, exit_code, message, kind="exit"):
        self.exit_code = exit_code
        self._state = "done"
        self._done = {
            "type": "done",
            "exit_code": exit_code,
            "message": message,
            "kind": kind,
        }
        if message:
            _say(self.output, f"[rendezvous] {message}")
        self._record(done=self._done)
        for rank, host in list(self._hosts.items()):
            self._send(rank, self._done)
            # The host reads what was sent, then closes its side.
            host.channel.close(finish=True)

    def _send(self, rank, message):
        if rank not in self._hosts:
            return  # lost meanwhile
        try:
            self._hosts[rank].channel.send(message)
        except OSError:
            pass  # the connection thread reports it closed

    def _count(self):
        if self.min_hosts == self.max_hosts:
            return str(self.max_hosts)
        return f"{self.min_hosts}:{self.max_hosts}"
