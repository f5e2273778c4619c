"""LaneSet: the K lane communicators of one group and the operations on all of them.

``Communicator.connect(lanes=K)`` opens K TCP connections to every peer; lane 0 is the
communicator itself and lanes 1 .. K-1 are Communicators of their own (each with its
lock, staging memory, sticky error and abort flag), so K collectives are in flight at
once and fail independently. The LaneSet owns them: abort, close, errors, counters,
options, the ring order and pacing are asked of it once, and it applies them to every
lane, as nccl's ``ncclComm`` owns its channels. Each lane is a ``Communicator`` whose
``native`` (``core.handle.NativeHandle``) the set reaches; this module does not import
``core.communicator``, which builds the set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..errors import InvalidArgumentError, PcclError
from .native import ffi, lib


class LaneSet:
    """The lanes of one group, lane 0 first; iterable and indexable like a tuple.

    A lane Communicator of lanes 1.. has a LaneSet of its own holding only itself, so
    an operation on that lane alone (``comm.lanes[1].abort()``) stays on it. The set
    keeps no state of its own (the lanes' ``NativeHandle``s do), so a Communicator
    builds its ``lane_set`` on each use.
    """

    def __init__(self, lanes: Sequence):
        """
        Args:
            lanes: the Communicators, lane 0 first, of one rank and world size.
        """
        self._lanes = tuple(lanes)

    def __len__(self) -> int:
        return len(self._lanes)

    def __iter__(self) -> Iterator:
        return iter(self._lanes)

    def __getitem__(self, k: int):
        return self._lanes[k]

    @property
    def lanes(self) -> tuple:
        """The lane Communicators, lane 0 first."""
        return self._lanes

    @property
    def world_size(self) -> int:
        """Number of ranks of every lane."""
        return self._lanes[0].world_size

    def abort(self, lost: str | None = None) -> None:
        """Wakes and fails every blocking call on every lane; safe from any thread.

        Args:
            lost: None fails them with ``AbortedError``; else with ``PeerLostError(lost)``
                (cut to ``PCCL_MAX_ABORT_REASON`` bytes natively). An earlier abort or
                network error of a lane keeps its own cause.
        """
        reason = None if lost is None else lost.encode("utf-8", "replace")
        for lane in self._lanes:
            lane.native.abort(reason)

    def close(self) -> None:
        """Frees every lane's native communicator, lanes 1.. first; idempotent. Waits for
        a collective in flight on a lane (``abort()`` first ends it promptly)."""
        for lane in reversed(self._lanes):
            lane.native.close()

    @property
    def closed(self) -> bool:
        """True once lane 0 is closed."""
        return self._lanes[0].native.closed

    def error(self) -> int:
        """The first non-zero sticky ``pcclResult_t`` in lane order, else 0."""
        for lane in self._lanes:
            rc = lane.native.error()
            if rc:
                return rc
        return 0

    def errored(self) -> PcclError | None:
        """The sticky error of the first failed lane in lane order, as an exception; else None."""
        for lane in self._lanes:
            err = lane.native.errored()
            if err is not None:
                return err
        return None

    def stats(self) -> tuple[int, int]:
        """``(bytes_sent, bytes_received)`` summed over the lanes, payload plus headers.

        Does not wait for a collective in flight (the counters are atomics).

        Raises:
            InvalidUsageError: a lane is closed.
        """
        sent = ffi.new("uint64_t *")
        received = ffi.new("uint64_t *")
        total = [0, 0]
        for lane in self._lanes:
            lane.native.query(lib.pcclCommGetStats, sent, received)
            total[0] += sent[0]
            total[1] += received[0]
        return total[0], total[1]

    def set_option(self, name: str, value: int) -> None:
        """Sets the native tuning knob ``name`` (e.g. ``"chunk_bytes"``, bytes) on every lane.

        Raises:
            InvalidArgumentError: unknown name or bad value.
        """
        for lane in self._lanes:
            lane.native.configure(**{name: value})

    def set_ring_order(self, order: Sequence[int]) -> None:
        """Runs every lane's ring collectives around ``order`` (the rank at each ring
        position); waits for the collective in flight on each lane. See
        ``Communicator.set_ring_order``.

        Raises:
            InvalidArgumentError: ``order`` is not a permutation of the ranks.
        """
        n = self.world_size
        order = list(order)
        if len(order) != n or sorted(order) != list(range(n)) \
                or not all(isinstance(r, int) for r in order):
            raise InvalidArgumentError(f"ring order {order!r} is not a permutation of 0 .. {n - 1}")
        for lane in self._lanes:
            lane.native.set_ring_order(order)

    def set_stripe(self, streams: int) -> None:
        """Stripes every lane's next ops over ``streams`` of the streams connected to each
        peer (``NativeHandle.set_stripe``); a collective decision: every rank calls it with
        the same count between the same two ops. See ``Communicator.stripe``.

        Raises:
            InvalidArgumentError: ``streams`` outside 1 .. the connected streams.
        """
        for lane in self._lanes:
            lane.native.set_stripe(streams)

    def min_rtt(self, peer: int) -> float:
        """The smallest round-trip time seen on lane 0's streams to rank ``peer``, seconds
        (``pcclCommGetMinRtt``; 0.0: none yet). Waits for an op in flight on lane 0.

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of the group.
        """
        seconds = ffi.new("double *")
        self._lanes[0].native.call(lib.pcclCommGetMinRtt, int(peer), seconds)
        return seconds[0]

    @property
    def ring_order(self) -> tuple[int, ...]:
        """The rank at each ring position of lane 0 (every lane runs the same order); waits
        for a collective in flight on lane 0."""
        array = ffi.new("int[]", self.world_size)
        self._lanes[0].native.call(lib.pcclCommGetRingOrder, array)
        return tuple(array)

    @property
    def last_ring_order(self) -> tuple[int, ...]:
        """The order last given to ``set_ring_order`` (rank order before any); never waits."""
        return self._lanes[0].native.last_ring_order or tuple(range(self.world_size))

    @property
    def current_op(self) -> str | None:
        """The native call running on any lane (``"AllReduce"``, ...), first in lane order,
        or None when all are idle; read without waiting."""
        for lane in self._lanes:
            op = lane.native.current_op
            if op is not None:
                return op
        return None

    def pacing(self, peer: int) -> tuple[float, float]:
        """``(estimate, cap)`` of the streams to rank ``peer``, bytes per second; shared by
        every lane, so lane 0's. See ``Communicator.pacing``.

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of the group.
            InvalidUsageError: the communicator is closed.
        """
        estimate = ffi.new("double *")
        cap = ffi.new("double *")
        self._lanes[0].native.query(lib.pcclCommGetPacing, int(peer), estimate, cap)
        return estimate[0], cap[0]

    def path_state(self, peer: int) -> tuple[bool, int]:
        """``(filled, stripe)`` of the rate controller of the path to rank ``peer``
        (``pcclCommGetPathState``): whether its start-up found the pipe full, and the
        stripe (streams per peer) it asks for from what each stripe carried (the current
        one while nothing says otherwise). The ranks agree on a stripe before it takes
        effect (``set_stripe``). Waits for an op in flight on lane 0.

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of the group.
        """
        filled = ffi.new("int *")
        stripe = ffi.new("int *")
        self._lanes[0].native.call(lib.pcclCommGetPathState, int(peer), filled, stripe)
        return bool(filled[0]), stripe[0]
