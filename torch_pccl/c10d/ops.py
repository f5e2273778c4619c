"""What each c10d op does on the one lane Communicator it is given.

``ProcessGroupPCCL`` checks a call's arguments, then queues one of these bodies on
a lane (``c10d.scheduler``), which passes that lane's ``Communicator`` as ``comm``.
Tensors on another device than the CPU are staged through host memory
(``c10d.staging``). Arguments are checked already (``c10d.checks``), so each body calls
the Communicator's ``*_unchecked`` entries with the native codes those checks found:
``dtype`` a pcclDataType_t, ``red`` a pcclRedOp_t. Every deadline ``timeout_s`` is in
seconds; network errors are the Communicator's ``PcclError`` subclasses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.communicator import Communicator
from .checks import offsets
from .sparse import all_reduce_sparse
from .staging import copy_back, host


def all_reduce(comm: Communicator, tensor: torch.Tensor, dtype: int, red: int,
               timeout_s: float) -> None:
    """In-place all-reduce of ``tensor`` with the reduce op ``red``."""
    staged = host(tensor)
    comm.all_reduce_unchecked(staged, staged, dtype, red, timeout_s=timeout_s)
    copy_back(tensor, staged)


def all_reduce_sparse_into(comm: Communicator, tensor: torch.Tensor, timeout_s: float) -> None:
    """Sum of the sparse COO ``tensor`` over ranks, copied in only once every gather succeeded."""
    result = all_reduce_sparse(comm, tensor, timeout_s)
    tensor.copy_(result.to(tensor.device))


def all_reduce_quantized(comm: Communicator, tensor: torch.Tensor, dtype: int, qtype: int,
                         red: int, block: int, timeout_s: float) -> None:
    """In-place ``Communicator.all_reduce_quantized`` of ``tensor``; ``qtype`` and ``red`` from
    ``core.tensors.quantized_args``."""
    staged = host(tensor)
    comm.all_reduce_quantized_unchecked(staged, staged, dtype, qtype, red, block,
                                        timeout_s=timeout_s)
    copy_back(tensor, staged)


def all_reduce_coalesced(comm: Communicator, groups: Sequence[tuple[int, Sequence[torch.Tensor]]],
                         red: int, timeout_s: float) -> None:
    """All-reduces every tensor in place, one native call per ``(dtype, tensors)`` group
    (tensors of one dtype, flattened into one buffer)."""
    for dtype, group in groups:
        flat = torch.cat([host(t).reshape(-1) for t in group])
        comm.all_reduce_unchecked(flat, flat, dtype, red, timeout_s=timeout_s)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()


def reduce(comm: Communicator, tensor: torch.Tensor, dtype: int, red: int, root: int,
           timeout_s: float) -> None:
    """An all-reduce into a temporary that only ``root`` copies into ``tensor``."""
    staged = host(tensor)
    result = torch.empty_like(staged)
    comm.all_reduce_unchecked(staged, result, dtype, red, timeout_s=timeout_s)
    if comm.rank == root:
        tensor.copy_(result)


def broadcast(comm: Communicator, tensor: torch.Tensor, dtype: int, root: int,
              timeout_s: float) -> None:
    """``tensor`` of ``root`` into ``tensor`` of every rank."""
    staged = host(tensor)
    comm.broadcast_unchecked(staged, dtype, root, timeout_s=timeout_s)
    copy_back(tensor, staged)


def gather_into_list(comm: Communicator, inp: torch.Tensor, outputs: Sequence[torch.Tensor],
                     dtype: int, timeout_s: float) -> None:
    """``outputs[r] = inp`` of rank r (one output per rank, ``inp``'s dtype and size)."""
    gathered = torch.empty(comm.world_size * inp.numel(), dtype=inp.dtype)
    comm.all_gather_unchecked(host(inp), gathered, dtype, timeout_s=timeout_s)
    for out, part in zip(outputs, gathered.split(inp.numel())):
        out.copy_(part.view(out.shape))


def gather_lists(comm: Communicator, inputs: Sequence[torch.Tensor],
                 per_input: Sequence[tuple[Sequence[torch.Tensor], int]],
                 timeout_s: float) -> None:
    """``gather_into_list`` for each input and its ``(outputs, dtype)`` (one output per rank)."""
    for inp, (outputs, dtype) in zip(inputs, per_input):
        gather_into_list(comm, inp, outputs, dtype, timeout_s)


def all_gather(comm: Communicator, output: torch.Tensor, inp: torch.Tensor, dtype: int,
               timeout_s: float) -> None:
    """``output`` (world_size * N elements) = ``inp`` (N) of every rank in rank order."""
    staged = host(output)
    comm.all_gather_unchecked(host(inp), staged, dtype, timeout_s=timeout_s)
    copy_back(output, staged)


def all_gather_pairs(comm: Communicator,
                     pairs: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
                     timeout_s: float) -> None:
    """``all_gather`` on each ``(output, input, dtype)``, in order."""
    for out, inp, dtype in pairs:
        all_gather(comm, out, inp, dtype, timeout_s)


def reduce_scatter(comm: Communicator, output: torch.Tensor, inp: torch.Tensor, dtype: int,
                   red: int, timeout_s: float) -> None:
    """``output`` (N) = ``red`` over ranks of ``inp[rank*N:(rank+1)*N]``."""
    staged = host(output)
    comm.reduce_scatter_unchecked(host(inp), staged, dtype, red, timeout_s=timeout_s)
    copy_back(output, staged)


def reduce_scatter_pairs(comm: Communicator,
                         pairs: Sequence[tuple[torch.Tensor, torch.Tensor, int]], red: int,
                         timeout_s: float) -> None:
    """``reduce_scatter`` on each ``(output, input, dtype)``, in order."""
    for out, inp, dtype in pairs:
        reduce_scatter(comm, out, inp, dtype, red, timeout_s)


def reduce_scatter_list(comm: Communicator, output: torch.Tensor,
                        inputs: Sequence[torch.Tensor], dtype: int, red: int,
                        timeout_s: float) -> None:
    """``output = red`` over ranks of ``inputs[rank]`` (one input per rank)."""
    reduce_scatter(comm, output, torch.cat([host(t).reshape(-1) for t in inputs]), dtype, red,
                   timeout_s)


def gather(comm: Communicator, inp: torch.Tensor, outputs: Sequence[torch.Tensor], dtype: int,
           root: int, timeout_s: float) -> None:
    """Root's ``outputs[r] = inp`` of rank r: an all-to-all-v in which only the root receives."""
    n, count = comm.world_size, inp.numel()
    staged = host(inp)
    send_counts = [count if r == root else 0 for r in range(n)]
    if comm.rank == root:
        gathered = torch.empty(n * count, dtype=inp.dtype)
        comm.all_to_all_v_unchecked(staged, send_counts, [0] * n, gathered, [count] * n,
                                    [r * count for r in range(n)], dtype, timeout_s=timeout_s)
        for r, out in enumerate(outputs):
            out.copy_(gathered[r * count:(r + 1) * count].view(out.shape))
    else:
        # Receives nothing: the input doubles as the (unwritten) receive buffer.
        comm.all_to_all_v_unchecked(staged, send_counts, [0] * n, staged, [0] * n, [0] * n,
                                    dtype, timeout_s=timeout_s)


def scatter(comm: Communicator, out: torch.Tensor, inputs: Sequence[torch.Tensor], dtype: int,
            root: int, timeout_s: float) -> None:
    """``out = inputs[rank]`` of the root: an all-to-all-v in which only the root sends."""
    n, count = comm.world_size, out.numel()
    staged = host(out)
    recv_counts = [count if r == root else 0 for r in range(n)]
    if comm.rank == root:
        flat = torch.cat([host(t).reshape(-1) for t in inputs])
        comm.all_to_all_v_unchecked(flat, [count] * n, [r * count for r in range(n)], staged,
                                    recv_counts, [0] * n, dtype, timeout_s=timeout_s)
    else:
        # Sends nothing: the output doubles as the (unread) send buffer.
        comm.all_to_all_v_unchecked(staged, [0] * n, [0] * n, staged, recv_counts, [0] * n,
                                    dtype, timeout_s=timeout_s)
    copy_back(out, staged)


def all_to_all(comm: Communicator, output: torch.Tensor, inp: torch.Tensor, dtype: int,
               send: tuple[list[int], list[int]], recv: tuple[list[int], list[int]],
               timeout_s: float) -> None:
    """``Communicator.all_to_all_v`` with ``send``/``recv`` = (counts, displacements)."""
    staged = host(output)
    comm.all_to_all_v_unchecked(host(inp), *send, staged, *recv, dtype, timeout_s=timeout_s)
    copy_back(output, staged)


def all_to_all_list(comm: Communicator, outputs: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], dtype: int, timeout_s: float) -> None:
    """``outputs[p]`` = rank p's ``inputs[me]``."""
    send_counts = [t.numel() for t in inputs]
    recv_counts = [t.numel() for t in outputs]
    flat_in = torch.cat([host(t).reshape(-1) for t in inputs])
    flat_out = torch.empty(sum(recv_counts), dtype=flat_in.dtype)
    comm.all_to_all_v_unchecked(flat_in, send_counts, offsets(send_counts), flat_out,
                                recv_counts, offsets(recv_counts), dtype, timeout_s=timeout_s)
    for out, part in zip(outputs, flat_out.split(recv_counts)):
        out.copy_(part.view(out.shape))


def barrier(comm: Communicator, earlier: Sequence, timeout_s: float) -> None:
    """Waits for the ``earlier`` Works (the other lanes' markers), then the native barrier."""
    for marker in earlier:
        marker.wait()
    comm.barrier(timeout_s=timeout_s)
