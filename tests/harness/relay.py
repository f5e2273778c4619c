"""A man in the middle for tests: a TCP relay that records what passes and can alter it.

``Relay(target_port)`` listens on loopback; each connection to it is relayed to
``127.0.0.1:target_port`` on two threads, one per direction. Bytes are passed on in
records whose sizes the test gives per direction (``sizes``: the record sizes in order;
bytes past the listed ones pass as they come), so an ``edit`` can act on whole records,
as an attacker on the path who knows the frame sizes would: pass one altered, drop it,
hold it and send it later, or send a recorded one again. Every socket has a timeout and
``close()`` ends both threads and the listener.
"""

from __future__ import annotations

import socket
import threading

UP = "up"        # from the connecting side to the target
DOWN = "down"    # from the target back


class Relay:
    """Relays connections to ``target_port``, recording every byte per direction.

    Args:
        target_port: the loopback port connections are relayed to.
        sizes: per direction (``UP``/``DOWN``), the sizes of its first records, bytes.
        edit: ``edit(direction, index, record, history) -> list[bytes]``, called for every
            listed record of the first connection: what to send in its place (``[]``
            drops it; ``history`` holds that direction's earlier records as received).
            Other connections, and bytes past the listed records, pass unchanged.
        timeout: seconds any one socket operation may take.
    """

    def __init__(self, target_port: int, sizes: dict | None = None, edit=None,
                 timeout: float = 20.0):
        self._target = target_port
        self._sizes = sizes or {}
        self._edit = edit
        self._timeout = timeout
        self.captured = {UP: bytearray(), DOWN: bytearray()}
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(timeout)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._first = True
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target), timeout=self._timeout)
            for s in (client, server):
                s.settimeout(self._timeout)
            with self._lock:
                self._socks += [client, server]
                first, self._first = self._first, False
            for src, dst, direction in ((client, server, UP), (server, client, DOWN)):
                t = threading.Thread(target=self._pump, args=(src, dst, direction, first),
                                     daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src, dst, direction, edited) -> None:
        sizes = list(self._sizes.get(direction, ())) if edited else []
        history: list[bytes] = []
        pending = bytearray()
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    self.captured[direction] += data
                pending += data
                while sizes and len(pending) >= sizes[0]:
                    record = bytes(pending[:sizes[0]])
                    del pending[:sizes[0]]
                    sizes.pop(0)
                    out = [record] if self._edit is None else \
                        self._edit(direction, len(history), record, history)
                    history.append(record)
                    for piece in out:
                        dst.sendall(piece)
                if not sizes and pending:
                    dst.sendall(bytes(pending))
                    pending.clear()
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Closes the listener and every relayed connection; joins the threads (bounded)."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes the accept (close does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        for t in [self._accept, *self._threads]:
            t.join(self._timeout)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
