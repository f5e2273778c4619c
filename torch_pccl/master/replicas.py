"""Sharded replicas at the master: who forms a whole replica, whose layout is refused, and
who goes down with a lost process (docs/sharded-replicas.md). Pure: peers in, decisions out.

A *replica* (torchft's replica group) is the set of processes that together hold one copy
of the model, sharded among them over an inner group that lives as long as the replica
(FSDP2, tensor parallel, any DTensor layout). Each of its processes registers with the
replica's id, its shard index and the shard count (the hello's ``replica``). The master
keeps one group of every process; each process connects only the ring of its shard index
(the members of the same index in every replica), and the master admits and drops
replicas whole:

- a pending process is admitted only once every shard of its replica is pending
  (``admissible``), so every shard ring gains the replica in the same update;
- when any process of a replica is lost, the others are dropped with it (``mates``): each
  ring loses that replica's shard, and the other replicas go on;
- a replica whose shard count or layout digest differs from the group's, or that names a
  shard index twice, is refused at its hello (``refusal``).

Peers without ``replica`` are peers of their own, as before; a group holds one kind or the
other.
"""

from __future__ import annotations

from collections.abc import Iterable

from .peers import ACCEPTED, JOINING, PENDING, RESUMING, Peer

_HOLDING = (PENDING, ACCEPTED, RESUMING)


def describe(replica: dict) -> str:
    """A replica's layout in words, for a refusal: shard count, description, digest head."""
    text = f"{replica['shards']} shard(s)"
    if replica["description"]:
        text += f", {replica['description']}"
    if replica["layout"]:
        text += f" (layout {replica['layout'][:12]})"
    return text


def refusal(replica: dict | None, peers: Iterable[Peer]) -> str | None:
    """Why a hello with ``replica`` (None: a peer of its own) cannot join the processes
    ``peers`` hold (pending or members), or None when it can.

    The group's layout is that of any process holding a place (members and pending
    processes agree: each was checked against the others at its hello)."""
    holding = [p for p in peers if p.state in _HOLDING]
    if not holding:
        return None
    plain = [p for p in holding if p.replica is None]
    if replica is None:
        if len(plain) < len(holding):
            return ("this group is made of sharded replicas: register with a replica id, "
                    "shard index and shard count (torch_pccl.init_replica_group)")
        return None
    if plain:
        return ("this group is made of single-process peers, not sharded replicas: join it "
                "with init_process_group(init_method='pccl://...')")
    ref = holding[0].replica
    if (ref["shards"], ref["layout"]) != (replica["shards"], replica["layout"]):
        return (f"replica {replica['id']!r} has layout {describe(replica)}, but the group's "
                f"is {describe(ref)}: every replica must shard the same model the same way")
    for p in holding:
        if p.replica["id"] == replica["id"] and p.replica["shard"] == replica["shard"]:
            return (f"shard {replica['shard']} of replica {replica['id']!r} is already "
                    f"registered (peer {p.peer_id}): each process of a replica needs its own "
                    f"shard index")
    return None


def admissible(pending: list[Peer]) -> list[Peer]:
    """The pending peers (in arrival order) that may be admitted now: peers of their own,
    and the processes of every replica whose shards are all pending. A replica's processes
    come together, in shard order, where its first process arrived; so a fresh group's rank
    is ``replica position * shards + shard``, and every shard ring orders the replicas
    alike."""
    by_replica: dict[str, list[Peer]] = {}
    for p in pending:
        if p.replica is not None:
            by_replica.setdefault(p.replica["id"], []).append(p)
    out: list[Peer] = []
    placed: set[str] = set()
    for p in pending:
        if p.replica is None:
            out.append(p)
            continue
        rid = p.replica["id"]
        if rid in placed:
            continue
        placed.add(rid)
        shards = by_replica[rid]
        if len({q.replica["shard"] for q in shards}) == p.replica["shards"]:
            out.extend(sorted(shards, key=lambda q: q.replica["shard"]))
    return out


def take(admissible_peers: list[Peer], n: int) -> list[Peer]:
    """The first ``n`` processes of ``admissible_peers``, rounded up to whole replicas."""
    out: list[Peer] = []
    for p in admissible_peers:
        if len(out) >= n and (p.replica is None or p.replica["shard"] == 0):
            break
        out.append(p)
    return out


def mates(peer: Peer, peers: Iterable[Peer]) -> list[Peer]:
    """The other processes of ``peer``'s replica that hold a place (none for a peer of
    its own)."""
    if peer.replica is None:
        return []
    rid = peer.replica["id"]
    return [p for p in peers if p is not peer and p.state != JOINING and
            p.replica is not None and p.replica["id"] == rid]


def unit(peer: Peer) -> str:
    """What a quorum counts: a process's replica (its id), or the peer itself."""
    return f"replica:{peer.replica['id']}" if peer.replica is not None else f"peer:{peer.conn}"


def roster_fields(peers: list[Peer]) -> dict:
    """The ``assign`` fields that let each member find its shard ring: ``replicas`` and
    ``shards`` by rank (empty when no member is part of a replica)."""
    if all(p.replica is None for p in peers):
        return {"replicas": [], "shards": []}
    return {"replicas": [p.replica["id"] for p in peers],
            "shards": [p.replica["shard"] for p in peers]}


__all__ = ["admissible", "describe", "mates", "refusal", "roster_fields", "take", "unit"]
