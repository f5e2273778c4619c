"""The point-to-point calls of a ``Communicator``: send, recv, from any source, batches.

A base class of ``Communicator``, kept apart from the collectives: each method checks
its arguments (``core.tensors``) and runs one native call on the communicator's own
handle (``native``), bounded by ``deadline_ms``. Messages to or from one peer are
matched in call order on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .native import ffi, lib, pointer
from .tensors import check_peer, check_tensor, checked_tag


class PointToPoint:
    """Point-to-point calls over ``self.native``; needs ``rank``, ``world_size``, ``native``
    and ``deadline_ms`` from the class that derives from it (``Communicator``)."""

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0,
             timeout_s: float | None = None) -> None:
        """Sends ``tensor`` to rank ``peer``, matched by its ``recv`` with the same tag; mirrors ``dist.send``.

        Raises:
            TypeError, InvalidArgumentError (bad tensor, peer is self or out of range),
            network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        check_peer(peer, self.rank, self.world_size)
        self.native.run(lib.pcclSend, pointer(tensor), tensor.numel(), dtype, peer, checked_tag(tag),
                  self.deadline_ms(timeout_s))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0,
             timeout_s: float | None = None) -> None:
        """Receives ``tensor.numel()`` elements from rank ``peer`` into ``tensor``; mirrors ``dist.recv``.

        Raises:
            TypeError, InvalidArgumentError (bad tensor or peer), MismatchError
            (the sender's size or dtype differ), network PcclErrors.
        """
        dtype = check_tensor(tensor, "tensor")
        check_peer(peer, self.rank, self.world_size)
        self.native.run(lib.pcclRecv, pointer(tensor), tensor.numel(), dtype, peer, checked_tag(tag),
                  self.deadline_ms(timeout_s))

    def recv_any_source(self, tensor: torch.Tensor, tag: int = 0,
                        timeout_s: float | None = None) -> int:
        """Receives into ``tensor`` from whichever rank sends to this one first; returns its rank.

        Mirrors ``dist.recv(tensor)`` with no ``src``: takes the first peer whose
        next message to this rank is a ``send`` with ``tag`` (a peer whose next
        frame belongs to something else, such as a collective it already
        started, is passed over). ``tensor`` is written only on success.

        Raises:
            TypeError, InvalidArgumentError (bad tensor or tag, a world of 1),
            MismatchError (the sender's size or dtype differ), network
            PcclErrors (PcclTimeoutError when no message comes by the deadline).
        """
        dtype = check_tensor(tensor, "tensor")
        src = ffi.new("int *")
        self.native.run(lib.pcclRecvAnySource, pointer(tensor), tensor.numel(), dtype, checked_tag(tag),
                  self.deadline_ms(timeout_s), src)
        return int(src[0])

    def p2p_batch(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]],
                  timeout_s: float | None = None) -> None:
        """Runs several sends and receives at once; mirrors ``dist.batch_isend_irecv``.

        Args:
            ops: ``(is_send, tensor, peer, tag)`` tuples. Messages to or from one
                peer are matched in list order (and after earlier calls' messages),
                so two ranks that send large tensors to each other do not wait on
                each other. Receive tensors are written only if the whole batch
                succeeds.

        Raises:
            TypeError, InvalidArgumentError (bad tensor, peer or tag),
            MismatchError (a peer's message differs in size, dtype or tag),
            network PcclErrors.
        """
        self.native.run(lib.pcclP2PBatch, *self._p2p_ops(ops), self.deadline_ms(timeout_s))

    def transfer_batch(self, ops: Sequence[tuple[bool, torch.Tensor, int, int]],
                       timeout_s: float | None = None) -> None:
        """``p2p_batch`` for bulk transfers: receives land in their tensors without a staging copy.

        Saves one copy and the staging memory of every received byte, at a
        price: after a failure a receive tensor holds unspecified bytes, so
        the caller must stage and verify (``sync_shared_state`` hashes every
        entry it receives).

        Raises:
            as ``p2p_batch``.
        """
        self.native.run(lib.pcclTransferBatch, *self._p2p_ops(ops), self.deadline_ms(timeout_s))

    def _p2p_ops(self, ops):
        c_ops = ffi.new("pcclP2POp_t[]", max(1, len(ops)))
        for i, (is_send, tensor, peer, tag) in enumerate(ops):
            dtype = check_tensor(tensor, f"ops[{i}] tensor")
            check_peer(peer, self.rank, self.world_size)
            c_ops[i].peer = peer
            c_ops[i].is_send = 1 if is_send else 0
            c_ops[i].buf = pointer(tensor)
            c_ops[i].count = tensor.numel()
            c_ops[i].dtype = dtype
            c_ops[i].tag = checked_tag(tag)
        return c_ops, len(ops)
