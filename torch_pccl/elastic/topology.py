"""Changing and using the world between steps: ``update_topology``, ``peers_pending``, retries.

Between membership changes collectives never talk to the master. At points
the application chooses, every member calls ``update_topology()``: the master
admits pending peers and forgets dead ones, and each member rebuilds its
communicator for the new epoch. ``peers_pending()`` tells every rank, with the
same answer, whether that is worth doing; ``all_reduce_with_retry`` shrinks
the world and retries after a peer failure. See docs/membership.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import config
from ..c10d.process_group import pccl_group
from ..errors import InvalidUsageError
from ..ring.measure import PROBE_BYTES
from ..ring.optimize import MIN_GAIN, RingChoice, optimize_ring_order
from .groups import elastic_group, membership_of
from .membership import RETRYABLE_ERRORS


@dataclass(frozen=True)
class TopologyChange:
    """What ``update_topology`` changed.

    Attributes:
        epoch: the new membership epoch.
        rank: this process's rank in the new world.
        world_size: the new world size.
        joined: master peer ids admitted in this epoch.
        left: master peer ids gone since the previous epoch (left or dropped).
    """

    epoch: int
    rank: int
    world_size: int
    joined: tuple[str, ...]
    left: tuple[str, ...]


def update_topology(group=None, timeout: float | timedelta | None = None,
                    optimize_ring: bool = False, admit: bool = True) -> TopologyChange:
    """Admits pending peers, drops dead ones and rebuilds the group; a collective of the members.

    Every live member must call it at the same point of its op sequence. It
    joins the master's update round for the current epoch (blocking until every
    live member has joined, or the master's round deadline drops the missing
    ones), then has the group connect a communicator for the next epoch, wait
    for its queued ops and swap it in (``ProcessGroupPCCL.configure``).
    Afterwards ``dist.get_rank()``, ``dist.get_world_size()`` and the group's
    ``getRank``/``getSize`` report the new world (c10d's frozen rank maps,
    ``get_process_group_ranks``, are refreshed for the default group only). Clears a sticky network error:
    the next op runs on the new communicator.

    A peer just admitted (by that round, or at bootstrap) that has run no
    collective, ``sync_shared_state`` or ``update_topology`` yet returns at once
    the change that admitted it: that round was its update (see ``peers_pending``).

    Args:
        group: a group formed with ``init_method="pccl://..."`` (default: the
            default group).
        timeout: deadline for the master's round in seconds or a timedelta
            (default ``config.UPDATE_TIMEOUT_S`` = 60 s); connecting the new
            communicator is bounded by the group's op timeout.
        optimize_ring: then measure the new world's links and run its ring
            collectives on the ring with the largest bottleneck
            (``torch_pccl.optimize_topology``); every member passes the same value.
        admit: False for a recovery from a failure in the middle of a step
            (``all_reduce_with_retry``, the DiLoCo wrappers' retries): pending
            peers stay pending until an update at a point where a joiner lines
            up with the members (a check at the top or the end of a step).

    Returns:
        TopologyChange(epoch, rank, world_size, joined, left).

    Raises:
        InvalidUsageError: the group was not formed through a master, or is shut down.
        PcclTimeoutError: the round did not complete in time.
        PeerLostError: the connection to the master is lost, or the master
            dropped this peer (heartbeat or round timeout); its message.
        PcclError: the master refused the update (a stale epoch); its message.
        PeerLostError, PcclTimeoutError, ...: connecting the new epoch failed
            ``CONNECT_ATTEMPTS`` times (the group keeps its old, failed
            communicator; call again). A newly admitted peer that cannot be
            reached within ``PCCL_CONNECT_TIMEOUT`` is dropped by the master on
            the members' report, and the members connect again without it.
    """
    pg, m = elastic_group(group)
    if m.held_by_owner():
        raise InvalidUsageError(
            "a DiLoCo wrapper manages this group's membership: it admits pending peers and "
            "drops lost ones at its outer boundaries; do not call update_topology() (or "
            "all_reduce_with_retry) on the group outside it")
    # A peer just admitted: the members' round that admitted it was this update.
    if m.close_admission() and pg.collectives_issued == 0 and admit:
        a = m.assignment
    else:
        a = m.update(pg, config.to_seconds(timeout, config.UPDATE_TIMEOUT_S), admit)
    change = TopologyChange(epoch=a.epoch, rank=a.rank, world_size=a.world_size,
                            joined=a.joined, left=a.left)
    if optimize_ring:
        optimize_topology(group)
    return change


def peers_pending(group=None, timeout: float | timedelta | None = None) -> bool:
    """True if any peer waits for admission; the same answer on every member, wherever it asks.

    The answer is meant for ``if peers_pending(): update_topology()``, placed at
    the top of a step, at its end, or both, with or without a
    ``sync_shared_state`` after the update, in a program that members and
    joiners run alike. No data-plane collective is involved: the master keys
    each query by ``(epoch, collectives issued in the epoch, index of the query
    since the last collective)`` and gives everyone the answer it fixed when
    that key was first asked. So members agree however far apart in time they
    ask, and a joiner's queries line up with the members' by their op count,
    not by where they sit in the program. Three rules make the first queries of
    an epoch agree too:

    - a query made before the epoch's first collective is False (the members
      have just updated; a peer arriving then waits one step);
    - while a DiLoCo wrapper lives on the group, other code gets False: the
      wrapper admits pending peers at its next outer boundary, where joiners
      line up with it (``Membership.own``);
    - a peer just admitted (or bootstrapped) that has run no collective,
      ``sync_shared_state`` or ``update_topology`` yet gets True without asking,
      and its ``update_topology()`` then returns at once: the members' round
      that admitted it was that update (so a joiner whose check is at the top of
      its loop runs the update, and the sync after it, with the members).

    Args:
        group: a pccl:// group (default: the default group).
        timeout: deadline for the master round trip, seconds or timedelta
            (default ``config.QUERY_TIMEOUT_S`` = 10 s).

    Raises:
        InvalidUsageError: the group was not formed through a master.
        PcclTimeoutError, PeerLostError, PcclError: the master did not answer
            or refused (this peer is no longer a member of its epoch).
    """
    pg, m = elastic_group(group)
    return m.pending(pg.collectives_issued, timeout)


def epoch(group=None) -> int:
    """The group's membership epoch (1 for the first group; +1 per ``update_topology``).

    Raises:
        InvalidUsageError: the group was not formed through a master.
    """
    return elastic_group(group).membership.assignment.epoch


def all_reduce_with_retry(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          max_retries: int = 3,
                          timeout: float | timedelta | None = None) -> list[TopologyChange]:
    """``dist.all_reduce`` that survives lost peers: on a network error, shrink and retry.

    A failed all-reduce leaves ``tensor`` unchanged, so after a network error
    (``RETRYABLE_ERRORS``: PeerLostError, RemoteError, PcclTimeoutError,
    PcclSystemError, ProtocolError) this calls ``update_topology(group,
    timeout)`` and runs the same all-reduce on the new world; SUM and AVG
    then cover the new world's members (AVG divides by the new size). Every
    live member must call it (the retry's ``update_topology`` is a collective).

    All or nothing: a peer lost inside the all-reduce can leave some survivors with the
    result and others with a failure. The ones that completed find their group failed at
    their next call (the master's ``member_lost``) and join the same recovery round; the
    round tells everyone who completed it, and those that did not get the result
    broadcast into ``tensor`` and return without redoing it (``Membership.roll_forward``).
    For that each call keeps a copy of its result until the next one (one more tensor of
    the same size, on its device).

    Args:
        tensor: the in-place all-reduce's tensor (as ``dist.all_reduce``).
        op: a ``dist.ReduceOp`` (SUM, AVG, MIN, MAX, PRODUCT).
        group: a pccl:// group (default: the default group).
        max_retries: how many topology updates to try (>= 0).
        timeout: passed to ``update_topology``.

    Returns:
        The TopologyChanges made, in order ([] when the first try succeeded).

    Raises:
        The last network PcclError when ``max_retries`` updates did not help;
        any other error of ``dist.all_reduce`` or ``update_topology`` at once.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    m = elastic_group(group).membership
    changes: list[TopologyChange] = []
    m.begin_exchange(tensor)
    while True:
        try:
            dist.all_reduce(tensor, op=op, group=group)
            # Kept until the next exchange: a survivor that missed this one gets it from here.
            m.end_exchange(tensor.detach().clone())
            return changes
        except RETRYABLE_ERRORS:
            if len(changes) >= max_retries:
                raise
        # A recovery: a joiner admitted here would start its program while the members
        # redo this all-reduce.
        changes.append(update_topology(group, timeout, admit=False))
        if m.rolled_forward:             # completed elsewhere; its result is now in tensor
            return changes


def optimize_topology(group=None, probe_bytes: int = PROBE_BYTES,
                      bandwidth: Sequence[Sequence[float]] | None = None,
                      min_gain: float = MIN_GAIN) -> RingChoice:
    """Measures the links, picks the ring with the largest bottleneck and applies it; a collective.

    Every rank of the group calls it at the same point of its op sequence (like
    any collective). It waits for the group's queued ops, measures every pair
    (``ring.measure.measure_links``: about ``W - 1`` rounds of a ping-pong and a
    ``probe_bytes`` exchange), computes ``ring.order.best_ring`` of the measured
    matrix (identical on every rank) and, when that ring's slowest hop is at
    least ``min_gain`` times the current ring's, makes it the group's ring order
    (``ProcessGroupPCCL.set_ring_order``) and warms the lanes up on it
    (``Communicator.warm_up``: the new neighbours' connections are cold). c10d ranks, ``dist.get_rank()`` and
    result layouts do not change. A membership change (``update_topology``)
    starts the new epoch in rank order: call this again after it. A group formed
    through a master shows this rank's measured row on the master's status page.
    The work is ``ring.optimize.optimize_ring_order``'s.

    Args:
        group: a pccl process group (default: the default group).
        probe_bytes: bytes each rank sends each peer to time the link.
        bandwidth: a known matrix (bytes/s, ``bandwidth[i][j]`` from rank i to
            rank j, the same on every rank) instead of measuring, e.g. from an
            operator who knows the links.
        min_gain: the factor by which the new ring's bottleneck must beat the
            current one's (default 1.2: measurement noise never reorders a ring).

    Returns:
        RingChoice(order, previous, bandwidth, rtt_s, bottleneck, previous_bottleneck, seconds).

    Raises:
        InvalidUsageError: ``group`` is not a pccl group.
        InvalidArgumentError: a bad ``probe_bytes``, ``bandwidth`` (not W x W) or
            ``min_gain`` (< 1).
        PeerLostError, PcclTimeoutError, ...: a probe failed (the order is unchanged).
    """
    choice = optimize_ring_order(group, probe_bytes, bandwidth, min_gain)
    pg = pccl_group(group)
    membership = membership_of(pg)
    if membership is not None:        # this rank's row, shown on the master's status page
        membership.report_links(list(choice.bandwidth[pg.getRank()]))
    return choice


__all__ = [
    "RETRYABLE_ERRORS",
    "TopologyChange",
    "all_reduce_with_retry",
    "elastic_group",
    "epoch",
    "optimize_topology",
    "peers_pending",
    "update_topology",
]
