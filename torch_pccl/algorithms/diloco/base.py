"""``OuterLoop``: what every DiLoCo wrapper shares.

It holds the model's trainable parameters and their outer copies, the
fragments, the step counter and the transport, and does what the three
wrappers do alike: the constructor's sync, the blocking exchange with retries
on a smaller world, waiting for an exchange in flight, the membership boundary
(``step += 1``, admit pending peers, sync the shared state), the shared state's
entries, leaving non-finite pseudo-gradients out of an exchange
(``reject_nonfinite``, ``torch_pccl.algorithms.finite``), the ``OuterStep`` reports
and ``finish()``. A sharded replica's parameters (DTensors: FSDP2, tensor parallel)
are worked on through their local shards (``shards``): the outer parameters, their
optimizer state and the exchanges are this process's shards. Each wrapper adds its
arguments, its fragments, ``step()`` and what the model gets from an outer
update (``_apply``).
"""

from __future__ import annotations

import abc
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ...elastic.shared_state import SyncResult
from ...elastic.topology import RETRYABLE_ERRORS
from ..finite import describe, exclude_nonfinite, is_finite
from ..topk import TopK
from . import shards, transport
from .fragment import (
    Exchange,
    Fragment,
    OuterOptimizerFactory,
    default_outer_optimizer,
    outer_optimizer_with_state,
)
from .quorum import Credit, Quorum, round_weights
from .report import OuterStep, Tally
from .transport import QUANTIZATION_BITS

__all__ = ["OuterLoop", "check_arguments"]

log = logging.getLogger("torch_pccl")


def check_arguments(sync_every: int, quantization: str | None, max_retries: int,
                    reject_nonfinite: bool = True, compression: TopK | None = None,
                    quorum: Quorum | None = None) -> None:
    """Raises ValueError for a bad argument common to every wrapper."""
    if quorum is not None and not isinstance(quorum, Quorum):
        raise ValueError(f"quorum must be None or a Quorum, got {quorum!r}")
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    if quantization not in QUANTIZATION_BITS:
        raise ValueError(f"quantization must be None, 'int8' or 'int4', got {quantization!r}")
    if compression is not None and not isinstance(compression, TopK):
        raise ValueError(f"compression must be None or a TopK, got {compression!r}")
    if compression is not None and quantization is not None:
        raise ValueError("quantization and compression are exclusive: TopK quantizes its "
                         "values itself (bits)")
    if not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
    if not isinstance(reject_nonfinite, bool):
        raise ValueError(f"reject_nonfinite must be True or False, got {reject_nonfinite!r}")


class OuterLoop(abc.ABC):
    """The parts the DiLoCo wrappers share (see the module docstring).

    A wrapper's constructor calls ``OuterLoop.__init__`` (the common arguments
    checked, no communication), builds its fragments with ``_new_fragment``
    and hands them to ``_join`` (the constructor's sync, a collective).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: OuterOptimizerFactory | None, sync_every: int,
                 quantization: str | None, max_retries: int, reject_nonfinite: bool,
                 compression: TopK | None = None, quorum: Quorum | None = None):
        check_arguments(sync_every, quantization, max_retries, reject_nonfinite, compression,
                        quorum)
        self.quorum = quorum
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.quantization = quantization
        self.compression = compression
        self.max_retries = max_retries
        self.reject_nonfinite = reject_nonfinite
        self._factory = outer_optimizer or default_outer_optimizer
        named = shards.trainable(model)
        if not named:
            raise ValueError("the model has no parameter with requires_grad")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) \
            else torch.float32
        self._wire_dtype = torch.float32 if QUANTIZATION_BITS[quantization] or compression \
            else self._dtype
        self._outer = [shards.local(p).detach().to("cpu", self._dtype, copy=True).contiguous()
                       for p in self._params]
        self._fragments: list[Fragment] = []
        self._step = torch.zeros((), dtype=torch.int64)
        # The exchanges in flight, in issue order (the order every peer waits in).
        self._pending: deque[Exchange] = deque()
        self._hook = None
        self.last_outer_step: OuterStep | None = None
        self._tally = Tally()
        # A quorum's bookkeeping (DiLoCo and AsyncDiLoCo: one stream of rounds).
        self._credit = Credit()
        self._asked: int | None = None      # the round whose ready went out ahead

    def _new_fragment(self, index: int, indices: Iterable[int], offset: int = 0) -> Fragment:
        """Fragment ``index`` of the trainable parameters at ``indices`` (ascending), its
        outer optimizer's state created now."""
        indices = list(indices)
        outer = [self._outer[i] for i in indices]
        return Fragment(index, [self._names[i] for i in indices],
                        [self._params[i] for i in indices], outer,
                        outer_optimizer_with_state(self._factory, outer), self._wire_dtype,
                        offset, self.compression)

    def _join(self, fragments: Sequence[Fragment], group, timeout) -> None:
        """Makes the transport and runs the constructor's sync (a collective): the model
        gets the group's outer parameters and the inner step count resumes the group's."""
        self._fragments = list(fragments)
        self._transport = transport.transport_for(group, timeout,
                                                  QUANTIZATION_BITS[self.quantization])
        # The group's last revision (a peer that never synced here passes 0 and adopts it).
        self._revision = self._transport.shared_revision()
        self._sync(advance=False)
        self._load_outer()
        self._t = int(self._step) * self.sync_every
        self._tally.traffic = self._transport.traffic()

    # -- public API ----------------------------------------------------------------

    @property
    def outer_parameters(self) -> list[torch.Tensor]:
        """The shared outer parameters (CPU), in the order of the model's trainable parameters.

        Identical on every peer after each sync; evaluate these (or ``finish()``,
        after which the model holds them). Do not modify them. Of a DTensor parameter,
        the outer copy of this process's local shard (its shape is the local one).
        """
        return list(self._outer)

    def outer_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name -> outer parameter, for ``model.load_state_dict(..., strict=False)``.

        A DTensor parameter's entry is a DTensor too: this process's outer shard (CPU)
        on the parameter's mesh, with its placements and global shape.
        """
        return {name: shards.wrap_like(p, outer)
                for name, p, outer in zip(self._names, self._params, self._outer)}

    @property
    def step_count(self) -> int:
        """The shared outer-step counter (outer rounds of H inner steps done by the group)."""
        return int(self._step)

    def state(self) -> dict[str, torch.Tensor]:
        """The shared state, by reference: ``outer/<param name>``, ``outer_opt/<param
        name>/<key>`` (e.g. ``momentum_buffer``) and ``step`` (int64, 0-dim). Of a
        DTensor parameter, the entries are this process's local shards: the state a
        group of the same shard index in every replica shares."""
        out: dict[str, torch.Tensor] = {}
        for name, t in zip(self._names, self._outer):
            out[f"outer/{name}"] = t
        for fragment in self._fragments:
            out.update(fragment.optimizer_state())
        out["step"] = self._step
        return out

    @abc.abstractmethod
    def step(self) -> OuterStep | None:
        """Call after every ``inner_optimizer.step()``; runs the outer work due at this step."""

    def finish(self) -> None:
        """Ends training in parity: completes the exchanges in flight, syncs the shared
        state once more (a collective of every peer) and copies the outer parameters
        into the model (local progress since the last outer update is dropped).

        Raises:
            As ``step()``.
        """
        self._reshard()
        self._complete()
        self._sync(advance=True)
        self._load_outer()

    def __enter__(self):
        """Runs ``step()`` after every ``inner_optimizer.step()`` (a post-step hook) until
        ``__exit__``; the latest ``OuterStep`` is kept in ``last_outer_step``."""
        if self._hook is None:
            self._hook = self.inner_optimizer.register_step_post_hook(self._on_inner_step)
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _on_inner_step(self, optimizer, args, kwargs) -> None:
        self.step()                     # an OuterStep lands in last_outer_step

    # -- the pieces ----------------------------------------------------------------

    @abc.abstractmethod
    def _apply(self, fragment: Fragment) -> None:
        """The outer update of ``fragment`` with the average in its buffer, and what the
        model gets from it."""

    def _exchange(self, fragment: Fragment, weights: dict[str, float] | None = None) -> None:
        """Blocking exchange of the fragment's buffer: an AVG all-reduce in place
        (non-finite contributions left out with ``reject_nonfinite``) or, sparse, the
        all-gather of the payloads decoded into it (non-finite payloads always left
        out); on a network error, shrink and retry (the same payload, sparse).

        ``weights`` (a quorum round: peer id -> merging weight; the others send zeros):
        the weighted mean over the members present when it completes. The buffer then
        holds ``w * delta`` (dense) or this peer's payload of ``delta`` (sparse, weighed
        at decoding), and every member scales alike once it completes."""
        tries = 0
        self._transport.begin_exchange(fragment.buffer)
        while True:
            try:
                contribution = fragment.buffer.clone() \
                    if self.reject_nonfinite and fragment.sparse is None else None
                fragment.exchange(self._transport, async_op=False)
                per_rank = self._per_rank(weights)
                rejected = self._settle(fragment, per_rank)
                if contribution is not None:
                    rejected = self._screen(fragment.buffer, contribution)
                self._weigh(fragment, per_rank, rejected)
                # The buffer keeps the average until the fragment's next fill: a survivor
                # that missed this exchange gets it from here (all or nothing).
                self._transport.end_exchange(fragment.buffer)
                return
            except RETRYABLE_ERRORS:
                if tries >= self.max_retries:
                    raise
            tries += 1
            self._update(retry=True, admit=False)
            if self._transport.rolled_forward():
                return

    def _wait(self, exchange: Exchange) -> Fragment:
        """Waits for an exchange in flight; returns its fragment, whose buffer holds the
        average (non-finite contributions left out when the exchange kept a copy of this
        peer's; a quorum round's weighted mean). If it failed (a peer died), the group is
        rebuilt once per epoch and the exchange redone, blocking, on the new world (a
        failed all-reduce, or a failed ``exclude_nonfinite``, leaves its buffer as this
        peer's contribution)."""
        fragment, contribution = exchange.fragment, exchange.contribution
        per_rank = exchange.per_rank
        try:
            exchange.work.wait()
            rejected = self._settle(fragment, per_rank)
            if contribution is not None and self._transport.epoch() == exchange.epoch:
                rejected = self._screen(fragment.buffer, contribution)
                self._weigh(fragment, per_rank, rejected)
                return fragment
        except RETRYABLE_ERRORS:
            if self._transport.epoch() == exchange.epoch:
                self._update(retry=True, admit=False)
            self._exchange(fragment, exchange.weights)
            return fragment
        if contribution is not None and not is_finite(fragment.buffer):
            # Completed in an epoch left since: its contributors cannot be gathered any
            # more, so it is redone on the new world like a failed one.
            fragment.buffer.copy_(contribution)
            self._exchange(fragment, exchange.weights)
            return fragment
        self._weigh(fragment, per_rank, rejected)
        return fragment

    def _per_rank(self, weights: dict[str, float] | None) -> list[float] | None:
        """A quorum round's weights (peer id -> weight) per rank of the current epoch (0
        for a member that takes no part); None without a quorum."""
        if weights is None:
            return None
        return [weights.get(pid, 0.0) for pid, _ in self._transport.members()]

    @staticmethod
    def _weigh(fragment: Fragment, per_rank: list[float] | None, rejected: list[int]) -> None:
        """A dense quorum exchange's average made the weighted mean: the AVG divided
        ``sum_i w_i delta_i`` by the ranks it kept, so ``n_kept / sum(w_kept)`` finishes it
        (the same float ops on every member). A sparse one weighed at decoding."""
        if per_rank is None or fragment.sparse is not None:
            return
        kept = [w for r, w in enumerate(per_rank) if r not in rejected]
        total = sum(kept)
        fragment.buffer.mul_(len(kept) / total if total else 0.0)

    def _quorum_round(self, round_: int, credit: Credit, tokens: int,
                      patience: int = 0) -> dict | None:
        """A quorum's check of round ``round_`` for a stream whose ``credit`` already
        counts this inner step (trained on ``tokens``): the round's announcement once it
        closed (with this peer or without it), else None.

        This peer is ready once it has done its H inner steps; it tells the master one
        inner step ahead. It then trains on for up to ``patience`` more inner steps while
        the round is open (Streaming and async DiLoCo: their exchange overlaps training
        anyway, so the round's grace window need not stop it), and past them waits for
        the close."""
        if credit.since >= self.sync_every + patience:
            self._asked = None
            return self._transport.quorum_ready(round_, credit.tokens, credit.missed,
                                                self.quorum.min_peers, self.quorum.grace)
        closed = self._transport.quorum_closed(round_)
        if closed is None and credit.since >= self.sync_every - 1 and self._asked != round_:
            # Ready one inner step ahead, counting the last step's tokens as this one's:
            # the master's round trip (a whole round's cost with no straggler: +3.0 %
            # wall-clock across the emulated WAN) runs during that step.
            ahead = tokens if credit.since == self.sync_every - 1 else 0
            self._transport.quorum_early(round_, credit.tokens + ahead, credit.missed,
                                         self.quorum.min_peers, self.quorum.grace)
            self._asked = round_
        if closed is not None:
            self._asked = None
        return closed

    def _quorum_weights(self, announcement: dict) -> tuple[dict[str, float], bool]:
        """A closed round's merging weights (participant id -> weight) and whether this
        peer is a participant; the round goes into the next ``OuterStep``."""
        ids = list(announcement["peer_ids"])
        weights = round_weights(ids, announcement["tokens"], announcement["stale"])
        late = tuple(sorted(pid for pid, _ in self._transport.members() if pid not in weights))
        self._tally.quorum_round(tuple(ids), late)
        return weights, self._transport.peer_id() in weights

    def _quorum_fill(self, fragment: Fragment, weights: dict[str, float], took_part: bool,
                     credit: Credit, contribution: torch.Tensor | None = None) -> None:
        """The fragment's buffer for a closed round: a participant's pseudo-gradients
        (``outer - local``, or ``contribution``) times its weight (sparse: weighed at
        decoding), its ``credit`` settled; any other member's zeros, one more round
        missed."""
        if took_part:
            if contribution is None:
                fragment.fill()
            else:
                fragment.fill_from(contribution)
            if fragment.sparse is None:
                fragment.buffer.mul_(weights[self._transport.peer_id()])
            credit.took_part()
        else:
            fragment.abstain()
            credit.missed += 1

    def _quorum_exchange(self, fragment: Fragment, announcement: dict) -> bool:
        """The blocking exchange and outer update of a closed quorum round
        (``announcement``): a participant sends its weighted pseudo-gradients and takes
        the outer parameters; any other member sends zeros and moves its local parameters
        by what the outer ones moved (``_follow``). Whether this peer took part."""
        weights, took_part = self._quorum_weights(announcement)
        self._quorum_fill(fragment, weights, took_part, self._credit)
        self._exchange(fragment, weights)
        if took_part:
            fragment.outer_update()
            fragment.load()
        else:
            self._follow(fragment)
        return took_part

    def _follow(self, fragment: Fragment) -> None:
        """The outer update of a round this peer took no part in: the local parameters
        move by what the outer ones moved (``Fragment.rebase``), so what it trained since
        it last took part stays in ``outer - local`` for its next round."""
        before = fragment.outer_copy()
        fragment.outer_update()
        fragment.rebase(before)

    def _settle(self, fragment: Fragment, weights: list[float] | None = None) -> list[int]:
        """The sparse exchange's decoding into the fragment's buffer (``weights``: one per
        rank, ``Fragment.settle``); the peers whose non-finite payloads it left out are
        logged and go into the next ``OuterStep``; their ranks."""
        if fragment.sparse is None:
            return []
        members = self._transport.members()
        rejected = fragment.settle(members, weights)
        if rejected:
            log.warning("sparse exchange of fragment %d: rejected the non-finite payload of "
                        "%s", fragment.index, ", ".join(describe(r, members) for r in rejected))
            self._tally.rejected.extend(members[r][0] for r in rejected)
        return rejected

    def _screen(self, buf: torch.Tensor, contribution: torch.Tensor) -> list[int]:
        """``exclude_nonfinite`` on an exchange's average ``buf``: the rejected peers'
        ids go into the next ``OuterStep``; their ranks."""
        if is_finite(buf):           # the common case: one pass, nothing more
            return []
        members = self._transport.members()
        rejected = exclude_nonfinite(buf, contribution, dist.ReduceOp.AVG,
                                     self._transport.world_size(), self._transport.all_gather,
                                     members)
        self._tally.rejected.extend(members[r][0] for r in rejected)
        return rejected

    def _complete(self, until: int | None = None) -> list[int]:
        """Waits for and applies the exchanges in flight, in issue order: those applied
        at inner step ``until`` or before (None: all); the indices of their fragments."""
        done = []
        while self._pending and (until is None or self._pending[0].apply_at <= until):
            exchange = self._pending.popleft()
            fragment = self._wait(exchange)
            if exchange.took_part:
                self._apply(fragment)
            else:
                self._follow(fragment)
            done.append(fragment.index)
        return done

    def _boundary(self, pending: bool | None = None,
                  settle: Callable[[], None] | None = None) -> SyncResult:
        """step += 1, admit pending peers, sync the shared state (the model is left alone).

        ``pending``: whether peers wait for admission, as every member was told (a quorum
        round's announcement); None: ask the master (a keyed pending query). ``settle``:
        called before a topology update or a sync, never at a boundary passed quiet (the
        exchanges still in flight complete there: a new epoch cannot carry them, and the
        vote compares every peer's outer state, which they have yet to change)."""
        settle = settle or (lambda: None)
        self._step += 1
        self._transport.report_step(int(self._step))
        if self._transport.errored():
            settle()
            if self._transport.errored():
                # A member was lost after this peer's exchange completed: the others may
                # be recovering (and need this peer's result) in an update round; join it.
                self._update(retry=True, admit=False)
        told = pending is not None
        if not told:
            try:
                pending = self._transport.peers_pending()
            except RETRYABLE_ERRORS:
                settle()
                self._update(retry=True)        # admits the pending peers as well
                # Asked again in the new epoch, without the master: quiet if the others
                # had passed this boundary quiet (docs/membership.md, "Quiet epochs").
                pending = self._transport.peers_pending()
        if pending:
            settle()
            self._update(retry=False)
        elif pending is False and not told and self._transport.quiet():
            # A quiet epoch (nobody pending since it formed: no round trip, no vote at an
            # outer step), or the master is away (or members are re-registering with a new
            # one): nobody can join, and every member got a quiet answer to this query, so
            # all skip this sync alike (docs/membership.md, "Quiet epochs").
            return SyncResult(revision=self._revision, content=self.last_sync.content,
                              bytes_sent=0, bytes_received=0, changed=(), sources=(),
                              retries=0, seconds=0.0)
        settle()
        return self._sync(advance=True)

    def _update(self, retry: bool, admit: bool = True) -> None:
        """``update_topology``; ``admit`` False inside an outer step (a retried exchange):
        a joiner lines up with the members only at a boundary, so it waits for the next."""
        self._tally.topology_changed(self._transport.update_topology(admit), retry)

    def _sync(self, advance: bool) -> SyncResult:
        """sync_shared_state at the next revision (``advance``) or the current one (the
        constructor); the model is left alone."""
        revision = self._revision + 1 if advance else self._revision
        res = self._transport.sync(self.state(), revision, self.max_retries)
        self.last_sync = res
        self._revision = res.revision
        self._tally.retries += res.retries
        return res

    def _reshard(self) -> None:
        """FSDP2 modules resharded (``shards.reshard``): the model's next forward sees
        what is written to the local shards. Every ``step()`` that reads or writes the
        model's parameters starts with it."""
        shards.reshard(self.model)

    def _load_outer(self, changed: Iterable[str] | None = None) -> None:
        """Copies the outer parameters into the model (its local shards): all of them, or
        those whose ``outer/<name>`` entry is in ``changed`` (a sync overwrote them: this
        peer had drifted)."""
        changed = None if changed is None else set(changed)
        self._reshard()
        with torch.no_grad():
            for name, p, outer in zip(self._names, self._params, self._outer):
                if changed is None or f"outer/{name}" in changed:
                    shards.local(p).copy_(outer)

    def _report(self, applied: Sequence[int]) -> OuterStep:
        traffic = self._transport.traffic()
        result = self._tally.report(int(self._step), self._transport.world_size(), traffic,
                                    applied)
        self.last_outer_step = result
        return result
