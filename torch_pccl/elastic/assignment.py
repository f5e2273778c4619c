"""What the master tells a peer about its place in an epoch (``Assignment``), and the
default peer id a process registers with. No I/O."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Assignment:
    """One ``assign`` from the master: this peer's place in membership epoch ``epoch``.

    Attributes:
        epoch: the membership epoch (1, 2, ...).
        comm_id: the epoch's 64-bit communicator id (same on every member).
        rank: this peer's rank, 0 .. world_size-1.
        world_size: members in the epoch.
        addrs: data-plane ``"host:port"`` of each rank.
        peer_ids: master-level id of each rank.
        joined: peer ids admitted in this epoch.
        left: peer ids gone since the previous epoch (left or dropped).
        done: per rank, the all-or-nothing exchanges its member had completed in the
            previous epoch (-1: none counted, a joiner); () when the round had no counts.
        busy: per rank, aligned with ``done``: whether its member came to the round from
            inside an exchange (``ExchangeLedger.passed``); () likewise.
        replicas: per rank, its sharded replica's id; () when the group has no replicas.
        shards: per rank, its shard index in its replica; () likewise.
    """

    epoch: int
    comm_id: int
    rank: int
    world_size: int
    addrs: tuple[str, ...]
    peer_ids: tuple[str, ...]
    joined: tuple[str, ...]
    left: tuple[str, ...]
    done: tuple[int, ...] = ()
    busy: tuple[bool, ...] = ()
    replicas: tuple[str, ...] = ()
    shards: tuple[int, ...] = ()

    def ring(self, shard: int) -> tuple[Assignment, tuple[int, ...]]:
        """The epoch as the ring of shard index ``shard`` sees it (docs/sharded-replicas.md):
        the members holding that shard of every replica, in rank order (so every ring
        orders the replicas alike), with a communicator id of the ring's own; and the
        group rank of each ring rank.

        Raises:
            ValueError: this assignment has no replicas, or this member is not of ``shard``.
        """
        if not self.shards or self.shards[self.rank] != shard:
            raise ValueError(f"the assignment of epoch {self.epoch} has no shard {shard} "
                             f"for this member")
        ranks = tuple(r for r, s in enumerate(self.shards) if s == shard)
        inside = set(self.peer_ids[r] for r in ranks)
        return Assignment(
            epoch=self.epoch, comm_id=ring_comm_id(self.comm_id, shard),
            rank=ranks.index(self.rank), world_size=len(ranks),
            addrs=tuple(self.addrs[r] for r in ranks),
            peer_ids=tuple(self.peer_ids[r] for r in ranks),
            joined=tuple(p for p in self.joined if p in inside),
            left=self.left,
            done=tuple(self.done[r] for r in ranks) if self.done else (),
            busy=tuple(self.busy[r] for r in ranks) if self.busy else (),
            replicas=tuple(self.replicas[r] for r in ranks),
            shards=tuple(shard for _ in ranks)), ranks

    @classmethod
    def from_message(cls, msg: dict) -> Assignment:
        """Builds an Assignment from a validated ``assign`` message."""
        return cls(epoch=msg["epoch"], comm_id=msg["comm_id"], rank=msg["rank"],
                   world_size=msg["world_size"], addrs=tuple(msg["addrs"]),
                   peer_ids=tuple(msg["peer_ids"]), joined=tuple(msg["joined"]),
                   left=tuple(msg["left"]), done=tuple(msg["done"]),
                   busy=tuple(msg.get("busy", ())),
                   replicas=tuple(msg.get("replicas", ())), shards=tuple(msg.get("shards", ())))


def ring_comm_id(comm_id: int, shard: int) -> int:
    """The communicator id of shard ``shard``'s ring in the epoch of ``comm_id``: distinct
    per shard (so that no ring's handshake accepts another's links), the same on every
    member. Shard 0 keeps the epoch's id."""
    digest = hashlib.blake2b(f"{comm_id}:{shard}".encode(), digest_size=8).digest()
    return comm_id if shard == 0 else int.from_bytes(digest, "little")


def default_peer_id() -> str:
    """``hostname-pid-random``: unique per process, readable in the master's log."""
    host = socket.gethostname()[:32] or "peer"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
