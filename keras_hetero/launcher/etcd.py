"""`--rdzv-backend etcd`: a rendezvous that survives its host.

With the default backend the launcher with `--node-rank 0` serves the
rendezvous (`rendezvous.py`), and losing that host ends the job. With etcd,
no host is special: every launcher campaigns for the role in a real etcd
(one key, created only if absent, held under a short lease the holder keeps
alive). The winner serves the same rendezvous on its own address and
publishes it in the key; the others read it there and join. When the
holder's host dies, its lease expires within `LEASE_SECONDS`, another
launcher takes the role, and the group continues with the round and restart
counts the last holder left in etcd. A launcher that comes back later joins
like any other host.

Keys, under `/keras-hetero/<rdzv-id>/`:

- `server`: the serving launcher's `HOST:PORT` (its lease: `LEASE_SECONDS`).
- `state`: JSON `{"round", "failures"}`: the next round and the failures so
  far. Its lease (`--rdzv-timeout` seconds, kept alive by the holder) ends
  it once no launcher of the job is left, so a later job with the same id
  starts afresh.
- `done`: JSON, the message that ended the job, under the same lease: a
  launcher that starts after the end returns it instead of starting the job
  again.

It speaks etcd's v3 JSON gateway (`POST /v3/kv/range`, `/v3/kv/txn`,
`/v3/lease/grant`, ...; served by etcd >= 3.4 on its client port) with
urllib: no client library.
"""

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from keras_hetero.launcher import policy
from keras_hetero.launcher.group import _say
from keras_hetero.launcher.ports import free_ports

LEASE_SECONDS = 3
REQUEST_SECONDS = 5.0
_PREFIX = "/keras-hetero/"


class EtcdError(ConnectionError):
    """etcd could not be reached, or answered with an error."""


def parse_endpoints(endpoint):
    """etcd's client URLs from `--rdzv-endpoint`.

    Args:
        endpoint: `"HOST:PORT"`, `"http://HOST:PORT"`, or several of these
            separated by commas (the members of an etcd cluster).

    Returns:
        A list of base URLs, e.g. `["http://10.0.0.5:2379"]`.

    Raises:
        ValueError: If an item is not `[http://]HOST:PORT` (named).
    """
    urls = []
    for item in str(endpoint).split(","):
        item = item.strip()
        url = item if "://" in item else f"http://{item}"
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or (port is None or parts.path not in ("", "/"))
        ):
            raise ValueError(
                "Invalid value for argument `rdzv_endpoint`. Received: "
                f"rdzv_endpoint={endpoint!r}. Expected etcd's client "
                "address(es) with --rdzv-backend etcd: HOST:PORT or "
                "http://HOST:PORT, comma-separated for several members "
                "(e.g. 10.0.0.5:2379)."
            )
        urls.append(f"{parts.scheme}://{parts.netloc}")
    return urls


def check_job_id(job_id):
    """`--rdzv-id`: the job's name in etcd (every host gives the same).

    Raises:
        ValueError: If it is missing, or not 1-64 characters of letters,
            digits, `.`, `_` and `-`.
    """
    text = "" if job_id is None else str(job_id)
    if not (
        0 < len(text) <= 64
        and all(c.isalnum() or c in "._-" for c in text)
        and text.isascii()
    ):
        raise ValueError(
            "Invalid value for argument `rdzv_id`. Received: "
            f"rdzv_id={job_id!r}. Expected the job's id, the same on every "
            "host and new for each job (1-64 letters, digits, '.', '_', "
            "'-'), e.g. --rdzv-id train-2026-12-07."
        )
    return text


def _b64(text):
    return base64.b64encode(text.encode()).decode()


class EtcdClient:
    """The few etcd v3 calls the rendezvous needs, over the JSON gateway.

    Args:
        urls: Client URLs of the cluster's members (`parse_endpoints`);
            each call tries them in order.

    Example:

    >>> client = EtcdClient(["http://127.0.0.1:2379"])  # doctest: +SKIP
    >>> client.put("/x", "1")  # doctest: +SKIP
    """

    def __init__(self, urls):
        self.urls = list(urls)

    def call(self, path, body):
        """POSTs `body` (a dict) to `path` on the first member that answers;
        returns the JSON reply.

        Raises:
            EtcdError: If no member answers (naming each and why), or one
                answers with an error.
        """
        data = json.dumps(body).encode()
        failures = []
        for url in self.urls:
            request = urllib.request.Request(
                url + path,
                data=data,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(
                    request, timeout=REQUEST_SECONDS
                ) as reply:
                    return json.loads(reply.read() or b"{}")
            except urllib.error.HTTPError as error:
                detail = error.read().decode(errors="replace")[:200]
                raise EtcdError(
                    f"etcd at {url} refused {path}: HTTP {error.code} {detail}"
                ) from None
            except (OSError, ValueError) as error:
                reason = getattr(error, "reason", error)
                failures.append(f"{url} ({reason})")
        raise EtcdError(
            "Cannot reach etcd at " + ", ".join(failures) + ". Expected "
            "--rdzv-endpoint to name etcd's client address (its "
            "--advertise-client-urls), reachable from this host."
        )

    def get(self, key):
        """The value of `key` as text, or None."""
        reply = self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = reply.get("kvs") or []
        if not kvs:
            return None
        return base64.b64decode(kvs[0].get("value", "")).decode()

    def put(self, key, value, lease=None):
        """Sets `key` to `value` (text), under `lease` if given."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        self.call("/v3/kv/put", body)

    def create(self, key, value, lease):
        """Sets `key` only if it does not exist (one etcd transaction);
        returns whether it did."""
        reply = self.call(
            "/v3/kv/txn",
            {
                "compare": [
                    {
                        "key": _b64(key),
                        "result": "EQUAL",
                        "target": "CREATE",
                        "createRevision": "0",
                    }
                ],
                "success": [
                    {
                        "requestPut": {
                            "key": _b64(key),
                            "value": _b64(value),
                            "lease": str(lease),
                        }
                    }
                ],
            },
        )
        return bool(reply.get("succeeded"))

    def delete(self, key):
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def grant(self, seconds):
        """A new lease of `seconds`; returns its id."""
        reply = self.call("/v3/lease/grant", {"TTL": str(int(seconds))})
        return int(reply["ID"])

    def keep_alive(self, lease):
        """Renews `lease`; returns whether it was still alive."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int((reply.get("result") or {}).get("TTL", 0)) > 0

    def revoke(self, lease):
        """Ends `lease` (its keys go with it)."""
        self.call("/v3/lease/revoke", {"ID": str(lease)})


class Role:
    """This launcher's standing in an etcd rendezvous: where the server
    is, whether the job ended, and (when it wins the role) holding it.

    Args:
        client: An `EtcdClient`.
        job_id: The job's id (`check_job_id`).
        keep_seconds: How long the job's `state` and `done` outlive the
            last launcher (`--rdzv-timeout`).

    Raises:
        EtcdError: From the first call if etcd cannot be reached.
    """

    def __init__(self, client, job_id, keep_seconds):
        self.client = client
        self.prefix = f"{_PREFIX}{job_id}/"
        self.keep_seconds = max(int(keep_seconds), LEASE_SECONDS)
        self.lost = threading.Event()  # set if a held role's lease ended
        self._leases = None  # (server lease, job lease) while held
        self._stop = threading.Event()

    def server(self):
        """The serving launcher's `HOST:PORT`, or None."""
        return self.client.get(self.prefix + "server")

    def done(self):
        """The message that ended the job (a dict), or None."""
        text = self.client.get(self.prefix + "done")
        return None if text is None else json.loads(text)

    def state(self):
        """`{"round", "failures"}` the last server left (zeros at first)."""
        text = self.client.get(self.prefix + "state")
        return {"round": 0, "failures": 0, **json.loads(text or "{}")}

    def claim(self, address):
        """Takes the role for the server at `address` if no one holds it.

        Returns:
            The job's state to continue from (`state`) if it did (it then
            keeps its leases alive), else None.
        """
        lease = self.client.grant(LEASE_SECONDS)
        if not self.client.create(self.prefix + "server", address, lease):
            self.client.revoke(lease)
            return None
        self._leases = (lease, self.client.grant(self.keep_seconds))
        self.lost.clear()
        self._stop.clear()
        threading.Thread(target=self._keep, daemon=True).start()
        state = self.state()
        self.record(state=state)  # now under this holder's job lease
        return state

    def record(self, state=None, done=None):
        """Saves the job's `state` or its end (`done`), under the job
        lease (from the server's loop)."""
        if self._leases is None:
            return
        try:
            if state is not None:
                self.client.put(
                    self.prefix + "state", json.dumps(state), self._leases[1]
                )
            if done is not None:
                self.client.put(
                    self.prefix + "done", json.dumps(done), self._leases[1]
                )
        except EtcdError:
            pass  # the lease thread notices a lasting loss

    def release(self):
        """Gives the role up at once (its server key goes; the job lease
        runs out on its own)."""
        self._stop.set()
        leases, self._leases = self._leases, None
        if leases is not None:
            try:
                self.client.revoke(leases[0])
            except EtcdError:
                pass  # it expires within LEASE_SECONDS anyway

    def _keep(self):
        leases = self._leases
        alive_until = time.monotonic() + LEASE_SECONDS
        while not self._stop.wait(LEASE_SECONDS / 3):
            try:
                if not self.client.keep_alive(leases[0]):
                    break
                self.client.keep_alive(leases[1])
                alive_until = time.monotonic() + LEASE_SECONDS
            except EtcdError:
                if time.monotonic() > alive_until:
                    break
        if not self._stop.is_set():
            self.lost.set()


class Seat:
    """Where a host's launcher finds the rendezvous with `--rdzv-backend
    etcd`, serving it itself when no launcher does.

    Args:
        endpoint: etcd's client address(es) (`parse_endpoints`).
        job_id: `--rdzv-id` (`check_job_id`).
        bind: The local address to serve on when this host takes the role.
            None: the address this host reaches etcd from. `0.0.0.0`
            listens everywhere and publishes that address.
        keep_seconds: How long the job's state outlives its last launcher.
        make_server: `make_server(address, port, state)` returns an
            unstarted `RendezvousServer`.
        output: A text stream for the launcher's lines.

    Raises:
        ValueError: For a bad `endpoint` or `job_id` (named).
        EtcdError: If etcd cannot be reached (naming each address and why).
    """

    def __init__(self, endpoint, job_id, bind, keep_seconds, make_server,
                 output):  # fmt: skip
        self.urls = parse_endpoints(endpoint)
        self.role = Role(
            EtcdClient(self.urls), check_job_id(job_id), keep_seconds
        )
        self.bind, self.make_server, self.output = bind, make_server, output
        self.server = None
        self.role.server()  # fails here, naming etcd, if unreachable

    def locate(self):
        """`(host, port)` of the rendezvous (serving it here if no one
        does), or the job's `done` message (a dict) if it already ended.

        Raises:
            EtcdError: If etcd cannot be reached, or the role changed
                hands meanwhile (the caller tries again).
            ValueError: If the server cannot listen on `bind`.
        """
        done = self.role.done()
        if done is not None:
            return done
        where = self.role.server()
        if where is None:
            reach = self._reach_address()
            listen = self.bind or reach
            public = reach if listen in ("0.0.0.0", "::") else listen
            port = free_ports(1, listen)[0]
            where = f"{public}:{port}"
            state = self.role.claim(where)
            if state is not None:
                try:
                    self.server = self.make_server(listen, port, state)
                except ValueError:
                    self.role.release()
                    raise
                self.server.start()
                _say(
                    self.output,
                    f"[launcher] serving the rendezvous at {where} (etcd "
                    f"{self.role.prefix}server); from attempt "
                    f"{state['round']}",
                )
            else:
                where = self.role.server()
                if where is None:
                    raise EtcdError("the rendezvous changed hands meanwhile")
        return policy.parse_endpoint(where)

    def check(self):
        """Stops serving if this host lost the role (etcd unreachable for
        `LEASE_SECONDS`): another launcher takes it."""
        if self.server is not None and self.role.lost.is_set():
            _say(
                self.output,
                "[launcher] lost the rendezvous role in etcd; handing over",
            )
            self.leave()

    def leave(self):
        """Hands the role over (this host leaves; the job goes on)."""
        if self.server is not None:
            self.server.abandon()
            self.server = None
        self.role.release()

    def close(self):
        """After the job: stops serving, gives the role up."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self.role.release()

    def _reach_address(self):
        parts = urllib.parse.urlsplit(self.urls[0])
        try:
            with socket.create_connection(
                (parts.hostname, parts.port), timeout=REQUEST_SECONDS
            ) as sock:
                return sock.getsockname()[0]
        except OSError as error:
            raise EtcdError(
                f"Cannot reach etcd at {self.urls[0]} ({error})."
            ) from None
