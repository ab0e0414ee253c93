"""The multi-host launcher's decisions, as pure functions.

Which hosts form the group and when a round starts (`decide_round`), when a
host that joined mid-round is let in (`should_admit`), which global index,
address and devices each worker gets (`assign_workers`), and whether two
hosts run the same job (`job_mismatch`). The rendezvous server
(`rendezvous.py`) feeds them what it has seen and does what they say; they
read no clock, socket or file, so tests call them directly.
"""

import dataclasses
import ipaddress

from keras_hetero._environment import HANG_EXIT_CODE


def parse_nnodes(nnodes):
    """`--nnodes`: a host count `N` or a range `MIN:MAX`.

    Args:
        nnodes: An int, or a string `"N"` or `"MIN:MAX"`.

    Returns:
        `(min_hosts, max_hosts)`, with `1 <= min_hosts <= max_hosts`.

    Raises:
        ValueError: For anything else, naming the value.

    Example:

    >>> parse_nnodes("2:3")
    (2, 3)
    >>> parse_nnodes(2)
    (2, 2)
    """
    text = str(nnodes).strip()
    low, _, high = text.partition(":")
    high = high if _ else low
    if (
        not isinstance(nnodes, bool)
        and low.isdigit()
        and high.isdigit()
        and 1 <= int(low) <= int(high)
    ):
        return int(low), int(high)
    raise ValueError(
        f"Invalid value for argument `nnodes`. Received: nnodes={nnodes!r}. "
        "Expected a host count N >= 1 or a range MIN:MAX with "
        "1 <= MIN <= MAX, e.g. 2 or 2:4."
    )


def parse_endpoint(endpoint, name="rdzv_endpoint"):
    """A `HOST:PORT` address (`--rdzv-endpoint`), IPv6 as `[::1]:PORT`.

    Args:
        endpoint: The address.
        name: The argument to name in the error. Defaults to
            `"rdzv_endpoint"`.

    Returns:
        `(host, port)`.

    Raises:
        ValueError: If it is not `HOST:PORT` with a port in [1, 65535].

    Example:

    >>> parse_endpoint("10.0.0.1:29400")
    ('10.0.0.1', 29400)
    """
    text = endpoint if isinstance(endpoint, str) else ""
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: "
            f"{name}={endpoint!r}. Expected HOST:PORT, e.g. 10.0.0.1:29400."
        )
    return host, int(port)


def is_loopback(host):
    """Whether `host` is a loopback address or `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the rendezvous does next while it gathers hosts for a round.

    Attributes:
        action: `"start"` (a round with `hosts`), `"wait"` (for more hosts)
            or `"fail"` (the timeout passed with fewer than the minimum).
        hosts: The ranks of the round's hosts, sorted (for `"start"`).
        missing: The ranks in `[0, max_hosts)` that have not joined.
    """

    action: str
    hosts: tuple = ()
    missing: tuple = ()


def decide_round(
    joined, min_hosts, max_hosts, *, waited, quiet, timeout, last_call
):
    """Whether a round starts, waits for more hosts, or fails.

    A round starts at once when all `max_hosts` ranks have joined; with at
    least `min_hosts`, it starts when no host joined for `last_call` seconds
    (more may be on their way). With fewer than `min_hosts` after `timeout`
    seconds of gathering, the rendezvous fails, naming the missing ranks.

    Args:
        joined: Ranks of the hosts connected and ready.
        min_hosts: The fewest hosts a round may have.
        max_hosts: The most (ranks are `0..max_hosts-1`).
        waited: Seconds since this gathering began.
        quiet: Seconds since the last host joined (or since the gathering
            began, if later).
        timeout: Seconds a gathering may last without `min_hosts`.
        last_call: Seconds to wait for more hosts once `min_hosts` are in.

    Returns:
        A `Decision`.

    Example:

    >>> decide_round([0, 1], 2, 3, waited=9, quiet=9, timeout=60,
    ...              last_call=5).hosts
    (0, 1)
    >>> decide_round([0], 2, 2, waited=61, quiet=61, timeout=60,
    ...              last_call=5).missing
    (1,)
    """
    hosts = tuple(sorted(set(joined)))
    missing = tuple(r for r in range(max_hosts) if r not in hosts)
    if not missing:
        return Decision("start", hosts, ())
    if len(hosts) >= min_hosts and (quiet >= last_call or waited >= timeout):
        return Decision("start", hosts, missing)
    if waited >= timeout:
        return Decision("fail", (), missing)
    return Decision("wait", (), missing)


def should_admit(members, joined, max_hosts, *, quiet, last_call):
    """Whether to restart a running group to let in hosts that joined
    since it started (a host that came back, or a late one).

    As for a new round, the restart waits until no host joined for
    `last_call` seconds, so hosts that come back together cost one restart.

    Args:
        members: Ranks of the running round's hosts.
        joined: Ranks of every host connected now.
        max_hosts: The most hosts a round may have.
        quiet: Seconds since the last host joined.
        last_call: As in `decide_round`.

    Returns:
        True to stop the group and start a round with the new hosts.

    Example:

    >>> should_admit([0, 1], [0, 1, 2], 3, quiet=0, last_call=5)
    True
    >>> should_admit([0, 1], [0, 1], 3, quiet=9, last_call=5)
    False
    """
    new = set(joined) - set(members)
    return bool(new) and (len(set(joined)) >= max_hosts or quiet >= last_call)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One worker of a round.

    Attributes:
        index: Its global worker index (its `TF_CONFIG` task index).
        rank: The node rank of its host.
        local_index: Its index among its host's workers.
        address: Its `"ip:port"` in `TF_CONFIG`.
        devices: Its `CUDA_VISIBLE_DEVICES`, or None to leave it unset.
    """

    index: int
    rank: int
    local_index: int
    address: str
    devices: object = None


def assign_workers(hosts):
    """Global worker indices, addresses and devices for a round.

    Workers are numbered host by host in rank order, and within a host in
    its own order, so worker 0 (the chief, which writes checkpoints) is the
    first worker of the lowest rank, and MultiWorkerMirroredStrategy's
    global replica order follows the node ranks.

    Args:
        hosts: `{rank: (ip, ports, devices)}`: the host's address, one free
            port per worker and one `CUDA_VISIBLE_DEVICES` value (or None)
            per worker.

    Returns:
        A tuple of `WorkerSpec`, in global index order.

    Raises:
        ValueError: If a host gives fewer ports than it has workers.

    Example:

    >>> [w.address for w in assign_workers(
    ...     {1: ("10.0.0.2", [5001], [None]),
    ...      0: ("10.0.0.1", [5000, 5002], ["0", "1"])})]
    ['10.0.0.1:5000', '10.0.0.1:5002', '10.0.0.2:5001']
    """
    workers = []
    for rank in sorted(hosts):
        ip, ports, devices = hosts[rank]
        if len(ports) < len(devices):
            raise ValueError(
                f"Invalid value for argument `hosts`. Received: host rank "
                f"{rank} with ports={list(ports)!r} for {len(devices)} "
                "worker(s). Expected one port per worker."
            )
        host = f"[{ip}]" if ":" in ip else ip
        for local, device in enumerate(devices):
            workers.append(
                WorkerSpec(
                    len(workers), rank, local, f"{host}:{ports[local]}", device
                )
            )
    return tuple(workers)


def devices_per_worker(devices):
    """What a worker with `CUDA_VISIBLE_DEVICES` `devices` replicates on:
    `"N GPU"` (one replica per GPU), or `"CPU"` (one replica) when the
    launcher leaves the variable unset.

    Example:

    >>> devices_per_worker("0,1"), devices_per_worker(None)
    ('2 GPU', 'CPU')
    """
    if devices is None:
        return "CPU"
    return f"{len(str(devices).split(','))} GPU"


# The fields of a host's job, in the order a mismatch is reported.
JOB_FIELDS = (
    "script",
    "arguments",
    "python",
    "keras_hetero",
    "tensorflow",
    "keras",
    "devices_per_worker",
)


def job_mismatch(reference, other, *, rank, reference_rank=0):
    """Why host `rank`'s job differs from the reference host's, or None.

    Every host must run the same script with the same arguments and
    versions, and its workers must replicate on as many devices of the same
    type as the reference's (MultiWorkerMirroredStrategy's collectives
    need one group size and device type).

    Args:
        reference: The reference host's job (`{field: value}` with the
            `JOB_FIELDS`).
        other: The joining host's job.
        rank: The joining host's node rank (for the message).
        reference_rank: The reference host's rank. Defaults to `0`.

    Returns:
        A sentence naming the first differing field and both values, or
        None if they agree.

    Example:

    >>> job_mismatch({"tensorflow": "2.21.0"}, {"tensorflow": "2.20.0"},
    ...              rank=1)  # doctest: +ELLIPSIS
    "Host rank 1 does not match host rank 0: tensorflow '2.20.0' (host ..."
    """
    for field in JOB_FIELDS:
        mine, theirs = reference.get(field), other.get(field)
        if mine == theirs:
            continue
        message = (
            f"Host rank {rank} does not match host rank {reference_rank}: "
            f"{field} {theirs!r} (host rank {reference_rank}: {mine!r})."
        )
        if field == "devices_per_worker":
            return message + (
                " MultiWorkerMirroredStrategy needs the same number and type "
                "of devices on every worker (its collectives form one group "
                "of one size and device type): use --workers-per-host auto "
                "(one worker per GPU) or a --workers-per-host that gives "
                "every worker as many GPUs; hosts without GPUs cannot join "
                "hosts with GPUs."
            )
        return message + (
            " Every host must run the same script, arguments and versions."
        )
    return None


# How long the others of a group get after a worker died, before SIGKILL.
PEER_STOP_SECONDS = 0.5


def stop_grace(codes, grace_seconds):
    """Seconds the other workers get to exit (after SIGTERM, before
    SIGKILL) when workers of a group ended with exit statuses `codes`.

    A worker that died (killed, crashed) leaves the others waiting in a
    collective that can never finish, and their save on SIGTERM needs that
    collective too: they get `PEER_STOP_SECONDS` (measured: the survivor
    of a killed worker otherwise sat out 5 s until TensorFlow's own
    heartbeat ended it). A worker that exited with `HANG_EXIT_CODE` wrote
    a hang report, and the others are writing theirs (the launcher reads
    them to leave a lost worker out): they keep `grace_seconds`, as do
    workers stopped for any other reason (a signal to the launcher, a host
    let in).

    Example:

    >>> stop_grace([-9], 30.0)
    0.5
    >>> stop_grace([75], 30.0)
    30.0
    """
    if codes and all(c not in (0, HANG_EXIT_CODE) for c in codes):
        return min(PEER_STOP_SECONDS, grace_seconds)
    return grace_seconds
