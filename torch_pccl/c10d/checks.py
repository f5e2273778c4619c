"""Argument checks of the c10d calls, run on the caller's thread before an op takes a lane.

An op refused on one rank must not shift the lanes of the next ones, so every mistake
(dtype, layout, sizes, list lengths, ranks, ops) raises here, at call time, as
``InvalidArgumentError`` (a ValueError) or ``TypeError``. Ranks are checked against the
group's current communicator, passed in by the caller. The checks hand back the native
codes they found (dtype, reduce op), which the op's body gives to the Communicator's
``*_unchecked`` entries (``core.collectives``): a c10d op is checked here, once, not again
in core.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch

from .. import config
from ..core.communicator import Communicator
from ..core.tensors import check_tensor as check_native_tensor
from ..core.tensors import op_code
from ..errors import InvalidArgumentError


def single(tensors: Sequence, name: str):
    """The one entry of ``tensors``: one process drives one device, so c10d's multi-device
    lists are not supported.

    Raises:
        InvalidArgumentError: ``tensors`` does not hold exactly one entry.
    """
    if len(tensors) != 1:
        raise InvalidArgumentError(
            f"{name} must hold exactly one entry (one device per process), got {len(tensors)}")
    return tensors[0]


def check_tensor(tensor: torch.Tensor, name: str) -> int:
    """``core.tensors.check_tensor`` on any device: CUDA tensors are staged through host
    memory (``c10d.staging``). Returns the tensor's pcclDataType_t.

    Raises:
        TypeError, InvalidArgumentError: as ``core.tensors.check_tensor``.
    """
    return check_native_tensor(tensor, name, cpu_only=False)


def reduce_code(opts) -> int:
    """The pcclRedOp_t of ``opts.reduceOp``, found now so that an unsupported op raises on
    the caller's thread.

    Raises:
        InvalidArgumentError: as ``core.tensors.op_code``.
    """
    return op_code(opts.reduceOp.op)


def op_timeout(opts, default_s: float) -> float:
    """The deadline of an op, seconds: ``opts.timeout`` when the caller set one, else
    ``default_s`` (the group's)."""
    timeout = getattr(opts, "timeout", None)
    # Unset options carry c10d's kUnsetTimeout (-1 ms).
    if isinstance(timeout, timedelta) and timeout > timedelta(0):
        return config.as_seconds(timeout)
    return default_s


def check_root(comm: Communicator, root: int) -> int:
    """Returns ``root`` if it is a rank of ``comm``'s group; else InvalidArgumentError."""
    if not 0 <= root < comm.world_size:
        raise InvalidArgumentError(f"root {root} is not a rank of a group of {comm.world_size}")
    return root


def check_peer(comm: Communicator, peer: int) -> None:
    """Raises InvalidArgumentError unless ``peer`` is a rank of ``comm``'s group other than
    this one."""
    check_root(comm, peer)
    if peer == comm.rank:
        raise InvalidArgumentError(f"peer {peer} is this rank")


def check_scaled(big: torch.Tensor, small: torch.Tensor, factor: int | None, big_name: str,
                 small_name: str) -> None:
    """Raises InvalidArgumentError unless both have one dtype and ``big`` holds ``factor`` times
    ``small``'s elements (``factor`` None: any count)."""
    if big.dtype != small.dtype:
        raise InvalidArgumentError(f"{big_name} is {big.dtype} but {small_name} is {small.dtype}")
    if factor is not None and big.numel() != factor * small.numel():
        raise InvalidArgumentError(
            f"{big_name} has {big.numel()} elements, need world_size * {small_name} = "
            f"{factor} * {small.numel()}")


def check_gather_list(comm: Communicator, tensors: Sequence[torch.Tensor], one: torch.Tensor,
                      name: str) -> int:
    """Raises unless ``tensors`` holds one valid tensor per rank of ``comm``'s group, each of
    ``one``'s dtype and element count (``one`` is checked too); returns their pcclDataType_t."""
    dtype = check_tensor(one, "tensor")
    n = comm.world_size
    if len(tensors) != n:
        raise InvalidArgumentError(f"{name} needs {n} tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        check_tensor(t, f"{name}[{i}]")
        if t.dtype != one.dtype or t.numel() != one.numel():
            raise InvalidArgumentError(
                f"{name}[{i}] is {t.dtype} with {t.numel()} elements, "
                f"expected {one.dtype} with {one.numel()}")
    return dtype


def per_input_lists(comm: Communicator, output_lists: Sequence[Sequence[torch.Tensor]],
                    input_list: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], int]]:
    """For ``all_gather_coalesced``: one output list per rank, each holding one tensor per
    input, regrouped as one list (a tensor per rank) per input, with that input's
    pcclDataType_t; raises on any mismatch."""
    n = comm.world_size
    if len(output_lists) != n:
        raise InvalidArgumentError(f"output_lists needs one list per rank ({n}), got {len(output_lists)}")
    for r, outputs in enumerate(output_lists):
        if len(outputs) != len(input_list):
            raise InvalidArgumentError(
                f"output_lists[{r}] holds {len(outputs)} tensors for {len(input_list)} inputs")
    per_input = [[output_lists[r][i] for r in range(n)] for i in range(len(input_list))]
    return [(outputs, check_gather_list(comm, outputs, inp, f"output_lists[*][{i}]"))
            for i, (outputs, inp) in enumerate(zip(per_input, input_list))]


def root_list(comm: Communicator, root: int, lists: Sequence[Sequence[torch.Tensor]],
              one: torch.Tensor, name: str) -> Sequence[torch.Tensor]:
    """The root's list of a gather or scatter (``lists[0]``, one tensor per rank like
    ``one``); ``[]`` on another rank, where every list must be empty.

    Raises:
        InvalidArgumentError: a bad list on the root, a non-empty one elsewhere.
    """
    if comm.rank == root:
        tensors = single(lists, name)
        check_gather_list(comm, tensors, one, f"{name}[0]")
        return tensors
    if any(len(lst) for lst in lists):
        raise InvalidArgumentError(f"{name} must be empty on a non-root rank")
    return []


def check_all_to_all_lists(comm: Communicator, outputs: Sequence[torch.Tensor],
                           inputs: Sequence[torch.Tensor]) -> int:
    """Raises unless both lists hold one valid tensor per rank, all of ``inputs[0]``'s dtype;
    returns that dtype's pcclDataType_t."""
    n = comm.world_size
    for name, lst in (("output_tensors", outputs), ("input_tensors", inputs)):
        if len(lst) != n:
            raise InvalidArgumentError(f"{name} needs {n} tensors, got {len(lst)}")
        for i, t in enumerate(lst):
            dtype = check_tensor(t, f"{name}[{i}]")
            if t.dtype != inputs[0].dtype:
                raise InvalidArgumentError(f"{name}[{i}] is {t.dtype}, "
                                           f"input_tensors[0] is {inputs[0].dtype}")
    return dtype    # every tensor's: one dtype, and a group holds at least one rank


def check_pairs(outputs: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(output, input, input's pcclDataType_t)`` of two lists of one length of valid
    tensors; else raises. (Whether each output matches its input: ``check_scaled``.)"""
    if len(outputs) != len(inputs):
        raise InvalidArgumentError(f"{len(outputs)} outputs for {len(inputs)} inputs")
    triples = []
    for i, (out, inp) in enumerate(zip(outputs, inputs)):
        check_tensor(out, f"outputs[{i}]")
        triples.append((out, inp, check_tensor(inp, f"inputs[{i}]")))
    return triples


def offsets(counts: Sequence[int]) -> list[int]:
    """The displacement of each part when parts of ``counts`` lie back to back."""
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def row_splits(tensor: torch.Tensor, split_sizes: Sequence[int], n: int,
               name: str) -> tuple[list[int], list[int]]:
    """Turns row split sizes along dim 0 (empty: ``n`` equal splits) into element counts
    and displacements.

    Raises:
        InvalidArgumentError: not ``n`` non-negative sizes summing to the rows, or rows
            not divisible by ``n`` for equal splits.
    """
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    row_elems = tensor.numel() // rows if rows else 0
    if not split_sizes:
        if rows % n:
            raise InvalidArgumentError(
                f"{name} has {rows} rows, not divisible by world size {n}")
        split_sizes = [rows // n] * n
    if len(split_sizes) != n or sum(split_sizes) != rows or min(split_sizes) < 0:
        raise InvalidArgumentError(
            f"{name} split sizes {list(split_sizes)} must be {n} non-negative values "
            f"summing to {rows} rows")
    counts = [s * row_elems for s in split_sizes]
    return counts, offsets(counts)
