"""``ElasticDDP``: torch's ``DistributedDataParallel`` on a world that changes between steps.

A join or a death is a step boundary that every peer crosses alike (docs/elastic-ddp.md).
``boundary()``, called by members after every step and by a joiner's constructor, runs one
sequence everywhere: recover from a failure on the smaller world, admit pending peers,
and, when the world changed, rebuild DDP (its reducer and buckets, with DDP's own start-up
collectives off) on every peer at once and make model, buffers, optimizer and scheduler
state bit-identical through the shared state (``TrainingState``; the majority's bytes win,
joiners receive them). ``step()`` applies the optimizer step on every peer or on none: a
peer lost during backward fails the step everywhere, and a one-element all-or-nothing
vote (``Membership.begin_exchange``) catches the case where some peers' gradients
completed and others' did not.

torchft's ``Manager`` (pytorch/torchft: a quorum per step, ``should_commit`` before the
optimizer step, a joiner healed from a peer's state) is the reference for the shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...c10d.torch_internals import detach_ddp_reducer
from ...elastic.shared_state import SyncResult
from ...elastic.topology import RETRYABLE_ERRORS, all_reduce_with_retry, elastic_group
from ...errors import InvalidArgumentError, InvalidUsageError, PcclError
from ..diloco import transport
from .training_state import TrainingState

__all__ = ["Boundary", "ElasticDDP"]

# DDP arguments ElasticDDP sets itself.
_OWN_ARGUMENTS = ("process_group", "init_sync", "device_ids", "output_device")


@dataclass(frozen=True)
class Boundary:
    """What one ``ElasticDDP.boundary()`` did on this peer.

    Attributes:
        step: the run's applied training steps after the boundary (shared).
        world_size: the group's size after it.
        epoch: the membership epoch after it.
        joined, left: master peer ids of the members after it that were not members
            before it, and the other way round (changes made inside the sync included).
        recovered: True if it rebuilt the group after a failure (a lost peer).
        applied_late: True if the step that failed here had completed on another
            survivor, and was applied here by this boundary (all or nothing).
        sync: the shared-state sync it ran (the world changed), else None.
    """

    step: int
    world_size: int
    epoch: int
    joined: tuple[str, ...]
    left: tuple[str, ...]
    recovered: bool
    applied_late: bool
    sync: SyncResult | None


class ElasticDDP:
    """``DistributedDataParallel`` over a pccl group whose members change between steps.

    Construct it where the script would build ``DistributedDataParallel(module)``; it
    is a collective, the first ``boundary()`` (a joiner's admission: it receives the
    run's model, optimizer and scheduler state and step count here). Then::

        model = torch_pccl.ElasticDDP(net, optimizer, scheduler)
        while model.step_count < steps:
            try:
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)      # batch chosen by model.rank / world_size
                loss.backward()                  # gradients averaged over the world
                model.step()                     # optimizer + scheduler step, everywhere or nowhere
            except torch_pccl.PcclError:
                pass                             # a peer was lost; nothing was applied here
            model.boundary()                     # admit / recover / rebuild / sync

    Gradients are averaged with DDP's reducer (buckets, overlap with backward) through
    a communication hook that divides by the current world size and all-reduces (SUM) on
    the group, so they are bit-identical on every peer; a bucket that fails is recorded
    and ``step()`` raises it. The first step after a change averages over the new world.

    Args:
        module: the model, on the CPU (``sync_shared_state`` takes CPU tensors).
        optimizer: a ``torch.optim.Optimizer`` over ``module``'s parameters (one whose
            ``step()`` needs no closure).
        scheduler: its LR scheduler, or None; ``step()`` steps it after the optimizer.
        group: a pccl group formed through a master (``init_method="pccl://..."``, or a
            fixed world with its automatic master); None: the default group. While this
            wrapper lives it owns the group's membership: ``peers_pending()`` from other
            code answers False and ``update_topology()`` raises (``Membership.own``).
        timeout: deadline of the master's rounds (update, sync, pending query), seconds
            or timedelta; None: as ``update_topology``.
        max_retries: topology updates a shared-state sync may make after network
            failures (>= 0).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``...);
            not ``process_group``, ``init_sync``, ``device_ids`` or ``output_device``.
            ``forward_sync_buffers`` (or the deprecated ``broadcast_buffers``), default
            True: rank 0's buffers are broadcast by ``step()``, before its vote, instead
            of at the start of DDP's next forward, so buffers are equal between steps
            too; False: never (each peer keeps its own until a boundary's sync).

    Raises:
        InvalidArgumentError: a CUDA module, an optimizer over other parameters, a DDP
            argument ElasticDDP sets itself, or ``max_retries`` < 0.
        InvalidUsageError: ``group`` was not formed through a master, or another
            wrapper owns it.
        MismatchError: the peers' models, optimizers or schedulers differ in names,
            dtypes or shapes (the sync names the entry).
        PcclError subclasses: the network or the master failed during the boundary.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler=None, group=None, timeout: float | timedelta | None = None,
                 max_retries: int = 3, **ddp_kwargs):
        own = sorted(set(ddp_kwargs) & set(_OWN_ARGUMENTS))
        if own:
            raise InvalidArgumentError(f"ElasticDDP sets {own} itself; pass the group as "
                                       "group=, and keep the module on the CPU")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgumentError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self._module = module
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._group = group
        self._max_retries = max_retries
        # Buffers (BatchNorm's running statistics) are the run's: rank 0's, broadcast by
        # step() before its vote instead of at the start of DDP's next forward, so that
        # every peer holds the same bytes between steps as well.
        self._sync_buffers = ddp_kwargs.pop("forward_sync_buffers",
                                            ddp_kwargs.pop("broadcast_buffers", True))
        self._buffers = [b for b in module.buffers()] if self._sync_buffers else []
        self._ddp_kwargs = dict(ddp_kwargs, forward_sync_buffers=False)
        self._state = TrainingState(module, optimizer, scheduler)
        self._transport = transport.transport_for(group, timeout, bits=0)
        self._ddp: DistributedDataParallel | None = None
        self._built_epoch: int | None = None
        self._world_size = 1
        self._revision: int | None = None        # the last revision synced here
        self._failure: PcclError | None = None   # a bucket's failure in this backward
        self._vote = torch.ones(1, dtype=torch.int32)
        self._voting = False        # a vote failed here; the recovery may complete it
        self.last_boundary: Boundary | None = None
        self.boundary()

    # -- what the training loop uses ---------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (as ``DistributedDataParallel.module``)."""
        return self._module

    @property
    def ddp(self) -> DistributedDataParallel:
        """The current ``DistributedDataParallel``; a new one after every change of world
        (do not keep it across ``boundary()`` calls)."""
        return self._ddp

    @property
    def step_count(self) -> int:
        """Training steps applied by the run (shared: a joiner gets the run's count)."""
        return self._state.step

    @property
    def rank(self) -> int:
        """This peer's rank in the current world (changes at boundaries)."""
        return elastic_group(self._group).pg.getRank()

    @property
    def world_size(self) -> int:
        """The current world size (changes at boundaries)."""
        return self._transport.world_size()

    def __call__(self, *args, **kwargs):
        """The forward pass through DDP (its buffer broadcast included).

        Raises:
            InvalidUsageError: a failure is pending: call ``boundary()`` first.
            PcclError subclasses: a collective of the forward failed (DDP's buffer
                broadcast, its bucket rebuild), including when torch wrapped it.
        """
        if self._failure is not None:
            raise InvalidUsageError("a peer was lost in the last backward: call boundary() "
                                    "before the next forward")
        with self._pccl_errors():
            return self._ddp(*args, **kwargs)

    def no_sync(self):
        """DDP's ``no_sync()``: accumulate gradients locally (``step()`` after the last
        backward of the accumulation averages them)."""
        return self._ddp.no_sync()

    def step(self) -> None:
        """Applies ``optimizer.step()`` and ``scheduler.step()``: on every peer, or on none.

        Call it after ``backward()``. First a one-element all-reduce (an all-or-nothing
        exchange) confirms that every peer's gradients completed; if this peer's exchange
        fails, the next ``boundary()`` applies the step after all when another survivor
        completed it (``Boundary.applied_late``), and not at all when none did.

        Raises:
            PcclError subclasses: a bucket's all-reduce failed in the last backward, or
                the vote failed (a peer was lost); nothing was applied here, and the
                next ``boundary()`` recovers.
        """
        if self._failure is not None:
            raise self._failure
        with self._pccl_errors():
            self._broadcast_buffers()
        self._vote.fill_(1)
        self._transport.begin_exchange(self._vote)
        try:
            dist.all_reduce(self._vote, op=dist.ReduceOp.MIN, group=self._group)
        except PcclError:
            self._voting = True
            raise
        self._transport.end_exchange(self._vote)
        self._apply()

    def boundary(self) -> Boundary:
        """The step boundary: every member calls it after every step (and after a failed
        one); a joiner's constructor calls it (its admission). A collective.

        Recovers after a failure (the lost peers dropped, a step that completed on
        another survivor applied here), admits pending peers, and when the world changed,
        rebuilds DDP on every peer and syncs the run's state (model, buffers, optimizer,
        scheduler, step). With nothing to do it costs one query to the master.

        Returns:
            ``Boundary`` (also kept in ``last_boundary``).

        Raises:
            PcclError subclasses: the master or the network failed beyond the retries
                (call it again), ``MismatchError`` (the peers' states differ in layout).
        """
        t = self._transport
        t.report_step(self._state.step)
        before = {peer for peer, _ in t.members()}
        recovered = applied_late = False
        if self._failure is not None or self._voting or t.errored():
            t.update_topology(admit=False)
            recovered = True
            if self._voting and t.rolled_forward():
                self._apply()           # the vote completed elsewhere: it carried 1
                applied_late = True
            self._failure, self._voting = None, False
        try:
            pending = t.peers_pending()
        except RETRYABLE_ERRORS:
            pending = True              # recover; pending peers are admitted alike
        if pending:
            t.update_topology(admit=True)
        result = None
        # A peer lost during the sync makes it (or the all-reduce before it) move to a newer
        # epoch: DDP is rebuilt for that one too.
        while t.epoch() != self._built_epoch:
            self._rebuild()
            result = self._sync()
        after = {peer for peer, _ in t.members()}
        self.last_boundary = Boundary(
            step=self._state.step, world_size=t.world_size(), epoch=t.epoch(),
            joined=tuple(sorted(after - before)), left=tuple(sorted(before - after)),
            recovered=recovered, applied_late=applied_late, sync=result)
        return self.last_boundary

    def state(self) -> dict[str, torch.Tensor]:
        """The run's shared state now (see ``TrainingState``): equal on every peer after a
        boundary that synced, and kept so by the steps; ``torch_pccl.content_digest`` of it
        compares peers."""
        return self._state.entries()

    # -- the pieces ----------------------------------------------------------------

    def _apply(self) -> None:
        self._optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()
        self._state.advance()

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers into every peer's, one broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self._buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            dist.broadcast(flat, group_src=0, group=self._group)
            with torch.no_grad():
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(part.view_as(t))

    def _rebuild(self) -> None:
        """A new DDP for the current world, built alike on every peer (no collective: its
        start-up sync is the shared-state sync that follows)."""
        if self._ddp is not None:
            # Its reducer's autograd hooks would otherwise fire in the next backward too.
            detach_ddp_reducer(self._ddp)
        kwargs = dict(self._ddp_kwargs)
        if self._group is not None:
            kwargs["process_group"] = self._group
        ddp = DistributedDataParallel(self._module, init_sync=False, **kwargs)
        ddp.register_comm_hook(None, self._reduce_bucket)
        self._ddp = ddp
        self._built_epoch = self._transport.epoch()
        self._world_size = self._transport.world_size()

    def _sync(self) -> SyncResult:
        """The optimizer state made alike in layout (peers that never stepped create it),
        then ``sync_shared_state`` of the whole run, numbers written back."""
        wanted = self._state.has_state()
        # All or nothing, as the sync after it: a peer lost here leaves every survivor with
        # the result (roll forward) or redoing it, so all reach the sync's vote together.
        with elastic_group(self._group).membership.as_owner():
            all_reduce_with_retry(wanted, op=dist.ReduceOp.MAX, group=self._group,
                                  max_retries=self._max_retries)
        self._state.materialize(wanted)
        entries = self._state.entries()
        revision = (self._transport.shared_revision() if self._revision is None
                    else self._revision + 1)
        result = self._transport.sync(entries, revision, self._max_retries)
        self._revision = result.revision
        self._state.restore(entries)
        return result

    def _reduce_bucket(self, _state, bucket):
        """DDP's communication hook (``dist.GradBucket`` -> ``Future[Tensor]``; DDP refuses
        a return annotation other than its own, which this module's postponed annotations
        would spell as a string): the bucket divided by the world size, all-reduced
        (SUM). A failure completes the future with the bucket as it is and is kept for
        ``step()``; later buckets of the same backward are not sent."""
        buf = bucket.buffer()
        if self._failure is None:
            buf.div_(self._world_size)
            try:
                work = dist.all_reduce(buf, group=self._group, async_op=True)
            except PcclError as exc:
                self._failure = exc
            else:
                future = work.get_future()

                def settle(done: torch.futures.Future) -> torch.Tensor:
                    try:
                        return done.value()[0]
                    except RuntimeError as exc:
                        self._failure = self._pccl_error(exc)
                        return buf
                return future.then(settle)
        finished = torch.futures.Future()
        finished.set_result(buf)
        return finished

    @contextlib.contextmanager
    def _pccl_errors(self):
        """Re-raises a torch ``RuntimeError`` that a failed pccl op caused as that op's
        ``PcclError`` (torch futures carry C++ errors; see ``PcclWork.get_future``)."""
        try:
            yield
        except PcclError:
            raise
        except RuntimeError as exc:
            err = self._pccl_error(exc)
            if err is exc:
                raise
            raise err from exc

    def _pccl_error(self, exc: RuntimeError) -> BaseException:
        err = elastic_group(self._group).pg.errored()
        return err if err is not None else exc
