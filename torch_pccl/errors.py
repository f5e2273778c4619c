"""Python exceptions for pcclResult_t codes.

``result_error(rc, detail)`` builds the exception of a native result code; the
native binding's ``torch_pccl.core.results.check_result(rc, handle)`` reads the detail
and raises it, the one place a native call's code becomes an exception. Each
code has its own class; where a standard Python exception already means the
same thing the class inherits it too, so ``except TimeoutError`` or
``except ValueError`` catch PCCL failures without importing torch_pccl.

Network errors (``PcclSystemError``, ``PeerLostError``, ``PcclTimeoutError``,
``AbortedError``, ``ProtocolError``, ``MismatchError``, ``RemoteError``,
``AuthenticationError``, ``IntegrityError``) are
sticky in the native layer: the communicator fails every later call with the
same error until the process group is rebuilt. The caller's mistakes
(``InvalidArgumentError``, ``InvalidUsageError``) and ``OutOfMemoryError`` are
not: the communicator stays usable.
See docs/errors.md.

This module imports nothing from the package (the native binding imports it, not the
other way round), so the exception classes are usable (and ``import torch_pccl``
works) before the extension is built.
"""

from __future__ import annotations

# pcclResult_t values, copied from native/include/pccl.h. The cffi ``lib``
# exposes the same names; the test suite checks that the two agree.
SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_USAGE = 2
SYSTEM_ERROR = 3
PEER_LOST = 4
TIMEOUT = 5
ABORTED = 6
PROTOCOL_ERROR = 7
MISMATCH = 8
OUT_OF_MEMORY = 9
REMOTE_ERROR = 10
AUTH_ERROR = 11
INTEGRITY_ERROR = 12


class PcclError(RuntimeError):
    """A PCCL call failed.

    Attributes:
        code (int): the ``pcclResult_t`` value (see docs/errors.md).
        detail (str): the native detail for the failure (which peer, which
            syscall, errno), or ``""`` when the error was raised by the Python
            checks before any native call.
        unreached_ranks (tuple[int, ...]): after a group failed to connect an epoch
            (``ProcessGroupPCCL.configure``), the ranks some link to or from which did
            not come up, ascending; ``()`` otherwise.
    """

    code = -1
    unreached_ranks: tuple[int, ...] = ()

    def __init__(self, message: str, code: int | None = None, detail: str = ""):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.detail = detail

    def __reduce__(self):
        # Keep code and detail across pickling (multiprocessing, torch.futures).
        return (type(self), (str(self), self.code, self.detail))


class InvalidArgumentError(PcclError, ValueError):
    """pcclInvalidArgument: a bad tensor, count, dtype, op, rank or tag. The group stays usable."""

    code = INVALID_ARGUMENT


class InvalidUsageError(PcclError):
    """pcclInvalidUsage: a call out of order (e.g. on a closed communicator). The group stays usable."""

    code = INVALID_USAGE


class PcclSystemError(PcclError):
    """pcclSystemError: a syscall failed; the detail names it and errno. Sticky."""

    code = SYSTEM_ERROR


class PeerLostError(PcclError):
    """pcclPeerLost: a peer closed or reset its connection (it crashed or exited). Sticky."""

    code = PEER_LOST


class GroupReplacedError(PeerLostError):
    """The master refused this member for good: its group is no longer the run's group
    there. A restarted master took the run back from other members (the group moved on
    without this one), or this peer's group, formed from joiners only while the run's
    members were away, gave way to theirs (docs/membership.md, "When the master
    restarts"). Collectives of the old group may still run, but membership calls
    (``update_topology``, ``peers_pending``, ``sync_shared_state``, a DiLoCo outer step)
    raise it: re-join as a new peer (``destroy_process_group``, then
    ``init_process_group``) to receive the run's state, or stop. Sticky."""


class ReplicaLostError(PeerLostError):
    """The master dropped this process because another process of its sharded replica
    died, stalled past the heartbeat timeout or left (docs/sharded-replicas.md): a replica
    joins and leaves whole, so the other replicas go on without it. The message names the
    replica, the lost shard and why. Every process of the replica gets it from its next
    membership call or outer step; the replica may rejoin, as a new replica, by running the
    same script again. Sticky."""


class ReplicaLayoutError(InvalidUsageError):
    """The master refused this process at admission: its replica's layout (shard count,
    parameter shapes, dtypes or placements) differs from the group's. The message names
    both layouts."""


class UpdateInProgressError(PcclError):
    """The master refused a shared-state vote, or abandoned it, because members of the
    same epoch opened an update round (a member lost mid-step is being recovered from):
    the caller joins that round (``update_topology``) and votes again.
    ``sync_shared_state`` does so itself."""


class NonFiniteError(PcclError, ValueError):
    """A checked all-reduce (``torch_pccl.all_reduce_finite``, a DiLoCo exchange with
    ``reject_nonfinite``) has no finite result: every rank's contribution held an inf or
    NaN (this rank's too), or the accepted contributions' sum overflowed. The message
    names the ranks. Raised alike on every rank; the caller's tensor is left unchanged
    and the group stays usable. Not a network error: it is not retried."""


class PcclTimeoutError(PcclError, TimeoutError):
    """pcclTimeout: the op's deadline passed before the peers answered. Sticky."""

    code = TIMEOUT


class AbortedError(PcclError):
    """pcclAborted: the communicator was aborted (``abort()``/``shutdown()``). Sticky."""

    code = ABORTED


class ProtocolError(PcclError):
    """pcclProtocolError: a peer sent bad magic, version, or an out-of-bounds frame. Sticky.

    Also raised for a malformed control message to or from the master
    (``torch_pccl.control.protocol``), and for shared-state bytes that do not
    match their elected hash.
    """

    code = PROTOCOL_ERROR


class MismatchError(PcclError):
    """pcclMismatch: ranks called different collectives, counts, dtypes or ops. Sticky."""

    code = MISMATCH


class OutOfMemoryError(PcclError, MemoryError):
    """pcclOutOfMemory: allocating staging memory failed."""

    code = OUT_OF_MEMORY


class RemoteError(PcclError):
    """pcclRemoteError: another peer failed this collective and told us; the detail names it. Sticky."""

    code = REMOTE_ERROR


class AuthenticationError(PcclError, PermissionError):
    """pcclAuthError: a peer or the master did not prove that it knows the shared secret
    (``PCCL_SECRET`` / ``PCCL_SECRET_FILE``), or only one side of a connection has one.
    The message says which. Sticky on a communicator. See docs/security.md."""

    code = AUTH_ERROR


class IntegrityError(PcclError):
    """pcclIntegrityError: an encrypted record from a peer (or the master) failed its AEAD
    check: it was altered, replayed, reordered or dropped on the way, or a record came in
    the clear where an encrypted one was due. The message names the peer. Nothing of the
    record is used: an op that receives one fails on the receiving rank, never with a wrong
    result. Sticky on a communicator. See docs/security.md."""

    code = INTEGRITY_ERROR


_CLASSES: dict[int, type[PcclError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        InvalidUsageError,
        PcclSystemError,
        PeerLostError,
        PcclTimeoutError,
        AbortedError,
        ProtocolError,
        MismatchError,
        OutOfMemoryError,
        RemoteError,
        AuthenticationError,
        IntegrityError,
    )
}


def error_class(code: int) -> type[PcclError]:
    """Returns the PcclError subclass for a non-zero pcclResult_t (PcclError for unknown codes)."""
    return _CLASSES.get(code, PcclError)


def result_error(rc: int, detail: str = "", name: str | None = None) -> PcclError:
    """The exception for a non-zero ``rc``: ``name + ": " + detail``.

    Returned, not raised, for callers that report an error they did not just
    receive (``Communicator.errored()``). Needs no native extension.

    Args:
        rc: a ``pcclResult_t`` value.
        detail: the native detail (which peer, which syscall, errno), or ``""``.
        name: what the code means, ``pcclGetErrorString(rc)``; the native binding passes
            it (``core.results.native_error``). Default: the class's name, since the texts
            are the native layer's and this module does not load it.
    """
    name = name or error_class(rc).__name__
    message = f"{name}: {detail}" if detail else name
    return error_class(rc)(message, rc, detail)


def check_result(rc: int, *, detail: str = "") -> None:
    """Raises ``result_error(rc, detail)`` unless ``rc`` is 0 (pcclSuccess).

    The form that needs no native extension, with the detail given. After a native
    call use ``torch_pccl.core.results.check_result(rc, handle)``, which reads the
    detail from the native layer (the calling thread's, else the communicator's).

    Raises:
        PcclError subclass (see ``error_class``) unless ``rc`` is 0.
    """
    if rc != SUCCESS:
        raise result_error(rc, detail)
