"""Native result codes become exceptions here, beside the binding that returns them.

``check_result(rc, handle)`` is what every caller of ``lib.pccl*`` uses: it reads the
native detail of the failure (the calling thread's ``pcclGetLastError``, else the
communicator's last error) and raises the ``PcclError`` subclass of the code
(``torch_pccl.errors``, which owns the classes and needs no extension).
"""

from __future__ import annotations

from ..errors import SUCCESS, PcclError, result_error
from .native import ffi, lib


def native_detail(handle=None) -> str:
    """The detail of the last failure: the calling thread's ``pcclGetLastError()``, or, when
    that is empty and ``handle`` (a ``pcclComm_t``) is given, the communicator's own last
    error (which names the original failure when a sticky error is returned again)."""
    detail = ffi.string(lib.pcclGetLastError()).decode("utf-8", "replace")
    if not detail and handle is not None and handle != ffi.NULL:
        detail = ffi.string(lib.pcclCommGetLastError(handle)).decode("utf-8", "replace")
    return detail


def native_error(rc: int, detail: str = "") -> PcclError:
    """The exception for a non-zero ``rc``, its message ``pcclGetErrorString(rc) + ": " +
    detail`` (``errors.result_error`` with the native layer's text)."""
    name = ffi.string(lib.pcclGetErrorString(rc)).decode("utf-8", "replace")
    return result_error(rc, detail, name)


def check_result(rc: int, handle=None) -> None:
    """Raises the PcclError subclass for ``rc``; returns None for pcclSuccess.

    Call it on the thread of the failing call, right after it: the thread's detail is
    gone after the next pccl call.

    Args:
        rc: the ``pcclResult_t`` a native call returned.
        handle: the ``pcclComm_t`` the call ran on, or None.

    Raises:
        PcclError subclass (``torch_pccl.errors.error_class(rc)``) unless ``rc`` is 0,
        its message ``pcclGetErrorString(rc) + ": " + detail``.
    """
    if rc != SUCCESS:
        raise native_error(rc, native_detail(handle))


__all__ = ["check_result", "native_detail", "native_error"]
