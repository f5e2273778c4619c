"""All-reduce of sparse COO tensors, as gloo does it: gather, concatenate, coalesce.

Every rank gathers every rank's (coalesced) indices and values, concatenates
them in rank order and coalesces the result, which sums entries that share an
index (gloo's ``AsyncSparseAllreduceWork``; sum is the one op it supports,
and the only one here). Every rank coalesces the same bytes in the same order,
so the result is bit-identical everywhere.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.communicator import Communicator
from ..errors import InvalidArgumentError, MismatchError


def check_sparse(tensor: torch.Tensor, op) -> None:
    """Raises InvalidArgumentError unless ``tensor`` is a sparse COO tensor and ``op`` SUM.

    Args:
        tensor: the tensor given to ``all_reduce``.
        op: a ``dist.ReduceOp.RedOpType``.
    """
    if tensor.layout != torch.sparse_coo:
        raise InvalidArgumentError(f"layout {tensor.layout} is not supported (dense tensors or "
                                   f"sparse COO tensors only)")
    if op != dist.ReduceOp.SUM:
        raise InvalidArgumentError(f"sparse all-reduce supports only SUM (as gloo's), got {op}")


def all_reduce_sparse(comm: Communicator, tensor: torch.Tensor, timeout_s: float) -> torch.Tensor:
    """Returns the sum over ranks of the sparse COO ``tensor``, coalesced, on the CPU.

    Three all-gathers: each rank's nnz and shape (int64), then its indices
    (int64, ``sparse_dim x max nnz``) and values (``max nnz x dense shape``),
    padded to the largest nnz. ``tensor`` itself is not written.

    Args:
        comm: the communicator to run on.
        tensor: a sparse COO tensor of any shape and dtype; every rank passes the
            same shape, sparse dimension count and dtype.
        timeout_s: deadline for the whole operation, seconds.

    Raises:
        MismatchError: ranks passed different shapes or sparse dimension counts
            (also from the gather, for different dtypes).
        Network PcclErrors, as ``Communicator.all_gather``.
    """
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(deadline - time.monotonic(), 1e-3)

    local = tensor.detach().to("cpu").coalesce()
    n, sparse_dim, count = comm.world_size, local.sparse_dim(), local.indices().shape[1]
    shape = list(local.shape)
    meta = torch.tensor([count, sparse_dim, len(shape), *shape], dtype=torch.int64)
    metas = torch.empty(n * meta.numel(), dtype=torch.int64)
    # Ranks with different dimension counts gather different sizes: a MismatchError there.
    comm.all_gather(meta, metas, timeout_s=left())
    metas = metas.view(n, -1)
    for r in range(n):
        if not torch.equal(metas[r, 1:], meta[1:]):
            raise MismatchError(
                f"sparse all-reduce: rank {r} passed shape {metas[r, 3:].tolist()} with "
                f"{int(metas[r, 1])} sparse dims, this rank {shape} with {sparse_dim}")
    nnz = [int(k) for k in metas[:, 0]]
    width = max(nnz)
    indices = torch.zeros(sparse_dim, width, dtype=torch.int64)
    indices[:, :count] = local.indices()
    values = torch.zeros((width, *shape[sparse_dim:]), dtype=local.dtype)
    values[:count] = local.values()
    all_indices = torch.empty((n, *indices.shape), dtype=torch.int64)
    all_values = torch.empty((n, *values.shape), dtype=values.dtype)
    if width:
        comm.all_gather(indices.reshape(-1), all_indices.view(-1), timeout_s=left())
        comm.all_gather(values.reshape(-1), all_values.view(-1), timeout_s=left())
    joined_indices = torch.cat([all_indices[r, :, :nnz[r]] for r in range(n)], dim=1)
    joined_values = torch.cat([all_values[r, :nnz[r]] for r in range(n)])
    return torch.sparse_coo_tensor(joined_indices, joined_values, shape).coalesce()
