"""A TCP echo server on 0.0.0.0:PORT (run in a NetworkHosts namespace)."""

import socket
import sys
import threading


def serve(connection):
    with connection:
        while data := connection.recv(65536):
            connection.sendall(data)


server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
while True:
    client, _ = server.accept()
    threading.Thread(target=serve, args=(client,), daemon=True).start()
