"""Connects to HOST:PORT, sends N bytes K times and prints each round trip
in seconds as JSON (run in a NetworkHosts namespace)."""

import json
import socket
import sys
import time

host, port, size, times = (
    sys.argv[1],
    int(sys.argv[2]),
    *map(int, sys.argv[3:5]),
)
timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 10.0
trips = []
try:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        for _ in range(times):
            started = time.perf_counter()
            sock.sendall(b"x" * size)
            got = 0
            while got < size:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("closed")
                got += len(chunk)
            trips.append(time.perf_counter() - started)
except OSError as error:
    print(json.dumps({"error": str(error), "trips": trips}))
    sys.exit(1)
print(json.dumps({"trips": trips}))
