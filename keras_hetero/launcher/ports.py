"""Ports for a cluster's `TF_CONFIG` addresses: any free ones (the
launcher's default, and `kh.testing.run_workers`' on loopback), or free
ones from a fixed range (`--worker-ports A-B`, for a firewall that opens
only those)."""

import socket


def free_ports(count, host="127.0.0.1"):
    """`count` distinct TCP ports free on `host` now (a worker binds one a
    moment later; another process may take it meanwhile, and the launcher
    then restarts the group on new ports).

    Args:
        count: How many ports.
        host: The local address to probe. Defaults to `"127.0.0.1"`.

    Returns:
        A list of port numbers.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def parse_port_range(value, name="worker_ports"):
    """`--worker-ports`: a range `"A-B"` of TCP ports (or one port `"A"`).

    Args:
        value: The range as a string, or a `range` of ports.
        name: The argument to name in errors. Defaults to
            `"worker_ports"`.

    Returns:
        The ports, a `range` from A to B inclusive.

    Raises:
        ValueError: Unless `1 <= A <= B <= 65535`, naming the value.

    Example:

    >>> parse_port_range("29500-29503")
    range(29500, 29504)
    """
    if isinstance(value, range) and value.step == 1:
        low, high = value.start, value.stop - 1
    else:
        text = value.strip() if isinstance(value, str) else ""
        first, dash, last = text.partition("-")
        last = last if dash else first
        ok = first.strip().isdigit() and last.strip().isdigit()
        low, high = (int(first), int(last)) if ok else (0, -1)
    if not 1 <= low <= high <= 65535:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}="
            f"{value!r}. Expected a port range A-B with 1 <= A <= B <= "
            "65535, e.g. 29500-29507."
        )
    return range(low, high + 1)


def check_port_range(ports, workers, name="worker_ports"):
    """Raises a `ValueError` if the range `ports` has fewer ports than
    `workers` (the workers on this host)."""
    if len(ports) < workers:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}="
            f"{_text(ports)} ({len(ports)} port(s)) for {workers} "
            "worker(s) on this host. Expected at least one port per worker, "
            f"e.g. {ports.start}-{ports.start + workers - 1}."
        )


def ports_in_range(count, ports, host="127.0.0.1", name="worker_ports"):
    """The first `count` ports of the range `ports` free on `host` now.

    The same ports on every attempt while nothing else holds them: a
    restarted worker gets its port back (the stopped workers' connections
    in TIME_WAIT do not count as taken, as they do not stop a gRPC server
    binding the port).

    Args:
        count: How many ports.
        ports: A `range` of ports (`parse_port_range`).
        host: The local address to probe. Defaults to `"127.0.0.1"`.
        name: The argument to name in errors. Defaults to
            `"worker_ports"`.

    Returns:
        A list of `count` port numbers, ascending.

    Raises:
        ValueError: If the range has fewer than `count` ports, or fewer
            than `count` of them are free (naming those in use).
    """
    check_port_range(ports, count, name)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    free, taken = [], []
    for port in ports:
        if len(free) == count:
            break
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                taken.append(port)
                continue
        free.append(port)
    if len(free) < count:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}="
            f"{_text(ports)}, whose port(s) {taken} are in use on {host} "
            f"(another process holds them). Expected {count} free port(s) "
            "for the workers: free them or give a wider range."
        )
    return free


def _text(ports):
    return f"'{ports.start}-{ports.stop - 1}'"
