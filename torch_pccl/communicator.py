"""Communicator: one rank's native pcclComm_t, reached through cffi.

The methods take contiguous CPU tensors and pass ``tensor.data_ptr()`` to C
without copying. Every argument (dtype, device, contiguity, sizes, ranks, op,
tag, timeout) is checked here in Python before any C call, so a caller's
mistake is a ``TypeError``/``ValueError`` with a clear message and never
reaches the native layer. cffi releases the GIL during each C call.

Bootstrap (``Communicator.bootstrap``) exchanges addresses through a c10d
store: addresses only, never tensor data. Elastic groups instead build one
communicator per membership epoch on a long-lived ``Listener``
(``Communicator.from_assignment``), with the addresses the master hands out.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._pccl_native import ffi, lib
from .errors import InvalidArgumentError, InvalidUsageError, _check

_DTYPES = {
    torch.float32: lib.pcclFloat32,
    torch.float64: lib.pcclFloat64,
    torch.float16: lib.pcclFloat16,
    torch.bfloat16: lib.pcclBFloat16,
    torch.int8: lib.pcclInt8,
    torch.uint8: lib.pcclUInt8,
    torch.int32: lib.pcclInt32,
    torch.int64: lib.pcclInt64,
}

_RedOpType = dist.ReduceOp.RedOpType
# Keyed by the enum's int value: hashing the pybind enum itself costs ~1 us per call.
_OPS = {
    _RedOpType.SUM.value: lib.pcclSum,
    _RedOpType.AVG.value: lib.pcclAvg,
    _RedOpType.MIN.value: lib.pcclMin,
    _RedOpType.MAX.value: lib.pcclMax,
    _RedOpType.PRODUCT.value: lib.pcclProd,
}

_UINT32_MAX = 2**32 - 1
# all_reduce_quantized: bits -> pcclQuantType_t, and the largest block (a 16-bit header field).
_QUANT_TYPES = {8: lib.pcclQuantInt8, 4: lib.pcclQuantInt4}
_MAX_QUANT_BLOCK = 65535
# The most connections per peer ``Communicator.connect(lanes=...)`` opens (pccl.h).
MAX_LANES = lib.PCCL_MAX_LANES
# pccl.h takes the deadline as a C int of milliseconds.
_MAX_TIMEOUT_S = (2**31 - 1) / 1000.0


def dtype_code(tensor: torch.Tensor, name: str = "tensor") -> int:
    """Returns the pcclDataType_t of ``tensor``.

    Raises:
        TypeError: ``tensor`` is not a tensor, or its dtype is not one of
            float32, float64, float16, bfloat16, int8, uint8, int32, int64
            (complex, bool, float8 and unsigned 16/32/64-bit are not supported).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    code = _DTYPES.get(tensor.dtype)
    if code is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise TypeError(f"{name} has unsupported dtype {tensor.dtype}; supported: {supported}")
    return code


def op_code(op) -> int:
    """Returns the pcclRedOp_t for a ``dist.ReduceOp`` or ``dist.ReduceOp.RedOpType``.

    Raises:
        InvalidArgumentError (a ValueError): BAND, BOR, BXOR, PREMUL_SUM or
            anything that is not a reduce op.
    """
    # ReduceOp objects (opts.reduceOp, PREMUL_SUM) carry the enum in `.op`.
    # (The RedOpType enum itself also passes isinstance(op, dist.ReduceOp).)
    kind = op if isinstance(op, _RedOpType) else getattr(op, "op", None)
    code = _OPS.get(kind.value) if isinstance(kind, _RedOpType) else None
    if code is None:
        raise InvalidArgumentError(
            f"unsupported reduce op {op}; supported: SUM, AVG, MIN, MAX, PRODUCT"
        )
    return code


def quantized_args(tensor: torch.Tensor, bits: int, block: int, op) -> tuple[int, int]:
    """Checks a quantized all-reduce's arguments; returns (pcclQuantType_t, pcclRedOp_t).

    Raises:
        InvalidArgumentError (a ValueError): ``tensor`` is not float32, float16
            or bfloat16; ``bits`` is not 8 or 4; ``block`` is not an int in
            1 .. 65535; ``op`` is not SUM or AVG.
    """
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidArgumentError(
            f"quantized all_reduce takes float32, float16 or bfloat16, got {tensor.dtype}")
    qtype = _QUANT_TYPES.get(bits) if type(bits) is int else None
    if qtype is None:
        raise InvalidArgumentError(f"bits must be 8 or 4, got {bits!r}")
    if type(block) is not int or not 1 <= block <= _MAX_QUANT_BLOCK:
        raise InvalidArgumentError(f"block must be an int in 1 .. {_MAX_QUANT_BLOCK}, got {block!r}")
    red = op_code(op)
    if red not in (lib.pcclSum, lib.pcclAvg):
        raise InvalidArgumentError(f"quantized all_reduce supports SUM and AVG, got {op}")
    return qtype, red


def check_tensor(tensor: torch.Tensor, name: str = "tensor", cpu_only: bool = True) -> int:
    """Checks dtype, device and contiguity of ``tensor``; returns its pcclDataType_t.

    Raises:
        TypeError: unsupported dtype (see ``dtype_code``).
        InvalidArgumentError (a ValueError): sparse, not contiguous, or not on the CPU
            when ``cpu_only`` (the process group stages CUDA tensors itself).
    """
    code = dtype_code(tensor, name)
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(f"{name} must be a dense (strided) tensor, got {tensor.layout}")
    if cpu_only and tensor.device.type != "cpu":
        raise InvalidArgumentError(f"{name} must be a CPU tensor, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous (call .contiguous())")
    return code


def _same_dtype(a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> None:
    if a.dtype != b.dtype:
        raise InvalidArgumentError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}")


def _ptr(tensor: torch.Tensor):
    return ffi.cast("void *", tensor.data_ptr())


def advertised_host(store: dist.Store | None = None, target: str | None = None) -> str:
    """Returns the numeric address this rank listens on and advertises to its peers.

    In order: env ``PCCL_HOST`` (resolved to a numeric address); 127.0.0.1 when
    the rendezvous host (``target`` if given, e.g. the master of a
    ``pccl://`` group, else env ``MASTER_ADDR``, else the host of the TCPStore
    under ``store``) is unknown or a loopback address; otherwise the address of
    the interface that routes to the rendezvous host, found with a UDP socket
    ``connect()`` + ``getsockname()`` (no packet is sent).

    Raises:
        OSError: the host cannot be resolved or there is no route to it.
    """
    env = os.environ.get("PCCL_HOST")
    if env:
        return socket.getaddrinfo(env, None, type=socket.SOCK_STREAM)[0][4][0]
    master = target or os.environ.get("MASTER_ADDR") or _store_host(store)
    if not master:
        return "127.0.0.1"
    family, _, _, _, sockaddr = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
    if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
        return "127.0.0.1"
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def _store_host(store) -> str | None:
    # init_method="tcp://host:port" sets no MASTER_ADDR; the TCPStore knows the host.
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, dist.TCPStore) else None


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
                _check(rc)
            finally:
                lib.pcclListenerDestroy(out[0])
        self._handle = ffi.gc(out[0], lib.pcclListenerDestroy)
        p = ffi.new("int *")
        _check(lib.pcclListenerGetPort(self._handle, p))
        self.port = p[0]

    @property
    def address(self) -> str:
        """``"host:port"`` to advertise (IPv6 in brackets); needs a numeric ``host``."""
        return _format_address(self.host or "127.0.0.1", self.port)

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

    def _live(self):
        if self._handle is None:
            raise InvalidUsageError("listener is closed")
        return self._handle


class Communicator:
    """One rank of a PCCL group: owns a native ``pcclComm_t``.

    Build one with ``Communicator.bootstrap(store, rank, world_size, ...)``.
    The handle is freed by ``close()`` (explicit, idempotent) or, failing that,
    by the garbage collector (``ffi.gc``). Collectives are blocking, run in the
    order their calls take the internal lock, and are bounded by a deadline;
    ``abort()`` from any thread wakes them.

    Tensor arguments must be contiguous CPU tensors of one of the supported
    dtypes; counts and displacements are in elements, timeouts in seconds.
    A failed collective never leaves an output partly written.

    Connected with ``lanes=K`` it also owns K-1 lane Communicators
    (``lanes``), each with its own connections to every peer, so K
    collectives can be in flight at once (one per lane).
    """

    def __init__(self, rank: int, world_size: int, comm_id: int, listen_host: str | None,
                 timeout_s: float, listener: Listener | None = None):
        """Creates the native communicator and starts listening (port 0).

        Most callers want ``bootstrap``. ``comm_id`` (0 .. 2**64-1) must be the
        same on all ranks and fresh per group; ``timeout_s`` is the default
        deadline of every later call. With ``listener`` the communicator
        accepts its links there (``listen_host`` is then ignored) and keeps a
        reference to it, so the listener outlives it.

        Raises:
            InvalidArgumentError: bad rank, world size, comm id or timeout.
            PcclSystemError: the listening socket could not be opened.
        """
        if not 0 < world_size or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank {rank} is not in a group of {world_size}")
        if not 0 <= comm_id <= 2**64 - 1:
            raise InvalidArgumentError(f"comm_id {comm_id} is not a 64-bit unsigned integer")
        self._timeout_s = _checked_timeout(timeout_s)
        self._rank = rank
        self._world_size = world_size
        # _op_lock serialises calls that use the handle and close(); abort()
        # must not wait behind a blocked collective, so it only takes
        # _handle_lock, which guards the handle's lifetime.
        self._op_lock = threading.Lock()
        self._handle_lock = threading.Lock()
        self._handle = None
        self._listener = listener
        self._lane_comms: list[Communicator] = []  # lanes 1.. (see connect(lanes=...))
        out = ffi.new("pcclComm_t *")
        if listener is not None:
            rc = lib.pcclCommCreateOnListener(out, rank, world_size, comm_id, listener._live())
        else:
            host = ffi.NULL if listen_host is None else listen_host.encode("ascii")
            rc = lib.pcclCommCreate(out, rank, world_size, comm_id, host)
        if rc != 0:
            try:
                _check(rc)  # first: the detail is gone after the next pccl call
            finally:
                # Keep the handle from leaking if the native side returned one.
                lib.pcclCommDestroy(out[0])
        self._handle = ffi.gc(out[0], lib.pcclCommDestroy)

    @classmethod
    def bootstrap(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                  prefix: str = "pccl", lanes: int = 1) -> Communicator:
        """Creates a communicator and connects it to all peers through ``store``.

        Rank 0 writes a random 64-bit communicator id; every rank writes its
        ``host:port`` (IPv6 in brackets) and reads everyone's. Keys are
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

        Raises:
            InvalidArgumentError: ``lanes`` outside 1 .. MAX_LANES.
            PcclError subclasses from create/connect (PcclTimeoutError,
            PeerLostError, PcclSystemError, ...); errors of the store.
        """
        generation = store.add(f"{prefix}/generation/{rank}", 1)
        key = f"{prefix}/{generation}"
        if rank == 0:
            comm_id = int.from_bytes(os.urandom(8), "little")
            store.set(f"{key}/comm_id", str(comm_id))
        else:
            comm_id = int(store.get(f"{key}/comm_id"))
        host = advertised_host(store)
        comm = cls(rank, world_size, comm_id, host, timeout_s)
        try:
            store.set(f"{key}/addr/{rank}", _format_address(host, comm.port))
            addrs = [store.get(f"{key}/addr/{r}").decode("ascii") for r in range(world_size)]
            comm.connect(addrs, lanes=lanes)
        except BaseException:
            comm.close()
            raise
        return comm

    @classmethod
    def from_assignment(cls, listener: Listener, assignment, timeout_s: float,
                        lanes: int = 1) -> Communicator:
        """Creates this epoch's communicator on ``listener`` and connects it to all members.

        Args:
            listener: this peer's long-lived data-plane listener (the address
                it gave the master).
            assignment: a ``torch_pccl.membership.Assignment`` (rank, world
                size, comm_id, every rank's address).
            timeout_s: deadline in seconds for connecting and default for
                every later call.
            lanes: connections per peer (see ``connect``); equal on every member.

        Raises:
            InvalidArgumentError: a bad rank, world size, comm id, timeout or lane count.
            PcclTimeoutError, PeerLostError, PcclSystemError, ProtocolError:
                the links could not be brought up (the communicator is closed).
        """
        comm = cls(assignment.rank, assignment.world_size, assignment.comm_id, None, timeout_s,
                   listener=listener)
        try:
            comm.connect(list(assignment.addrs), lanes=lanes)
        except BaseException:
            comm.close()
            raise
        return comm

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
        """TCP port this communicator listens on."""
        port = ffi.new("int *")
        with self._op_lock:
            self._call(lib.pcclCommGetPort, port)
        return port[0]

    @property
    def closed(self) -> bool:
        """True once ``close()`` has run."""
        return self._handle is None

    # -- lifecycle ---------------------------------------------------------

    def connect(self, addrs: Sequence[str], timeout_s: float | None = None,
                lanes: int = 1) -> None:
        """Connects to every peer; ``addrs[i]`` is rank i's ``"host:port"``.

        With ``lanes`` = K > 1 it opens K TCP connections to every peer in one
        connect phase (``pcclCommConnectLanes``): this communicator is lane 0
        and ``self.lanes[1:]`` are K-1 new Communicators of the same rank and
        world, each with its own lock, staging memory, sticky error and abort
        flag, so collectives on different lanes run at once and fail
        independently. This communicator owns them: ``abort``, ``close``,
        ``set_option`` and ``stats`` cover every lane. Every rank must pass the
        same K (the handshake refuses a peer with another count) and issue the
        same collectives on the same lane.

        Raises:
            InvalidArgumentError: wrong number of addresses; ``lanes`` not an
                int in 1 .. MAX_LANES.
            PcclTimeoutError, PeerLostError, PcclSystemError, ProtocolError,
            AbortedError: the links could not be brought up.
        """
        if len(addrs) != self._world_size:
            raise InvalidArgumentError(
                f"need {self._world_size} addresses, got {len(addrs)}")
        if not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            raise InvalidArgumentError(f"lanes {lanes!r} is not an int in 1 .. {MAX_LANES}")
        encoded = [ffi.new("char[]", a.encode("ascii")) for a in addrs]
        array = ffi.new("const char *[]", encoded)
        ms = self._timeout_ms(timeout_s)
        if lanes == 1:
            with self._op_lock:
                self._call(lib.pcclCommConnect, array, ms)
            return
        out = ffi.new("pcclComm_t[]", lanes - 1)
        with self._op_lock:
            self._call(lib.pcclCommConnectLanes, array, lanes, out, ms)
            self._lane_comms = [self._adopt_lane(out[i]) for i in range(lanes - 1)]

    def _adopt_lane(self, handle) -> Communicator:
        # A connected lane handle from pcclCommConnectLanes, wrapped without __init__.
        lane = Communicator.__new__(Communicator)
        lane.__dict__.update(self.__dict__)  # rank, world size, timeout, ...; then its own:
        lane._op_lock = threading.Lock()
        lane._handle_lock = threading.Lock()
        lane._listener = None
        lane._lane_comms = []
        lane._handle = ffi.gc(handle, lib.pcclCommDestroy)
        return lane

    @property
    def lanes(self) -> tuple[Communicator, ...]:
        """This communicator (lane 0) and its lane Communicators (1 .. K-1; see ``connect``)."""
        return (self, *self._lane_comms)

    def abort(self) -> None:
        """Wakes and fails every blocking call (``AbortedError``); safe from any thread.

        Sticky: every later call fails with ``AbortedError``. A no-op after ``close()``.
        Aborts every lane.
        """
        with self._handle_lock:
            if self._handle is not None:
                lib.pcclCommAbort(self._handle)
        for lane in self._lane_comms:
            lane.abort()

    def close(self) -> None:
        """Frees the native communicator (closes all sockets). Idempotent.

        Waits for a collective in flight on another thread; call ``abort()``
        first to end it promptly. Closes every lane.
        """
        for lane in self._lane_comms:
            lane.close()
        with self._op_lock, self._handle_lock:
            handle, self._handle = self._handle, None
            if handle is not None:
                # Runs pcclCommDestroy now and detaches it from the gc.
                ffi.release(handle)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def error(self) -> int:
        """Returns the sticky pcclResult_t of the communicator (0 if healthy).

        With lanes: the first lane's (in lane order) that is not 0.
        """
        with self._handle_lock:
            rc = 0 if self._handle is None else lib.pcclCommGetError(self._handle)
        for lane in self._lane_comms:
            rc = rc or lane.error()
        return rc

    def set_option(self, name: str, value: int) -> None:
        """Sets a native tuning knob, e.g. ``"chunk_bytes"`` (bytes).

        Applies to every lane.

        Raises:
            InvalidArgumentError: unknown name or bad value.
        """
        with self._op_lock:
            self._call(lib.pcclCommSetOption, name.encode("ascii"), int(value))
        for lane in self._lane_comms:
            lane.set_option(name, value)

    def stats(self) -> tuple[int, int]:
        """Returns ``(bytes_sent, bytes_received)`` since creation, payload plus headers.

        Summed over every lane. Does not wait for a collective in flight: the
        counters are atomics, so only the handle's lifetime lock is taken.

        Raises:
            InvalidUsageError: the communicator is closed.
        """
        sent = ffi.new("uint64_t *")
        received = ffi.new("uint64_t *")
        with self._handle_lock:
            if self._handle is None:
                raise InvalidUsageError("communicator is closed")
            _check(lib.pcclCommGetStats(self._handle, sent, received), self._handle)
        total = [sent[0], received[0]]
        for lane in self._lane_comms:
            lane_sent, lane_received = lane.stats()
            total[0] += lane_sent
            total[1] += lane_received
        return total[0], total[1]

    # -- collectives -------------------------------------------------------

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None,
                   op=dist.ReduceOp.SUM, tag: int = 0, timeout_s: float | None = None) -> None:
        """``out = op over ranks of inp``, elementwise; mirrors ``dist.all_reduce``.

        Args:
            inp: contiguous CPU tensor, any shape, N elements.
            out: same dtype and N elements (may be ``inp``; None means in place).
            op: ``dist.ReduceOp`` SUM, AVG, MIN, MAX or PRODUCT. AVG divides by
                world size (integers truncate toward zero); float16/bfloat16
                accumulate in float32. Every rank ends with identical bytes.
            tag: 32-bit unsigned tag that peers must match.
            timeout_s: deadline in seconds (default: the communicator's).

        Raises:
            TypeError: unsupported dtype.
            InvalidArgumentError: non-contiguous, non-CPU, size/dtype mismatch, bad op.
            PeerLostError, PcclTimeoutError, RemoteError, MismatchError, ... (sticky).
        """
        out, dtype = _same_shape_output(inp, out)
        red = op_code(op)
        self._run(lib.pcclAllReduce, _ptr(inp), _ptr(out), inp.numel(), dtype, red,
                  _tag(tag), self._timeout_ms(timeout_s))

    def all_reduce_quantized(self, inp: torch.Tensor, out: torch.Tensor | None = None,
                             bits: int = 8, block: int = 256, op=dist.ReduceOp.SUM, tag: int = 0,
                             timeout_s: float | None = None) -> None:
        """``out ~= op over ranks of inp`` with int8/int4 traffic (``pcclAllReduceQuantized``).

        Each value is quantized twice, never at a hop: every rank quantizes
        the other owners' block-aligned slices of ``inp`` once (symmetric
        absmax per block of ``block`` elements, a float32 scale per block,
        round half to even) and sends them; each owner adds the decoded
        contributions and its own exact slice in float32 in rank order,
        divides by the world size for AVG, quantizes the result once and
        all-gathers it. Every rank decodes the same bytes, so ``out`` is
        bit-identical on every rank (at world size 1 it is ``inp`` quantized
        once). Per element, ``|out - exact| <=`` the sum over the other ranks
        of half their input block's scale (absmax / 127 for int8, / 7 for
        int4; divided by the world size for AVG) plus half the result block's
        scale. A block holding an inf or NaN comes out NaN. Bytes sent per
        rank: about ``2 (W-1)/W * N * (bits/8 + 4/block)`` against
        ``2 (W-1)/W * N * 4`` for float32 ``all_reduce``. Algorithm: see
        native/src/quantize.hpp and docs/quantization.md.

        Args:
            inp: contiguous CPU tensor of float32, float16 or bfloat16, N elements.
            out: same dtype and N elements (may be ``inp``; None means in place);
                written only if the whole operation succeeded.
            bits: 8 (codes in [-127, 127]) or 4 (codes in [-7, 7], two per byte).
            block: elements per scale, 1 .. 65535 (e.g. 64 .. 4096).
            op: ``dist.ReduceOp`` SUM or AVG.
            tag: 32-bit unsigned tag that peers must match.
            timeout_s: deadline in seconds (default: the communicator's).

        Raises:
            TypeError: unsupported dtype.
            InvalidArgumentError: a dtype other than float32/float16/bfloat16,
                non-contiguous or non-CPU tensors, size/dtype mismatch, bits not
                8 or 4, block out of range, op not SUM or AVG.
            MismatchError: a peer passed another ``bits``, ``block``, size,
                dtype or op (or called another collective).
            PeerLostError, PcclTimeoutError, RemoteError, ... (sticky).
        """
        out, dtype = _same_shape_output(inp, out)
        qtype, red = quantized_args(inp, bits, block, op)
        self._run(lib.pcclAllReduceQuantized, _ptr(inp), _ptr(out), inp.numel(), dtype, red,
                  qtype, block, _tag(tag), self._timeout_ms(timeout_s))

    def broadcast(self, tensor: torch.Tensor, root: int, tag: int = 0,
                  timeout_s: float | None = None) -> None:
        """Copies ``tensor`` of rank ``root`` into ``tensor`` of every rank; mirrors ``dist.broadcast``.

        Raises:
            TypeError, InvalidArgumentError (bad tensor or root), network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        self._check_rank(root, "root")
        self._run(lib.pcclBroadcast, _ptr(tensor), tensor.numel(), dtype, root, _tag(tag),
                  self._timeout_ms(timeout_s))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, tag: int = 0,
                   timeout_s: float | None = None) -> None:
        """``out[r*N:(r+1)*N] = inp of rank r`` (flat elements); mirrors ``dist.all_gather_into_tensor``.

        Args:
            inp: N elements. out: world_size * N elements, same dtype.

        Raises:
            TypeError, InvalidArgumentError (size or dtype mismatch), network PcclErrors.
        """
        dtype = check_tensor(inp, "input")
        check_tensor(out, "output")
        _same_dtype(inp, out, "input", "output")
        if out.numel() != inp.numel() * self._world_size:
            raise InvalidArgumentError(
                f"output has {out.numel()} elements, need world_size * input = "
                f"{self._world_size} * {inp.numel()}")
        self._run(lib.pcclAllGather, _ptr(inp), _ptr(out), inp.numel(), dtype, _tag(tag),
                  self._timeout_ms(timeout_s))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op=dist.ReduceOp.SUM,
                       tag: int = 0, timeout_s: float | None = None) -> None:
        """``out = op over ranks of inp[rank*N:(rank+1)*N]``; mirrors ``dist.reduce_scatter_tensor``.

        Args:
            inp: world_size * N elements. out: N elements, same dtype.
            op: as in ``all_reduce``.

        Raises:
            TypeError, InvalidArgumentError (size/dtype mismatch, bad op), network PcclErrors.
        """
        dtype = check_tensor(inp, "input")
        check_tensor(out, "output")
        _same_dtype(inp, out, "input", "output")
        if inp.numel() != out.numel() * self._world_size:
            raise InvalidArgumentError(
                f"input has {inp.numel()} elements, need world_size * output = "
                f"{self._world_size} * {out.numel()}")
        red = op_code(op)
        self._run(lib.pcclReduceScatter, _ptr(inp), _ptr(out), out.numel(), dtype, red,
                  _tag(tag), self._timeout_ms(timeout_s))

    def all_to_all_v(self, inp: torch.Tensor, send_counts: Sequence[int],
                     send_displs: Sequence[int], out: torch.Tensor, recv_counts: Sequence[int],
                     recv_displs: Sequence[int], tag: int = 0,
                     timeout_s: float | None = None) -> None:
        """All-to-all with per-peer counts and displacements, in elements.

        ``inp[send_displs[p] : + send_counts[p]]`` goes to rank p and lands in
        that rank's ``out[recv_displs[me] : + recv_counts[me]]``; zero counts
        are allowed. Mirrors ``dist.all_to_all_single`` (which works in rows).

        Raises:
            TypeError, InvalidArgumentError (list lengths != world_size, negative
            counts, a range outside its tensor, dtype mismatch), network PcclErrors.
        """
        dtype = check_tensor(inp, "input")
        check_tensor(out, "output")
        _same_dtype(inp, out, "input", "output")
        arrays = []
        for name, counts, displs, tensor in (("send", send_counts, send_displs, inp),
                                             ("recv", recv_counts, recv_displs, out)):
            self._check_ranges(name, counts, displs, tensor.numel())
            arrays.append(ffi.new("uint64_t[]", [int(c) for c in counts]))
            arrays.append(ffi.new("uint64_t[]", [int(d) for d in displs]))
        self._run(lib.pcclAllToAllv, _ptr(inp), arrays[0], arrays[1], _ptr(out), arrays[2],
                  arrays[3], dtype, _tag(tag), self._timeout_ms(timeout_s))

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0,
             timeout_s: float | None = None) -> None:
        """Sends ``tensor`` to rank ``peer``, matched by its ``recv`` with the same tag; mirrors ``dist.send``.

        Raises:
            TypeError, InvalidArgumentError (bad tensor, peer is self or out of range),
            network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        self._check_peer(peer)
        self._run(lib.pcclSend, _ptr(tensor), tensor.numel(), dtype, peer, _tag(tag),
                  self._timeout_ms(timeout_s))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0,
             timeout_s: float | None = None) -> None:
        """Receives ``tensor.numel()`` elements from rank ``peer`` into ``tensor``; mirrors ``dist.recv``.

        Raises:
            TypeError, InvalidArgumentError (bad tensor or peer), MismatchError
            (the sender's size or dtype differ), network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        self._check_peer(peer)
        self._run(lib.pcclRecv, _ptr(tensor), tensor.numel(), dtype, peer, _tag(tag),
                  self._timeout_ms(timeout_s))

    def p2p_batch(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]],
                  timeout_s: float | None = None) -> None:
        """Runs several sends and receives at once; mirrors ``dist.batch_isend_irecv``.

        Args:
            ops: ``(is_send, tensor, peer, tag)`` tuples. Messages to or from one
                peer are matched in list order (and after earlier calls' messages),
                so two ranks that send large tensors to each other do not wait on
                each other. Receive tensors are written only if the whole batch
                succeeds.

        Raises:
            TypeError, InvalidArgumentError (bad tensor, peer or tag),
            MismatchError (a peer's message differs in size, dtype or tag),
            network PcclErrors.
        """
        self._run(lib.pcclP2PBatch, *self._p2p_ops(ops), self._timeout_ms(timeout_s))

    def transfer_batch(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]],
                       timeout_s: float | None = None) -> None:
        """``p2p_batch`` for bulk transfers: receives land in their tensors without a staging copy.

        Saves one copy and the staging memory of every received byte, at a
        price: after a failure a receive tensor holds unspecified bytes, so
        the caller must stage and verify (``sync_shared_state`` hashes every
        entry it receives).

        Raises:
            as ``p2p_batch``.
        """
        self._run(lib.pcclTransferBatch, *self._p2p_ops(ops), self._timeout_ms(timeout_s))

    def _p2p_ops(self, ops):
        c_ops = ffi.new("pcclP2POp_t[]", max(1, len(ops)))
        for i, (is_send, tensor, peer, tag) in enumerate(ops):
            dtype = check_tensor(tensor, f"ops[{i}] tensor")
            self._check_peer(peer)
            c_ops[i].peer = peer
            c_ops[i].is_send = 1 if is_send else 0
            c_ops[i].buf = _ptr(tensor)
            c_ops[i].count = tensor.numel()
            c_ops[i].dtype = dtype
            c_ops[i].tag = _tag(tag)
        return c_ops, len(ops)

    def barrier(self, tag: int = 0, timeout_s: float | None = None) -> None:
        """Returns once every rank has entered the barrier; mirrors ``dist.barrier``.

        Raises:
            network PcclErrors (PeerLostError, PcclTimeoutError, ...).
        """
        self._run(lib.pcclBarrier, _tag(tag), self._timeout_ms(timeout_s))

    # -- internals ---------------------------------------------------------

    def _run(self, fn, *args) -> None:
        with self._op_lock:
            self._call(fn, *args)

    def _call(self, fn, *args) -> None:
        # Caller holds _op_lock, so close() cannot free the handle under us.
        handle = self._handle
        if handle is None:
            raise InvalidUsageError("communicator is closed")
        rc = fn(handle, *args)
        if rc != 0:
            _check(rc, handle)

    def _timeout_ms(self, timeout_s: float | None) -> int:
        seconds = self._timeout_s if timeout_s is None else _checked_timeout(timeout_s)
        return max(1, int(seconds * 1000))

    def _check_rank(self, rank: int, name: str) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self._world_size:
            raise InvalidArgumentError(
                f"{name} {rank!r} is not a rank of a group of {self._world_size}")

    def _check_peer(self, peer: int) -> None:
        self._check_rank(peer, "peer")
        if peer == self._rank:
            raise InvalidArgumentError(f"peer {peer} is this rank; send/recv need another rank")

    def _check_ranges(self, name: str, counts: Sequence[int], displs: Sequence[int],
                      numel: int) -> None:
        if len(counts) != self._world_size or len(displs) != self._world_size:
            raise InvalidArgumentError(
                f"{name} counts and displacements need {self._world_size} entries each, "
                f"got {len(counts)} and {len(displs)}")
        for peer, (count, displ) in enumerate(zip(counts, displs)):
            if count < 0 or displ < 0 or displ + count > numel:
                raise InvalidArgumentError(
                    f"{name} range for rank {peer} (displacement {displ}, count {count}) "
                    f"is outside a tensor of {numel} elements")


def _same_shape_output(inp: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``(out or inp, dtype code)`` for an all-reduce: checks both tensors and that they match."""
    out = inp if out is None else out
    dtype = check_tensor(inp, "input")
    check_tensor(out, "output")
    _same_dtype(inp, out, "input", "output")
    if out.numel() != inp.numel():
        raise InvalidArgumentError(f"output has {out.numel()} elements, input has {inp.numel()}")
    return out, dtype


def _tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= _UINT32_MAX:
        raise InvalidArgumentError(f"tag {tag!r} is not a 32-bit unsigned integer")
    return tag


def _checked_timeout(timeout_s: float) -> float:
    if not 0 < timeout_s <= _MAX_TIMEOUT_S:
        raise InvalidArgumentError(
            f"timeout {timeout_s!r} s is not in (0, {_MAX_TIMEOUT_S:.0f}] seconds")
    return float(timeout_s)
