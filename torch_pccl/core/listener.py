"""Listener: a data-plane listening socket that outlives communicators (``pcclListener_t``)."""

from __future__ import annotations

import threading

from ..errors import InvalidArgumentError, InvalidUsageError
from .address import format_address
from .native import ffi, lib
from .results import check_result


class Listener:
    """A data-plane listening socket that outlives communicators (``pcclListener_t``).

    An elastic peer keeps one address for its whole life; each membership
    epoch's ``Communicator`` accepts its links here and refuses connections
    that carry another epoch's communicator id. ``close()`` (explicit,
    idempotent) or the garbage collector frees it; communicators created on
    it hold a reference, so close those first.
    """

    def __init__(self, host: str | None, port: int = 0):
        """Listens on ``host`` (numeric address; None: every interface) at ``port`` (0: any free).

        Raises:
            InvalidArgumentError: a bad host or port.
            PcclSystemError: the socket could not be opened or bound.
        """
        if not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port {port} is outside 0 .. 65535")
        self.host = host
        self._lock = threading.Lock()
        self._handle = None
        out = ffi.new("pcclListener_t *")
        rc = lib.pcclListenerCreate(out, ffi.NULL if host is None else host.encode("ascii"), port)
        if rc != 0:
            try:
                check_result(rc)
            finally:
                lib.pcclListenerDestroy(out[0])
        self._handle = ffi.gc(out[0], lib.pcclListenerDestroy)
        p = ffi.new("int *")
        check_result(lib.pcclListenerGetPort(self._handle, p))
        self.port = p[0]

    @property
    def address(self) -> str:
        """``"host:port"`` to advertise (IPv6 in brackets); needs a numeric ``host``."""
        return format_address(self.host or "127.0.0.1", self.port)

    @property
    def closed(self) -> bool:
        """True once ``close()`` has run."""
        return self._handle is None

    def close(self) -> None:
        """Closes the listening socket. Idempotent."""
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is not None:
                ffi.release(handle)

    @property
    def handle(self):
        """The native ``pcclListener_t``, for ``Communicator(listener=...)``.

        Raises:
            InvalidUsageError: the listener is closed.
        """
        if self._handle is None:
            raise InvalidUsageError("listener is closed")
        return self._handle
