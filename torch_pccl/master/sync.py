"""The master's side of ``sync_shared_state()``: the shared state's revision and content,
and the sync round that elects them (docs/shared-state.md).

A sync round is a collective of the accepted members within one epoch, started by the
first ``sync`` vote and completed by ``elect()`` (master/election.py) once every live
member voted: it picks the revision and content and tells every voter who serves them
(``sources``) and who must fetch them (``outdated``). An update round or a new epoch
abandons an open sync round; its voters get a non-fatal error and sync again.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import Actions
from .counters import Counters
from .election import Vote, elect
from .peers import Peer
from .rounds import SyncRound


class SharedStateSync:
    """The shared state as the master knows it, and the open sync round.

    Attributes (read them; they change through the methods):
        revision: the elected revision, None before the first successful sync.
        content: its content digest (32 hex), None before the first successful sync.
        round: the open ``SyncRound``, or None.

    Sharded replicas (master/replicas.py) hold a different state per shard index: the
    votes are elected per ``key`` (a voter's shard index; -1 for a peer of its own), each
    voter told its own key's result; ``revision`` and ``content`` are then the lowest
    key's.

    Args:
        counters: the master's counters (a completed round counts as ``sync_rounds``).
        key: a voter's connection -> the key whose votes it is elected with (None: one
            election of every vote).
    """

    def __init__(self, counters: Counters, key: Callable[[int], int] | None = None):
        self.revision: int | None = None
        self.content: str | None = None
        self.round: SyncRound | None = None
        self._counters = counters
        self._key = key or (lambda conn: -1)

    def view(self) -> dict:
        """``{"revision", "content"}`` for the status document."""
        return {"revision": self.revision, "content": self.content}

    def adopt(self, revision: int | None, content: str | None) -> None:
        """A resumed epoch's shared state (None: none yet); any open round is dropped."""
        self.revision, self.content, self.round = revision, content, None

    def raise_to(self, revision: int) -> bool:
        """A re-registered member holds ``revision``: keeps it if newer; whether it was."""
        if revision > (-1 if self.revision is None else self.revision):
            self.revision = revision
            return True
        return False

    def close_round(self) -> SyncRound | None:
        """Ends the open round without an answer to its voters; returns it."""
        rnd, self.round = self.round, None
        return rnd

    def vote(self, act: Actions, peer: Peer, msg: dict, now: float, epoch: int,
             timeout_s: float) -> None:
        """``peer`` (a member of ``epoch``) sent ``sync`` ``msg`` at ``now``: opens the round
        (deadline ``timeout_s`` seconds later) if none is, and records the vote."""
        if self.round is None:
            self.round = SyncRound(epoch=epoch, started_at=now, deadline=now + timeout_s)
            act.events.append(f"sync for epoch {epoch} started by {peer.peer_id}")
        self.round.vote(peer.conn, Vote(
            rank=peer.rank, peer_id=peer.peer_id, revision=msg["revision"],
            strategy=msg["strategy"], fresh=msg["fresh"], content=msg["content"]),
            msg.get("id", -1))

    def forget(self, conn: int) -> None:
        """Member ``conn`` is gone: its vote is void (``complete`` may then end the round)."""
        if self.round is not None:
            self.round.forget(conn)

    def voter_gone(self, act: Actions, conn: int, live: list[int]) -> None:
        """Member ``conn`` is gone: its vote is void, and the round may be complete."""
        self.forget(conn)
        self.complete(act, live)

    def complete(self, act: Actions, live: list[int], quiet: bool = False) -> bool:
        """Elects the shared state once every member of ``live`` (live members) voted; tells
        each voter the result (``sync_result``). A new revision sets ``act.persist``.
        ``quiet``: the caller would grant the epoch quiet (nobody pending): every result
        then says so when every election succeeded; returns whether they did."""
        rnd = self.round
        if rnd is None or rnd.waiting(live):
            return False
        self.round = None
        if not rnd.votes:
            act.events.append(f"sync for epoch {rnd.epoch} abandoned: no voter left")
            return False
        by_key: dict[int, list[int]] = {}
        for conn in rnd.votes:
            by_key.setdefault(self._key(conn), []).append(conn)
        self._counters.synced()
        before, elected = self.revision, False
        results = {key: elect([rnd.votes[c] for c in conns], before)
                   for key, conns in by_key.items()}
        # Every live member voted (the round waited for them): the state is equal once it
        # completes, unless an election failed.
        quiet = quiet and not any(r["error"] for r in results.values())
        for key in sorted(by_key):
            conns = by_key[key]
            result = results[key]
            where = "" if key < 0 else f" (shard {key})"
            if result["error"]:
                act.events.append(f"sync for epoch {rnd.epoch}{where} failed: {result['error']}")
            else:
                if not elected:
                    self.revision, self.content, elected = (result["revision"],
                                                            result["content"], True)
                    act.persist = True
                act.events.append(
                    f"sync for epoch {rnd.epoch}{where}: revision {result['revision']}, "
                    f"content {result['content'][:8]}, sources {result['sources']}, "
                    f"outdated {result['outdated']}")
            msg = dict(result, type="sync_result", epoch=rnd.epoch)
            if quiet:
                msg["quiet"] = True
            for conn in conns:
                act.reply(conn, dict(msg), rnd.ids.get(conn, -1))
        return quiet

    def yield_to_update(self, act: Actions, initiator: int) -> None:
        """An update round started while this round is open in the same epoch: members
        recovering from a loss (or admitting peers) are in the one, the others in the
        other, and neither can complete. The update wins: the voters still waiting on the
        sync (not ``initiator``, who gave it up) are told to join it."""
        rnd = self.close_round()
        if rnd is None:
            return
        why = (f"the shared-state sync of epoch {rnd.epoch} was abandoned: members opened an "
               f"update round of that epoch; join it, then sync again")
        act.events.append(why)
        for conn in rnd.votes:
            if conn != initiator:
                act.refuse(conn, why, rnd.ids.get(conn, -1), update=True)

    def epoch_changed(self, act: Actions, epoch: int) -> None:
        """A new ``epoch`` began: an open round is abandoned. Call after the assigns, so
        that a voter blocked in update_topology() takes its assign first; the error is for
        the sync it has given up on."""
        rnd = self.close_round()
        if rnd is None:
            return
        why = f"membership changed during shared-state sync (epoch {rnd.epoch} -> {epoch})"
        act.events.append(f"sync for epoch {rnd.epoch} abandoned: {why}")
        for conn in rnd.votes:
            act.refuse(conn, why, rnd.ids.get(conn, -1))
