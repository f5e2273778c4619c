"""``torch_pccl.all_reduce_finite``: an all-reduce that leaves out non-finite contributions
and names the ranks that sent them.

One inf or NaN in one rank's contribution makes the sum of every rank non-finite, and
with it whatever every peer updates from it (a DiLoCo outer step turns every replica's
outer parameters into NaN for good, and nothing raises). Here the common case costs
one copy of the tensor and one ``isfinite`` pass, nothing on the wire: the all-reduce
runs as usual (plain or quantized) and its result, bit-identical on every rank, is
checked on every rank, so every rank takes the same branch. Only a non-finite result
takes the slow path (``exclude_nonfinite``):

1. each rank says whether its own contribution is finite (an all-gather of one
   float32 per rank);
2. the contributions themselves are all-gathered at full precision, in chunks of at
   most ``GATHER_CHUNK_BYTES`` for all ranks together; a rank is rejected if it said
   so or if a value it sent is not finite (a peer that said "finite" and was not is
   caught here, and the pass starts over without it);
3. the result is the sum of the accepted contributions, added element-wise in rank
   order (accumulated in float32 for 16-bit inputs), divided by their count for AVG:
   the same operations on the same bytes, so bit-identical on every rank.

The rejected ranks are logged (logger ``torch_pccl``, a warning) with their master
peer id and data address when the group was formed through a master, and returned.

Not protected: finite garbage (a peer sending huge or wrong finite values is
averaged in), and a malicious peer *relaying* other ranks' chunks in the ring, which
can alter what it forwards (rejecting that needs signed contributions). See
docs/diloco.md, "Non-finite contributions".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import config
from ..c10d.process_group import ProcessGroupPCCL, pccl_group
from ..elastic.groups import membership_of
from ..core.tensors import check_tensor
from ..errors import InvalidArgumentError, NonFiniteError

__all__ = ["GATHER_CHUNK_BYTES", "FiniteResult", "all_reduce_finite", "exclude_nonfinite",
           "group_members", "is_finite"]

log = logging.getLogger("torch_pccl")

GATHER_CHUNK_BYTES = 64 << 20
"""Slow path: bytes of gathered contributions held at once, all ranks together (at
least one element per rank)."""

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

AllGather = Callable[[torch.Tensor, torch.Tensor], None]
"""``all_gather(out, inp)``: a blocking all-gather of every rank's ``inp`` (n elements)
into ``out`` (world_size x n, in rank order), bit-identical on every rank."""

Members = Sequence[tuple[str, str]]
"""(master peer id, data-plane "host:port") of each rank, in rank order."""


@dataclass(frozen=True)
class FiniteResult:
    """What ``all_reduce_finite`` left out of the result.

    Attributes:
        rejected: ranks (of the group at the call) whose contribution held an inf or
            NaN, ascending; () when none was (the common case).
        peer_ids: their master peer ids, in the same order, for a group formed
            through a master; () otherwise.
        addrs: their data-plane addresses ("host:port"), likewise.
        world_size: ranks in the group at the call.
    """

    rejected: tuple[int, ...]
    peer_ids: tuple[str, ...]
    addrs: tuple[str, ...]
    world_size: int

    @property
    def accepted(self) -> int:
        """How many contributions the result holds."""
        return self.world_size - len(self.rejected)


def all_reduce_finite(tensor: torch.Tensor, op=dist.ReduceOp.AVG, group=None, bits: int = 0,
                      block: int = config.QUANT_BLOCK,
                      timeout: timedelta | None = None) -> FiniteResult:
    """In-place all-reduce of ``tensor`` that leaves out the ranks whose contribution holds
    an inf or NaN, and names them.

    Like ``dist.all_reduce(tensor, op, group)`` (``bits`` 0) or
    ``torch_pccl.all_reduce_quantized(tensor, bits, op, group, block=block)`` (8 or 4),
    and exactly that when every contribution is finite (the common case, which costs
    one copy of ``tensor`` and one ``isfinite`` pass more, nothing on the wire). When
    the result is not finite, every rank all-gathers every contribution (full
    precision, in chunks of ``GATHER_CHUNK_BYTES``), rejects each rank that sent a
    non-finite value, logs a warning naming it, and computes the result from the other
    contributions: added in rank order (in float32 for 16-bit tensors), divided by their
    count for AVG, never quantized; bit-identical on every rank. Every rank of the group
    must call it (a collective), with the same arguments. Synchronous only: the slow
    path issues further collectives after the all-reduce.

    Args:
        tensor: contiguous float32, float64, float16 or bfloat16 tensor (float64 not
            with ``bits``), any shape; on the CPU, or a GPU (staged through host memory).
        op: ``dist.ReduceOp`` AVG (default; divides by the number of accepted
            contributions) or SUM.
        group: a pccl process group (default: the default group).
        bits: 0 (plain), 8 or 4 (``all_reduce_quantized``'s traffic and error bound).
        block: with ``bits``: elements per float32 scale, 1 .. 65535.
        timeout: the deadline of each collective of the call (default: the group's).

    Returns:
        A ``FiniteResult``: the rejected ranks, ascending, with their master peer ids
        and data addresses for a group formed through a master (the same on every rank).

    Raises:
        InvalidUsageError: ``group`` (or the default group) is not a pccl group.
        TypeError, InvalidArgumentError: a bad tensor, ``op`` (not SUM or AVG), ``bits``
            or ``block``.
        NonFiniteError: every contribution held an inf or NaN, or the accepted ones'
            reduction overflowed (on every rank alike).
        MismatchError, PeerLostError, PcclTimeoutError, ... (network errors).
        On every error ``tensor`` is left unchanged, so the call can be retried.
    """
    pg = pccl_group(group)
    check_tensor(tensor, "tensor", cpu_only=False)
    if tensor.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"all_reduce_finite takes a floating-point tensor (float32, "
                                   f"float64, float16, bfloat16), got {tensor.dtype}")
    op = sum_or_avg(op)
    if isinstance(bits, bool) or bits not in (0, 8, 4):
        raise InvalidArgumentError(f"bits must be 0, 8 or 4, got {bits!r}")
    members = group_members(pg)
    world_size = pg.getSize()
    contribution = tensor.detach().clone()
    _all_reduce(pg, tensor, op, bits, block, timeout)
    rejected = exclude_nonfinite(tensor, contribution, op, world_size,
                                 lambda out, inp: _all_gather(pg, out, inp, timeout), members)
    return FiniteResult(rejected=rejected,
                        peer_ids=tuple(members[r][0] for r in rejected) if members else (),
                        addrs=tuple(members[r][1] for r in rejected) if members else (),
                        world_size=world_size)


def exclude_nonfinite(tensor: torch.Tensor, contribution: torch.Tensor, op, world_size: int,
                      all_gather: AllGather, members: Members | None = None) -> tuple[int, ...]:
    """Makes an all-reduce's result finite by leaving out the non-finite contributions.

    Call it on every rank right after a SUM or AVG all-reduce of ``contribution`` into
    ``tensor`` whose result is bit-identical on every rank, so that every rank takes the
    same branch: a finite ``tensor`` is left as it is; otherwise the slow path of the
    module docstring replaces it (one tiny and ``ceil(n * world_size * itemsize /
    GATHER_CHUNK_BYTES)`` chunked all-gathers, each ``all_gather`` call made on every
    rank alike) and logs the rejected ranks.

    Args:
        tensor: the all-reduce's result (float32, float64, float16 or bfloat16; any
            shape, contiguous), replaced in place on the slow path.
        contribution: this rank's input to that all-reduce: same dtype and number of
            elements, contiguous; not modified.
        op: ``dist.ReduceOp`` SUM or AVG (AVG divides by the accepted count).
        world_size: ranks in the all-reduce.
        all_gather: the group's blocking all-gather (``AllGather``), called on the slow
            path only.
        members: (peer id, address) of each rank, to name the rejected ranks (None:
            ranks only).

    Returns:
        The rejected ranks, ascending; () when none was (also when the result was
        finite and ``tensor`` was not touched).

    Raises:
        NonFiniteError: every contribution was rejected, or the accepted ones' reduction
            overflowed.
        Errors of ``all_gather`` (network errors).
        On every error ``tensor`` holds ``contribution`` again (as before the
        all-reduce), so the caller can redo the exchange.
    """
    if is_finite(tensor):
        return ()
    try:
        rejected, result = _without_nonfinite(contribution.detach().reshape(-1), op,
                                              world_size, all_gather, members)
    except BaseException:
        with torch.no_grad():
            tensor.copy_(contribution.reshape(tensor.shape))
        raise
    with torch.no_grad():
        tensor.copy_(result.view(tensor.shape))
    what = "averages" if op == dist.ReduceOp.AVG else "sums"
    if rejected:
        log.warning("all-reduce of %d values: rejected the non-finite contribution of %s; "
                    "the result %s the other %d of %d contributions", contribution.numel(),
                    ", ".join(describe(r, members) for r in rejected), what,
                    world_size - len(rejected), world_size)
    else:
        log.warning("all-reduce of %d values: the result was not finite although every "
                    "gathered contribution is (a peer sent other bytes to the all-reduce, or "
                    "its summation order overflowed); recomputed from the gathered ones",
                    contribution.numel())
    return rejected


def _without_nonfinite(flat: torch.Tensor, op, world_size: int, all_gather: AllGather,
                       members: Members | None) -> tuple[tuple[int, ...], torch.Tensor]:
    """The slow path: (rejected ranks, the reduction of the others' contributions, 1-D,
    ``flat``'s dtype)."""
    claim = torch.tensor([0.0 if is_finite(flat) else 1.0])
    claims = torch.empty(world_size)
    all_gather(claims, claim)
    rejected = set(claims.ne(0.0).nonzero().flatten().tolist())
    accumulate = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
    chunk = max(1, GATHER_CHUNK_BYTES // (world_size * flat.element_size()))
    acc = torch.empty(flat.numel(), dtype=accumulate, device=flat.device)
    while True:
        if len(rejected) == world_size:
            raise NonFiniteError(
                f"every contribution to this all-reduce holds an inf or NaN: "
                f"{', '.join(describe(r, members) for r in sorted(rejected))}")
        liars = _sum_accepted(flat, acc, rejected, world_size, chunk, all_gather)
        if not liars:
            break
        rejected |= liars          # they said "finite" and were not: start over without them
    if op == dist.ReduceOp.AVG:
        acc.div_(world_size - len(rejected))
    result = acc.to(flat.dtype)
    if not is_finite(result):
        raise NonFiniteError(
            f"the reduction of the {world_size - len(rejected)} finite contributions to this "
            f"all-reduce overflows {flat.dtype}"
            + (f" (rejected: {', '.join(describe(r, members) for r in sorted(rejected))})"
               if rejected else ""))
    return tuple(sorted(rejected)), result


def _sum_accepted(flat: torch.Tensor, acc: torch.Tensor, rejected: set[int], world_size: int,
                  chunk: int, all_gather: AllGather) -> set[int]:
    """``acc`` = the sum, in rank order, of the gathered ``flat`` of the ranks not in
    ``rejected``, chunk by chunk. Stops at the first chunk where one of them sent a
    non-finite value and returns those ranks (``acc`` is then incomplete); else ``set()``."""
    accepted = [r for r in range(world_size) if r not in rejected]
    for lo in range(0, flat.numel(), chunk):
        hi = min(flat.numel(), lo + chunk)
        parts = torch.empty((world_size, hi - lo), dtype=flat.dtype, device=flat.device)
        all_gather(parts, flat[lo:hi])
        finite = torch.isfinite(parts).all(dim=1).tolist()
        liars = {r for r in accepted if not finite[r]}
        if liars:
            return liars
        out = acc[lo:hi]
        out.copy_(parts[accepted[0]])
        for r in accepted[1:]:
            out.add_(parts[r])
    return set()


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (True for an empty tensor)."""
    return bool(torch.isfinite(tensor).all())


def sum_or_avg(op) -> dist.ReduceOp.RedOpType:
    """``op`` (a ``dist.ReduceOp`` or its ``RedOpType``) as ``RedOpType`` SUM or AVG.

    Raises:
        InvalidArgumentError: any other op.
    """
    kind = op if isinstance(op, dist.ReduceOp.RedOpType) else getattr(op, "op", None)
    if kind not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise InvalidArgumentError(f"all_reduce_finite takes op SUM or AVG, got {op}")
    return kind


def group_members(group=None) -> tuple[tuple[str, str], ...] | None:
    """(master peer id, data address) of each rank of a pccl group formed through a master,
    in rank order (its current epoch); None for a group without a master.

    Raises:
        InvalidUsageError: ``group`` (or the default group) is not a pccl group.
    """
    membership = membership_of(pccl_group(group))
    if membership is None:
        return None
    a = membership.assignment
    return tuple(zip(a.peer_ids, a.addrs))


def describe(rank: int, members: Members | None) -> str:
    """``"rank R"``, with ``" (peer ID at HOST:PORT)"`` when ``members`` names it."""
    if members is None:
        return f"rank {rank}"
    peer, addr = members[rank]
    return f"rank {rank} (peer {peer} at {addr})"


def _all_reduce(pg: ProcessGroupPCCL, tensor: torch.Tensor, op, bits: int, block: int,
                timeout: timedelta | None) -> None:
    if bits:
        pg.allreduce_quantized(tensor, bits=bits, block=block, op=op, async_op=False,
                               timeout=timeout).wait()
        return
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = False
    if timeout is not None:
        opts.timeout = timeout
    pg.allreduce([tensor], opts).wait()


def _all_gather(pg: ProcessGroupPCCL, out: torch.Tensor, inp: torch.Tensor,
                timeout: timedelta | None) -> None:
    opts = c10d.AllgatherOptions()
    opts.asyncOp = False
    if timeout is not None:
        opts.timeout = timeout
    pg.all_gather_single(out, inp, opts).wait()
