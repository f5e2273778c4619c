"""The collectives of the accepted members that the master runs within one epoch.

A *round* starts with the first member's message and completes when every live member
has sent it (or the deadline drops the rest): ``Round`` collects ``update`` messages and
ends the epoch (master/group.py), ``SyncRound`` collects ``sync`` votes and elects the
shared state (master/sync.py). Both are records of who responded, changed through their
methods; their owners decide what completion means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


class Collective:
    """What both kinds of round answer: who still owes its message, and their view."""

    owed = ""                  # the message each member owes
    epoch: int
    started_at: float
    deadline: float
    ids: dict

    @property
    def responded(self):
        raise NotImplementedError

    def waiting(self, live: list[int]) -> list[int]:
        """The conns of ``live`` (live members) that still owe their message."""
        return [c for c in live if c not in self.responded]

    def view(self, peers: Mapping, live: list[int], key: str) -> dict:
        """JSON-able view for the status document: peer ids that responded (under ``key``)
        and that still owe their message."""
        return {"epoch": self.epoch, "started_at": self.started_at, "deadline": self.deadline,
                key: sorted(peers[c].peer_id for c in self.responded),
                "waiting": sorted(peers[c].peer_id for c in self.waiting(live))}


@dataclasses.dataclass
class Round(Collective):
    """An update round in progress for ``epoch`` (times in seconds, the caller's clock)."""

    owed = "update"

    epoch: int
    started_at: float
    deadline: float
    members: set = dataclasses.field(default_factory=set)     # conns that sent update
    admit: bool = True        # False once any member asked for a recovery round
    done: dict = dataclasses.field(default_factory=dict)      # conn -> its `done`
    busy: set = dataclasses.field(default_factory=set)        # conns inside an exchange
    ids: dict = dataclasses.field(default_factory=dict)       # conn -> its request's `id`

    @property
    def responded(self) -> set:
        """The conns that sent ``update``."""
        return self.members

    def respond(self, conn: int, rid: int, admit: bool, done: int, busy: bool = False) -> None:
        """``conn`` sent ``update`` (request ``rid``; a repeat is harmless). ``admit``
        false: it recovers from a loss mid-step and cannot take a joiner in there (the
        joiner starts at the top of its program, docs/membership.md); ``done`` >= 0: the
        exchanges it completed this epoch; ``busy``: it came from inside the next one."""
        self.members.add(conn)
        self.ids[conn] = rid
        if done >= 0:
            self.done[conn] = done
        if busy:
            self.busy.add(conn)
        else:
            self.busy.discard(conn)
        self.admit = self.admit and admit

    def ledger(self, conns: list[int]) -> dict:
        """The assign's ``done`` and ``busy`` for the new epoch's ``conns`` (by rank; -1 and
        false for a joiner); {} when no member sent a ``done``."""
        if not self.done:
            return {}
        return {"done": [self.done.get(c, -1) for c in conns],
                "busy": [c in self.busy for c in conns]}

    def forget(self, conn: int) -> None:
        """``conn`` is gone: it no longer counts as responded."""
        self.members.discard(conn)

    def rename(self, old: int, new: int) -> None:
        """A member re-registered on connection ``new``: what ``old`` sent counts for it."""
        if old in self.members:
            self.members.discard(old)
            self.members.add(new)
            if old in self.done:
                self.done[new] = self.done.pop(old)
            if old in self.busy:
                self.busy.discard(old)
                self.busy.add(new)


@dataclasses.dataclass
class SyncRound(Collective):
    """A shared-state sync round in progress for ``epoch``: each voter's ``Vote``."""

    owed = "sync"

    epoch: int
    started_at: float
    deadline: float
    votes: dict = dataclasses.field(default_factory=dict)     # conn -> Vote
    ids: dict = dataclasses.field(default_factory=dict)       # conn -> its request's `id`

    @property
    def responded(self):
        """The conns that voted."""
        return self.votes.keys()

    def vote(self, conn: int, vote, rid: int) -> None:
        """``conn`` voted (request ``rid``); a repeated vote replaces the earlier one."""
        self.votes[conn] = vote
        self.ids[conn] = rid

    def forget(self, conn: int) -> None:
        """``conn`` is gone: its vote is void."""
        self.votes.pop(conn, None)

    def rename(self, old: int, new: int) -> None:
        """A member re-registered on connection ``new``: ``old``'s vote is its vote."""
        if old in self.votes:
            self.votes[new] = self.votes.pop(old)
