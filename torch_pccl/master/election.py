"""The shared-state election of a sync round (docs/membership.md, "Shared-state sync
round"): who serves the shared state and who fetches it. Pure: votes in, a result out."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Vote:
    """One member's ``sync`` vote, with its rank and id in the vote's epoch."""

    rank: int
    peer_id: str
    revision: int
    strategy: str
    fresh: bool
    content: str


def elect(votes: list[Vote], shared_revision: int | None) -> dict:
    """The outcome of a sync round: deterministic, pure.

    Only votes whose strategy is not ``receive_only`` count; among them the
    incumbents (``fresh`` False) outvote fresh peers entirely when there are
    any. The most common ``(revision, content)`` wins; ties go to the higher
    revision, then to the content held by the lowest rank. Incumbents must
    sync ``shared_revision`` or ``shared_revision + 1`` (when it is not None).

    Returns:
        The fields of a ``sync_result`` but its epoch: ``revision``,
        ``content``, ``sources`` (ranks offering the winner, ascending),
        ``outdated`` (ranks holding other content, ascending) and ``error``
        ("" on success; otherwise content "", no sources or outdated, and
        revision ``shared_revision`` or 0).
    """
    voters = [v for v in votes if v.strategy != "receive_only"]
    incumbents = [v for v in voters if not v.fresh]
    pool = incumbents or voters

    def failed(why):
        return {"revision": shared_revision or 0, "content": "", "sources": [],
                "outdated": [], "error": why}

    if not pool:
        return failed("no member offers its state: every member syncs with receive_only")
    if shared_revision is not None:
        for v in sorted(incumbents, key=lambda v: v.rank):
            if v.revision not in (shared_revision, shared_revision + 1):
                return failed(
                    f"peer {v.peer_id} (rank {v.rank}) syncs revision {v.revision}, but the "
                    f"shared state is at revision {shared_revision}: a revision must equal "
                    f"the previous one or advance by exactly one")
    holders: dict[tuple, list] = {}
    for v in pool:
        holders.setdefault((v.revision, v.content), []).append(v.rank)
    (revision, content), _ = max(holders.items(),
                                 key=lambda kv: (len(kv[1]), kv[0][0], -min(kv[1])))
    return {"revision": revision, "content": content,
            "sources": sorted(v.rank for v in voters if v.content == content),
            "outdated": sorted(v.rank for v in votes if v.content != content),
            "error": ""}
