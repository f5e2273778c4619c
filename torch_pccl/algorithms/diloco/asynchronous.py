"""``AsyncDiLoCo``: DiLoCo whose exchange of round n runs during round n + 1, made
stable by eager updates (Kale, Douillard, Donchev, arXiv 2502.12996)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch

from ..topk import TopK
from .base import OuterLoop
from .correction import MomentumAligned
from .fragment import Fragment, outer_optimizer_with_state
from .quorum import Quorum
from .report import OuterStep
from .schedule import pseudo_gradient

__all__ = ["AsyncDiLoCo"]


class AsyncDiLoCo(OuterLoop):
    """DiLoCo whose exchange overlaps the next round: one-round-delayed outer updates
    made stable by *eager updates* (Kale, Douillard, Donchev, arXiv 2502.12996).

    At the boundary that ends round n, each peer computes its pseudo-gradient
    ``g_n = start_n - local`` (``start_n``: where its round began), waits for the
    average ``G_{n-1}`` of the previous round's pseudo-gradients (in flight
    during round n), and starts the exchange of ``g_n`` in the background.

    - The *shared* state (outer parameters ``S``, outer-optimizer buffers,
      step) is stepped with the delayed averages only: ``S <- Opt(S, G_{n-1})``.
      It is bit-identical on every peer and is what ``sync_shared_state``
      checks and gives to joiners.
    - The *eager* term ``E`` is per peer and lives outside the shared state: a
      second instance of the outer optimizer steps ``E`` with
      ``c_n = w * (g_n - g_{n-1})``. The next round starts from ``S + E``.

    For an outer optimizer that is linear in its gradients (SGD with momentum,
    Nesterov or not, weight decay included) ``S + E`` is exactly what the outer
    optimizer gives when fed ``G_{n-1} + w * (g_n - g_{n-1})``: with
    ``w = 1/W`` (``eager_weight=None``) that is the paper's eager update, a
    mixture of this peer's fresh pseudo-gradient and the others' delayed
    ones; with ``w = 1`` (the default) this peer's own fresh pseudo-gradient
    stands in for the missing average and is swapped for it when it arrives
    (the sum telescopes: every average is applied once, every local term
    only until its average comes). With one peer, or peers whose
    pseudo-gradients agree, ``w = 1`` reproduces synchronous DiLoCo. On small
    quadratic problems ``w = 1/W`` behaves more and more like the stale update
    as W grows: in tests/algorithms/test_diloco.py, at W = 4, it oscillates with a growing
    amplitude where ``w = 1`` converges like synchronous DiLoCo.

    ``rule="stale"`` is the naive delayed update (restart every round from
    ``S``, no eager term): with Nesterov lr 0.7 / momentum 0.9 it diverges; it
    is here as the baseline that shows it.

    A joiner (constructed at the incumbents' boundary sync) contributes a zero
    pseudo-gradient to the exchange issued at that boundary and starts with
    ``E = 0``. ``finish()`` waits for the exchange in flight, applies it to
    ``S``, syncs, loads ``S`` into the model and resets the eager term.

    With ``reject_nonfinite`` the average ``G_n`` leaves out the peers whose
    ``g_n`` holds an inf or NaN (named in the ``OuterStep`` of the boundary that
    applies it, one round later), so ``S`` stays finite. ``E`` is the peer's
    own: a peer whose ``g_n`` was non-finite trains on from a non-finite
    ``S + E`` (and is left out again) until ``finish()`` resets ``E``.

    With ``quorum`` (docs/diloco.md, "Stragglers: quorum rounds") each outer step is a
    quorum round, as for ``DiLoCo``: a peer that has done its H inner steps tells the
    master (one inner step ahead) and trains on while the round is open (for up to
    H - 1 more inner steps, then it waits for the close); the round's exchange runs
    during the next round. A participant's ``g_n`` goes out
    weighted by its tokens / (1 + rounds missed), and ``G_n`` is the weighted mean; a
    member that was not ready sends zeros at its next inner step and moves its local
    parameters by what ``S`` moved (its eager term and what it trained stay its own, for
    its next round). The exchange of round n goes out before round n's boundary, so a
    peer admitted there does not take part in it (a boundary that admits completes it
    first).

    Args:
        rule: ``"eager"`` (default) or ``"stale"``.
        eager_weight: w, a float in (0, 1], or None for 1/W (the paper's mixture).
        compression: as ``DiLoCo``: ``g_n`` goes through the error feedback and
            the sparse exchange, and ``G_{n-1}`` is the mean of the decoded payloads.
        quorum: None, or a ``Quorum(min_peers, grace)``: rounds as above.
        correction: None, or a ``MomentumAligned`` (after HeLoCo, arXiv 2606.00271;
            ``correction.py``): the delayed average ``G_{n-1}`` is corrected block by
            block against the outer optimizer's momentum buffer before ``S`` steps with
            it (the same bytes on every peer: both are shared). An optimizer without a
            ``momentum_buffer`` is stepped uncorrected.
        the others: as ``DiLoCo``.

    Raises:
        ValueError: as ``DiLoCo``, and a bad ``rule`` or ``eager_weight``.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None,
                 sync_every: int = 100, quantization: str | None = None, rule: str = "eager",
                 eager_weight: float | None = 1.0, group=None, max_retries: int = 3,
                 timeout: float | timedelta | None = None, reject_nonfinite: bool = True,
                 compression: TopK | None = None, quorum: Quorum | None = None,
                 correction: MomentumAligned | None = None):
        if rule not in ("eager", "stale"):
            raise ValueError(f"rule must be 'eager' or 'stale', got {rule!r}")
        if eager_weight is not None and not 0.0 < float(eager_weight) <= 1.0:
            raise ValueError(f"eager_weight must be in (0, 1] or None, got {eager_weight!r}")
        if correction is not None and not isinstance(correction, MomentumAligned):
            raise ValueError(f"correction must be None or a MomentumAligned, got {correction!r}")
        self.rule = rule
        self.eager_weight = eager_weight
        self.correction = correction
        super().__init__(model, inner_optimizer, outer_optimizer, sync_every, quantization,
                         max_retries, reject_nonfinite, compression, quorum)
        self._fragment = self._new_fragment(0, range(len(self._params)))
        self._join([self._fragment], group, timeout)
        # The eager term E (per peer, not shared), its optimizer and g_{n-1}.
        self._eager = [torch.zeros_like(o) for o in self._outer]
        self._eager_opt = outer_optimizer_with_state(self._factory, self._eager) \
            if rule == "eager" else None
        self._previous = torch.zeros(self._fragment.buffer.numel(), dtype=self._dtype)
        # The incumbents issue their exchange right after this sync (with a quorum:
        # before it, without this peer).
        if self._t > 0 and quorum is None:
            self._fragment.fill_from(torch.zeros_like(self._fragment.buffer))
            self._start_exchange()

    def step(self, tokens: int = 1) -> OuterStep | None:
        """Call after every ``inner_optimizer.step()``; every ``sync_every``-th call is
        the boundary described in the class docstring.

        Args:
            tokens: what this inner step trained on, for a quorum's token-weighted
                merging (default 1); unused without ``quorum``.

        Returns:
            An ``OuterStep`` at every boundary (with a quorum: at every call at which a
            round closed), else None.

        Raises:
            ValueError: ``tokens`` is not an int >= 0 (with a quorum).
        """
        self._t += 1
        if self.quorum is not None:
            return self._quorum_step(tokens)
        if self._t % self.sync_every:
            return None
        self._reshard()
        started = time.monotonic()
        fresh = torch.cat([pseudo_gradient(s, p).reshape(-1)
                           for s, p in zip(self._start_point(), self._fragment.local)])
        applied = self._complete()          # S <- Opt(S, G_{n-1})
        if self._eager_opt is not None:
            self._eager_step(fresh)
        self._previous = fresh
        self._boundary()
        self._load_start()
        self._tally.seconds += time.monotonic() - started
        result = self._report(applied)   # before the new exchange: its bytes are the next's
        started = time.monotonic()
        self._fragment.fill_from(fresh)
        self._start_exchange()
        self._tally.seconds += time.monotonic() - started
        return result

    def _quorum_step(self, tokens: int) -> OuterStep | None:
        """``step()`` with a quorum: once the round closed, ``S`` takes the last round's
        mean, the round's exchange goes out, then the boundary; a participant restarts
        from ``S + E``, any other member moves by what ``S`` moved."""
        if type(tokens) is not int or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        self._credit.train(tokens)
        # A ready peer trains on while the round is open, for up to another round.
        announcement = self._quorum_round(self._revision, self._credit, tokens,
                                          self.sync_every - 1)
        if announcement is None:
            return None
        self._reshard()
        started = time.monotonic()
        weights, took_part = self._quorum_weights(announcement)
        if took_part:
            fresh = torch.cat([pseudo_gradient(s, p).reshape(-1)
                               for s, p in zip(self._start_point(), self._fragment.local)])
            applied = self._complete()          # S <- Opt(S, G of the last round)
            if self._eager_opt is not None:
                self._eager_step(fresh)
            self._previous = fresh
            settle = self._complete
        else:
            applied = self._complete_following()
            fresh = None
            settle = self._complete_following
        self._quorum_fill(self._fragment, weights, took_part, self._credit, fresh)
        self._pending.append(self._fragment.start_exchange(
            self._transport, self._t + self.sync_every, self.reject_nonfinite,
            weights=weights))
        # The announcement told every member whether peers wait: no pending query. A
        # boundary that admits completes the exchange just issued (a new epoch cannot
        # carry it); one that only syncs leaves it in flight (it changes no shared state
        # until it is applied).
        pending = announcement.get("pending", 0) > 0
        changed = self._boundary(
            pending=pending,
            settle=(lambda: applied.extend(settle())) if pending else None).changed
        if took_part or changed:
            self._load_start()
        self._tally.seconds += time.monotonic() - started
        return self._report(applied)

    def _complete_following(self) -> list[int]:
        """``_complete()`` for a member that took no part in the latest round: the local
        parameters move by what ``S`` moved."""
        before = self._fragment.outer_copy()
        applied = self._complete()
        if applied:
            self._fragment.rebase(before)
        return applied

    def finish(self) -> None:
        """Applies the exchange in flight to the shared state, syncs it (a collective),
        loads the outer parameters ``S`` into the model and resets the eager term."""
        self._complete()
        with torch.no_grad():
            for e in self._eager:
                e.zero_()
        if self._eager_opt is not None:
            for state in self._eager_opt.state.values():
                for value in state.values():
                    value.zero_()
        self._previous.zero_()
        super().finish()

    def _apply(self, fragment: Fragment) -> None:
        """``S <- Opt(S, G)`` (``G`` corrected first with ``correction``); the model gets
        ``S + E`` at the boundary (``_load_start``)."""
        if self.correction is None:
            fragment.outer_update()
            return
        momenta = [fragment.optimizer.state[o].get("momentum_buffer") for o in fragment.outer]
        fragment.outer_update(self.correction.correct_all(fragment.views(), momenta))

    def _start_exchange(self) -> None:
        """Starts the exchange of the buffer (this round's g_n) in the background."""
        self._pending.append(self._fragment.start_exchange(self._transport,
                                                           self._t + self.sync_every,
                                                           self.reject_nonfinite))

    def _start_point(self) -> list[torch.Tensor]:
        """Where the next round starts: ``S + E`` (``S`` with the stale rule)."""
        if self.rule == "stale":
            return list(self._outer)
        return [o + e for o, e in zip(self._outer, self._eager)]

    def _eager_step(self, fresh: torch.Tensor) -> None:
        """``E <- Opt_E(E, w * (g_n - g_{n-1}))``."""
        w = self.eager_weight
        if w is None:
            w = 1.0 / self._transport.world_size()
        correction = (fresh - self._previous).mul_(w)
        offset = 0
        for e in self._eager:
            e.grad = correction[offset:offset + e.numel()].view(e.shape)
            offset += e.numel()
        self._eager_opt.step()
        for e in self._eager:
            e.grad = None

    def _load_start(self) -> None:
        """The model := the start point of the next round."""
        with torch.no_grad():
            for p, s in zip(self._fragment.local, self._start_point()):
                p.copy_(s)
