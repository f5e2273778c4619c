"""``torch_pccl.all_reduce_quantized``: ``dist.all_reduce`` with int8/int4 traffic on a pccl group.

A drop-in for the all-reduce of pseudo-gradients or gradients where 4x (int8)
or ~7.5x (int4) fewer bytes on the wire are worth a bounded, deterministic
error: every rank ends with bit-identical values. The algorithm (each value
quantized exactly twice, once as a contribution and once as a result, never
at a hop) and its error bound are in ``Communicator.all_reduce_quantized`` and
docs/quantization.md.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .. import config
from ..c10d.process_group import pccl_group
from ..c10d.work import PcclWork
from ..core.tensors import check_tensor
from ..errors import InvalidArgumentError


def all_reduce_quantized(tensor: torch.Tensor, bits: int = 8, op=dist.ReduceOp.AVG,
                         group=None, async_op: bool = False, block: int = config.QUANT_BLOCK,
                         timeout: timedelta | None = None) -> PcclWork | None:
    """In-place all-reduce of ``tensor`` whose traffic is quantized to ``bits`` per value.

    Like ``dist.all_reduce(tensor, op, group, async_op)`` on a pccl group, but
    each rank sends about ``2 (W-1)/W * N * (bits/8 + 4/block)`` bytes instead
    of ``2 (W-1)/W * N * 4``. The result is bit-identical on every rank; per
    element it differs from the exact reduction by at most the sum over the
    other ranks of half their input block's scale (block absmax / 127 for
    int8, / 7 for int4; divided by the world size for AVG) plus half the
    result block's scale. At world size 1 the tensor is quantized once.
    Blocks holding an inf or NaN come out NaN. On failure the tensor is left
    unchanged (so the call can be retried on a smaller world).

    Args:
        tensor: contiguous tensor of float32 (float16 and bfloat16 are
            accepted too; they accumulate in float32 and round once), any
            shape; on the CPU, or on a GPU (staged through host memory).
        bits: 8 or 4.
        op: ``dist.ReduceOp`` AVG (default) or SUM.
        group: a pccl process group (default: the default group).
        async_op: True returns the Work at once (queued behind the group's
            earlier ops, as ``dist.all_reduce`` is); False waits.
        block: elements per float32 scale, 1 .. 65535; smaller blocks cost
            more scale bytes (4/block per element) and give a tighter error.
        timeout: this op's deadline (default: the group's timeout).

    Returns:
        The ``PcclWork`` when ``async_op``, else None.

    Raises:
        InvalidUsageError: ``group`` (or the default group) is not a pccl group.
        TypeError, InvalidArgumentError: a bad tensor (dtype, device, layout,
            contiguity), ``bits``, ``block`` or ``op``.
        MismatchError: a peer passed another ``bits``, ``block``, size or op.
        PeerLostError, RemoteError, PcclTimeoutError, ... (from ``wait()``
            when ``async_op``).
    """
    pg = pccl_group(group)
    # As the process group's all_reduce: CUDA tensors are staged through host memory.
    check_tensor(tensor, "tensor", cpu_only=False)
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InvalidArgumentError(
            f"all_reduce_quantized takes float32 (or float16/bfloat16), got {tensor.dtype}")
    work = pg.allreduce_quantized(tensor, bits=bits, block=block, op=op, async_op=async_op,
                                  timeout=timeout)
    if async_op:
        return work
    work.wait()
    return None


__all__ = ["all_reduce_quantized"]
