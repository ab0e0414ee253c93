"""Free loopback ports for a local cluster (the launcher's and
`kh.testing.run_workers`' `TF_CONFIG` addresses)."""

import socket


def free_ports(count):
    """`count` distinct free TCP ports on 127.0.0.1 (the launcher's and
    `kh.testing.run_workers`' cluster addresses)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
