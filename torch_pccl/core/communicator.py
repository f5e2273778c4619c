"""Communicator: one rank's native pcclComm_t, reached through cffi.

The methods take contiguous CPU tensors and pass ``tensor.data_ptr()`` to C
without copying. Every argument (dtype, device, contiguity, sizes, ranks, op,
tag, timeout) is checked in Python before any C call (``core.tensors``), so a
caller's mistake is a ``TypeError``/``ValueError`` with a clear message and
never reaches the native layer. cffi releases the GIL during each C call.
Its native handle is a ``core.handle.NativeHandle``, its lanes a ``core.lanes.LaneSet``,
its collectives and point-to-point calls ``core.collectives`` and ``core.point_to_point``;
how ``connect`` stripes, paces and warms its links is ``core.striping``'s policy.

Bootstrap (``Communicator.bootstrap``) exchanges addresses through a c10d
store: addresses only, never tensor data. Elastic groups instead build one
communicator per membership epoch on a long-lived ``Listener``, with the addresses the
master hands out: ``torch_pccl.elastic.membership.Membership.connect`` builds and
connects each.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .. import config
from ..errors import InvalidArgumentError, PcclError, ProtocolError
from .address import advertised_host, format_address
from .collectives import Collectives
from .handle import NativeHandle
from .lanes import LaneSet
from .listener import Listener
from .native import MAX_LANES, ffi, lib
from .point_to_point import PointToPoint
# auto_streams and stripe_ceiling live in core.striping; re-exported for the callers
# that know them from here.
from .striping import auto_streams, plan_streams, stripe_ceiling
from .tensors import checked_timeout
from .warmup import warm_up

__all__ = ["Communicator", "auto_streams", "stripe_ceiling"]


class Communicator(Collectives, PointToPoint):
    """One rank of a PCCL group: owns a native ``pcclComm_t`` (a ``NativeHandle``).

    Build one with ``Communicator.bootstrap(store, rank, world_size, ...)``.
    The handle is freed by ``close()`` (explicit, idempotent) or, failing that,
    by the garbage collector (``ffi.gc``). Collectives are blocking, run in the
    order their calls take the internal lock, and are bounded by a deadline;
    ``abort()`` from any thread wakes them.

    Tensor arguments must be contiguous CPU tensors of one of the supported
    dtypes; counts and displacements are in elements, timeouts in seconds.
    A failed collective never leaves an output partly written.

    Connected with ``lanes=K`` it also owns K-1 lane Communicators
    (``lanes``; ``lane_set`` owns all K), each with its own connections to every
    peer, so K collectives can be in flight at once (one per lane).
    """

    def __init__(self, rank: int, world_size: int, comm_id: int, listen_host: str | None,
                 timeout_s: float, listener: Listener | None = None, *,
                 native: NativeHandle | None = None, streams: int = 1):
        """Creates the native communicator and starts listening (port 0).

        Most callers want ``bootstrap``. ``comm_id`` (0 .. 2**64-1) must be the
        same on all ranks and fresh per group; ``timeout_s`` is the default
        deadline of every later call. With ``listener`` the communicator
        accepts its links there (``listen_host`` is then ignored) and keeps a
        reference to it, so the listener outlives it. With ``native`` it owns
        that already-created handle instead of creating one (``comm_id``,
        ``listen_host`` and ``listener`` unused; see ``adopt``), connected with ``streams``
        per peer.

        Raises:
            InvalidArgumentError: bad rank, world size, comm id or timeout.
            PcclSystemError: the listening socket could not be opened.
        """
        if not 0 < world_size or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank {rank} is not in a group of {world_size}")
        if not 0 <= comm_id <= 2**64 - 1:
            raise InvalidArgumentError(f"comm_id {comm_id} is not a 64-bit unsigned integer")
        self._timeout_s = checked_timeout(timeout_s)
        self._rank = rank
        self._world_size = world_size
        self._listener = listener
        self._streams = streams                    # see connect(streams=...)
        self._warm_lanes = False                   # see connect and warm_up
        created = native is None
        if created:
            native = NativeHandle.create(rank, world_size, comm_id, listen_host, listener)
        self._native = native
        self._lane_comms: tuple[Communicator, ...] = ()   # lanes 1.. (connect(lanes=...))
        self._deferred: tuple[list[str], int] | None = None  # connect(defer_lanes=True)
        port = ffi.new("int *")
        native.call(lib.pcclCommGetPort, port)
        self._port = port[0]
        # Every data link of the run proves the shared secret (docs/security.md); without
        # one, links are not authenticated. An adopted lane has its lane 0's already.
        secret = config.secret() if created else None
        if secret is not None:
            self.set_secret(secret)
            self.set_encryption(config.encrypt())

    @classmethod
    def adopt(cls, native: NativeHandle, rank: int, world_size: int, timeout_s: float,
              streams: int = 1) -> Communicator:
        """A Communicator over an already-connected ``native`` handle (a lane that
        ``pcclCommConnectLanes`` opened beside lane 0), of ``rank`` in ``world_size``, with
        lane 0's default deadline ``timeout_s`` (seconds) and ``streams`` per peer.

        Raises:
            InvalidArgumentError: bad rank, world size or timeout.
        """
        return cls(rank, world_size, 0, None, timeout_s, native=native, streams=streams)

    def set_secret(self, secret: bytes) -> None:
        """Makes every link of this communicator prove ``secret`` (1 .. 4096 bytes; ``b""``
        clears it) with an HMAC-SHA256 challenge-response before any frame flows
        (``pcclCommSetSecret``). Every rank must use the same bytes. A new communicator
        takes ``PCCL_SECRET`` / ``PCCL_SECRET_FILE`` by itself; this is for callers that
        hold the secret elsewhere.

        Raises:
            InvalidArgumentError: ``secret`` is longer than 4096 bytes.
            InvalidUsageError: the communicator is already connected.
        """
        data = bytes(secret)
        self._native.call(lib.pcclCommSetSecret, data, len(data))

    def set_id(self, comm_id: int) -> None:
        """Replaces the communicator id given at creation (``pcclCommSetId``): a rank can
        listen and publish its address before it learns the group's id (``bootstrap``).

        Raises:
            InvalidArgumentError: ``comm_id`` outside 0 .. 2**64-1.
            InvalidUsageError: the communicator is already connected.
        """
        if not 0 <= comm_id <= 2**64 - 1:
            raise InvalidArgumentError(f"comm_id {comm_id} is not a 64-bit unsigned integer")
        self._native.call(lib.pcclCommSetId, comm_id)

    def set_encryption(self, enabled: bool) -> None:
        """Whether this communicator's links, when it has a secret, carry every frame in
        AES-256-GCM records under per-link keys that HKDF-SHA256 derives from the secret
        and both ends' fresh nonces (``True``, the default; ``pcclCommSetEncryption``) or
        in the clear after the challenge-response (``False``). A new communicator takes
        ``PCCL_ENCRYPT``. Every rank must choose alike: a rank refuses a peer that differs
        with ``AuthenticationError``. A record altered, dropped, replayed or reordered on
        the way fails the receiving rank's op with ``IntegrityError``. Construction and
        threat model: docs/security.md.

        Raises:
            InvalidUsageError: the communicator is already connected.
        """
        self._native.call(lib.pcclCommSetEncryption, int(bool(enabled)))

    @classmethod
    def bootstrap(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                  prefix: str = "pccl", lanes: int = 1,
                  streams: int | None = 1) -> Communicator:
        """Creates a communicator and connects it to all peers through ``store``.

        Every rank listens and writes its ``host:port`` (IPv6 in brackets), rank 0
        with a random 64-bit communicator id beside it, and reads the id and everyone's
        address in one request. Keys are
        ``{prefix}/{generation}/...`` where the generation counts this rank's
        bootstraps under ``prefix``, so rebuilding a group on the same store
        never reads stale addresses. ``store.get`` blocks up to the store's own
        timeout; connecting is bounded by ``timeout_s`` (seconds).

        Args:
            store: a c10d store shared by the group (c10d passes a PrefixStore
                per group, so groups do not collide).
            rank, world_size: this rank and the group size.
            timeout_s: default deadline in seconds for connect and every collective.
            prefix: namespace for the store keys.
            lanes: connections per peer, each its own lane communicator (see
                ``connect``); equal on every rank.
            streams: TCP streams per peer and lane that each operation is
                striped over (see ``connect``; None: ``auto_streams``); equal on every rank.

        Raises:
            InvalidArgumentError: ``lanes`` outside 1 .. MAX_LANES.
            PcclError subclasses from create/connect (PcclTimeoutError,
            PeerLostError, PcclSystemError, ...); errors of the store.
        """
        comm, finish = cls.publish(store, rank, world_size, timeout_s, prefix)
        finish(lanes, streams)
        return comm

    @classmethod
    def publish(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                prefix: str = "pccl") -> tuple[Communicator, Callable[[int, int | None], None]]:
        """``bootstrap``'s first half: creates the communicator, listens and publishes this
        rank's address (rank 0: with the communicator id); returns it, not connected, and
        ``finish(lanes, streams, defer_lanes, read)``, the second half: reads the id and every
        address in one store request (``read(keys)``, default ``store.multi_get``) and connects
        (arguments, keys and errors as ``bootstrap``; ``finish`` closes the communicator when
        it fails). A group that connects lazily
        (``ProcessGroupPCCL(connect=...)``) runs ``finish`` on its lane 0 executor, so a rank
        forms its next group while this one's peers arrive.

        Raises:
            PcclError subclasses from create (PcclSystemError: no port); errors of the store.
        """
        generation = store.add(f"{prefix}/generation/{rank}", 1)
        key = f"{prefix}/{generation}"
        host = advertised_host(store)
        # The id is set once rank 0's is read (set_id): every rank listens and publishes
        # its address first, and reads the id with the addresses, in one request. A device
        # mesh forms many small groups one after the other, and a round trip that waits for
        # rank 0 alone adds up on a loaded host.
        comm = cls(rank, world_size, 0, host, timeout_s)
        addr_keys = [f"{key}/addr/{r}" for r in range(world_size)]
        try:
            mine = format_address(host, comm.port)
            if rank == 0:
                store.multi_set([f"{key}/comm_id", addr_keys[0]],
                                [str(int.from_bytes(os.urandom(8), "little")), mine])
            else:
                store.set(addr_keys[rank], mine)
        except BaseException:
            comm.close()
            raise

        def finish(lanes: int = 1, streams: int | None = 1, defer_lanes: bool = False,
                   read: Callable[[list[str]], list[bytes]] | None = None) -> None:
            try:
                values = (read or store.multi_get)([f"{key}/comm_id"] + addr_keys)
                comm.set_id(_comm_id(values[0]))
                comm.connect([a.decode("ascii") for a in values[1:]], lanes=lanes,
                             streams=streams, defer_lanes=defer_lanes)
            except BaseException:
                comm.close()
                raise

        return comm, finish

    # -- properties --------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank, 0 .. world_size-1."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world_size

    @property
    def timeout_s(self) -> float:
        """Default deadline of each call, in seconds."""
        return self._timeout_s

    @property
    def port(self) -> int:
        """TCP port this communicator listens on (fixed at creation, so reading it never
        waits behind a connect or a collective holding the handle)."""
        return self._port

    @property
    def closed(self) -> bool:
        """True once ``close()`` has run."""
        return self._native.closed

    # -- lifecycle ---------------------------------------------------------

    def connect(self, addrs: Sequence[str], timeout_s: float | None = None,
                lanes: int = 1, streams: int | None = 1, defer_lanes: bool = False) -> None:
        """Connects to every peer; ``addrs[i]`` is rank i's ``"host:port"``.

        With ``lanes`` = K > 1 it opens K TCP connections to every peer in one
        connect phase (``pcclCommConnectLanes``): this communicator is lane 0
        and ``self.lanes[1:]`` are K-1 new Communicators of the same rank and
        world, each with its own lock, staging memory, sticky error and abort
        flag, so collectives on different lanes run at once and fail
        independently. Its ``lane_set`` owns them: ``abort``, ``close``,
        ``set_option`` and ``stats`` cover every lane. Every rank must pass the
        same K (the handshake refuses a peer with another count) and issue the
        same collectives on the same lane.

        With ``streams`` = S > 1 every lane opens S TCP connections to every
        peer (the native "streams" option) and deals the chunks of each
        operation to whichever of them has room, so one large operation fills a
        long fat pipe that a single TCP stream cannot (its window caps it at
        about window / RTT) and a slow stream takes few chunks; results stay
        bit-identical, and losing any one stream
        fails the operation like a lost peer. Every rank must pass the same S;
        ``streams=None`` takes ``auto_streams(addrs)``, the same on every rank.
        Striped streams are paced as ``PCCL_PACING`` says (``config.pacing``; see
        ``pacing``). With ``streams=None``, striping and pacing on, it connects
        ``stripe_ceiling(world, lanes)`` streams instead and stripes over
        ``auto_streams`` of them, and the warm-up (``warm_up``) picks the stripe from the
        measured bandwidth-delay product (``core/warmup.py``). The policy, one function of
        the addresses, the group's shape and the settings: ``core.striping.plan_streams``.

        With ``defer_lanes`` and a group that needs no warm-up, only lane 0 connects now
        and ``connect_deferred_lanes`` connects lanes 1 .. K-1 later, when the group first
        needs them: the connections a group opens are (K x streams) per peer, and on a host
        with more ranks than cores, a device mesh that forms many small groups spends its
        CPU there (benchmarks/mesh_setup.py). Every rank must pass the same ``defer_lanes``
        (the hellos name K either way).

        Raises:
            InvalidArgumentError: wrong number of addresses; ``lanes`` not an
                int in 1 .. MAX_LANES; ``streams`` not an int in 1 .. MAX_STREAMS.
            ValueError: a malformed ``PCCL_PACING``.
            PcclTimeoutError, PeerLostError, PcclSystemError, ProtocolError,
            AbortedError: the links could not be brought up.
        """
        if len(addrs) != self._world_size:
            raise InvalidArgumentError(f"need {self._world_size} addresses, got {len(addrs)}")
        if not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            raise InvalidArgumentError(f"lanes {lanes!r} is not an int in 1 .. {MAX_LANES}")
        plan = plan_streams(addrs, self._world_size, lanes, streams)
        self._native.configure(streams=plan.connected, pacing=plan.pacing,
                               link_timeout_ms=config.link_timeout_ms())
        self._streams = plan.connected
        encoded = [ffi.new("char[]", a.encode("ascii")) for a in addrs]
        array = ffi.new("const char *[]", encoded)
        ms = self.deadline_ms(timeout_s)
        if lanes == 1:
            self._native.call(lib.pcclCommConnect, array, ms)
        elif defer_lanes and not plan.warm:
            self._native.call(lib.pcclCommConnectLaneRange, array, 0, 1, lanes, ffi.NULL, ms)
            self._deferred = (list(addrs), lanes)
        else:
            out = ffi.new("pcclComm_t[]", lanes - 1)
            self._native.call(lib.pcclCommConnectLanes, array, lanes, out, ms)
            natives = [NativeHandle(out[i]) for i in range(lanes - 1)]  # owned before raising
            self._lane_comms = tuple(
                Communicator.adopt(n, self._rank, self._world_size, self._timeout_s,
                                   plan.connected)
                for n in natives)
        if plan.picks_stripe:           # the group picks its stripe (warm_up)
            self.lane_set.set_stripe(plan.stripe)
        self._warm_lanes = plan.warm
        self.warm_up()

    @property
    def deferred_lanes(self) -> int:
        """Lanes still to connect (``connect(defer_lanes=True)``): 0 once all are."""
        deferred = self._deferred
        return 0 if deferred is None else deferred[1] - 1

    def connect_deferred_lanes(self, timeout_s: float | None = None) -> LaneSet:
        """Connects the lanes ``connect(defer_lanes=True)`` left for later (1 .. K-1) and
        returns every lane (``lane_set``); returns it at once when none is left. A
        collective of the group's ranks, each calling it once at the same point of its op
        sequence, from any thread: it does not wait for a collective on lane 0, nor does
        lane 0 wait for it. The new lanes take lane 0's settings and ring order. A failure
        leaves lane 0 as it was (its ``abort`` wakes this call); calling again retries.

        Raises:
            PcclTimeoutError, PeerLostError, PcclSystemError, ProtocolError, AbortedError:
                the lanes' links could not be brought up (``timeout_s``: the group's
                deadline by default).
            InvalidUsageError: the communicator is closed.
        """
        deferred = self._deferred
        if deferred is None:
            return self.lane_set
        addrs, lanes = deferred
        encoded = [ffi.new("char[]", a.encode("ascii")) for a in addrs]
        out = ffi.new("pcclComm_t[]", lanes - 1)
        self._native.call_beside(lib.pcclCommConnectLaneRange, ffi.new("const char *[]", encoded),
                                 1, lanes - 1, lanes, out, self.deadline_ms(timeout_s))
        natives = [NativeHandle(out[i]) for i in range(lanes - 1)]  # owned before raising
        comms = tuple(Communicator.adopt(n, self._rank, self._world_size, self._timeout_s,
                                         self._streams) for n in natives)
        order = self._native.last_ring_order
        if order is not None:
            LaneSet(comms).set_ring_order(order)
        self._lane_comms, self._deferred = comms, None
        return self.lane_set

    def warm_up(self) -> list[int]:
        """Opens every lane's streams to the path's rate and measures it (``core/warmup.py``):
        a collective of every rank, run by ``connect`` for a striped group unless pacing is
        off, and after a new ring order (``torch_pccl.optimize_topology``), whose new
        neighbours' connections are cold. Sends at most ``warmup.BUDGET_BYTES`` per rank: a
        few round trips of start-up per lane on a long link, one op on a LAN.

        Returns:
            The warm-up all-reduces run on each lane ([] where nothing is warmed: one
            stream, pacing off, or a world of one).

        Raises:
            PcclError: as ``all_reduce``.
        """
        if not self._warm_lanes:
            return []
        order = self.ring_order
        successor = order[(order.index(self._rank) + 1) % len(order)]
        return warm_up(self.lane_set, successor)

    def last_rate(self, peer: int) -> float:
        """The rate this lane's streams to rank ``peer`` carried in its last striped op,
        bytes per second: its fastest window of about one round trip with bytes waiting on
        the streams (0.0: none, one stream, or pacing off). Tells whether this lane's
        connections have opened to the path (``warm_up``). Waits for an op in flight.

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of the group.
            InvalidUsageError: the communicator is closed.
        """
        rate = ffi.new("double *")
        self._native.run(lib.pcclCommGetLastRate, int(peer), rate)
        return rate[0]

    @property
    def streams(self) -> int:
        """TCP connections to each peer per lane (``connect(streams=...)``, or
        ``stripe_ceiling`` when the group picks its stripe; 1 before connecting)."""
        return self._streams

    @property
    def stripe(self) -> int:
        """How many of the ``streams`` to each peer every op is striped over: all of them
        unless the group picks its stripe (``connect(streams=None)`` between hosts, paced),
        then what the warm-up chose from the path's bandwidth-delay product."""
        return self._native.stripe or self._streams

    @property
    def native(self) -> NativeHandle:
        """The native handle this communicator owns (its locks, ``current_op``, lifetime)."""
        return self._native

    @property
    def lane_set(self) -> LaneSet:
        """Every lane of this communicator, itself first: the owner of the operations on all
        of them (abort, close, errors, stats, options, ring order, pacing)."""
        # Built on each use: a kept set would hold self in a cycle (unclosed: freed late).
        return LaneSet((self, *self._lane_comms))

    @property
    def lanes(self) -> tuple[Communicator, ...]:
        """This communicator (lane 0) and its lane Communicators (1 .. K-1; see ``connect``)."""
        return self.lane_set.lanes

    def unreached_ranks(self) -> list[int]:
        """After a failed ``connect``: the ranks some link to or from which did not come up.

        Ascending, this rank excluded; [] once connected. Tells a member which peer
        it could not reach (``pcclCommGetUnreachedRanks``).

        Raises:
            InvalidUsageError: the communicator is closed.
        """
        ranks = ffi.new("int[]", max(1, self._world_size))
        n = ffi.new("int *")
        self._native.run(lib.pcclCommGetUnreachedRanks, ranks, n)
        return [ranks[i] for i in range(n[0])]

    def abort(self, lost: str | None = None) -> None:
        """Wakes and fails every blocking call (``AbortedError``); safe from any thread.

        Sticky: every later call fails the same way. A no-op after ``close()``.
        Aborts every lane.

        Args:
            lost: a member is known to be gone (e.g. the master dropped it):
                the call in flight and every later one fail with
                ``PeerLostError(lost)`` instead of ``AbortedError``, and
                ``errored()`` reports it (``pcclCommAbortWithError``). The text
                is cut to ``PCCL_MAX_ABORT_REASON`` (1024) bytes. An earlier abort
                or network error keeps its own cause.
        """
        self.lane_set.abort(lost)

    def close(self) -> None:
        """Frees the native communicator (closes all sockets). Idempotent.

        Waits for a collective in flight on another thread; call ``abort()``
        first to end it promptly. Closes every lane.
        """
        self.lane_set.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def error(self) -> int:
        """Returns the sticky pcclResult_t of the communicator (0 if healthy).

        With lanes: the first lane's (in lane order) that is not 0.
        """
        return self.lane_set.error()

    def errored(self) -> PcclError | None:
        """The sticky error of this communicator or one of its lanes, as an exception; else None.

        Mirrors torchft's ``ProcessGroup.errored()``: the exception that every
        later call on that lane would raise (class from the result code,
        message with the native detail of the original failure). None while
        healthy or once closed. With lanes: the first failed lane's, in lane order.
        """
        return self.lane_set.errored()

    def set_option(self, name: str, value: int) -> None:
        """Sets a field of the native ``pcclConfig_t``, e.g. ``"chunk_bytes"`` (bytes).

        Names: ``core.handle.CONFIG_FIELDS``; units and bounds: pccl.h. Applies to every lane.

        Raises:
            InvalidArgumentError: unknown name or bad value.
            InvalidUsageError: ``streams`` or ``link_timeout_ms`` changed after connecting.
        """
        self.lane_set.set_option(name, value)

    def set_ring_order(self, order: Sequence[int]) -> None:
        """Runs the ring collectives around ``order``: position p of the ring holds rank ``order[p]``.

        Each rank then sends to the rank after it in ``order`` and receives from
        the one before, so a ring can avoid slow links (see
        ``torch_pccl.optimize_topology``). Ranks, the layout of every result and
        bit-identical results are unchanged; floating-point sums may round
        differently than in rank order (another summation order). A collective
        in its own right: every rank must set the same order at the same point
        of its op sequence (it waits for a collective in flight on this lane).
        Applies to every lane; ``range(world_size)`` restores rank order.

        Raises:
            InvalidArgumentError: ``order`` is not a permutation of the ranks.
        """
        self.lane_set.set_ring_order(order)

    @property
    def last_ring_order(self) -> tuple[int, ...]:
        """The order last given to ``set_ring_order`` (rank order before any); unlike
        ``ring_order`` it never waits for a collective in flight (status reports read it)."""
        return self.lane_set.last_ring_order

    @property
    def current_op(self) -> str | None:
        """The native call running on any lane (``"AllReduce"``, ``"P2PBatch"``, ...), or None
        when idle; read without waiting (status reports read it from another thread)."""
        return self.lane_set.current_op

    @property
    def ring_order(self) -> tuple[int, ...]:
        """The rank at each ring position (rank order until ``set_ring_order``)."""
        return self.lane_set.ring_order

    def pacing(self, peer: int) -> tuple[float, float]:
        """Returns ``(estimate, cap)`` of the streams to rank ``peer``, in bytes per second.

        ``estimate``: the peer's path rate as measured during earlier operations (0.0
        before any long enough op); ``cap``: what the streams to the peer may send
        together now (0.0: no cap; one stream is never capped). Shared by every lane.
        Set with ``set_option("pacing", v)``: 0 off (default), > 0 pinned bytes/s, -1
        measured (experimental; env ``PCCL_PACING``). Why and how: native/src/pacing.hpp.
        Does not wait for a collective in flight.

        Raises:
            InvalidArgumentError: ``peer`` is not a rank of the group.
            InvalidUsageError: the communicator is closed.
        """
        return self.lane_set.pacing(peer)

    def stats(self) -> tuple[int, int]:
        """Returns ``(bytes_sent, bytes_received)`` since creation, payload plus headers.

        Summed over every lane. Does not wait for a collective in flight: the
        counters are atomics, so only the handle's lifetime lock is taken.

        Raises:
            InvalidUsageError: the communicator is closed.
        """
        return self.lane_set.stats()

    def deadline_ms(self, timeout_s: float | None = None) -> int:
        """The native deadline of a call, ms (at least 1): ``timeout_s`` seconds, or the
        communicator's ``timeout_s`` when None.

        Raises:
            InvalidArgumentError: ``timeout_s`` is not a positive number of seconds in range.
        """
        seconds = self._timeout_s if timeout_s is None else checked_timeout(timeout_s)
        return max(1, int(seconds * 1000))



def _comm_id(value: bytes) -> int:
    # Rank 0's id as the store holds it: a decimal 64-bit number, bounded before it is
    # parsed or shown.
    if len(value) > 20 or not value.isdigit() or int(value) > 2**64 - 1:
        raise ProtocolError(f"the store holds no communicator id but {value[:24]!r}")
    return int(value)
