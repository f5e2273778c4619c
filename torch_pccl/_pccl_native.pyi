"""Type stub for the cffi extension built from native/include/pccl.h (API mode).

``lib`` holds the functions, enum constants and ``#define`` constants declared
in pccl.h between the cffi-cdef markers; ``ffi`` is the cffi FFI instance
(``new``, ``cast``, ``string``, ``gc``, ``release``, ``NULL``). Pointers are
cffi ``CData``, e.g. ``ffi.new("pcclComm_t*")``, ``ffi.new("pcclListener_t*")``,
``ffi.new("pcclP2POp_t[]", n)``; a ``const char *`` argument also takes
``bytes``. tests/native/test_native_stub.py checks this stub against the header.
"""

from typing import Any

ffi: Any

class _Lib:
    PCCL_VERSION_MAJOR: int
    PCCL_VERSION_MINOR: int
    PCCL_MAX_TIMEOUT_MS: int
    PCCL_MAX_LANES: int
    PCCL_MAX_STREAMS: int
    PCCL_MAX_QUANT_BLOCK: int
    # pcclResult_t
    pcclSuccess: int
    pcclInvalidArgument: int
    pcclInvalidUsage: int
    pcclSystemError: int
    pcclPeerLost: int
    pcclTimeout: int
    pcclAborted: int
    pcclProtocolError: int
    pcclMismatch: int
    pcclOutOfMemory: int
    pcclRemoteError: int
    pcclNumResults: int
    # pcclDataType_t
    pcclFloat32: int
    pcclFloat64: int
    pcclFloat16: int
    pcclBFloat16: int
    pcclInt8: int
    pcclUInt8: int
    pcclInt32: int
    pcclInt64: int
    pcclNumTypes: int
    # pcclRedOp_t
    pcclSum: int
    pcclAvg: int
    pcclMin: int
    pcclMax: int
    pcclProd: int
    pcclNumOps: int
    # pcclQuantType_t
    pcclQuantInt8: int
    pcclQuantInt4: int
    pcclNumQuantTypes: int

    def pcclGetErrorString(self, result: int) -> Any: ...
    def pcclGetLastError(self) -> Any: ...
    def pcclTypeSize(self, dtype: int) -> int: ...
    def pcclCommCreate(self, comm: Any, rank: int, world_size: int, comm_id: int,
                       listen_host: Any) -> int: ...
    def pcclListenerCreate(self, listener: Any, host: Any, port: int) -> int: ...
    def pcclListenerGetPort(self, listener: Any, port: Any) -> int: ...
    def pcclListenerDestroy(self, listener: Any) -> int: ...
    def pcclCommCreateOnListener(self, comm: Any, rank: int, world_size: int, comm_id: int,
                                 listener: Any) -> int: ...
    def pcclCommGetPort(self, comm: Any, port: Any) -> int: ...
    def pcclCommConnect(self, comm: Any, addrs: Any, timeout_ms: int) -> int: ...
    def pcclCommConnectLanes(self, comm: Any, addrs: Any, nlanes: int, lanes_out: Any,
                             timeout_ms: int) -> int: ...
    def pcclCommAbort(self, comm: Any) -> int: ...
    def pcclCommDestroy(self, comm: Any) -> int: ...
    def pcclCommGetInfo(self, comm: Any, rank: Any, world_size: Any) -> int: ...
    def pcclCommGetError(self, comm: Any) -> int: ...
    def pcclCommGetLastError(self, comm: Any) -> Any: ...
    def pcclCommSetOption(self, comm: Any, name: bytes, value: int) -> int: ...
    def pcclCommGetStats(self, comm: Any, bytes_sent: Any, bytes_received: Any) -> int: ...
    def pcclAllReduce(self, comm: Any, sendbuf: Any, recvbuf: Any, count: int, dtype: int,
                      op: int, tag: int, timeout_ms: int) -> int: ...
    def pcclAllReduceQuantized(self, comm: Any, sendbuf: Any, recvbuf: Any, count: int,
                               dtype: int, op: int, qtype: int, block: int, tag: int,
                               timeout_ms: int) -> int: ...
    def pcclBroadcast(self, comm: Any, buf: Any, count: int, dtype: int, root: int, tag: int,
                      timeout_ms: int) -> int: ...
    def pcclAllGather(self, comm: Any, sendbuf: Any, recvbuf: Any, count: int, dtype: int,
                      tag: int, timeout_ms: int) -> int: ...
    def pcclReduceScatter(self, comm: Any, sendbuf: Any, recvbuf: Any, count: int, dtype: int,
                          op: int, tag: int, timeout_ms: int) -> int: ...
    def pcclAllToAllv(self, comm: Any, sendbuf: Any, scounts: Any, sdispls: Any, recvbuf: Any,
                      rcounts: Any, rdispls: Any, dtype: int, tag: int,
                      timeout_ms: int) -> int: ...
    def pcclSend(self, comm: Any, buf: Any, count: int, dtype: int, peer: int, tag: int,
                 timeout_ms: int) -> int: ...
    def pcclRecv(self, comm: Any, buf: Any, count: int, dtype: int, peer: int, tag: int,
                 timeout_ms: int) -> int: ...
    def pcclP2PBatch(self, comm: Any, ops: Any, nops: int, timeout_ms: int) -> int: ...
    def pcclTransferBatch(self, comm: Any, ops: Any, nops: int, timeout_ms: int) -> int: ...
    def pcclBarrier(self, comm: Any, tag: int, timeout_ms: int) -> int: ...

lib: _Lib
