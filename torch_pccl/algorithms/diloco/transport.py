"""The group operations the DiLoCo wrappers use, and their pccl implementation.

Every collective, membership call and shared-state sync of a wrapper goes
through one ``Transport`` object made by ``transport_for``: ``PcclTransport``
on a pccl group formed through a master. The unit tests (tests/algorithms/test_diloco.py)
replace ``transport_for`` with one returning an in-process group of replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from ... import config
from ...elastic.shared_state import SyncResult, sync_shared_state
from ...elastic.topology import TopologyChange, elastic_group, peers_pending, update_topology
from ..finite import group_members
from ..quantized import all_reduce_quantized

__all__ = ["QUANTIZATION_BITS", "PcclTransport", "Transport", "transport_for"]

QUANTIZATION_BITS = {None: 0, "int8": 8, "int4": 4}
"""The wrappers' ``quantization`` argument -> bits per value on the wire (0: plain)."""


class Transport(Protocol):
    """What a wrapper asks of its group (all of it on the calling thread)."""

    def world_size(self) -> int:
        """The group's current size."""

    def epoch(self) -> int:
        """The current membership epoch (it changes at every topology update)."""

    def shared_revision(self) -> int:
        """The group's last shared-state revision (0 when none)."""

    def all_reduce(self, buf: torch.Tensor, async_op: bool):
        """AVG all-reduce of ``buf`` in place; a Work with ``wait()`` when ``async_op``."""

    def all_reduce_max(self, buf: torch.Tensor):
        """MAX all-reduce of ``buf`` (a few int64 values) in place, never quantized, in the
        background: its Work (``wait()``). Streaming DiLoCo agrees on its ``tau`` with it."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """All-gather of every peer's ``inp`` (n elements) into ``out`` (world_size x n,
        rank order): the sparse exchange's payloads, and a non-finite result's slow
        path; a Work with ``wait()`` when ``async_op``."""

    def members(self) -> Sequence[tuple[str, str]]:
        """(master peer id, data address) of each rank of the current epoch."""

    def peers_pending(self) -> bool:
        """Whether peers wait to be admitted (the same answer on every peer)."""

    def quiet(self) -> bool:
        """Whether the last ``peers_pending`` answer was quiet: answered alone under the
        epoch's quiet grant or while the master was away (or its members were still
        re-registering), the same on every peer for that query."""

    def update_topology(self, admit: bool = True) -> TopologyChange:
        """Forgets lost peers and (``admit``) admits pending ones; the change made."""

    def begin_exchange(self, buf: torch.Tensor) -> None:
        """A blocking all-or-nothing exchange of ``buf`` starts (``Membership.begin_exchange``)."""

    def end_exchange(self, buf: torch.Tensor) -> None:
        """It completed here; ``buf`` keeps its result until the next exchange."""

    def rolled_forward(self) -> bool:
        """The exchange under way was completed by the recovery round (its result is in
        ``buf``): it must not be redone."""

    def errored(self) -> bool:
        """The group's communicator has failed (e.g. a member was dropped)."""

    def round_opened(self) -> bool:
        """A member opened an update round while this peer, past its last boundary, trains
        towards the next exchange (``Membership.round_opened``): it joins at once."""

    def sync(self, state: dict[str, torch.Tensor], revision: int,
             max_retries: int) -> SyncResult:
        """``sync_shared_state(state, revision)`` on the group."""

    def traffic(self) -> tuple[int, int]:
        """Data-plane bytes (sent, received) by this peer so far."""

    def report_step(self, step: int) -> None:
        """The outer step this peer has reached (the master's status page shows it)."""

    def peer_id(self) -> str:
        """This peer's master id (its entry in ``members()``)."""

    def quorum_ready(self, round_: int, tokens: int, stale: int, min_peers: int,
                     grace_s: float) -> dict:
        """This peer is ready for quorum round ``round_`` (``tokens`` trained since it
        last took part, ``stale`` rounds ago): blocks until the master closes it; the
        announcement, ``peer_ids``/``tokens``/``stale`` of its participants
        (master/quorum.py)."""

    def quorum_early(self, round_: int, tokens: int, stale: int, min_peers: int,
                     grace_s: float) -> None:
        """``quorum_ready`` sent ahead, without waiting (one inner step before this peer is
        ready); the ``quorum_ready`` call for the same round then only waits."""

    def quorum_closed(self, round_: int) -> dict | None:
        """The announcement of quorum round ``round_`` once the master closed it; None
        while it is open. Never blocks."""


class PcclTransport:
    """AVG all-reduces, all-gathers (sparse payloads, ``exclude_nonfinite``), membership and the
    shared-state sync on a pccl group formed through a master; counts this peer's
    data-plane bytes across communicator swaps.

    Args:
        group: a pccl process group formed through a master (None: the default group).
        timeout: deadline of the master's rounds (update, sync, pending query),
            seconds or timedelta; None: as ``update_topology``.
        bits: 0 for ``dist.all_reduce``, 8 or 4 for ``all_reduce_quantized``.

    Raises:
        InvalidUsageError: ``group`` is not a pccl group formed through a master.
    """

    def __init__(self, group, timeout: float | timedelta | None, bits: int):
        self.group = group
        self.timeout = timeout
        self.bits = bits
        # InvalidUsageError now, not at the first outer step. The wrapper that holds this
        # transport admits peers at its boundaries only (Membership.own).
        elastic_group(group).membership.own(self)
        self._comm = None
        self._base = (0, 0)
        self._sent = self._received = 0
        self._mark()

    def _pg(self):
        return elastic_group(self.group).pg

    def _membership(self):
        return elastic_group(self.group).membership

    def world_size(self) -> int:
        return self._pg().getSize()

    def epoch(self) -> int:
        return self._membership().assignment.epoch

    def shared_revision(self) -> int:
        return self._membership().shared_revision or 0

    def all_reduce(self, buf: torch.Tensor, async_op: bool):
        if self.bits:
            return all_reduce_quantized(buf, bits=self.bits, op=dist.ReduceOp.AVG,
                                        group=self.group, async_op=async_op)
        return dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=self.group, async_op=async_op)

    def all_reduce_max(self, buf: torch.Tensor):
        return dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        return dist.all_gather_single(out, inp, group=self.group, async_op=async_op)

    def members(self) -> tuple[tuple[str, str], ...]:
        return group_members(self.group)

    def begin_exchange(self, buf: torch.Tensor) -> None:
        self._membership().begin_exchange(buf)

    def end_exchange(self, buf: torch.Tensor) -> None:
        self._membership().end_exchange(buf)

    def rolled_forward(self) -> bool:
        return self._membership().rolled_forward

    def errored(self) -> bool:
        return self._pg().errored() is not None

    def round_opened(self) -> bool:
        return self._membership().round_opened

    def peers_pending(self) -> bool:
        with self._membership().as_owner():
            return peers_pending(self.group, self.timeout)

    def quiet(self) -> bool:
        return self._membership().last_quiet

    def update_topology(self, admit: bool = True) -> TopologyChange:
        pg = self._pg()
        try:
            pg.drain()                 # count the bytes of the ops still queued
        except Exception:  # noqa: BLE001 - update_topology reports a closed group itself
            pass
        self._mark()
        with self._membership().as_owner():
            change = update_topology(self.group, self.timeout, admit=admit)
        self._mark()
        return change

    def sync(self, state: dict[str, torch.Tensor], revision: int,
             max_retries: int) -> SyncResult:
        self._mark()
        comm = self._pg().communicator
        with self._membership().as_owner():
            res = sync_shared_state(state, revision, group=self.group, timeout=self.timeout,
                                    max_retries=max_retries)
        if self._pg().communicator is comm:
            self._mark()
        else:                           # the sync rebuilt the group: take its own count
            self._sent += res.bytes_sent
            self._received += res.bytes_received
            self._comm = None
            self._mark()
        return res

    def traffic(self) -> tuple[int, int]:
        self._mark()
        return self._sent, self._received

    def report_step(self, step: int) -> None:
        self._membership().report_step(step)

    def peer_id(self) -> str:
        return self._membership().client.peer_id

    def quorum_ready(self, round_: int, tokens: int, stale: int, min_peers: int,
                     grace_s: float) -> dict:
        with self._membership().as_owner():
            return self._membership().quorum(round_, tokens, stale, min_peers, grace_s,
                                                config.QUORUM_TIMEOUT_S)

    def quorum_early(self, round_: int, tokens: int, stale: int, min_peers: int,
                     grace_s: float) -> None:
        self._membership().send_ready(round_, tokens, stale, min_peers, grace_s)

    def quorum_closed(self, round_: int) -> dict | None:
        return self._membership().closed_quorum(round_)

    def _mark(self) -> None:
        try:
            comm = self._pg().communicator
            now = comm.stats()
        except Exception:  # noqa: BLE001 - a closed group counts nothing more
            return
        if comm is self._comm:
            self._sent += max(0, now[0] - self._base[0])
            self._received += max(0, now[1] - self._base[1])
        self._comm, self._base = comm, now


def transport_for(group, timeout: float | timedelta | None, bits: int) -> Transport:
    """The transport of a wrapper on ``group``: the one place the wrappers' group
    operations come from (the wrappers call it through this module, so a test can
    substitute an in-process group here)."""
    return PcclTransport(group, timeout, bits)
