"""Members of an earlier group re-registering with a (re)started master, and the run's
record adopted (docs/membership.md, "When the master restarts"): ``Resumption``.

The transitions of the restart rules: a state file's record or a member's re-registration
becomes the current epoch (each rank a placeholder until its member is back), a group of
joiners only gives way to a resumed group with more history, and a re-registering member
takes over its rank. ``RestartRules`` (master/restart.py) remembers what the master knows
of the run and answers whether a record is adoptable; this module changes the group, the
peers and the shared state through their owners' methods.
"""

from __future__ import annotations

from .actions import Actions
from .answers import PendingAnswers
from .counters import Counters
from .group import Group
from .peers import ACCEPTED, RESUMING, Peer, Peers
from .restart import REREGISTRATION, STATE_FILE, RestartRules
from .sync import SharedStateSync


class Resumption:
    """Re-registrations and adoptions, applied to the master's owners (shared, not copied)."""

    def __init__(self, peers: Peers, group: Group, sync: SharedStateSync,
                 answers: PendingAnswers, rules: RestartRules, counters: Counters):
        self._peers, self._group, self._sync = peers, group, sync
        self._answers, self._rules, self._counters = answers, rules, counters

    def resuming(self) -> bool:
        """Whether a member of the current epoch has not re-registered yet."""
        return any(self._peers[c].state == RESUMING for c in self._group.live(self._peers))

    def view(self) -> dict:
        """The restart rules now (``RestartRules.view``): the joiners held, the members not
        re-registered yet and those that did."""
        live = self._group.live(self._peers)
        return self._rules.view(
            held=[p.peer_id for p in self._peers.pending()],
            resuming=[self._peers[c].peer_id for c in live
                      if self._peers[c].state == RESUMING])

    def record(self) -> dict | None:
        """The run's record for the state file (``MembershipState.run_record``)."""
        roster, g, sync = self._rules.roster, self._group, self._sync
        if g.epoch == 0 or not roster:
            return None
        return {"epoch": g.epoch, "comm_id": g.comm_id,
                "peer_ids": [pid for pid, _ in roster],
                "addrs": [addr for _, addr in roster],
                "revision": -1 if sync.revision is None else sync.revision,
                "content": sync.content or ""}

    def resume(self, act: Actions, peer: Peer, msg: dict, now: float) -> str | None:
        """``peer`` re-registers with hello ``msg``: adopts its epoch first when
        ``RestartRules.adoptable`` says its group is the run's, then hands it its rank.
        Returns why it cannot resume (the caller refuses it for good), else None."""
        r, pid, g = msg["resume"], msg["peer_id"], self._group
        if (r["epoch"], r["comm_id"]) != (g.epoch, g.comm_id) and self._adoptable(r):
            if g.live(self._peers):
                self._give_way(act, r, pid)
            self.adopt(act, r, now, f"{pid}'s re-registration")
        rank = r["rank"]
        old = self._peers.get(g.members[rank]) if rank < len(g.members) else None
        if (r["epoch"], r["comm_id"]) != (g.epoch, g.comm_id) or old is None or \
                old.peer_id != pid:
            return (f"cannot resume rank {rank} of epoch {r['epoch']}: the group is at "
                    f"epoch {g.epoch} without it")
        # Take over the old record: a placeholder, or a connection not yet seen dead.
        self._counters.resumed()
        self._peers.remove(old.conn)
        if old.state == ACCEPTED:
            act.closes.append(old.conn)
        for rnd in (g.round, self._sync.round):
            if rnd is not None:
                rnd.rename(old.conn, peer.conn)
        peer.introduce(msg, ACCEPTED, rank)
        g.seat(rank, peer.conn)
        self._answers.quiet_up_to(tuple(r["last_key"]))
        if self._sync.raise_to(r["revision"]):
            act.persist = True
        self._rules.resumed(pid)
        act.events.append(f"peer {pid} ({peer.addr}) re-registered as rank {rank} of epoch "
                          f"{g.epoch}")
        return None

    def adopt(self, act: Actions, r: dict, now: float, source: str) -> None:
        """Takes record ``r`` (a re-registration's ``resume``, or the state file's
        ``run_record``) as the current epoch: its comm_id, its ranks as placeholders,
        its shared-state revision (and content, from a file). Ends the grace window: the
        run is known, and held joiners are pending peers of this group."""
        roster = list(zip(r["peer_ids"], r["addrs"]))
        conns = [self._peers.placeholder(now, member, addr, rank)
                 for rank, (member, addr) in enumerate(roster)]
        self._group.adopt(r["epoch"], r["comm_id"], conns)
        self._answers.reset()
        self._sync.adopt(None if r["revision"] < 0 else r["revision"], r.get("content") or None)
        held = self._peers.pending_count() if self._rules.holding else 0
        self._rules.adopted(r["comm_id"], roster,
                            STATE_FILE if source == "the state file" else REREGISTRATION)
        act.persist = True
        act.events.append(f"resumed epoch {r['epoch']} (comm_id {r['comm_id']:#018x}, world "
                          f"size {len(conns)}) from {source}")
        if held:
            act.events.append(f"resume grace window over: {held} held joiner(s) are pending "
                              f"peers of the resumed group")

    def _adoptable(self, r: dict) -> bool:
        live = self._group.live(self._peers)
        return self._rules.adoptable(
            r, live=bool(live), unconfirmed=all(self._peers[c].state == RESUMING for c in live),
            shared_revision=self._sync.revision, epoch=self._group.epoch)

    def _give_way(self, act: Actions, r: dict, pid: str) -> None:
        """The current group yields to ``pid``'s resumed group (``_adoptable``): each of
        its live members is told so (fatal, ``replaced``) and forgotten; pending peers stay
        pending and join the resumed group at its members' next round."""
        why = (f"the run's earlier group re-registered (epoch {r['epoch']}, shared-state "
               f"revision {r['revision']}, by {pid}) and takes precedence over this group "
               f"(epoch {self._group.epoch}, formed from joiners only after the master "
               f"restarted); re-join as a new peer to receive the run's state")
        for conn in self._group.live(self._peers):
            gone = self._peers.remove(conn)
            if gone.depart() == RESUMING:
                continue        # a placeholder of a state file nobody confirmed: no peer
            self._counters.dropped("replaced")
            act.sends.append((conn, {"type": "error", "fatal": True, "replaced": True,
                                     "message": why}))
            act.closes.append(conn)
            act.events.append(f"peer {gone.peer_id} (rank {gone.rank}) dropped: {why}")
        self._group.dissolve()
        self._sync.close_round()
