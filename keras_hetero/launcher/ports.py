"""Free ports for a cluster's `TF_CONFIG` addresses (the launcher's, and
`kh.testing.run_workers`' on loopback)."""

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
