"""What the master tells a peer about its place in an epoch (``Assignment``), and the
default peer id a process registers with. No I/O."""

from __future__ import annotations

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

    @classmethod
    def from_message(cls, msg: dict) -> Assignment:
        """Builds an Assignment from a validated ``assign`` message."""
        return cls(epoch=msg["epoch"], comm_id=msg["comm_id"], rank=msg["rank"],
                   world_size=msg["world_size"], addrs=tuple(msg["addrs"]),
                   peer_ids=tuple(msg["peer_ids"]), joined=tuple(msg["joined"]),
                   left=tuple(msg["left"]), done=tuple(msg["done"]))


def default_peer_id() -> str:
    """``hostname-pid-random``: unique per process, readable in the master's log."""
    host = socket.gethostname()[:32] or "peer"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
