"""``ReplicaDataParallel``: per-step data parallelism across sharded replicas (HSDP's shape,
``ElasticDDP``'s rules; docs/sharded-replicas.md, "Per-step data parallelism across replicas").

A replica is a set of processes holding one copy of the model sharded among them (FSDP2's
``fully_shard`` over the replica's inner group); after its backward each process holds its
*local gradient shards*, already reduce-scattered and averaged inside the replica by FSDP2.
Across replicas, shard i of every replica holds the same slice, so each process averages
its local gradient shards with the same shard of the other replicas over its *shard ring*
(``init_replica_group``), once per step, before the optimizer step: HSDP's replicate
dimension, on a world of replicas that join and die between steps.

The rules are ElasticDDP's (docs/elastic-ddp.md): a step is applied on every surviving
replica or on none, with bit-identical averaged gradients per shard (an all-or-nothing
exchange, ``Membership.begin_exchange``, rolled forward to the survivors that missed it);
joins happen at ``boundary()``, where the run's state (local parameter shards, local
optimizer-state shards, scheduler, step) is synced over every ring, so joiners receive
their shards from the members' same shard index.

What rings cannot decide alone, the replica's inner group does: rings are separate pccl
groups, and one ring can complete an exchange or answer a pending query while another
fails or answers otherwise; the processes of a replica then must still act alike (FSDP2's
next forward needs all of them). So after each exchange the replica agrees (one 1-element
MIN over the inner group) on whether every ring completed, and at each boundary (a MAX) on
whether any ring saw pending replicas. Every ring's answer is the same in every replica
(the master keys it by the ring's epoch and op count), so the replicas agree with each
other too. A replica whose step result was rolled forward from the epoch left skips its
next pending query: the replicas that completed that step crossed the boundary in the old
epoch, and the op counts of the rings line up again from the next step on.

torchft (pytorch/torchft) is the reference for the shape: its ``Manager`` (a quorum per
step, ``should_commit`` before the optimizer step, a joiner healed from a peer's state) and
its device mesh whose replicate dimension is a managed process group (``ft_init_device_mesh``
/ ``extend_device_mesh``: FSDP2 with hybrid sharding, i.e. HSDP, across replica groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...elastic.replica_group import replica_error
from ...elastic.shared_state import SyncResult
from ...elastic.topology import (
    RETRYABLE_ERRORS,
    TopologyChange,
    all_reduce_with_retry,
    elastic_group,
)
from ...errors import InvalidArgumentError, PeerLostError
from ..diloco import transport
from ..diloco.shards import is_dtensor, local, reshard, trainable, wrap_like
from .training_state import TrainingState

__all__ = ["ReplicaBoundary", "ReplicaDataParallel", "REPLICA_VERDICT_S"]

REPLICA_VERDICT_S = 10.0
"""Seconds to wait for the master's word (``replica_error``) when the replica's inner group
fails: a SIGKILLed mate closes its connection to the master at once; the verdict then
arrives within a round trip or two."""


@dataclass(frozen=True)
class ReplicaBoundary:
    """What one ``ReplicaDataParallel.boundary()`` did on this process.

    Attributes:
        step: the run's applied steps after the boundary (shared).
        replicas: replicas in the group after it (this ring's world size).
        epoch: the membership epoch after it.
        joined, left: master peer ids of this ring's members after it that were not
            members before it, and the other way round.
        sync: the shared-state sync it ran (replicas joined), else None.
    """

    step: int
    replicas: int
    epoch: int
    joined: tuple[str, ...]
    left: tuple[str, ...]
    sync: SyncResult | None


class ReplicaDataParallel:
    """Per-step gradient averaging across sharded replicas over this process's shard ring.

    Build the model sharded inside the replica (``fully_shard`` over the inner group), its
    optimizer over the sharded parameters, join the shard ring, then::

        pg = torch_pccl.init_replica_group(master, replica_id, model)
        rdp = torch_pccl.ReplicaDataParallel(model, optimizer, scheduler, group=pg)
        while rdp.step_count < steps:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()   # FSDP2: local gradient shards, replica average
            rdp.step()                        # ring average + optimizer/scheduler step
            rdp.boundary()                    # admit pending replicas, sync them

    The constructor is the first boundary (a collective of the rings and of the inner
    group): a joining replica receives the run's state there.

    ``step()`` flattens the local gradient shard of every trainable parameter (a DTensor
    gradient's ``to_local()``, a plain gradient as is; a missing gradient counts as zeros)
    into one buffer of the widest gradient dtype (float64 if any, else float32), averages
    it (AVG all-reduce) over the ring as an all-or-nothing exchange, writes it back, then
    steps the optimizer and the scheduler. Each step costs one all-reduce of the local
    gradient shards per ring (the rings run in parallel), plus a 1-element all-reduce over
    the inner group. On a network error the replica's processes all join a recovery round
    (``update_topology(admit=False)``: the dead replicas dropped); a ring whose exchange
    completed somewhere gets the result rolled forward, the others redo it on the smaller
    world. So the step is applied on every surviving replica, each shard with the same
    averaged gradient in every replica, or, if ``step()`` raises, on none here.

    Args:
        module: the replica's model, on the CPU (FSDP2 DTensor parameters, or plain ones).
        optimizer: a ``torch.optim.Optimizer`` over ``module``'s parameters (its state for
            DTensor parameters is DTensors: their local shards are synced); one whose
            ``step()`` needs no closure.
        scheduler: its LR scheduler, or None; ``step()`` steps it after the optimizer.
        group: this process's shard ring (``init_replica_group``). While this wrapper
            lives it owns the ring's membership (``Membership.own``).
        inner_group: the replica's inner group (gloo on CPU), None: the default group.
        timeout: deadline of the master's rounds (update, sync, pending query), seconds
            or timedelta; None: as ``update_topology``.
        max_retries: recovery rounds one ``step()`` (or a sync) may make (>= 0).

    Raises:
        InvalidArgumentError: a non-CPU module, an optimizer over other parameters, or
            ``max_retries`` < 0.
        InvalidUsageError: ``group`` was not formed through a master, or another wrapper
            owns it.
        MismatchError: the replicas' shard states differ in names, dtypes or shapes.
        ReplicaLostError: the master dropped this replica (a mate died).
        PcclError subclasses: the network or the master failed during the boundary.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler=None, *, group, inner_group=None,
                 timeout: float | timedelta | None = None, max_retries: int = 3):
        if not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgumentError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self._module = module
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._group = group
        self._inner = inner_group
        self._inner_size = dist.get_world_size(inner_group) if dist.is_initialized() else 1
        self._max_retries = max_retries
        reshard(module)         # TrainingState matches the optimizer's (sharded) parameters
        self._state = TrainingState(module, optimizer, scheduler)
        self._transport = transport.transport_for(group, timeout, bits=0)
        self._revision: int | None = None
        self._late = False      # the last step's result came from the epoch left
        self.last_boundary: ReplicaBoundary | None = None
        self.boundary()

    # -- what the training loop uses ---------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model."""
        return self._module

    @property
    def step_count(self) -> int:
        """Steps applied by the run (shared: a joining replica gets the run's count)."""
        return self._state.step

    @property
    def replicas(self) -> int:
        """Replicas in the group now (this ring's world size; changes at steps and
        boundaries)."""
        return self._transport.world_size()

    @property
    def replica_rank(self) -> int:
        """This replica's rank among them now (its rank in the ring)."""
        return elastic_group(self._group).pg.getRank()

    def step(self) -> list[TopologyChange]:
        """Averages the local gradient shards over the ring, then applies
        ``optimizer.step()`` and ``scheduler.step()``; a collective of the ring and of the
        inner group. Call it after ``backward()`` on every process of every replica.

        Returns:
            The recovery rounds it made, in order ([] when nothing failed).

        Raises:
            ReplicaLostError: the master dropped this replica (its inner group or the ring
                failed because a mate died); nothing applied here.
            PcclError subclasses: the exchange failed ``max_retries`` + 1 times, or a
                recovery round failed; nothing applied here.
        """
        params = [p for _, p in trainable(self._module)]
        grads = [self._local_grad(p) for p in params]
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        # A fresh buffer per step: the ledger keeps it by reference as this exchange's
        # result, which a survivor that missed it may get (roll forward) at the next round.
        buf = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        changes = self._exchange(buf)
        with torch.no_grad():
            for p, part in zip(params, buf.split([g.numel() for g in grads])):
                if p.grad is None:
                    # A copy: ``buf`` is the ledger's result until the next exchange.
                    p.grad = wrap_like(p, part.view_as(local(p)).to(p.dtype, copy=True))
                else:
                    local(p.grad).copy_(part.view_as(local(p.grad)))
        self._optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()
        self._state.advance()
        return changes

    def boundary(self) -> ReplicaBoundary:
        """The step boundary: every process of every member replica calls it after every
        step; a joining replica's constructor calls it (its admission). A collective.

        One keyed pending query per ring (the same answer in every replica), agreed over
        the inner group; if replicas wait, an update round admits them and the run's state
        is synced over every ring: joiners receive their shards. With nothing to do it
        costs one query to the master and a 1-element all-reduce of the inner group.

        Returns:
            ``ReplicaBoundary`` (also kept in ``last_boundary``).

        Raises:
            ReplicaLostError: the master dropped this replica.
            PcclError subclasses: the master or the network failed beyond the retries;
                ``MismatchError`` (the replicas' shard states differ in layout).
        """
        t = self._transport
        t.report_step(self._state.step)
        before = {peer for peer, _ in t.members()}
        result = None
        if self._late:
            # This step's result came from the epoch left (``_exchange``): the replicas
            # that completed it there crossed this boundary in that epoch (or skip it
            # too), so a query here would be this replica's alone (and maybe an update
            # round of its own, while the others wait in the next step's exchange).
            # Pending replicas are admitted at the next boundary.
            self._late = False
        elif self._replica_agrees(self._pending(), dist.ReduceOp.MAX):
            change = t.update_topology(admit=True)
            # A round that only dropped (a member asked for a recovery, admit=False) leaves
            # the survivors' shards equal: no sync. A round that admitted syncs in every ring
            # (the joiners' ``joined`` lists themselves).
            if change.joined:
                result = self._sync()
        after = {peer for peer, _ in t.members()}
        self.last_boundary = ReplicaBoundary(
            step=self._state.step, replicas=t.world_size(), epoch=t.epoch(),
            joined=tuple(sorted(after - before)), left=tuple(sorted(before - after)),
            sync=result)
        return self.last_boundary

    def state(self) -> dict[str, torch.Tensor]:
        """This shard's part of the run's state, by reference: ``TrainingState``'s entries
        with every DTensor replaced by its local shard (parameters, optimizer moments);
        equal in every replica after each step and boundary, which
        ``torch_pccl.content_digest`` of it compares."""
        reshard(self._module)
        return {name: local(t) if is_dtensor(t) else t
                for name, t in self._state.entries().items()}

    # -- the pieces ----------------------------------------------------------------

    def _pending(self) -> bool:
        try:
            return self._transport.peers_pending()
        except RETRYABLE_ERRORS:
            return True         # the epoch moved on (a death): the update round recovers

    @staticmethod
    def _local_grad(p: torch.Tensor) -> torch.Tensor:
        """This process's shard of ``p``'s gradient (zeros where ``p`` got none)."""
        if p.grad is None:
            return torch.zeros_like(local(p))
        return local(p.grad)

    def _exchange(self, buf: torch.Tensor) -> list[TopologyChange]:
        """The AVG all-reduce of ``buf`` over the ring, all or nothing, agreed by the
        replica: returns once every ring of this replica holds its result. Sets
        ``self._late`` (see ``boundary``)."""
        t = self._transport
        t.begin_exchange(buf)
        done, error = self._all_reduce(buf)
        done_in = t.epoch() if done else None    # the epoch whose exchange gave the result
        changes: list[TopologyChange] = []
        # Every process of the replica goes on together: a ring that completed while
        # another failed still joins the recovery round, so no mate is left in it alone.
        while not self._replica_agrees(done, dist.ReduceOp.MIN):
            if len(changes) >= self._max_retries:
                if error is not None:
                    raise error
                raise PeerLostError(f"the exchange of another ring of this replica failed "
                                    f"{len(changes) + 1} times (max_retries="
                                    f"{self._max_retries})")
            left = t.epoch()
            changes.append(t.update_topology(admit=False))
            if done:
                continue        # this ring's result stands (the roll forward may send it)
            if t.rolled_forward():
                done, done_in = True, left      # completed by others in the epoch left
            else:
                done, error = self._all_reduce(buf)     # redone on the smaller world
                done_in = t.epoch() if done else None
        # Late: the result came from the epoch left, so the replicas that completed it
        # there went on to this step's boundary in that epoch (or will reach the new one
        # only from the next step's exchange). This replica's boundary then has no
        # counterpart among them and must not ask the master (``boundary``).
        late = bool(changes) and done_in != t.epoch()
        self._late = self._replica_agrees(late, dist.ReduceOp.MAX) if changes else False
        return changes

    def _all_reduce(self, buf: torch.Tensor) -> tuple[bool, BaseException | None]:
        try:
            self._transport.all_reduce(buf, async_op=False)
        except RETRYABLE_ERRORS as exc:
            return False, exc
        self._transport.end_exchange(buf)
        return True, None

    def _replica_agrees(self, flag: bool, op) -> bool:
        """``flag`` reduced (MIN: all, MAX: any) over the replica's inner group."""
        if self._inner_size == 1:
            return bool(flag)
        vote = torch.tensor([int(bool(flag))], dtype=torch.int32)
        try:
            dist.all_reduce(vote, op=op, group=self._inner)
        except RuntimeError as exc:
            # A mate died (gloo's error names no reason): the master's verdict does.
            err = replica_error(self._group, timeout=REPLICA_VERDICT_S)
            if err is None:
                raise
            raise err from exc
        return bool(vote.item())

    def _sync(self) -> SyncResult:
        """The optimizer state made alike in layout (replicas that never stepped create it),
        then ``sync_shared_state`` of this shard's part of the run, numbers written back."""
        wanted = self._state.has_state()
        with elastic_group(self._group).membership.as_owner():
            all_reduce_with_retry(wanted, op=dist.ReduceOp.MAX, group=self._group,
                                  max_retries=self._max_retries)
        self._state.materialize(wanted)
        entries = self.state()
        revision = (self._transport.shared_revision() if self._revision is None
                    else self._revision + 1)
        result = self._transport.sync(entries, revision, self._max_retries)
        self._revision = result.revision
        self._state.restore(entries)
        return result
