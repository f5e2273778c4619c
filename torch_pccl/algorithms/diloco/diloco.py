"""``DiLoCo`` (Douillard et al., arXiv 2311.08105): one blocking exchange of the whole
model's pseudo-gradients every H inner steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch

from ..topk import TopK
from .base import OuterLoop
from .fragment import Fragment
from .quorum import Quorum
from .report import OuterStep

__all__ = ["DiLoCo"]


class DiLoCo(OuterLoop):
    """DiLoCo (arXiv 2311.08105) over a pccl group, with membership at the outer steps.

    Every ``sync_every``-th call of ``step()`` is an *outer boundary*, in this order:

    1. the pseudo-gradients ``outer - local`` (CPU, float32) are averaged over
       the group (``dist.all_reduce`` AVG, or ``torch_pccl.all_reduce_quantized``
       with ``quantization``, or the sparse exchange with ``compression``); with ``reject_nonfinite`` a peer whose
       pseudo-gradients hold an inf or NaN is left out of the average and named
       (``exclude_nonfinite``); on a network error (``RETRYABLE_ERRORS``: a peer
       died) ``update_topology()`` and the same exchange again on the smaller
       world, at most ``max_retries`` times;
    2. the outer optimizer steps the outer parameters with that average;
    3. ``step += 1``;
    4. if ``peers_pending()``: ``update_topology()`` admits them;
    5. ``sync_shared_state(self.state(), revision)``: joiners receive the
       group's outer parameters, outer-optimizer buffers and step; a drifted
       peer is repaired; after the first sync nothing moves;
    6. the outer parameters are copied into the model.

    The constructor is a collective too: it runs the sync of step 5, so all
    peers start from the same parameters (the lowest rank's, when every peer is
    new), and a peer that joins later constructs its ``DiLoCo`` while the
    others are at their step 5 (right after the ``update_topology`` that
    admitted it) and returns with the group's state.

    Args:
        model: the ``nn.Module`` trained by every peer; its parameters with
            ``requires_grad`` are the ones synchronised (buffers stay local). They may
            be DTensors (a replica sharded inside itself: FSDP2, tensor parallel), whose
            local shards are worked on, ``group`` then joining the same shard of every
            replica (docs/diloco.md, "Sharded replicas").
        inner_optimizer: the optimizer of ``model`` (e.g. AdamW); its state is
            never synchronised.
        outer_optimizer: callable ``params -> torch.optim.Optimizer`` applied to
            the outer parameters (default ``default_outer_optimizer``: SGD lr
            0.7, momentum 0.9, Nesterov). Its per-parameter tensor state is
            created at construction (a dry step on zero gradients whose new
            state is then zeroed) so that joiners and incumbents hold the same
            entries; with SGD ``dampening != 0`` the first momentum update
            differs from torch's lazy initialisation.
        sync_every: H, inner steps per outer step (>= 1).
        quantization: None, ``"int8"`` or ``"int4"``: the pseudo-gradients go
            through ``torch_pccl.all_reduce_quantized`` with 8 / 4 bits (block
            256); the result is still bit-identical on every peer.
        compression: None, or a ``TopK`` (``torch_pccl.TopK``): the sparse
            exchange with error feedback (SparseLoCo, arXiv 2508.15706;
            docs/diloco.md, "Sparse exchange"): each peer sends the chunk-wise
            top-k of its error-feedback accumulator with low-bit values, the
            payloads are all-gathered, and every peer decodes and averages them in
            rank order (bit-identical). Exclusive with ``quantization``. The outer
            optimizer is ``outer_optimizer`` as without it (SparseLoCo's own is plain
            SGD, lr 1: ``sparseloco_outer_optimizer``; at H = 10 here Nesterov measured
            better, docs/diloco.md). Non-finite payloads are always left out (named as
            with ``reject_nonfinite``, at no cost: every peer holds every payload).
        quorum: None, or a ``Quorum(min_peers, grace)`` (``torch_pccl.Quorum``;
            docs/diloco.md, "Stragglers: quorum rounds"): an outer step does not wait
            for the slowest peer. A peer that has done its H inner steps tells the
            master and waits; the master closes the round when every member is
            ready, or ``grace`` seconds after ``min_peers`` are, and announces its
            participants. Their pseudo-gradients are merged weighted by the tokens
            each trained on since it last took part (``step(tokens=...)``), divided
            by 1 + the rounds it missed. A member that was not ready keeps training:
            at its next ``step()`` it joins the round's exchange with zeros, takes
            the same outer update, and keeps its own progress (``local += outer_new
            - outer_old``) for a later round. Outer parameters stay bit-identical on
            every peer. Peers then run unequal numbers of inner steps: end a
            training loop on ``step_count`` (the shared outer step), not on an inner
            step count, so that every peer calls ``finish()`` after the same round.
        group: a pccl process group formed through a master (``pccl://`` or a
            fixed world with its automatic master); default the default group.
        max_retries: topology updates allowed per exchange after network
            failures (>= 0).
        timeout: deadline of the master's rounds (update, sync, pending
            query), seconds or timedelta; default as ``update_topology``.
        reject_nonfinite: True (default): check every exchange's average; when it
            is not finite, the peers whose pseudo-gradients hold an inf or NaN are
            left out of it (the others' average is then computed from an
            all-gather of every peer's pseudo-gradients, full precision,
            bit-identical on every peer), logged with their peer ids and
            addresses, and listed in ``OuterStep.rejected``; every peer, the
            offender included, applies that average, so the outer parameters stay
            finite and identical. Costs one copy of the exchange buffer and one
            ``isfinite`` pass per exchange, no bytes unless a value is
            non-finite. False: one non-finite value makes every peer's outer
            parameters NaN for good, silently.

    Attributes:
        last_sync: the ``SyncResult`` of the latest shared-state sync.

    Raises:
        ValueError: a bad argument (``sync_every``, ``quantization``,
            ``max_retries``, ``reject_nonfinite``, no trainable parameter, an outer
            optimizer with non-tensor state).
        InvalidUsageError: ``group`` is not a pccl group formed through a master.
        Errors of ``sync_shared_state`` (``MismatchError`` when peers built
            different models, network errors, ...).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None,
                 sync_every: int = 100, quantization: str | None = None, group=None,
                 max_retries: int = 3, timeout: float | timedelta | None = None,
                 reject_nonfinite: bool = True, compression: TopK | None = None,
                 quorum: Quorum | None = None):
        super().__init__(model, inner_optimizer, outer_optimizer, sync_every, quantization,
                         max_retries, reject_nonfinite, compression, quorum)
        self._fragment = self._new_fragment(0, range(len(self._params)))
        self._join([self._fragment], group, timeout)

    def step(self, tokens: int = 1) -> OuterStep | None:
        """Call after every ``inner_optimizer.step()``; runs the outer work due at this step.

        Args:
            tokens: what this inner step trained on (e.g. the batch's tokens), for a
                quorum's token-weighted merging (default 1: weighted by inner steps);
                unused without ``quorum``.

        Returns:
            An ``OuterStep`` on every call that applied an outer update or ran the
            membership boundary (DiLoCo: every ``sync_every``-th call; with a quorum,
            every call at which a round closed), else None.

        Raises:
            The last network ``PcclError`` when ``max_retries`` topology updates
            did not help; ``NonFiniteError`` (``reject_nonfinite``) when every
            peer's pseudo-gradients hold an inf or NaN (the outer parameters are
            left as they were); errors of ``update_topology`` /
            ``sync_shared_state``.
        """
        self._t += 1
        if self.quorum is not None:
            return self._quorum_step(tokens)
        if self._t % self.sync_every:
            if self._transport.round_opened():
                # Past a boundary passed quiet while a member recovers: the round waits
                # for this peer (docs/membership.md, "Quiet epochs").
                self._update(retry=True, admit=False)
            return None
        self._reshard()
        started = time.monotonic()
        self._fragment.fill()
        self._exchange(self._fragment)
        self._apply(self._fragment)
        self._load_outer(self._boundary().changed)
        self._tally.seconds += time.monotonic() - started
        return self._report([self._fragment.index])

    def _quorum_step(self, tokens: int) -> OuterStep | None:
        """``step()`` with a quorum: the round's exchange and outer update once it closed
        (``OuterLoop._quorum_exchange``), then the membership boundary."""
        if type(tokens) is not int or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        started = time.monotonic()
        # A round is named by the shared-state revision it starts from: equal on every
        # member (the last sync made it so) and, unlike the step counter, never reused by
        # a later wrapper on the same group.
        self._credit.train(tokens)
        announcement = self._quorum_round(self._revision, self._credit, tokens)
        if announcement is None:
            return None
        self._reshard()
        self._quorum_exchange(self._fragment, announcement)
        # The announcement told every member whether peers wait: no pending query.
        changed = self._boundary(pending=announcement.get("pending", 0) > 0).changed
        # A drifted peer repaired by the sync takes the outer parameters (its local work
        # since it last took part is dropped with them).
        self._load_outer(changed)
        self._tally.seconds += time.monotonic() - started
        return self._report([self._fragment.index])

    def _apply(self, fragment: Fragment) -> None:
        """Outer step, then ``local = outer``."""
        fragment.outer_update()
        fragment.load()
