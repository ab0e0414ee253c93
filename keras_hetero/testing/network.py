"""`NetworkHosts`: worker "hosts" in network namespaces with links a test can
cut, restore, flap and slow (test infrastructure; needs root).

Each host is a Linux network namespace joined by a veth pair to a bridge in
the root namespace; addresses are only on those links (`10.77.S.h/24`, `S`
picked per run, the bridge `.254`). Traffic goes only to those addresses.
A cut sets the host's bridge-side veth down (a switch port going down: the
host's sockets stay, packets are lost, TCP retransmits). A slow link goes
through a small shaping TCP relay in this process (`tc netem` is not needed),
which every worker reaches the host through when the host is in `relayed`.
Everything made is removed by `close()` (also from `atexit`, and by the
context manager on failure).
"""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

from keras_hetero._checks import check_int

_SUBNET_BASE = "10.77"
_BRIDGE_HOST = 254


def network_available():
    """Whether `NetworkHosts` can run here.

    Returns:
        `(True, "")`, or `(False, reason)` naming what is missing (root,
        the `ip` tool, network namespaces, veth or bridge links).
    """
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return False, "the `ip` tool (iproute2) is not installed"
    probe = "khprobe" + uuid.uuid4().hex[:6]
    try:
        _ip("netns", "add", probe)
    except RuntimeError as error:
        return False, f"cannot create a network namespace: {error}"
    try:
        _ip("link", "add", probe[:13] + "b", "type", "bridge")
        _ip("link", "del", probe[:13] + "b")
        _ip(
            "link",
            "add",
            probe[:13] + "v",
            "type",
            "veth",
            "peer",
            "name",
            probe[:13] + "p",
        )
        _ip("link", "del", probe[:13] + "v")
    except RuntimeError as error:
        return False, f"cannot create veth or bridge links: {error}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


class NetworkHosts:
    """`hosts` worker hosts in network namespaces on one bridge.

    Test infrastructure: the fault methods (`cut`, `restore`, `kill`,
    `flap`, `slow`) act on the running job from the test. Use it as a
    context manager (or call `close()`); it is also a `hosts=` for
    `kh.launcher.launch`, which then starts worker `i` in host `i`'s
    namespace with a `TF_CONFIG` of these addresses.

    Args:
        hosts: How many hosts, in [1, 200].
        relayed: Host indices that every other host reaches through the
            shaping relay (only those can be `slow`ed). Defaults to `()`.

    Raises:
        ValueError: For `hosts` outside [1, 200] or a relayed index that is
            not a host.
        RuntimeError: If namespaces cannot be made here (see
            `network_available`).

    Example:

    >>> with NetworkHosts(2) as net:  # doctest: +SKIP
    ...     launcher.launch(command, 2, hosts=net)
    """

    def __init__(self, hosts, *, relayed=()):
        hosts = check_int("hosts", hosts, 1, maximum=200)
        relayed = tuple(relayed)
        bad = [h for h in relayed if h not in range(hosts)]
        if bad:
            raise ValueError(
                "Invalid value for argument `relayed`. Received: "
                f"relayed={relayed!r}. Expected host indices in "
                f"[0, {hosts - 1}]."
            )
        self.hosts = hosts
        self.relayed = relayed
        run = uuid.uuid4().hex[:6]
        self.prefix = f"kh{run}"
        self.subnet = self._free_subnet()
        self.namespaces = [f"{self.prefix}h{i}" for i in range(hosts)]
        self._bridge = f"{self.prefix}br"
        self._made = []  # ("netns", name) / ("link", name), to remove
        self._relays = {}
        self._flaps = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # --- addresses ----------------------------------------------------------

    def address(self, host):
        """Host `host`'s own IP address (on its veth link)."""
        return f"{_SUBNET_BASE}.{self.subnet}.{host + 1}"

    @property
    def bridge_address(self):
        """The bridge's address in the root namespace (the relay's)."""
        return f"{_SUBNET_BASE}.{self.subnet}.{_BRIDGE_HOST}"

    def addresses(self, count, restart):
        """The `TF_CONFIG` addresses (`"ip:port"`) of workers `0..count-1`
        for attempt `restart`: a relayed host is reached at the relay.
        Used by `kh.launcher.launch(..., hosts=...)`."""
        if count > self.hosts:
            raise ValueError(
                f"Invalid value for argument `workers`. Received: {count} "
                f"workers. Expected at most the {self.hosts} hosts."
            )
        return self.addresses_of(range(count), restart)

    def addresses_of(self, hosts, restart):
        """The `TF_CONFIG` addresses of workers on hosts `hosts` (in that
        order) for attempt `restart`: the launcher's way to leave a lost
        host out of a restart."""
        bad = [h for h in hosts if h not in range(self.hosts)]
        if bad:
            raise ValueError(
                f"Invalid value for argument `hosts`. Received: {list(hosts)}."
                f" Expected host indices in [0, {self.hosts - 1}]."
            )
        result = []
        for host in hosts:
            port = 21000 + 50 * (restart % 100) + host
            if host in self.relayed:
                self._relay(host, port)
                result.append(f"{self.bridge_address}:{port}")
            else:
                result.append(f"{self.address(host)}:{port}")
        return result

    def command(self, host, command):
        """`command` run in host `host`'s namespace (for the launcher)."""
        return ["ip", "netns", "exec", self.namespaces[host], *command]

    def popen(self, host, command, **kwargs):
        """Starts `command` in host `host`'s namespace (`subprocess.Popen`
        keyword arguments pass through)."""
        return subprocess.Popen(self.command(host, command), **kwargs)

    # --- faults -------------------------------------------------------------

    def cut(self, host):
        """Takes host `host`'s link down (its bridge port)."""
        _ip("link", "set", self._veth(host), "down")

    def restore(self, host):
        """Brings host `host`'s link back up."""
        _ip("link", "set", self._veth(host), "up")

    def pids(self, host):
        """The ids of the processes in host `host`'s namespace."""
        listed = _ip("netns", "pids", self.namespaces[host], check=False)
        return [int(pid) for pid in listed.split()]

    def kill(self, host):
        """SIGKILLs every process in host `host`'s namespace: the host
        crashed. The kernel closes their sockets, so peers see their
        connections end (a host that lost power would also be `cut`).

        Returns:
            The ids of the processes killed.
        """
        killed = []
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def flap(self, host, down, up, times):
        """In the background: `times` times, cut host `host` for `down`
        seconds then restore it for `up` seconds.

        Returns:
            A `threading.Thread`; `join()` it to wait for the last restore.
        """

        def run():
            for _ in range(times):
                if self._closed:
                    return
                self.cut(host)
                time.sleep(down)
                if self._closed:
                    return
                self.restore(host)
                time.sleep(up)

        thread = threading.Thread(target=run, daemon=True)
        self._flaps.append(thread)
        thread.start()
        return thread

    def slow(self, host, latency=0.0, bandwidth=None):
        """Shapes the relayed host `host`'s traffic: every chunk waits
        `latency` seconds, and each direction of a connection carries at
        most `bandwidth` bytes per second (None: unlimited).

        Raises:
            ValueError: If `host` is not in `relayed`.
        """
        self._check_relayed(host)
        _Shape.set(self, host, float(latency), bandwidth)

    def relayed_bytes(self, host):
        """Bytes the relay carried to and from host `host` so far (both
        directions, every connection: what went over its shaped link).

        Raises:
            ValueError: If `host` is not in `relayed`.
        """
        self._check_relayed(host)
        return sum(r.bytes for r in self._relays.values() if r.host == host)

    # --- lifecycle ----------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stops the relays and removes every namespace and link made."""
        if self._closed:
            return
        self._closed = True
        for relay in self._relays.values():
            relay.close()
        for kind, name in reversed(self._made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)
        self._made = []
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def leftovers(self):
        """Namespaces and links of this run still present (for tests of the
        cleanup): a list of names, empty after `close()`."""
        names = _ip("netns", "list", check=False).split()
        names += [
            line.split(":")[1].strip().split("@")[0]
            for line in _ip("-o", "link", "show", check=False).splitlines()
            if ":" in line
        ]
        return [name for name in names if name.startswith(self.prefix)]

    # --- internals ----------------------------------------------------------

    def _check_relayed(self, host):
        if host not in self.relayed:
            raise ValueError(
                f"Invalid value for argument `host`. Received: host={host!r}."
                f" Expected a relayed host (relayed={self.relayed!r})."
            )

    def _veth(self, host):
        return f"{self.prefix}v{host}"

    def _free_subnet(self):
        used = _ip("-o", "addr", "show", check=False)
        start = os.getpid() % 200
        for offset in range(200):
            subnet = 20 + (start + offset) % 200
            if f" {_SUBNET_BASE}.{subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.77.S.0/24 subnet for NetworkHosts")

    def _build(self):
        _ip("link", "add", self._bridge, "type", "bridge")
        self._made.append(("link", self._bridge))
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self._bridge)
        _ip("link", "set", self._bridge, "up")
        for host, namespace in enumerate(self.namespaces):
            _ip("netns", "add", namespace)
            self._made.append(("netns", namespace))
            veth, peer = self._veth(host), f"{self.prefix}p{host}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self._made.append(("link", veth))
            _ip("link", "set", peer, "netns", namespace)
            _ip("link", "set", veth, "master", self._bridge)
            _ip("link", "set", veth, "up")
            inside = ("-n", namespace)
            _ip(*inside, "addr", "add", f"{self.address(host)}/24", "dev", peer)
            _ip(*inside, "link", "set", peer, "up")
            _ip(*inside, "link", "set", "lo", "up")

    def _relay(self, host, port):
        if port not in self._relays:
            self._relays[port] = _Relay(
                self,
                host,
                (self.bridge_address, port),
                (self.address(host), port),
            )
        return self._relays[port]


def _ip(*args, check=True):
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=30
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` failed: {result.stderr.strip()}"
        )
    return result.stdout


class _Shape:
    """Per-host shaping settings the relays read."""

    _settings = {}
    _lock = threading.Lock()

    @classmethod
    def set(cls, net, host, latency, bandwidth):
        with cls._lock:
            cls._settings[(id(net), host)] = (latency, bandwidth)

    @classmethod
    def get(cls, net, host):
        with cls._lock:
            return cls._settings.get((id(net), host), (0.0, None))


class _Relay:
    """A TCP relay from `listen` to `target` that applies the host's shape
    to each chunk (delay, then a bandwidth pace), both directions."""

    def __init__(self, net, host, listen, target):
        self.net, self.host, self.target = net, host, target
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(listen)
        self.server.listen(64)
        self.sockets = []
        self.closed = False
        self.bytes = 0
        self._count_lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pipe, args=(source, sink), daemon=True
                ).start()

    def _pipe(self, source, sink):
        try:
            while not self.closed:
                data = source.recv(65536)
                if not data:
                    break
                latency, bandwidth = _Shape.get(self.net, self.host)
                pause = latency + (len(data) / bandwidth if bandwidth else 0.0)
                if pause:
                    time.sleep(pause)
                sink.sendall(data)
                with self._count_lock:
                    self.bytes += len(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.closed = True
        try:
            # Wakes the thread blocked in accept(): until it returns it
            # holds the socket, which would stay listening on the address
            # (and refuse the next relay's bind there).
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for sock in [self.server, *self.sockets]:
            try:
                sock.close()
            except OSError:
                pass
