"""A fragment: parameters exchanged and stepped together, with their outer state.

``DiLoCo`` and ``AsyncDiLoCo`` have one fragment, the whole model;
``StreamingDiLoCo`` has P of them on staggered schedules. A fragment holds
the model's parameters (``params``; ``local``: the tensors this process holds of
them, a DTensor's local shard: ``shards.local``), their outer copies (``outer``,
part of the shared state), its own instance of the outer optimizer, the buffer its
pseudo-gradients are averaged in (with ``compression``: its ``SparseExchange``,
whose decoded mean lands in that buffer), and its schedule offset;
``start_exchange`` returns the ``Exchange`` in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..topk import TopK
from . import shards
from .compressed import SparseExchange
from .schedule import pseudo_gradient
from .transport import Transport

__all__ = ["Exchange", "Fragment", "default_outer_optimizer", "outer_optimizer_with_state",
           "sparseloco_outer_optimizer"]

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The papers' outer optimizer: ``SGD(params, lr=0.7, momentum=0.9, nesterov=True)``."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def sparseloco_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """SparseLoCo's outer optimizer (arXiv 2508.15706): ``SGD(params, lr=1.0)``, no
    momentum, ``theta <- theta - mean(decoded payloads)`` (its error feedback stands in for
    outer momentum); pass it as ``outer_optimizer`` with ``compression``."""
    return torch.optim.SGD(params, lr=1.0)


def outer_optimizer_with_state(factory: OuterOptimizerFactory,
                               params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``factory(params)`` with its per-parameter state created now: a dry step on zero
    gradients, after which ``params`` are restored and the state the step created is
    zeroed (state the optimizer made itself keeps its value), so that joiners and
    incumbents hold the same shared-state entries.

    Raises:
        ValueError: the optimizer keeps non-tensor per-parameter state.
    """
    opt = factory(params)
    before = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in opt.state[p].items()}
              for p in params if p in opt.state}
    saved = [p.clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    for p in params:
        old = before.get(id(p), {})
        for key, value in opt.state[p].items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"the outer optimizer keeps non-tensor state {key!r}: "
                                 "it cannot be synchronised")
            with torch.no_grad():
                if key in old and isinstance(old[key], torch.Tensor):
                    value.copy_(old[key])      # created by the optimizer itself
                else:
                    value.zero_()              # created by the dry step
    return opt


class Fragment:
    """Parameters exchanged and stepped together, with their outer state.

    Args:
        index: p, the fragment's number (what ``OuterStep.fragments`` lists).
        names: the parameters' names, in model order.
        params: the model's parameters (any device and dtype; a DTensor is worked on
            through its local shard, ``local``).
        outer: the outer copies of ``local`` (CPU, float32 or float64, shaped like
            the local shards), updated in place.
        optimizer: the outer optimizer over ``outer``, its state created
            (``outer_optimizer_with_state``).
        wire_dtype: dtype of the exchange buffer (float32 when quantized, else
            the outer dtype).
        offset: t_p: the fragment sends at the inner steps t with
            ``(t - t_p) % H == 0`` (0 when the fragment is the whole model).
        compression: a ``TopK``: the fragment's exchange is the sparse one
            (``SparseExchange``; ``wire_dtype`` must then be float32); None: an
            AVG all-reduce of ``buffer``.

    Attributes:
        buffer: 1-D exchange buffer of all the fragment's elements, in order; after
            an exchange, their average.
        sparse: the ``SparseExchange`` (None without ``compression``).
        and the arguments, under their names.
    """

    def __init__(self, index: int, names: Sequence[str], params: Sequence[torch.Tensor],
                 outer: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                 wire_dtype: torch.dtype, offset: int = 0, compression: TopK | None = None):
        self.index = index
        self.names = list(names)
        self.params = list(params)
        self.outer = list(outer)
        self.optimizer = optimizer
        self.offset = offset
        self.buffer = torch.empty(sum(o.numel() for o in self.outer), dtype=wire_dtype)
        self.sparse = None if compression is None else SparseExchange(self.buffer.numel(),
                                                                      compression)

    @property
    def local(self) -> list[torch.Tensor]:
        """The tensors this process holds of ``params`` (``shards.local``), what every
        read and in-place write of the model's parameters goes through."""
        return [shards.local(p) for p in self.params]

    def fill(self) -> None:
        """Writes the pseudo-gradients ``outer - local`` into ``buffer`` (and, sparse,
        compresses them: the error feedback's step)."""
        offset = 0
        for outer, local in zip(self.outer, self.local):
            n = outer.numel()
            self.buffer[offset:offset + n].copy_(pseudo_gradient(outer, local).reshape(-1))
            offset += n
        if self.sparse is not None:
            self.sparse.compress(self.buffer)

    def fill_from(self, contribution: torch.Tensor) -> None:
        """Like ``fill`` with ``contribution`` (1-D, ``buffer``'s size) as the pseudo-gradients."""
        self.buffer.copy_(contribution)
        if self.sparse is not None:
            self.sparse.compress(self.buffer)

    def abstain(self) -> None:
        """Like ``fill`` for a peer that takes no part in a quorum round: it sends zeros
        (sparse: a payload of zeros; its error feedback is left alone)."""
        self.buffer.zero_()
        if self.sparse is not None:
            self.sparse.abstain()

    def exchange(self, transport: Transport, async_op: bool):
        """Starts this fragment's exchange: the AVG all-reduce of ``buffer`` in place, or
        (sparse) the all-gather of the payloads, after which ``settle`` decodes. Its Work
        when ``async_op``."""
        if self.sparse is not None:
            return self.sparse.start(transport, async_op)
        return transport.all_reduce(self.buffer, async_op=async_op)

    def settle(self, members=None, weights: list[float] | None = None) -> list[int]:
        """After a completed exchange: (sparse) the mean of the decoded payloads into
        ``buffer`` (weighted by ``weights``, one per rank: ``SparseExchange.finish``);
        the ranks whose payload was left out as non-finite. Nothing to do (``[]``) for
        an all-reduce.

        Raises:
            NonFiniteError: every payload was non-finite.
        """
        if self.sparse is None:
            return []
        return self.sparse.finish(self.buffer, members, weights)

    def views(self) -> list[torch.Tensor]:
        """``buffer``'s slices shaped like the outer parameters (outer dtype)."""
        out, offset = [], 0
        for o in self.outer:
            out.append(self.buffer[offset:offset + o.numel()].view(o.shape).to(o.dtype))
            offset += o.numel()
        return out

    def start_exchange(self, transport: Transport, apply_at: int,
                       keep_contribution: bool = False, sent_at: int = 0,
                       weights: dict[str, float] | None = None,
                       took_part: bool = True) -> Exchange:
        """Starts the AVG all-reduce of ``buffer`` in the background; the ``Exchange`` in
        flight, sent at inner step ``sent_at``, to be applied at inner step ``apply_at``
        (``keep_contribution``: with a copy of what this peer sent, for
        ``exclude_nonfinite``; ``weights``, ``took_part``: a quorum round's, as
        ``Exchange``)."""
        # A sparse exchange screens its payloads itself (settle): no copy to keep.
        contribution = self.buffer.clone() if keep_contribution and self.sparse is None \
            else None
        per_rank = None if weights is None else \
            [weights.get(pid, 0.0) for pid, _ in transport.members()]
        work = self.exchange(transport, async_op=True)
        return Exchange(self, apply_at, work, transport.epoch(), contribution, sent_at,
                        weights=weights, per_rank=per_rank, took_part=took_part)

    def outer_update(self, grads: Sequence[torch.Tensor] | None = None) -> None:
        """The outer optimizer steps with the averaged pseudo-gradients in ``buffer`` (or
        ``grads``, shaped like ``outer``: a correction of them)."""
        for o, g in zip(self.outer, self.views() if grads is None else grads):
            o.grad = g
        self.optimizer.step()
        for o in self.outer:
            o.grad = None

    def load(self) -> None:
        """``local = outer``."""
        with torch.no_grad():
            for local, outer in zip(self.local, self.outer):
                local.copy_(outer)

    def outer_copy(self) -> list[torch.Tensor]:
        """A copy of the outer parameters (what ``rebase`` takes)."""
        return [o.clone() for o in self.outer]

    def rebase(self, before: Sequence[torch.Tensor]) -> None:
        """``local += outer - before``: the local parameters follow an outer update they
        took no part in (``before``: ``outer_copy()`` from before it), keeping what this
        peer trained since in ``outer - local``."""
        with torch.no_grad():
            for local, outer, old in zip(self.local, self.outer, before):
                local.add_((outer - old).to(local.device, local.dtype))

    def merge(self, alpha: float) -> None:
        """``local = alpha * local + (1 - alpha) * outer`` (Streaming DiLoCo's mixing)."""
        with torch.no_grad():
            for local, outer in zip(self.local, self.outer):
                local.mul_(alpha).add_(outer.to(local.device, local.dtype), alpha=1.0 - alpha)

    def optimizer_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The outer optimizer's shared-state entries: ``outer_opt/<param name>/<key>``."""
        for name, o in zip(self.names, self.outer):
            for key, value in self.optimizer.state[o].items():
                yield f"outer_opt/{name}/{key}", value


@dataclass
class Exchange:
    """A fragment's exchange in flight: its Work, the inner step it is applied at, the
    membership epoch it was issued in and (``reject_nonfinite``) a copy of this peer's
    contribution; the fragment's ``buffer`` is averaged in place. ``sent_at``: the inner
    step it was sent at; ``done_at``: the inner step at which it was first seen complete
    (None until then; Streaming DiLoCo's automatic tau measures exchanges with them).

    A quorum round's exchange (``OuterLoop._quorum_fill``) also carries ``weights`` (its
    participants' ids -> merging weight), ``per_rank`` (those weights per rank of the
    epoch it was issued in, 0 for the others) and ``took_part`` (False: this peer sent
    zeros and follows the outer update, ``OuterLoop._follow``)."""

    fragment: Fragment
    apply_at: int
    work: object
    epoch: int
    contribution: torch.Tensor | None = None
    sent_at: int = 0
    done_at: int | None = None
    weights: dict[str, float] | None = None
    per_rank: list[float] | None = None
    took_part: bool = True
