"""The compiled extension (``torch_pccl._pccl_native``) and the limits it declares.

The only module that imports the extension: everything else takes ``ffi``,
``lib`` and the constants of ``native/include/pccl.h`` from here, so a missing
build fails in one place. Importing this module loads the extension; the
package imports it lazily (see ``torch_pccl.__init__``).
"""

from __future__ import annotations

import torch

from .._pccl_native import ffi, lib

MAX_LANES: int = lib.PCCL_MAX_LANES
"""The most TCP connections per peer a communicator opens (``PCCL_MAX_LANES``)."""
MAX_STREAMS: int = lib.PCCL_MAX_STREAMS
"""The most TCP streams per peer and lane an operation is striped over (``PCCL_MAX_STREAMS``)."""
MAX_QUANT_BLOCK: int = lib.PCCL_MAX_QUANT_BLOCK
"""The largest block of the quantized all-reduce, elements (a 16-bit header field)."""
MAX_TIMEOUT_S: float = lib.PCCL_MAX_TIMEOUT_MS / 1000.0
"""The longest deadline a native call takes, seconds (pccl.h takes a C int of ms)."""


def pointer(tensor: torch.Tensor):
    """``void *`` to the first element of a contiguous CPU tensor (no copy)."""
    return ffi.cast("void *", tensor.data_ptr())


def byte_view(flat_u8: torch.Tensor):
    """A buffer over the bytes of a flat, contiguous uint8 CPU tensor (no copy)."""
    if flat_u8.numel() == 0:
        return b""
    return ffi.buffer(ffi.cast("char *", flat_u8.data_ptr()), flat_u8.numel())


__all__ = ["MAX_LANES", "MAX_QUANT_BLOCK", "MAX_STREAMS", "MAX_TIMEOUT_S", "byte_view", "ffi", "lib", "pointer"]
