"""DiLoCo, Streaming DiLoCo and AsyncDiLoCo (being split into one module per variant)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from ...elastic.topology import RETRYABLE_ERRORS
from . import transport
from .schedule import fragment_offsets, fragments_due, pseudo_gradient, strided_fragments
from .transport import QUANTIZATION_BITS

__all__ = ["AsyncDiLoCo", "DiLoCo", "OuterStep", "StreamingDiLoCo", "default_outer_optimizer"]


def default_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The papers' outer optimizer: ``SGD(params, lr=0.7, momentum=0.9, nesterov=True)``."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class OuterStep:
    """What one ``step()`` (or the exchange it completed) did on this peer.

    Attributes:
        step: the shared outer-step counter after the call (outer rounds of H
            inner steps completed by the group).
        world_size: the group's size after the call.
        bytes_sent, bytes_received: data-plane bytes of this peer since the
            previous ``OuterStep`` (exchanges, membership queries, the
            shared-state sync; headers included).
        seconds: wall time this peer spent blocked in the outer machinery since
            the previous ``OuterStep`` (waiting for exchanges, outer steps,
            membership, the sync), seconds.
        retries: topology updates made after network failures (a lost peer).
        joined, left: master peer ids admitted / gone in those updates and in
            the admission of pending peers.
        fragments: the fragments whose outer update was applied in this call
            (``DiLoCo``: ``(0,)``; ``AsyncDiLoCo``: ``(0,)`` from its second
            boundary on; empty when the call only ran the membership boundary).
    """

    step: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    retries: int
    joined: tuple[str, ...]
    left: tuple[str, ...]
    fragments: tuple[int, ...] = ()


@dataclass
class _Pending:
    """An exchange in flight: fragment, the inner step it is applied at, its Work,
    its buffer (averaged in place) and the membership epoch it was issued in."""

    fragment: int
    apply_at: int
    work: object
    buf: torch.Tensor
    epoch: int


# -- DiLoCo --------------------------------------------------------------------


class DiLoCo:
    """DiLoCo (arXiv 2311.08105) over a pccl group, with membership at the outer steps.

    Every ``sync_every``-th call of ``step()`` is an *outer boundary*, in this order:

    1. the pseudo-gradients ``outer - local`` (CPU, float32) are averaged over
       the group (``dist.all_reduce`` AVG, or ``torch_pccl.all_reduce_quantized``
       with ``quantization``); on a network error (``RETRYABLE_ERRORS``: a peer
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
            ``requires_grad`` are the ones synchronised (buffers stay local).
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
        group: a pccl process group formed through a master (``pccl://`` or a
            fixed world with its automatic master); default the default group.
        max_retries: topology updates allowed per exchange after network
            failures (>= 0).
        timeout: deadline of the master's rounds (update, sync, pending
            query), seconds or timedelta; default as ``update_topology``.

    Attributes:
        last_sync: the ``SyncResult`` of the latest shared-state sync.

    Raises:
        ValueError: a bad argument (``sync_every``, ``quantization``,
            ``max_retries``, no trainable parameter, an outer optimizer with
            non-tensor state).
        InvalidUsageError: ``group`` is not a pccl group formed through a master.
        Errors of ``sync_shared_state`` (``MismatchError`` when peers built
            different models, network errors, ...).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None,
                 sync_every: int = 100, quantization: str | None = None, group=None,
                 max_retries: int = 3, timeout: float | timedelta | None = None):
        self._configure(model, inner_optimizer, outer_optimizer, sync_every, quantization,
                        group, max_retries, timeout, fragments=None, num_fragments=1,
                        offsets=[0], tau=0, alpha=0.0)

    # -- construction ------------------------------------------------------------

    def _configure(self, model, inner_optimizer, outer_optimizer, sync_every, quantization,
                   group, max_retries, timeout, fragments, num_fragments, offsets, tau,
                   alpha) -> None:
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if quantization not in QUANTIZATION_BITS:
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {quantization!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if not isinstance(tau, int) or not 0 <= tau < sync_every:
            raise ValueError(f"tau must be an int in 0 .. sync_every - 1 = {sync_every - 1}, "
                             f"got {tau!r}")
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        bits = QUANTIZATION_BITS[quantization]
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.quantization = quantization
        self.max_retries = max_retries
        self._tau = tau
        self._alpha = float(alpha)
        self._factory = outer_optimizer or default_outer_optimizer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameter with requires_grad")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) \
            else torch.float32
        self._wire_dtype = torch.float32 if bits else self._dtype
        self._outer = [p.detach().to("cpu", self._dtype, copy=True).contiguous()
                       for p in self._params]
        self._fragments = self._resolve_fragments(fragments, num_fragments)
        if offsets is None:
            offsets = fragment_offsets(sync_every, len(self._fragments))
        offsets = list(offsets)
        if len(offsets) != len(self._fragments) or not all(
                isinstance(o, int) and 0 <= o < sync_every for o in offsets):
            raise ValueError(f"fragment_offsets must be {len(self._fragments)} ints in "
                             f"0 .. {sync_every - 1}, got {offsets!r}")
        self._offsets = offsets
        self._outer_opts = [self._make_optimizer([self._outer[i] for i in f])
                            for f in self._fragments]
        self._buffers = [torch.empty(sum(self._outer[i].numel() for i in f),
                                     dtype=self._wire_dtype) for f in self._fragments]
        self._step = torch.zeros((), dtype=torch.int64)
        self._pending: deque[_Pending] = deque()
        self._hook = None
        self.last_outer_step: OuterStep | None = None
        self._reset_accumulators()
        self._transport = transport.transport_for(group, timeout, bits)
        # The group's last revision (a peer that never synced here passes 0 and adopts it).
        self._revision = self._transport.shared_revision()
        self._sync(copy="all")
        self._t = int(self._step) * sync_every
        self._traffic = self._transport.traffic()
        self._after_join()

    def _resolve_fragments(self, fragments, num_fragments) -> list[list[int]]:
        if fragments is None:
            numels = [p.numel() for p in self._params]
            return strided_fragments(self._names, num_fragments, numels)
        index = {id(p): i for i, p in enumerate(self._params)}
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
                    raise ValueError(f"parameter {self._names[i]!r} is in two fragments")
                seen.add(i)
                idx.append(i)
            if not idx:
                raise ValueError(f"fragments[{k}] is empty")
            out.append(sorted(idx))
        missing = [self._names[i] for i in range(len(self._params)) if i not in seen]
        if missing:
            raise ValueError(f"parameters in no fragment: {missing[:4]}")
        if not out:
            raise ValueError("fragments is empty")
        return out

    def _make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The outer optimizer over ``params`` with its per-parameter state created now."""
        opt = self._factory(params)
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

    def _after_join(self) -> None:
        """Called once the constructor's sync is done: a joiner catches up with what the
        group does right after its boundary sync (StreamingDiLoCo: its sends)."""
        if self._tau > 0 and self._t > 0:
            for p in fragments_due(self._t, self.sync_every, self._offsets):
                self._issue(p)

    # -- public API ----------------------------------------------------------------

    @property
    def outer_parameters(self) -> list[torch.Tensor]:
        """The shared outer parameters (CPU), in the order of the model's trainable parameters.

        Identical on every peer after each sync; evaluate these (or ``finish()``,
        after which the model holds them). Do not modify them.
        """
        return list(self._outer)

    def outer_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name -> outer parameter, for ``model.load_state_dict(..., strict=False)``."""
        return dict(zip(self._names, self._outer))

    @property
    def step_count(self) -> int:
        """The shared outer-step counter (outer rounds of H inner steps done by the group)."""
        return int(self._step)

    def state(self) -> dict[str, torch.Tensor]:
        """The shared state, by reference: ``outer/<param name>``, ``outer_opt/<param
        name>/<key>`` (e.g. ``momentum_buffer``) and ``step`` (int64, 0-dim)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in zip(self._names, self._outer):
            out[f"outer/{name}"] = t
        for frag, opt in zip(self._fragments, self._outer_opts):
            for i in frag:
                for key, value in opt.state[self._outer[i]].items():
                    out[f"outer_opt/{self._names[i]}/{key}"] = value
        out["step"] = self._step
        return out

    def step(self) -> OuterStep | None:
        """Call after every ``inner_optimizer.step()``; runs the outer work due at this step.

        Returns:
            An ``OuterStep`` on every call that applied an outer update or ran the
            membership boundary (DiLoCo: every ``sync_every``-th call), else None.

        Raises:
            The last network ``PcclError`` when ``max_retries`` topology updates
            did not help; errors of ``update_topology`` / ``sync_shared_state``.
        """
        self._t += 1
        t = self._t
        started = time.monotonic()
        applied: list[int] = []
        while self._pending and self._pending[0].apply_at <= t:
            applied.append(self._complete(self._pending.popleft()))
        if self._tau == 0:
            for p in fragments_due(t, self.sync_every, self._offsets):
                buf = self._fill(p)
                self._exchange(buf)
                self._apply(p, buf)
                applied.append(p)
        boundary = t % self.sync_every == 0
        if boundary:
            while self._pending:
                applied.append(self._complete(self._pending.popleft()))
            self._boundary()
        self._busy += time.monotonic() - started
        # Counted before the sends below go out: their bytes belong to the OuterStep
        # that applies them.
        result = self._report(applied) if applied or boundary else None
        if self._tau > 0:
            started = time.monotonic()
            for p in fragments_due(t, self.sync_every, self._offsets):
                self._issue(p)
            self._busy += time.monotonic() - started
        return result

    def finish(self) -> None:
        """Ends training in parity: completes the exchanges in flight, syncs the shared
        state once more (a collective of every peer) and copies the outer parameters
        into the model (local progress since the last outer update is dropped).

        Raises:
            As ``step()``.
        """
        while self._pending:
            self._complete(self._pending.popleft())
        self._sync(copy="all", advance=True)

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

    def _local_tensors(self, p: int) -> list[torch.Tensor]:
        return [self._params[i] for i in self._fragments[p]]

    def _fill(self, p: int) -> torch.Tensor:
        """Writes fragment p's pseudo-gradients ``outer - local`` into its exchange
        buffer; returns the buffer."""
        buf = self._buffers[p]
        offset = 0
        for i in self._fragments[p]:
            n = self._outer[i].numel()
            buf[offset:offset + n].copy_(
                pseudo_gradient(self._outer[i], self._params[i]).reshape(-1))
            offset += n
        return buf

    def _views(self, p: int, buf: torch.Tensor) -> list[torch.Tensor]:
        """Fragment p's slices of ``buf`` shaped like its outer parameters (outer dtype)."""
        out, offset = [], 0
        for i in self._fragments[p]:
            o = self._outer[i]
            out.append(buf[offset:offset + o.numel()].view(o.shape).to(o.dtype))
            offset += o.numel()
        return out

    def _exchange(self, buf: torch.Tensor) -> None:
        """Blocking AVG all-reduce of ``buf`` in place; on a network error, shrink and retry."""
        errors = RETRYABLE_ERRORS
        tries = 0
        while True:
            try:
                self._transport.all_reduce(buf, async_op=False)
                return
            except errors:
                if tries >= self.max_retries:
                    raise
            tries += 1
            self._update(retry=True)

    def _issue(self, p: int) -> None:
        """Starts fragment p's exchange in the background; applied at t + tau."""
        buf = self._fill(p)
        work = self._transport.all_reduce(buf, async_op=True)
        self._pending.append(_Pending(p, self._t + self._tau, work, buf,
                                      self._transport.epoch()))

    def _wait(self, pending: _Pending) -> torch.Tensor:
        """The averaged buffer of an exchange in flight. If it failed (a peer died), the
        group is rebuilt once per epoch and the exchange redone, blocking, on the new
        world (a failed all-reduce leaves its buffer unchanged)."""
        try:
            pending.work.wait()
        except RETRYABLE_ERRORS:
            if self._transport.epoch() == pending.epoch:
                self._update(retry=True)
            self._exchange(pending.buf)
        return pending.buf

    def _complete(self, pending: _Pending) -> int:
        self._apply(pending.fragment, self._wait(pending))
        return pending.fragment

    def _outer_update(self, p: int, averaged: torch.Tensor) -> None:
        """The outer optimizer of fragment p steps with the averaged pseudo-gradients."""
        params = [self._outer[i] for i in self._fragments[p]]
        for o, g in zip(params, self._views(p, averaged)):
            o.grad = g
        self._outer_opts[p].step()
        for o in params:
            o.grad = None

    def _apply(self, p: int, averaged: torch.Tensor) -> None:
        """Outer step of fragment p, then merge: local = outer (tau = 0), else
        ``alpha * local + (1 - alpha) * outer``."""
        self._outer_update(p, averaged)
        with torch.no_grad():
            for i in self._fragments[p]:
                local, outer = self._params[i], self._outer[i]
                if self._tau == 0:
                    local.copy_(outer)
                else:
                    local.mul_(self._alpha).add_(outer.to(local.device, local.dtype),
                                                 alpha=1.0 - self._alpha)

    def _boundary(self) -> None:
        """step += 1, admit pending peers, sync the shared state."""
        self._step += 1
        try:
            pending = self._transport.peers_pending()
        except RETRYABLE_ERRORS:
            pending = None
            self._update(retry=True)        # admits the pending peers as well
        if pending:
            self._update(retry=False)
        self._sync(copy="changed", advance=True)

    def _update(self, retry: bool) -> None:
        change = self._transport.update_topology()
        self._retries += int(retry)
        self._joined.extend(change.joined)
        self._left.extend(change.left)

    def _sync(self, copy: str, advance: bool = False) -> None:
        """sync_shared_state at the next revision (``advance``) or the current one (the
        constructor), then copy the outer parameters into the model: ``"all"`` of
        them, ``"changed"``: those the sync overwrote (this peer had drifted), or
        ``"none"``."""
        revision = self._revision + 1 if advance else self._revision
        res = self._transport.sync(self.state(), revision, self.max_retries)
        self.last_sync = res
        self._revision = res.revision
        self._retries += res.retries
        if copy == "all":
            self._load_outer(range(len(self._params)))
        elif copy == "changed":
            changed = set(res.changed)
            self._load_outer(i for i, n in enumerate(self._names)
                             if f"outer/{n}" in changed)

    def _load_outer(self, indices: Iterable[int]) -> None:
        with torch.no_grad():
            for i in indices:
                self._params[i].copy_(self._outer[i])

    def _reset_accumulators(self) -> None:
        self._retries = 0
        self._joined: list[str] = []
        self._left: list[str] = []
        self._busy = 0.0

    def _report(self, applied: Sequence[int]) -> OuterStep:
        traffic = self._transport.traffic()
        result = OuterStep(step=int(self._step), world_size=self._transport.world_size(),
                           bytes_sent=traffic[0] - self._traffic[0],
                           bytes_received=traffic[1] - self._traffic[1],
                           seconds=self._busy, retries=self._retries,
                           joined=tuple(self._joined), left=tuple(self._left),
                           fragments=tuple(applied))
        self._traffic = traffic
        self._reset_accumulators()
        self.last_outer_step = result
        return result


class StreamingDiLoCo(DiLoCo):
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

    Every H steps (t % H == 0) comes the membership boundary: the exchanges
    still in flight are completed (applied early), ``step += 1``, pending peers
    are admitted, and the shared state is synchronised, in that order; the
    sends due at that step go out after it (tau > 0), so a joiner, whose
    constructor is the incumbents' sync, takes part in them with a zero
    pseudo-gradient (it has not trained: its local parameters are the outer
    ones). An exchange that fails because a peer died is redone, blocking, on
    the smaller world when it is waited for.

    Args:
        num_fragments: P (ignored when ``fragments`` is given).
        fragment_offsets: t_p per fragment, ints in 0 .. H - 1.
        tau: overlap in inner steps, 0 .. H - 1 (the paper's main runs: 1).
        alpha: merge weight of the local parameters, in [0, 1] (paper: 0.5).
        fragments: explicit list of lists of the model's trainable parameters
            (each in exactly one list).
        the others: as ``DiLoCo``.

    Raises:
        ValueError: as ``DiLoCo``, and bad fragments, offsets, tau or alpha.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None,
                 sync_every: int = 100, num_fragments: int = 4,
                 fragment_offsets: Sequence[int] | None = None, tau: int = 1,
                 alpha: float = 0.5, quantization: str | None = None,
                 fragments: Sequence[Sequence[torch.Tensor]] | None = None, group=None,
                 max_retries: int = 3, timeout: float | timedelta | None = None):
        self._configure(model, inner_optimizer, outer_optimizer, sync_every, quantization,
                        group, max_retries, timeout, fragments=fragments,
                        num_fragments=num_fragments, offsets=fragment_offsets, tau=tau,
                        alpha=alpha)

    @property
    def fragments(self) -> list[list[str]]:
        """The parameter names of each fragment."""
        return [[self._names[i] for i in f] for f in self._fragments]

    @property
    def fragment_offsets(self) -> list[int]:
        """t_p of each fragment."""
        return list(self._offsets)


class AsyncDiLoCo(DiLoCo):
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
    as W grows: in tests/test_diloco.py, at W = 4, it oscillates with a growing
    amplitude where ``w = 1`` converges like synchronous DiLoCo.

    ``rule="stale"`` is the naive delayed update (restart every round from
    ``S``, no eager term): with Nesterov lr 0.7 / momentum 0.9 it diverges; it
    is here as the baseline that shows it.

    A joiner (constructed at the incumbents' boundary sync) contributes a zero
    pseudo-gradient to the exchange issued at that boundary and starts with
    ``E = 0``. ``finish()`` waits for the exchange in flight, applies it to
    ``S``, syncs, loads ``S`` into the model and resets the eager term.

    Args:
        rule: ``"eager"`` (default) or ``"stale"``.
        eager_weight: w, a float in (0, 1], or None for 1/W (the paper's mixture).
        the others: as ``DiLoCo``.

    Raises:
        ValueError: as ``DiLoCo``, and a bad ``rule`` or ``eager_weight``.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                 | None = None,
                 sync_every: int = 100, quantization: str | None = None, rule: str = "eager",
                 eager_weight: float | None = 1.0, group=None, max_retries: int = 3,
                 timeout: float | timedelta | None = None):
        if rule not in ("eager", "stale"):
            raise ValueError(f"rule must be 'eager' or 'stale', got {rule!r}")
        if eager_weight is not None and not 0.0 < float(eager_weight) <= 1.0:
            raise ValueError(f"eager_weight must be in (0, 1] or None, got {eager_weight!r}")
        self.rule = rule
        self.eager_weight = eager_weight
        self._eager: list[torch.Tensor] = []
        self._configure(model, inner_optimizer, outer_optimizer, sync_every, quantization,
                        group, max_retries, timeout, fragments=None, num_fragments=1,
                        offsets=[0], tau=0, alpha=0.0)

    def _after_join(self) -> None:
        self._eager = [torch.zeros_like(o) for o in self._outer]
        self._eager_opt = self._make_optimizer(self._eager) if self.rule == "eager" else None
        self._previous = torch.zeros(self._buffers[0].numel(), dtype=self._dtype)
        if self._t > 0:               # the incumbents issue their exchange right after this sync
            self._buffers[0].zero_()
            self._start_exchange()

    def _start_exchange(self) -> None:
        work = self._transport.all_reduce(self._buffers[0], async_op=True)
        self._pending.append(_Pending(0, self._t + self.sync_every, work, self._buffers[0],
                                      self._transport.epoch()))

    def _start_point(self) -> list[torch.Tensor]:
        if self.rule == "stale":
            return list(self._outer)
        return [o + e for o, e in zip(self._outer, self._eager)]

    def step(self) -> OuterStep | None:
        """Call after every ``inner_optimizer.step()``; every ``sync_every``-th call is
        the boundary described in the class docstring.

        Returns:
            An ``OuterStep`` at every boundary, else None.
        """
        self._t += 1
        if self._t % self.sync_every:
            return None
        started = time.monotonic()
        start = self._start_point()
        local = self._local_tensors(0)
        fresh = torch.cat([pseudo_gradient(s, p).reshape(-1) for s, p in zip(start, local)])
        applied: list[int] = []
        if self._pending:
            pending = self._pending.popleft()
            self._outer_update(0, self._wait(pending))
            applied.append(0)
        if self._eager_opt is not None:
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
        self._previous = fresh
        self._boundary()
        self._load_start()
        self._busy += time.monotonic() - started
        result = self._report(applied)   # before the new exchange: its bytes are the next's
        started = time.monotonic()
        self._buffers[0].copy_(fresh)
        self._start_exchange()
        self._busy += time.monotonic() - started
        return result

    def _load_start(self) -> None:
        with torch.no_grad():
            for p, s in zip(self._params, self._start_point()):
                p.copy_(s)

    def _sync(self, copy: str, advance: bool = False) -> None:
        # The model holds S + E, not S: load the start point after a boundary sync.
        super()._sync("all" if copy == "all" else "none", advance)

    def finish(self) -> None:
        """Applies the exchange in flight to the shared state, syncs it (a collective),
        loads the outer parameters ``S`` into the model and resets the eager term."""
        if self._pending:
            self._outer_update(0, self._wait(self._pending.popleft()))
        with torch.no_grad():
            for e in self._eager:
                e.zero_()
        if self._eager_opt is not None:
            for state in self._eager_opt.state.values():
                for value in state.values():
                    value.zero_()
        self._previous.zero_()
        super()._sync("all", advance=True)
