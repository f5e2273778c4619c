"""The collectives of a ``Communicator``: all-reduce (plain and quantized), broadcast,
all-gather, reduce-scatter, all-to-all-v and barrier.

A base class of ``Communicator``, as ``core.point_to_point`` is for sends and receives.
Each collective has two entries, one check per layer boundary:

- the public method (``all_reduce``, ...) checks every argument in Python (``core.tensors``)
  and raises ``TypeError`` / ``InvalidArgumentError`` before any C call; users and tests
  call these;
- its ``*_unchecked`` twin takes arguments its caller has checked already, with their
  native codes (``core.tensors.check_tensor``, ``op_code``, ``quantized_args``), and makes
  the native call at once. The c10d adapter checks every argument on the caller's thread
  before the op takes a lane (``c10d.checks``), then runs the op through these, so a
  tensor is checked once on its way down and the reduce-op code computed once.

Both end in the same native call, whose own checks guard the C API (``InvalidArgumentError``
for what it refuses). Only the deadline is checked on both: ``timeout_s`` is turned into the
native deadline (``deadline_ms``) when the op runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import config
from ..errors import InvalidArgumentError
from .native import ffi, lib, pointer
from .tensors import (
    check_rank,
    check_ranges,
    check_tensor,
    checked_tag,
    op_code,
    quantized_args,
    same_dtype,
    same_shape_output,
)


class Collectives:
    """Collectives over ``self.native``; needs ``world_size``, ``native`` and ``deadline_ms``
    from the class that derives from it (``Communicator``).

    The ``*_unchecked`` entries take contiguous CPU tensors whose dtype, sizes and device
    the caller has checked as the public method would, their native codes (``dtype``: a
    ``pcclDataType_t`` from ``check_tensor``; ``red``: a ``pcclRedOp_t`` from ``op_code``)
    and a 32-bit unsigned ``tag``. They skip the Python checks, not the native ones; a
    tensor smaller than the sizes say is the caller's bug (C reads and writes
    ``numel()`` elements).
    """

    # -- all-reduce --------------------------------------------------------

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None,
                   op=dist.ReduceOp.SUM, tag: int = 0, timeout_s: float | None = None) -> None:
        """``out = op over ranks of inp``, elementwise; mirrors ``dist.all_reduce``.

        Args:
            inp: contiguous CPU tensor, any shape, N elements.
            out: same dtype and N elements (may be ``inp``; None means in place).
            op: ``dist.ReduceOp`` SUM, AVG, MIN, MAX or PRODUCT. AVG divides by
                world size (integers truncate toward zero); float16/bfloat16
                accumulate in float32. Every rank ends with identical bytes.
            tag: 32-bit unsigned tag that peers must match.
            timeout_s: deadline in seconds (default: the communicator's).

        Raises:
            TypeError: unsupported dtype.
            InvalidArgumentError: non-contiguous, non-CPU, size/dtype mismatch, bad op.
            PeerLostError, PcclTimeoutError, RemoteError, MismatchError, ... (sticky).
        """
        out, dtype = same_shape_output(inp, out)
        red = op_code(op)
        self.all_reduce_unchecked(inp, out, dtype, red, checked_tag(tag), timeout_s)

    def all_reduce_unchecked(self, inp: torch.Tensor, out: torch.Tensor, dtype: int, red: int,
                             tag: int = 0, timeout_s: float | None = None) -> None:
        """``all_reduce`` of arguments checked by the caller (see the class): ``inp`` and
        ``out`` contiguous CPU tensors of one dtype (code ``dtype``) and N elements each
        (``out`` may be ``inp``), ``red`` the ``op_code`` of the reduce op.

        Raises:
            InvalidArgumentError: ``timeout_s`` out of range; what the native layer refuses.
            PeerLostError, PcclTimeoutError, RemoteError, MismatchError, ... (sticky).
        """
        self.native.run(lib.pcclAllReduce, pointer(inp), pointer(out), inp.numel(), dtype, red,
                        tag, self.deadline_ms(timeout_s))

    def all_reduce_quantized(self, inp: torch.Tensor, out: torch.Tensor | None = None,
                             bits: int = 8, block: int = config.QUANT_BLOCK, op=dist.ReduceOp.SUM,
                             tag: int = 0, timeout_s: float | None = None) -> None:
        """``out ~= op over ranks of inp`` with int8/int4 traffic (``pcclAllReduceQuantized``).

        Each value is quantized twice, never at a hop: every rank quantizes
        the other owners' block-aligned slices of ``inp`` once (symmetric
        absmax per block of ``block`` elements, a float32 scale per block,
        round half to even) and sends them; each owner adds the decoded
        contributions and its own exact slice in float32 in rank order,
        divides by the world size for AVG, quantizes the result once and
        all-gathers it. Every rank decodes the same bytes, so ``out`` is
        bit-identical on every rank (at world size 1 it is ``inp`` quantized
        once). Per element, ``|out - exact| <=`` the sum over the other ranks
        of half their input block's scale (absmax / 127 for int8, / 7 for
        int4; divided by the world size for AVG) plus half the result block's
        scale. A block holding an inf or NaN comes out NaN. Bytes sent per
        rank: about ``2 (W-1)/W * N * (bits/8 + 4/block)`` against
        ``2 (W-1)/W * N * 4`` for float32 ``all_reduce``. Algorithm: see
        native/src/quantize.hpp and docs/quantization.md.

        Args:
            inp: contiguous CPU tensor of float32, float16 or bfloat16, N elements.
            out: same dtype and N elements (may be ``inp``; None means in place);
                written only if the whole operation succeeded.
            bits: 8 (codes in [-127, 127]) or 4 (codes in [-7, 7], two per byte).
            block: elements per scale, 1 .. 65535 (e.g. 64 .. 4096).
            op: ``dist.ReduceOp`` SUM or AVG.
            tag: 32-bit unsigned tag that peers must match.
            timeout_s: deadline in seconds (default: the communicator's).

        Raises:
            TypeError: unsupported dtype.
            InvalidArgumentError: a dtype other than float32/float16/bfloat16,
                non-contiguous or non-CPU tensors, size/dtype mismatch, bits not
                8 or 4, block out of range, op not SUM or AVG.
            MismatchError: a peer passed another ``bits``, ``block``, size,
                dtype or op (or called another collective).
            PeerLostError, PcclTimeoutError, RemoteError, ... (sticky).
        """
        out, dtype = same_shape_output(inp, out)
        qtype, red = quantized_args(inp, bits, block, op)
        self.all_reduce_quantized_unchecked(inp, out, dtype, qtype, red, block,
                                            checked_tag(tag), timeout_s)

    def all_reduce_quantized_unchecked(self, inp: torch.Tensor, out: torch.Tensor, dtype: int,
                                       qtype: int, red: int, block: int, tag: int = 0,
                                       timeout_s: float | None = None) -> None:
        """``all_reduce_quantized`` of arguments checked by the caller (see the class):
        tensors as in ``all_reduce_unchecked``; ``qtype`` and ``red`` from
        ``quantized_args``, which also checked ``block`` (elements per scale).

        Raises:
            as ``all_reduce_unchecked``; MismatchError as ``all_reduce_quantized``.
        """
        self.native.run(lib.pcclAllReduceQuantized, pointer(inp), pointer(out), inp.numel(),
                        dtype, red, qtype, block, tag, self.deadline_ms(timeout_s))

    # -- broadcast, all-gather, reduce-scatter -------------------------------

    def broadcast(self, tensor: torch.Tensor, root: int, tag: int = 0,
                  timeout_s: float | None = None) -> None:
        """Copies ``tensor`` of rank ``root`` into ``tensor`` of every rank; mirrors ``dist.broadcast``.

        Raises:
            TypeError, InvalidArgumentError (bad tensor or root), network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        check_rank(root, self.world_size, "root")
        self.broadcast_unchecked(tensor, dtype, root, checked_tag(tag), timeout_s)

    def broadcast_unchecked(self, tensor: torch.Tensor, dtype: int, root: int, tag: int = 0,
                            timeout_s: float | None = None) -> None:
        """``broadcast`` of arguments checked by the caller (see the class): ``tensor`` of
        code ``dtype``, ``root`` a rank of the group.

        Raises:
            as ``all_reduce_unchecked``.
        """
        self.native.run(lib.pcclBroadcast, pointer(tensor), tensor.numel(), dtype, root, tag,
                        self.deadline_ms(timeout_s))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, tag: int = 0,
                   timeout_s: float | None = None) -> None:
        """``out[r*N:(r+1)*N] = inp of rank r`` (flat elements); mirrors ``dist.all_gather_into_tensor``.

        Args:
            inp: N elements. out: world_size * N elements, same dtype.

        Raises:
            TypeError, InvalidArgumentError (size or dtype mismatch), network PcclErrors.
        """
        dtype = check_tensor(inp, "input")
        check_tensor(out, "output")
        same_dtype(inp, out, "input", "output")
        if out.numel() != inp.numel() * self.world_size:
            raise InvalidArgumentError(
                f"output has {out.numel()} elements, need world_size * input = "
                f"{self.world_size} * {inp.numel()}")
        self.all_gather_unchecked(inp, out, dtype, checked_tag(tag), timeout_s)

    def all_gather_unchecked(self, inp: torch.Tensor, out: torch.Tensor, dtype: int,
                             tag: int = 0, timeout_s: float | None = None) -> None:
        """``all_gather`` of arguments checked by the caller (see the class): ``inp`` of N
        elements, ``out`` of world_size * N, both of code ``dtype``.

        Raises:
            as ``all_reduce_unchecked``.
        """
        self.native.run(lib.pcclAllGather, pointer(inp), pointer(out), inp.numel(), dtype, tag,
                        self.deadline_ms(timeout_s))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op=dist.ReduceOp.SUM,
                       tag: int = 0, timeout_s: float | None = None) -> None:
        """``out = op over ranks of inp[rank*N:(rank+1)*N]``; mirrors ``dist.reduce_scatter_tensor``.

        Args:
            inp: world_size * N elements. out: N elements, same dtype.
            op: as in ``all_reduce``.

        Raises:
            TypeError, InvalidArgumentError (size/dtype mismatch, bad op), network PcclErrors.
        """
        dtype = check_tensor(inp, "input")
        check_tensor(out, "output")
        same_dtype(inp, out, "input", "output")
        if inp.numel() != out.numel() * self.world_size:
            raise InvalidArgumentError(
                f"input has {inp.numel()} elements, need world_size * output = "
                f"{self.world_size} * {out.numel()}")
        red = op_code(op)
        self.reduce_scatter_unchecked(inp, out, dtype, red, checked_tag(tag), timeout_s)

    def reduce_scatter_unchecked(self, inp: torch.Tensor, out: torch.Tensor, dtype: int,
                                 red: int, tag: int = 0, timeout_s: float | None = None) -> None:
        """``reduce_scatter`` of arguments checked by the caller (see the class): ``inp`` of
        world_size * N elements, ``out`` of N, both of code ``dtype``; ``red`` from ``op_code``.

        Raises:
            as ``all_reduce_unchecked``.
        """
        self.native.run(lib.pcclReduceScatter, pointer(inp), pointer(out), out.numel(), dtype,
                        red, tag, self.deadline_ms(timeout_s))

    # -- all-to-all and barrier ----------------------------------------------

    def all_to_all_v(self, inp: torch.Tensor, send_counts: Sequence[int],
                     send_displs: Sequence[int], out: torch.Tensor, recv_counts: Sequence[int],
                     recv_displs: Sequence[int], tag: int = 0,
                     timeout_s: float | None = None) -> None:
        """All-to-all with per-peer counts and displacements, in elements.

        ``inp[send_displs[p] : + send_counts[p]]`` goes to rank p and lands in
        that rank's ``out[recv_displs[me] : + recv_counts[me]]``; zero counts
        are allowed. Mirrors ``dist.all_to_all_single`` (which works in rows).

        Raises:
            TypeError, InvalidArgumentError (list lengths != world_size, negative
            counts, a range outside its tensor, dtype mismatch), network PcclErrors.
        """
        dtype = check_tensor(inp, "input")
        check_tensor(out, "output")
        same_dtype(inp, out, "input", "output")
        for name, counts, displs, tensor in (("send", send_counts, send_displs, inp),
                                             ("recv", recv_counts, recv_displs, out)):
            check_ranges(name, counts, displs, tensor.numel(), self.world_size)
        self.all_to_all_v_unchecked(inp, send_counts, send_displs, out, recv_counts,
                                    recv_displs, dtype, checked_tag(tag), timeout_s)

    def all_to_all_v_unchecked(self, inp: torch.Tensor, send_counts: Sequence[int],
                               send_displs: Sequence[int], out: torch.Tensor,
                               recv_counts: Sequence[int], recv_displs: Sequence[int],
                               dtype: int, tag: int = 0, timeout_s: float | None = None) -> None:
        """``all_to_all_v`` of arguments checked by the caller (see the class): ``inp`` and
        ``out`` of code ``dtype``; world_size counts and displacements (elements) per side,
        each range inside its tensor.

        Raises:
            as ``all_reduce_unchecked``.
        """
        arrays = [ffi.new("uint64_t[]", [int(v) for v in values])
                  for values in (send_counts, send_displs, recv_counts, recv_displs)]
        self.native.run(lib.pcclAllToAllv, pointer(inp), arrays[0], arrays[1], pointer(out),
                        arrays[2], arrays[3], dtype, tag, self.deadline_ms(timeout_s))

    def barrier(self, tag: int = 0, timeout_s: float | None = None) -> None:
        """Returns once every rank has entered the barrier; mirrors ``dist.barrier``.

        Raises:
            network PcclErrors (PeerLostError, PcclTimeoutError, ...).
        """
        self.native.run(lib.pcclBarrier, checked_tag(tag), self.deadline_ms(timeout_s))
