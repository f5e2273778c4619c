"""A ``MasterServer`` hosted by a process of the job: its own event loop in a daemon thread.

``MasterServer.start_in_thread`` and ``torch_pccl.master.start_in_thread`` return one; a
process that hosts the master for its job (``pccl://``'s automatic master, the examples,
the tests) reads the server's state through it, on the server's loop, and stops it.
The server is not imported here: it imports this module to hand itself over.
"""

from __future__ import annotations

import asyncio
import threading


class MasterThread:
    """A ``MasterServer`` running on its own event loop in a daemon thread.

    Attributes:
        server: the server (touch it only through this handle's methods).
        host, port, address: where it listens.
    """

    def __init__(self, server, timeout_s: float = 10.0):
        """Starts ``server`` (a ``MasterServer`` not yet started) and returns once it listens.

        Args:
            server: the server to run; its ``start`` runs on the new loop.
            timeout_s: how long to wait for it to listen (seconds).

        Raises:
            OSError: the address cannot be bound (raised by ``server.start``).
            TimeoutError: the server did not start within ``timeout_s`` seconds.
        """
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pccl-master", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"pccl-master did not start within {timeout_s:g} s")
        if self._error is not None:
            self._thread.join(timeout_s)
            raise self._error

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.server.start())
        except BaseException as e:  # handed to the starting thread
            self._error = e
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return self.server.address

    def snapshot(self, timeout_s: float = 5.0) -> dict:
        """The state snapshot, taken on the server's loop.

        Raises:
            TimeoutError: the loop did not answer within ``timeout_s`` seconds.
        """
        return self._on_loop(self.server.snapshot, timeout_s)

    def status(self, timeout_s: float = 5.0) -> dict:
        """The status page's document (``MasterServer.status``), taken on the server's loop.

        Raises:
            TimeoutError: the loop did not answer within ``timeout_s`` seconds.
        """
        return self._on_loop(self.server.status, timeout_s)

    def _on_loop(self, fn, timeout_s: float):
        async def take():
            return fn()
        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the server and its thread; safe to call twice.

        Raises:
            TimeoutError: the server did not stop within ``timeout_s`` seconds.
        """
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop)
        try:
            fut.result(timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"pccl-master thread did not stop within {timeout_s:g} s")

    def __enter__(self) -> "MasterThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
