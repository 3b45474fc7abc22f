"""A tiny TCP proxy on loopback that a test can freeze: connections stay open, nothing
is forwarded (what a stalled middlebox does). Bounded: every thread is a daemon and
every wait has a timeout."""

from __future__ import annotations

import contextlib
import socket
import threading


class FreezableProxy:
    """Forward 127.0.0.1:<port> to ``target``; :meth:`freeze` stops all forwarding."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._running = threading.Event()  # set: forwarding; clear: frozen
        self._running.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._running.clear()

    def thaw(self) -> None:
        self._running.set()

    def retarget(self, target: tuple[str, int]) -> None:
        """Forward new connections to ``target`` from now on (a failover behind a fixed
        address); connections already open stay with the old target."""
        self.target = target

    def cut(self) -> None:
        """Close every forwarded connection (both ends); new ones are still accepted.

        What the server's keepalives do at their deadline: its end of a silent link is
        closed, and the locks of that session are freed.
        """
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self._closed.set()
        self._running.set()
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(
                    target=self._pump, args=(source, sink), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        source.settimeout(0.2)
        while not self._closed.is_set():
            if not self._running.wait(0.2):
                continue  # frozen: read nothing, so nothing is forwarded
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                sink.sendall(data)
            except OSError:
                break
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
