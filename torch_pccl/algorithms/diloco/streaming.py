"""``StreamingDiLoCo`` (Douillard et al., arXiv 2501.18512): P fragments on staggered
schedules, each exchange overlapped with ``tau`` inner steps, merged with ``alpha``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from ...elastic.topology import RETRYABLE_ERRORS
from ..topk import TopK
from . import schedule
from .base import OuterLoop, check_arguments
from .fragment import Exchange, Fragment
from .overlap import TauChooser
from .quorum import Credit, Quorum
from .report import OuterStep

__all__ = ["StreamingDiLoCo"]

MAX_QUORUM_FRAGMENTS = 16
"""With a quorum, a member late for every round of an outer step still reads their
announcements afterwards: the master keeps the latest 16 closed rounds and so does each
member's mailbox (master/quorum.py ``MAX_HISTORY``), and the boundary's sync keeps the
members within one outer step of each other, P rounds."""


class StreamingDiLoCo(OuterLoop):
    """Streaming DiLoCo (Douillard et al., arXiv 2501.18512): fragments on staggered
    schedules, overlapped with training, merged with ``alpha``.

    The trainable parameters are split into P fragments (default: *strided*
    block assignment, ``strided_fragments``; or explicit ``fragments``).
    Fragment p sends at the inner steps t with ``(t - t_p) % H == 0`` (default
    ``t_p = p * H // P``, so one fragment is on the wire at a time and the peak
    traffic per exchange is 1/P of DiLoCo's). Its pseudo-gradients are
    all-reduced in the background (``async_op=True``; with the group's lanes
    several exchanges run at once) while training continues; at ``t + tau`` the
    average is waited for, the fragment's outer optimizer steps, and the local
    parameters are merged ``local = alpha * local + (1 - alpha) * outer``
    (``tau = 0``: the exchange blocks and ``local = outer``). Each fragment has
    its own instance of the outer optimizer.

    Every H steps (t % H == 0) comes the membership boundary: ``step += 1``,
    pending peers are admitted, and the shared state is synchronised, in that
    order. The exchanges still in flight run across a boundary passed quiet
    (no peer pending and no vote: docs/membership.md, "Quiet epochs") and are
    applied at their own step; a boundary that admits a peer or votes completes
    them first (applied early), since a new epoch cannot carry them and the
    vote compares every peer's outer state. The sends due at the boundary go
    out after it (tau > 0), so a joiner, whose constructor is the incumbents'
    sync, takes part in them with a zero pseudo-gradient (it has not trained:
    its local parameters are the outer ones). An exchange that fails because a
    peer died is redone, blocking, on the smaller world when it is waited for.
    With ``reject_nonfinite`` an exchange in flight keeps a copy of this peer's
    pseudo-gradients, and its average is checked when it is waited for.

    With ``tau=None`` (the default) tau is sized from the measured exchange
    time (``overlap.TauChooser``): every peer counts the inner steps each of
    its exchanges took (seen complete at a step, or waited for), proposes the
    longest of the round, and the group takes the largest proposal (a MAX
    all-reduce of one int64, sent in the background at each boundary and read
    at the next), so tau changes at boundaries, alike on every peer (it is
    part of the shared state: ``streaming/tau``). It starts at 1 and stays
    within the shortest spacing between two fragments' sends
    (``schedule.send_spacing``; H // P with the default offsets): past it the
    fragments' exchanges overlap, share the link and each takes longer, so
    the measured time grows with tau itself, and staleness costs quality (on
    the emulated WAN, an uncapped tau climbed to H - 1 = 19 and the eval loss
    at equal tokens rose 3.4 % above tau = 5's, docs/wan-training.md).

    With ``quorum`` (docs/diloco.md, "Stragglers: quorum rounds") the group holds one
    quorum round per fragment send, P per outer step, in the order the fragments send
    (``schedule.cycle_order``), each fragment keeping its own count of what this peer
    trained for it (``quorum.Credit``). A peer is ready for a fragment's round once it
    has done H inner steps since it last took part in one of that fragment's rounds
    (the first: at the fragment's offset); it tells the master one inner step ahead
    and trains on while the round is open, waiting for the close only when the next
    fragment is due (``send_spacing - 1`` inner steps later). Then the round's exchange
    goes out in the background, as without a quorum: a participant sends its
    token-weighted pseudo-gradients and applies the weighted mean tau inner steps later
    (merged with ``alpha``); a member that was not ready sends zeros at its next inner
    step, and follows the outer update at once (``local += outer_new - outer_old``: its
    work for that fragment stays owed to the fragment's next round, weighted by
    1 / (1 + rounds missed)). The membership boundary (``step += 1``, admissions, the sync) comes once
    the last round of the outer step has been applied; peers then run unequal numbers
    of inner steps, so end a training loop on ``step_count``.

    Args:
        num_fragments: P (ignored when ``fragments`` is given).
        fragment_offsets: t_p per fragment, ints in 0 .. H - 1.
        tau: overlap in inner steps, 0 .. H - 1 (the paper's main runs: 1), or
            None: sized from the measured exchange time, as above (with H = 1,
            0).
        alpha: merge weight of the local parameters, in [0, 1] (paper: 0.5).
        fragments: explicit list of lists of the model's trainable parameters
            (each in exactly one list).
        compression: as ``DiLoCo``; each fragment has its own error-feedback
            accumulator and payload.
        quorum: None, or a ``Quorum(min_peers, grace)``: rounds per fragment send, as
            above.
        the others: as ``DiLoCo``.

    Raises:
        ValueError: as ``DiLoCo``, and bad fragments, offsets, tau or alpha; with a
            quorum, more than 16 fragments (``MAX_QUORUM_FRAGMENTS``).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None,
                 sync_every: int = 100, num_fragments: int = 4,
                 fragment_offsets: Sequence[int] | None = None, tau: int | None = None,
                 alpha: float = 0.5, quantization: str | None = None,
                 fragments: Sequence[Sequence[torch.Tensor]] | None = None, group=None,
                 max_retries: int = 3, timeout: float | timedelta | None = None,
                 reject_nonfinite: bool = True, compression: TopK | None = None,
                 quorum: Quorum | None = None):
        # The common arguments are checked before tau and alpha (and again by OuterLoop).
        check_arguments(sync_every, quantization, max_retries, reject_nonfinite, compression,
                        quorum)
        if tau is not None and (not isinstance(tau, int) or not 0 <= tau < sync_every):
            raise ValueError(f"tau must be None or an int in 0 .. sync_every - 1 = "
                             f"{sync_every - 1}, got {tau!r}")
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        super().__init__(model, inner_optimizer, outer_optimizer, sync_every, quantization,
                         max_retries, reject_nonfinite, compression, quorum)
        self._alpha = float(alpha)
        if fragments is None:
            parts = schedule.strided_fragments(self._names, num_fragments,
                                               [p.numel() for p in self._params])
        else:
            parts = _explicit_fragments(fragments, self._params, self._names)
        if fragment_offsets is None:
            fragment_offsets = schedule.fragment_offsets(sync_every, len(parts))
        offsets = list(fragment_offsets)
        if len(offsets) != len(parts) or not all(
                isinstance(o, int) and 0 <= o < sync_every for o in offsets):
            raise ValueError(f"fragment_offsets must be {len(parts)} ints in "
                             f"0 .. {sync_every - 1}, got {offsets!r}")
        # The automatic tau: this peer's measurements, the group's agreed value (a shared
        # state entry) and the MAX all-reduce of the proposals in flight.
        self._chooser = None
        if tau is None and sync_every > 1:
            self._chooser = TauChooser(sync_every,
                                       max_tau=schedule.send_spacing(sync_every, offsets))
        self._tau_agreed = torch.tensor(1 if self._chooser else (tau or 0), dtype=torch.int64)
        self._proposal: tuple[torch.Tensor, object] | None = None
        self._returned: float | None = None
        if quorum is not None and len(parts) > MAX_QUORUM_FRAGMENTS:
            raise ValueError(f"a quorum holds at most {MAX_QUORUM_FRAGMENTS} fragments' rounds "
                             f"per outer step, got {len(parts)} fragments")
        # A quorum's rounds: the fragments in the order they send, the next one's position
        # in that order, each fragment's credit (the first round of a fragment comes at its
        # offset) and the latest announcement (whether peers wait, for the boundary).
        self._order = schedule.cycle_order(sync_every, offsets)
        # A ready peer trains on while its round is open, until the next fragment is due.
        self._patience = schedule.send_spacing(sync_every, offsets) - 1
        self._position = 0
        self._credits = [Credit(since=sync_every - schedule.first_send(sync_every, o))
                         for o in offsets]
        self._announced: dict = {}
        self._join([self._new_fragment(p, part, offset)
                    for p, (part, offset) in enumerate(zip(parts, offsets))], group, timeout)
        # A joiner sends what the incumbents send right after the sync it joined in.
        self._propose_tau()
        if self.tau > 0 and self._t > 0 and quorum is None:
            for fragment in self._due():
                self._issue(fragment)

    @property
    def tau(self) -> int:
        """The overlap in inner steps of the exchanges sent now (fixed, or the group's
        agreed automatic value)."""
        return int(self._tau_agreed)

    def state(self) -> dict[str, torch.Tensor]:
        """As ``OuterLoop.state``, and ``streaming/tau`` (int64, 0-dim) with an automatic tau."""
        out = super().state()
        if self._chooser is not None:
            out["streaming/tau"] = self._tau_agreed
        return out

    def finish(self) -> None:
        """As ``OuterLoop.finish``; with an automatic tau, the proposal in flight is waited
        for first (it agrees on tau, as at a boundary)."""
        self._agree_tau()
        super().finish()

    @property
    def fragments(self) -> list[list[str]]:
        """The parameter names of each fragment."""
        return [list(f.names) for f in self._fragments]

    @property
    def fragment_offsets(self) -> list[int]:
        """t_p of each fragment."""
        return [f.offset for f in self._fragments]

    def step(self, tokens: int = 1) -> OuterStep | None:
        """Call after every ``inner_optimizer.step()``; runs the outer work due at this step.

        Args:
            tokens: what this inner step trained on, for a quorum's token-weighted
                merging (default 1); unused without ``quorum``.

        Returns:
            An ``OuterStep`` on every call that applied an outer update or ran the
            membership boundary (every ``sync_every``-th call; with a quorum, once the
            outer step's last round was applied), else None.

        Raises:
            ValueError: ``tokens`` is not an int >= 0 (with a quorum).
            The last network ``PcclError`` when ``max_retries`` topology updates
            did not help; errors of ``update_topology`` / ``sync_shared_state``.
        """
        started = time.monotonic()
        if self._chooser is not None and self._returned is not None:
            self._chooser.inner_step(started - self._returned)
        if self.quorum is not None:
            return self._quorum_step(tokens, started)
        self._t += 1
        self._reshard()
        self._poll()
        applied = self._complete(until=self._t)
        if self.tau == 0:
            for fragment in self._due():
                fragment.fill()
                self._exchange(fragment)
                self._apply(fragment)
                applied.append(fragment.index)
        boundary = self._t % self.sync_every == 0
        if boundary:
            self._agree_tau()
            changed = self._boundary(settle=lambda: applied.extend(self._complete())).changed
            self._load_outer(changed)
        self._tally.seconds += time.monotonic() - started
        # Counted before the sends below go out: their bytes belong to the OuterStep
        # that applies them.
        result = self._report(applied) if applied or boundary else None
        started = time.monotonic()
        if boundary:
            self._propose_tau()
        if self.tau > 0:
            for fragment in self._due():
                self._issue(fragment)
        self._returned = time.monotonic()
        self._tally.seconds += self._returned - started
        return result

    def _quorum_step(self, tokens: int, started: float) -> OuterStep | None:
        """``step()`` with a quorum: the rounds of this outer step in send order, as many as
        are decided now (this peer ready: it waits for the close; not ready: closed
        without it), each exchange issued in the background; then, once the last round of
        the outer step is applied, the membership boundary."""
        if type(tokens) is not int or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        self._t += 1
        for credit in self._credits:
            credit.train(tokens)
        self._reshard()
        self._poll()
        applied = self._complete(until=self._t)
        rounds = len(self._order)
        while self._position < rounds:
            p = self._order[self._position]
            # Named by the revision the outer step started from and the position in it:
            # equal on every member, rising, and P of them between two syncs.
            announcement = self._quorum_round(self._revision * rounds + self._position,
                                              self._credits[p], tokens, self._patience)
            if announcement is None:
                break
            self._quorum_issue(self._fragments[p], announcement)
            self._announced = announcement
            self._position += 1
            applied.extend(self._complete(until=self._t))
        boundary = self._position == rounds and not self._pending
        if boundary:
            self._agree_tau()
            # Every member was told whether peers wait: no pending query of its own.
            changed = self._boundary(pending=self._announced.get("pending", 0) > 0).changed
            self._load_outer(changed)
            self._position = 0
        self._tally.seconds += time.monotonic() - started
        result = self._report(applied) if applied or boundary else None
        if boundary:
            self._propose_tau()
        self._returned = time.monotonic()
        return result

    def _quorum_issue(self, fragment: Fragment, announcement: dict) -> None:
        """A closed round's exchange of ``fragment``, in the background: a participant's
        weighted pseudo-gradients, applied tau inner steps from now (``_apply``), or a
        member's zeros, applied as soon as it completes (``_follow``): a member that was
        late does not hold the next boundary back by tau more of its steps."""
        weights, took_part = self._quorum_weights(announcement)
        self._quorum_fill(fragment, weights, took_part, self._credits[fragment.index])
        apply_at = self._t + self.tau if took_part else self._t
        self._pending.append(fragment.start_exchange(
            self._transport, apply_at, self.reject_nonfinite, sent_at=self._t,
            weights=weights, took_part=took_part))

    def _due(self) -> list[Fragment]:
        """The fragments that send at this inner step."""
        due = schedule.fragments_due(self._t, self.sync_every, self.fragment_offsets)
        return [self._fragments[p] for p in due]

    def _issue(self, fragment: Fragment) -> None:
        """Starts the fragment's exchange in the background; applied at t + tau."""
        fragment.fill()
        self._pending.append(fragment.start_exchange(self._transport, self._t + self.tau,
                                                     self.reject_nonfinite, sent_at=self._t))

    def _poll(self) -> None:
        """The automatic tau's measurement: the exchanges in flight that completed during
        the last inner step (their length: the steps since they were sent)."""
        if self._chooser is None:
            return
        for exchange in self._pending:
            if exchange.done_at is None and exchange.work.is_completed():
                exchange.done_at = self._t
                self._chooser.completed(self._t - exchange.sent_at)

    def _wait(self, exchange: Exchange) -> Fragment:
        """``OuterLoop._wait``; with an automatic tau, an exchange not seen complete yet is
        measured by how long this peer waits for it."""
        if self._chooser is None or exchange.done_at is not None:
            return super()._wait(exchange)
        started = time.monotonic()
        fragment = super()._wait(exchange)
        exchange.done_at = self._t
        self._chooser.waited(self._t - exchange.sent_at, time.monotonic() - started)
        return fragment

    def _propose_tau(self) -> None:
        """Sends this peer's proposal (a MAX all-reduce in the background, read at the next
        boundary by ``_agree_tau``)."""
        if self._chooser is None:
            return
        proposal = torch.tensor([self._chooser.propose()], dtype=torch.int64)
        self._proposal = (proposal, self._transport.all_reduce_max(proposal))

    def _agree_tau(self) -> None:
        """tau := the largest proposal sent at the last boundary. When that all-reduce
        failed (a peer died), tau stays: a peer whose copy completed may differ until the
        next vote (every new epoch's first boundary votes) repairs ``streaming/tau``."""
        if self._proposal is None:
            return
        proposal, work = self._proposal
        self._proposal = None
        try:
            work.wait()
        except RETRYABLE_ERRORS:
            return
        self._tau_agreed.fill_(int(proposal[0]))

    def _apply(self, fragment: Fragment) -> None:
        """Outer step of the fragment, then merge: local = outer (tau = 0), else
        ``alpha * local + (1 - alpha) * outer``."""
        fragment.outer_update()
        if self.tau == 0:
            fragment.load()
        else:
            fragment.merge(self._alpha)


def _explicit_fragments(fragments: Sequence[Sequence[torch.Tensor]],
                        params: Sequence[torch.Tensor], names: Sequence[str]) -> list[list[int]]:
    """The ``fragments`` argument as ascending indices into ``params``.

    Raises:
        ValueError: a tensor that is not in ``params``, in two fragments or in none;
            an empty fragment or no fragment.
    """
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    out = []
    for k, frag in enumerate(fragments):
        idx = []
        for p in frag:
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"fragments[{k}] holds a tensor that is not a trainable "
                                 f"parameter of the model")
            if i in seen:
                raise ValueError(f"parameter {names[i]!r} is in two fragments")
            seen.add(i)
            idx.append(i)
        if not idx:
            raise ValueError(f"fragments[{k}] is empty")
        out.append(sorted(idx))
    missing = [names[i] for i in range(len(params)) if i not in seen]
    if missing:
        raise ValueError(f"parameters in no fragment: {missing[:4]}")
    if not out:
        raise ValueError("fragments is empty")
    return out
