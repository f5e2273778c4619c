"""The current epoch of the master's group: ``Group``.

An epoch is a number, a fresh communicator id, its members by rank, who left it since it
began, who was admitted in it, and at most one update round, whose completion forms the
next epoch. ``MembershipState`` (master/state.py) decides when; ``Group`` keeps the
bookkeeping consistent.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Callable

from .rounds import Round


class Group:
    """The current epoch and its members.

    Attributes (read them; they change through the methods):
        epoch: 0 until a group forms, then +1 per formed epoch (or the adopted one).
        comm_id: the epoch's 64-bit communicator id, fresh for each formed group.
        members: the epoch's conns by rank, live or not.
        left: peer ids of members gone since the epoch began.
        round: the open update ``Round``, or None.

    Args:
        new_comm_id: returns a fresh 64-bit communicator id; tests pass a deterministic
            one. Defaults to ``secrets.randbits(64)``.
    """

    def __init__(self, new_comm_id: Callable[[], int] | None = None):
        self._new_comm_id = new_comm_id or (lambda: secrets.randbits(64))
        self.epoch = 0
        self.comm_id = 0
        self.members: list[int] = []
        self.left: list[str] = []
        self.round: Round | None = None
        self._joined: set[str] = set()

    def live(self, peers: Mapping) -> list[int]:
        """The members still connected (in ``peers``), by rank."""
        return [c for c in self.members if c in peers]

    def admitted_here(self, peer_id: str) -> bool:
        """Whether ``peer_id`` joined in this epoch (not a member of an earlier one)."""
        return peer_id in self._joined

    def form(self, conns: list[int], joined: list[str]) -> list[str]:
        """The next epoch: a fresh comm_id (never the previous one: pcclCommCreate needs a
        new id per group), members ``conns`` by rank, ``joined`` (peer ids) admitted in
        it. Returns who left the epoch before."""
        comm_id = self._new_comm_id()
        while comm_id == self.comm_id:
            comm_id = self._new_comm_id()
        left = self.left
        self.epoch, self.comm_id, self.members = self.epoch + 1, comm_id, list(conns)
        self.left, self._joined = [], set(joined)
        return left

    def adopt(self, epoch: int, comm_id: int, conns: list[int]) -> None:
        """A resumed epoch (a state file or a re-registration) with members ``conns``."""
        self.epoch, self.comm_id, self.members = epoch, comm_id, list(conns)
        self.left, self._joined, self.round = [], set(), None

    def dissolve(self) -> None:
        """Every member is gone at once (the group gave way to a resumed one)."""
        self.members, self.round = [], None

    def seat(self, rank: int, conn: int) -> None:
        """The member of ``rank`` re-registered on connection ``conn``."""
        self.members[rank] = conn

    def lost(self, peer_id: str) -> None:
        """A member left or was dropped: the next epoch's ``assign`` names it in ``left``."""
        self.left.append(peer_id)

    def open_round(self, now: float, timeout_s: float) -> Round:
        """Opens the update round at ``now``; its deadline is ``timeout_s`` seconds later."""
        self.round = Round(epoch=self.epoch, started_at=now, deadline=now + timeout_s)
        return self.round

    def close_round(self) -> Round | None:
        """Ends the open update round; returns it."""
        rnd, self.round = self.round, None
        return rnd
