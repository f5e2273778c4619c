"""Checks of tensors and arguments before any native call, and their native codes.

bcrypt's rule: every argument is checked in Python before C sees it, so a
caller's mistake is a ``TypeError`` / ``InvalidArgumentError`` (a
``ValueError``) with a clear message and never reaches the native layer. The
communicator (CPU tensors) and the process group (which stages CUDA tensors
through host memory) share these checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError
from .native import MAX_QUANT_BLOCK, MAX_TIMEOUT_S, lib

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
# all_reduce_quantized: bits -> pcclQuantType_t.
_QUANT_TYPES = {8: lib.pcclQuantInt8, 4: lib.pcclQuantInt4}


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
    if type(block) is not int or not 1 <= block <= MAX_QUANT_BLOCK:
        raise InvalidArgumentError(f"block must be an int in 1 .. {MAX_QUANT_BLOCK}, got {block!r}")
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


def same_dtype(a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> None:
    """Raises InvalidArgumentError unless ``a`` and ``b`` have one dtype."""
    if a.dtype != b.dtype:
        raise InvalidArgumentError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}")


def same_shape_output(inp: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """``(out or inp, dtype code)`` for an all-reduce: checks both tensors and that they match."""
    out = inp if out is None else out
    dtype = check_tensor(inp, "input")
    check_tensor(out, "output")
    same_dtype(inp, out, "input", "output")
    if out.numel() != inp.numel():
        raise InvalidArgumentError(f"output has {out.numel()} elements, input has {inp.numel()}")
    return out, dtype


def checked_tag(tag: int) -> int:
    """``tag`` if it is a 32-bit unsigned int; else InvalidArgumentError."""
    if not isinstance(tag, int) or not 0 <= tag <= _UINT32_MAX:
        raise InvalidArgumentError(f"tag {tag!r} is not a 32-bit unsigned integer")
    return tag


def checked_timeout(timeout_s: float) -> float:
    """``timeout_s`` as float seconds if in (0, MAX_TIMEOUT_S]; else InvalidArgumentError."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise InvalidArgumentError(
            f"timeout {timeout_s!r} s is not in (0, {MAX_TIMEOUT_S:.0f}] seconds")
    return float(timeout_s)


def check_rank(rank: int, world_size: int, name: str = "rank") -> int:
    """Returns ``rank`` if it is an int in 0 .. world_size-1.

    Raises:
        InvalidArgumentError: otherwise, naming the argument ``name``.
    """
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"{name} {rank!r} is not a rank of a group of {world_size}")
    return rank


def check_peer(peer: int, rank: int, world_size: int) -> int:
    """Returns ``peer`` if it is a rank of the group other than ``rank`` (this one).

    Raises:
        InvalidArgumentError: out of range, or this rank (send/recv need another).
    """
    check_rank(peer, world_size, "peer")
    if peer == rank:
        raise InvalidArgumentError(f"peer {peer} is this rank; send/recv need another rank")
    return peer


def check_ranges(name: str, counts, displs, numel: int, world_size: int) -> None:
    """Checks the per-rank counts and displacements (elements) of an all-to-all-v side.

    Raises:
        InvalidArgumentError: not ``world_size`` entries each, or a negative value, or a
            range ``[displ, displ + count)`` outside a tensor of ``numel`` elements.
    """
    if len(counts) != world_size or len(displs) != world_size:
        raise InvalidArgumentError(
            f"{name} counts and displacements need {world_size} entries each, "
            f"got {len(counts)} and {len(displs)}")
    for peer, (count, displ) in enumerate(zip(counts, displs)):
        if count < 0 or displ < 0 or displ + count > numel:
            raise InvalidArgumentError(
                f"{name} range for rank {peer} (displacement {displ}, count {count}) "
                f"is outside a tensor of {numel} elements")
