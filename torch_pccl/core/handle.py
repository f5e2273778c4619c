"""NativeHandle: one native ``pcclComm_t``, its two locks and its lifetime.

A ``Communicator`` (and each lane of one) owns exactly one. The handle is freed by
``close()`` (explicit, idempotent) or, failing that, by the garbage collector
(``ffi.gc``). Two locks, because ``abort()`` must not wait behind a blocked
collective: the op lock serialises the calls that use the handle with ``close()``;
the handle lock guards only the handle's lifetime, so ``abort()``, the error and
the counters are read while a collective runs. A third, the side lock, holds off
``close()`` from a call that runs beside the collectives (``call_beside``).
"""

from __future__ import annotations

import threading

from ..errors import InvalidArgumentError, InvalidUsageError, PcclError
from .listener import Listener
from .native import ffi, lib
from .results import check_result, native_error


# The settable fields of pccl.h's pcclConfig_t (its size and magic are the library's).
CONFIG_FIELDS = ("streams", "link_timeout_ms", "chunk_bytes", "pacing")


class NativeHandle:
    """Owns one ``pcclComm_t``: every native call on it goes through these methods."""

    def __init__(self, handle):
        """Takes ownership of ``handle`` (a ``pcclComm_t`` from ``create`` or from
        ``pcclCommConnectLanes``): it is destroyed by ``close()`` or the garbage collector."""
        self._op_lock = threading.Lock()
        self._side_lock = threading.Lock()
        self._handle_lock = threading.Lock()
        self._handle = ffi.gc(handle, lib.pcclCommDestroy)
        self._current_op: str | None = None
        self._last_ring: tuple[int, ...] | None = None   # set_ring_order's
        self._stripe: int | None = None                  # set_stripe's

    @classmethod
    def create(cls, rank: int, world_size: int, comm_id: int, listen_host: str | None,
               listener: Listener | None = None) -> NativeHandle:
        """A new, unconnected communicator listening on ``listen_host`` (port 0), or
        accepting on ``listener`` when one is given (``listen_host`` is then ignored).

        Raises:
            InvalidArgumentError: bad rank, world size or comm id.
            PcclSystemError: the listening socket could not be opened.
        """
        out = ffi.new("pcclComm_t *")
        if listener is not None:
            rc = lib.pcclCommCreateOnListener(out, rank, world_size, comm_id, listener.handle)
        else:
            host = ffi.NULL if listen_host is None else listen_host.encode("ascii")
            rc = lib.pcclCommCreate(out, rank, world_size, comm_id, host)
        if rc != 0:
            try:
                check_result(rc)  # first: the detail is gone after the next pccl call
            finally:
                # Keep the handle from leaking if the native side returned one.
                lib.pcclCommDestroy(out[0])
        return cls(out[0])

    @property
    def closed(self) -> bool:
        """True once ``close()`` has run."""
        return self._handle is None

    @property
    def current_op(self) -> str | None:
        """The native call running through ``run`` (``"AllReduce"``, ...), or None; read
        without waiting."""
        return self._current_op

    def run(self, fn, *args) -> None:
        """``fn(handle, *args)`` under the op lock, recorded as ``current_op`` while it runs.

        Raises:
            InvalidUsageError: the handle is closed.
            PcclError subclass: ``fn`` returned a non-zero result code.
        """
        with self._op_lock:
            self._current_op = fn.__name__.removeprefix("pccl")
            try:
                self._call(fn, *args)
            finally:
                self._current_op = None

    def call_beside(self, fn, *args) -> None:
        """``fn(handle, *args)`` without the op lock, beside a collective in flight, but never
        beside ``close()``: for a native call that may run as long as a collective and
        must not wait for one (``pcclCommConnectLaneRange`` of later lanes). Raises as ``run``."""
        with self._side_lock:
            self._call(fn, *args)

    def call(self, fn, *args) -> None:
        """``fn(handle, *args)`` under the op lock (a setting or a getter that must not run
        beside a collective); raises as ``run``."""
        with self._op_lock:
            self._call(fn, *args)

    def configure(self, **fields: int) -> None:
        """Sets fields of the native ``pcclConfig_t`` (``CONFIG_FIELDS``; units there), the
        others kept: ``pcclCommGetConfig``, the change, ``pcclCommSetConfig``, under one hold
        of the op lock so that two threads configuring at once cannot undo each other's
        field. All fields apply or none.

        Raises:
            InvalidArgumentError: a name that is no field, a value out of its bounds (the
                native message names it).
            InvalidUsageError: ``streams`` or ``link_timeout_ms`` changed after connecting;
                the handle is closed.
        """
        for name in fields:
            if name not in CONFIG_FIELDS:
                raise InvalidArgumentError(f"unknown option {name!r}; options are "
                                           f"{', '.join(CONFIG_FIELDS)}")
        config = ffi.new("pcclConfig_t *")
        with self._op_lock:
            self._call(lib.pcclCommGetConfig, config)
            for name, value in fields.items():
                setattr(config, name, int(value))
            self._call(lib.pcclCommSetConfig, config)

    def query(self, fn, *args) -> None:
        """``fn(handle, *args)`` under the lifetime lock only: a native getter that must not
        wait for a collective in flight (counters, pacing). Raises as ``run``."""
        with self._handle_lock:
            if self._handle is None:
                raise InvalidUsageError("communicator is closed")
            check_result(fn(self._handle, *args), self._handle)

    def set_ring_order(self, order: list[int]) -> None:
        """``pcclCommSetRingOrder`` with ``order`` (a permutation of the ranks, checked by the
        caller), remembered as ``last_ring_order`` once set; waits for a call in flight.

        Raises:
            InvalidArgumentError: the native side refused ``order``.
            InvalidUsageError: the handle is closed.
        """
        self.call(lib.pcclCommSetRingOrder, ffi.new("int[]", order), len(order))
        self._last_ring = tuple(order)

    def set_stripe(self, streams: int) -> None:
        """``pcclCommSetStripe``: the next ops deal their frames over the first ``streams``
        of the streams connected to each peer (every rank alike, between the same two ops);
        remembered as ``stripe``; waits for a call in flight. A change clears the measured
        pacing estimates (the path is measured again).

        Raises:
            InvalidArgumentError: ``streams`` outside 1 .. the connected streams.
            InvalidUsageError: the handle is closed.
        """
        self.call(lib.pcclCommSetStripe, int(streams))
        self._stripe = int(streams)

    @property
    def stripe(self) -> int | None:
        """The count last given to ``set_stripe``, or None before any (all connected
        streams); never waits."""
        return self._stripe

    @property
    def last_ring_order(self) -> tuple[int, ...] | None:
        """The order last set through ``set_ring_order``, or None before any; never waits."""
        return self._last_ring

    def abort(self, reason: bytes | None = None) -> None:
        """Wakes and fails every blocking call on this handle; a no-op once closed.

        Args:
            reason: None for ``AbortedError``; else the bytes of a ``PeerLostError``
                (``pcclCommAbortWithError``).
        """
        with self._handle_lock:
            if self._handle is not None:
                if reason is None:
                    lib.pcclCommAbort(self._handle)
                else:
                    lib.pcclCommAbortWithError(self._handle, lib.pcclPeerLost, reason)

    def close(self) -> None:
        """Destroys the native communicator; waits for a call in flight. Idempotent."""
        with self._op_lock, self._side_lock, self._handle_lock:
            handle, self._handle = self._handle, None
            if handle is not None:
                # Runs pcclCommDestroy now and detaches it from the gc.
                ffi.release(handle)

    def error(self) -> int:
        """The sticky ``pcclResult_t`` of the handle (0 while healthy or once closed)."""
        with self._handle_lock:
            return 0 if self._handle is None else lib.pcclCommGetError(self._handle)

    def errored(self) -> PcclError | None:
        """The sticky error as an exception with its native detail, or None (healthy or closed)."""
        with self._handle_lock:
            rc = 0 if self._handle is None else lib.pcclCommGetError(self._handle)
            detail = ffi.string(lib.pcclCommGetLastError(self._handle)).decode(
                "utf-8", "replace") if rc else ""
        return native_error(rc, detail) if rc else None

    def _call(self, fn, *args) -> None:
        # Caller holds _op_lock or _side_lock, so close() cannot free the handle under us.
        handle = self._handle
        if handle is None:
            raise InvalidUsageError("communicator is closed")
        rc = fn(handle, *args)
        if rc != 0:
            check_result(rc, handle)
