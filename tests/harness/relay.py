"""A man in the middle for tests: a TCP relay that records what passes and can alter it.

``Relay(target_port)`` listens on loopback; each connection to it is relayed to
``127.0.0.1:target_port`` on two threads, one per direction. Bytes are passed on in
records whose sizes the test gives per direction (``sizes``: the record sizes in order;
bytes past the listed ones pass as they come), so an ``edit`` can act on whole records,
as an attacker on the path who knows the frame sizes would: pass one altered, drop it,
hold it and send it later, or send a recorded one again. ``pace`` makes chosen connections
slow (a congested path under one TCP stream): their bytes from the connecting side pass at a
given rate, read no faster, so the sender's socket fills as it would on such a path. Every
socket has a timeout and ``close()`` ends both threads and the listener.
"""

from __future__ import annotations

import socket
import threading
import time

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
        pace: ``pace(opening) -> bytes per second or None``, called once per connection
            with its first ``OPENING`` bytes from the connecting side (a pccl hello, which
            names lane and stream): the rate at which that direction's bytes pass from then
            on (None: as they come).

    ``connections`` lists every relayed connection in accept order: its ``opening`` and the
    bytes it carried per direction (``UP``, ``DOWN``).
    """

    OPENING = 32

    def __init__(self, target_port: int, sizes: dict | None = None, edit=None,
                 timeout: float = 20.0, pace=None):
        self._target = target_port
        self._sizes = sizes or {}
        self._edit = edit
        self._timeout = timeout
        self._pace = pace
        self.captured = {UP: bytearray(), DOWN: bytearray()}
        self.connections: list[dict] = []
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
            conn = {"opening": b"", UP: 0, DOWN: 0}
            with self._lock:
                self._socks += [client, server]
                first, self._first = self._first, False
                self.connections.append(conn)
            for src, dst, direction in ((client, server, UP), (server, client, DOWN)):
                t = threading.Thread(target=self._pump, args=(src, dst, direction, first, conn),
                                     daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src, dst, direction, edited, conn) -> None:
        sizes = list(self._sizes.get(direction, ())) if edited else []
        history: list[bytes] = []
        pending = bytearray()
        undecided = direction == UP and self._pace is not None
        rate, since, paced = None, 0.0, 0
        try:
            while True:
                # A paced direction reads in small pieces, so that what it has not passed
                # on yet stays in the sender's socket (its window closes), not here.
                data = src.recv(1 << 14 if rate else 1 << 16)
                if not data:
                    break
                with self._lock:
                    self.captured[direction] += data
                    conn[direction] += len(data)
                    if direction == UP and len(conn["opening"]) < self.OPENING:
                        conn["opening"] += data[:self.OPENING - len(conn["opening"])]
                    opening = conn["opening"]
                if undecided and len(opening) >= self.OPENING:
                    undecided = False
                    rate, since = self._pace(opening), time.monotonic()
                if rate:
                    paced += len(data)
                    # The rate of a slow path, not a wait for another thread.
                    time.sleep(max(0.0, since + paced / rate - time.monotonic()))
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
