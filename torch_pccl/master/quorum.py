"""The master's side of quorum rounds: which members take part in an outer step
(docs/diloco.md, "Stragglers: quorum rounds").

A DiLoCo wrapper with ``quorum=`` tells the master when its peer has done its inner
steps for outer step ``round`` (``ready``, with the tokens it trained on since it last
took part). The master closes the round when every live member is ready, or when at
least ``min_peers`` are ready and ``grace_s`` seconds have passed since the
``min_peers``-th one came (Decoupled DiLoCo's minimum quorum and grace window, arXiv
2604.21428; the window here is fixed, not adaptive: see ``QuorumRounds``). It then
announces the participants and their tokens to every live member (``quorum``): the
ready ones as the answer to their request, the others unasked, so that each of them
joins that outer step's exchange with no contribution at its next inner step. No tensor
data goes through here: only peer ids and token counts.

Round numbers are the shared-state revision each round starts from (the wrappers'
``sync_shared_state`` revision: equal on every member, and rising from one round to the
next), so a round outlives an epoch change: a member lost while the others wait only
leaves the live set, and the round closes without it. A group formed of joiners only
starts a new history (``reset``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping

from .actions import Actions

MAX_HISTORY = 16
"""Closed rounds kept for the status page and for a late ``ready`` (its announcement)."""


@dataclasses.dataclass
class QuorumRound:
    """An open quorum round (times in seconds, the master's clock).

    Attributes:
        number: the outer step it closes.
        min_peers: ready members that make a quorum (the first ``ready``'s setting).
        grace_s: seconds the round stays open after the quorum was reached.
        started_at: when the first member became ready.
        ready: conn -> (peer id, tokens, stale, request id) of the members that are ready.
        quorum_at: when the quorum was first reached (None: not yet).
    """

    number: int
    min_peers: int
    grace_s: float
    started_at: float
    ready: dict = dataclasses.field(default_factory=dict)
    quorum_at: float | None = None

    def view(self, peers: Mapping, live: list[int]) -> dict:
        """JSON-able: the round, who is ready and who is not (peer ids)."""
        return {"round": self.number, "min_peers": self.min_peers, "grace_s": self.grace_s,
                "started_at": self.started_at, "quorum_at": self.quorum_at,
                "ready": sorted(v[0] for v in self.ready.values()),
                "waiting": sorted(peers[c].peer_id for c in live if c not in self.ready)}


class QuorumRounds:
    """The open quorum round and the latest closed ones.

    The grace window is a fixed number of seconds chosen by the job, not adapted from
    the spread of recent arrivals as Decoupled DiLoCo does: with the few peers of an
    internet run (2-16) a spread estimate from the last rounds is noisy, and one slow
    round would widen the window for the next ones; a fixed bound is what an operator
    can reason about (the longest a fast peer waits beyond the quorum).

    A sharded replica (master/replicas.py) is ready when all its processes are: rounds
    count *units* (``unit``: a member's replica, or the member itself), a unit takes part
    only with every live process of it ready, and ``min_peers`` counts units.

    Attributes (read them; they change through the methods):
        open: the open ``QuorumRound``, or None.
        closed: the latest closed rounds' announcements, oldest first (at most
            ``MAX_HISTORY``): ``{"round", "peer_ids", "tokens", "stale", "late",
            "seconds", "pending"}``.

    Args:
        unit: a member's connection -> the unit it counts in (None: each member its own).
    """

    def __init__(self, unit: Callable[[int], object] | None = None):
        self.open: QuorumRound | None = None
        self.closed: deque[dict] = deque(maxlen=MAX_HISTORY)
        self._unit = unit or (lambda conn: conn)

    def view(self, peers: Mapping, live: list[int]) -> dict:
        """``{"open", "closed"}`` for the status document."""
        return {"open": None if self.open is None else self.open.view(peers, live),
                "closed": list(self.closed)}

    def reset(self) -> None:
        """Forgets every round (a new group of joiners only: no round of theirs was held)."""
        self.open = None
        self.closed.clear()

    def last_closed(self) -> int:
        """The number of the latest closed round (-1: none)."""
        return self.closed[-1]["round"] if self.closed else -1

    def ready(self, act: Actions, conn: int, peer_id: str, msg: dict, now: float,
              peers: Mapping, live: list[int], pending: int = 0) -> None:
        """Member ``conn`` sent ``ready`` ``msg`` (round, tokens, stale, min_peers, grace_s,
        id).

        A ``ready`` for a round already closed is answered with its announcement (the
        member was late and is not among its participants); one for an older round, or
        for another round than the open one, is refused (a member out of step).
        """
        number, rid = msg["round"], msg.get("id", -1)
        for past in self.closed:
            if past["round"] == number:
                act.reply(conn, self._announcement(past), rid)
                return
        if number <= self.last_closed():
            act.refuse(conn, f"ready for quorum round {number}, which closed before round "
                             f"{self.last_closed()}", rid)
            return
        if self.open is not None and self.open.number != number:
            act.refuse(conn, f"ready for quorum round {number} while round "
                             f"{self.open.number} is open", rid)
            return
        if self.open is None:
            self.open = QuorumRound(number, msg["min_peers"], msg["grace_s"], now)
            act.events.append(f"quorum round {number} started by {peer_id} (at least "
                              f"{msg['min_peers']} members, grace {msg['grace_s']:g} s)")
        self.open.ready[conn] = (peer_id, msg["tokens"], msg["stale"], rid)
        self.check(act, now, peers, live, pending)

    def check(self, act: Actions, now: float, peers: Mapping, live: list[int],
              pending: int = 0) -> None:
        """Closes the open round if its rule holds at ``now`` for the ``live`` members
        (called on every ``ready``, tick and departure); ``pending``: the peers waiting
        for admission now, which the announcement carries (the members' boundary after
        the round then needs no pending query of its own)."""
        rnd = self.open
        if rnd is None:
            return
        for conn in [c for c in rnd.ready if c not in live]:
            del rnd.ready[conn]             # gone: it no longer counts as ready
        if not rnd.ready:
            if not live:
                self.open = None
            return
        everyone = all(c in rnd.ready for c in live)
        units, ready = self._units(rnd, live)
        quorum = len(ready) >= min(rnd.min_peers, len(units))
        if quorum and rnd.quorum_at is None:
            rnd.quorum_at = now
        if not quorum:
            rnd.quorum_at = None            # a ready member was lost: wait for another
        if everyone or (quorum and now >= rnd.quorum_at + rnd.grace_s):
            self._close(act, now, peers, live, pending)

    def _units(self, rnd: QuorumRound, live: list[int]) -> tuple[dict, set]:
        """The live units (unit -> its conns) and those whose every process is ready."""
        units: dict = {}
        for conn in live:
            units.setdefault(self._unit(conn), []).append(conn)
        return units, {u for u, conns in units.items() if all(c in rnd.ready for c in conns)}

    def deadline(self) -> float | None:
        """When the open round's grace window ends (None: no quorum yet)."""
        rnd = self.open
        return None if rnd is None or rnd.quorum_at is None else rnd.quorum_at + rnd.grace_s

    def _close(self, act: Actions, now: float, peers: Mapping, live: list[int],
               pending: int) -> None:
        units, ready = self._units(self.open, live)
        rnd, self.open = self.open, None
        # A replica with a process not yet ready sits the round out whole.
        order = sorted((c for c in rnd.ready if self._unit(c) in ready),
                       key=lambda c: rnd.ready[c][0])
        late = sorted(peers[c].peer_id for c in live if c not in order)
        past = {"round": rnd.number, "peer_ids": [rnd.ready[c][0] for c in order],
                "tokens": [rnd.ready[c][1] for c in order],
                "stale": [rnd.ready[c][2] for c in order], "late": late,
                "seconds": round(now - rnd.started_at, 3), "pending": pending}
        self.closed.append(past)
        for conn in live:
            rid = rnd.ready[conn][3] if conn in rnd.ready else -1
            act.reply(conn, self._announcement(past), rid)
        act.events.append(f"quorum round {rnd.number} closed after {past['seconds']:g} s: "
                          f"{len(ready)} of {len(units)} "
                          f"{'members' if len(units) == len(live) else 'replicas'}"
                          + (f", late: {', '.join(late)}" if late else ""))

    @staticmethod
    def _announcement(past: dict) -> dict:
        return {"type": "quorum", "round": past["round"], "peer_ids": list(past["peer_ids"]),
                "tokens": list(past["tokens"]), "stale": list(past["stale"]),
                "pending": past["pending"]}
