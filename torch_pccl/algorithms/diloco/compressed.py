"""``SparseExchange``: one fragment's error-feedback accumulator and its all-gathered payloads.

The ``compression=TopK(...)`` exchange of the DiLoCo wrappers (SparseLoCo,
Sarfi et al., arXiv 2508.15706; the error feedback of Karimireddy et al.,
"Error Feedback Fixes SignSGD", arXiv 1901.09847):

1. ``compress(delta)``, once per outer step: ``e <- beta * e + delta``,
   ``payload = encode(e)``, ``e <- e - decode(payload)``. The accumulator is
   this peer's own (never shared state; a joiner starts from zero), and a
   retried exchange re-sends the same payload, so what was sent is subtracted
   once however often it goes out.
2. ``start``: one all-gather of every peer's payload (fixed size, so a plain
   ``dist.all_gather_single`` on the group: striped and paced like any collective).
3. ``finish(out)``: every peer decodes every payload and adds them in rank
   order, then divides by their count: the same float operations on the same
   bytes, so ``out`` (the mean) is bit-identical on every peer. A payload with
   a non-finite scale (its sender's accumulator held an inf or NaN) is left
   out and its rank returned; no extra bytes are needed, since every peer
   holds every payload.
"""

from __future__ import annotations

import torch

from ...errors import NonFiniteError
from ..finite import describe
from ..topk import TopK, decode_add, encode
from .transport import Transport

__all__ = ["SparseExchange"]


class SparseExchange:
    """Error feedback and the payload exchange of one fragment (``numel`` float32 elements).

    Args:
        numel: elements of the fragment's exchange buffer.
        cfg: the ``TopK`` settings.

    Attributes:
        accumulator: the error-feedback accumulator ``e`` (float32, ``numel``).
        payload: this peer's payload of the current outer step (uint8,
            ``cfg.payload_bytes(numel)``), None before the first ``compress``.
    """

    def __init__(self, numel: int, cfg: TopK):
        self.cfg = cfg
        self.accumulator = torch.zeros(numel, dtype=torch.float32)
        self.payload: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None

    @property
    def payload_bytes(self) -> int:
        """Bytes of one peer's payload."""
        return self.cfg.payload_bytes(self.accumulator.numel())

    def compress(self, delta: torch.Tensor) -> None:
        """``e <- beta e + delta``; the payload of ``e``; ``e <- e - decode(payload)``.

        ``delta``: float32, 1-D, ``numel`` elements (the pseudo-gradient). When ``e``
        holds an inf or NaN, the payload says so (its peers leave it out) and ``e`` is
        reset to zero, so one bad round does not poison every later one.
        """
        e = self.accumulator
        e.mul_(self.cfg.beta).add_(delta)
        self.payload = encode(e, self.cfg)
        if not decode_add(e, self.payload, self.cfg, alpha=-1.0):
            e.zero_()

    def abstain(self) -> None:
        """This outer step's payload is all zeros (a peer that takes no part in a quorum
        round); the accumulator is left alone."""
        self.payload = encode(torch.zeros_like(self.accumulator), self.cfg)

    def start(self, transport: Transport, async_op: bool):
        """The all-gather of every peer's payload (rank order); its Work when ``async_op``."""
        if self.payload is None:
            raise RuntimeError("SparseExchange.start before compress")
        world = transport.world_size()
        self._gathered = torch.empty(world * self.payload.numel(), dtype=torch.uint8)
        return transport.all_gather(self._gathered, self.payload, async_op=async_op)

    def finish(self, out: torch.Tensor, members=None,
               weights: list[float] | None = None) -> list[int]:
        """Writes the mean of the gathered payloads' decoded values into ``out`` (float32,
        1-D, ``numel``), adding them in rank order; returns the ranks left out because
        their payload was non-finite (ascending).

        ``weights`` (one per rank; None: all 1): the weighted mean
        ``sum_r w_r x_r / sum_r w_r`` over the finite payloads, those of weight 0 not
        decoded (a quorum round's non-participants; zero when no weight is left).

        Raises:
            NonFiniteError: every payload was non-finite (``out`` is then zero).
        """
        size = self.payload.numel()
        gathered = self._gathered.view(-1, size)
        out.zero_()
        rank_weights = [1.0] * gathered.shape[0] if weights is None else list(weights)
        rejected = [r for r in range(gathered.shape[0]) if rank_weights[r]
                    and not decode_add(out, gathered[r], self.cfg, alpha=rank_weights[r])]
        if rejected and len(rejected) == sum(1 for w in rank_weights if w):
            raise NonFiniteError(
                "every peer's sparse payload holds an inf or NaN: "
                + ", ".join(describe(r, members) for r in rejected))
        total = sum(w for r, w in enumerate(rank_weights) if r not in rejected)
        if total:
            out.div_(total)
        return rejected
