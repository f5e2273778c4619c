"""The membership state machine of the master: pure, no I/O, no clock.

Every entry point takes the current time ``now`` (seconds, any monotonic
origin) and returns an ``Actions``: messages to send, connections to close,
and one-line events for the log. The asyncio server (server.py) only moves
bytes and the clock; everything that decides who is in the group is here, so
tests drive it by hand, deadlines included, without sockets or sleeps.

Peers are addressed by *connection id* (an int from ``connect``), not by
``peer_id``; their lifecycle is in master/peers.py.

A *round* is a collective of the accepted members: it starts with the first
``update(epoch)`` and completes when every live member has sent it (or the
deadline drops the rest). Completion bumps the epoch, draws a fresh comm_id,
orders the survivors by their old rank followed by the pending peers in
arrival order, and sends each member its ``assign``.

A *sync round* is the master's side of ``sync_shared_state()``: the same kind
of collective within one epoch, started by the first ``sync`` vote and
completed by ``elect()``, which picks the shared state's revision and content
and tells every voter who serves it (``sources``) and who must fetch it
(``outdated``). A new epoch abandons an open sync round.

``MembershipState`` decides the transitions; each concern has its owner, changed
through its methods: the connections (peers.py), the epoch and its update round
(group.py, rounds.py), the shared state and its sync round (sync.py), the keyed
pending answers (answers.py), the DiLoCo quorum rounds (quorum.py), re-registrations
and adoptions (resume.py) with the restart rules' memory (restart.py), and the metrics'
counts (counters.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .. import config
from ..control.schemas import MAX_ERROR_CHARS
from . import answers, replicas
from .actions import Actions
from .answers import PendingAnswers
from .quiet import QuietGrant
from .counters import Counters
from .election import Vote, elect
from .group import Group
from .peers import ACCEPTED, GONE, JOINING, PENDING, RESUMING, Peer, Peers, rank_hint_key
from .quorum import QuorumRounds
from .restart import RestartRules
from .resume import Resumption
from .rounds import Collective, Round, SyncRound
from .sync import SharedStateSync

# Names importable from here before their owners had modules of their own.
__all__ = ["ACCEPTED", "GONE", "JOINING", "PENDING", "RESUMING", "Actions", "MembershipState",
           "Peer", "Round", "SyncRound", "Vote", "elect"]


class MembershipState:
    """Peers, the current epoch and its group, the update round and the sync round.

    Args:
        world_size: bootstrap size. 0: the first pending peer forms a group of
            one at once; N > 0: wait until N peers are pending and admit them
            together (what torchrun's fixed world needs). Applies whenever the
            group is empty, also after every member has gone.
        heartbeat_interval_s: how often peers should send a message (seconds);
            told to each peer in ``welcome``.
        heartbeat_timeout_s: a pending or accepted peer silent for longer is
            dropped (seconds). Must exceed ``heartbeat_interval_s``.
        round_timeout_s: members that have not sent ``update`` (``sync``) this
            long after an update (sync) round started are dropped and the
            round completes without them.
        handshake_timeout_s: a connection must send its hello within this.
        resume_grace_s: the resume grace window (seconds, >= 0; 0: none). A master that
            ``start``s without a record of the run holds joiners pending this long
            before it forms a group from them, so that members of an earlier group (its
            previous incarnation's) re-register first and the joiners join their group
            instead (docs/membership.md, "When the master restarts"). The CLI's default
            is ``config.resume_grace_s``: the heartbeat timeout plus the members'
            longest reconnect backoff.
        quiet_epochs: grant quiet epochs (quiet.py; off by default for now).
        new_comm_id: returns a fresh 64-bit communicator id; tests pass a
            deterministic one. Defaults to ``secrets.randbits(64)``.

    Raises:
        ValueError: a negative world size or grace window, a non-positive duration,
            or a heartbeat timeout not above the interval.
    """

    def __init__(self, world_size: int = 0,
                 heartbeat_interval_s: float = config.HEARTBEAT_INTERVAL_S,
                 heartbeat_timeout_s: float = config.HEARTBEAT_TIMEOUT_S,
                 round_timeout_s: float = config.ROUND_TIMEOUT_S,
                 handshake_timeout_s: float = config.HANDSHAKE_TIMEOUT_S,
                 resume_grace_s: float = 0.0, quiet_epochs: bool = False,
                 new_comm_id: Callable[[], int] | None = None):
        if type(world_size) is not int or world_size < 0:
            raise ValueError(f"world_size must be an int >= 0, got {world_size!r}")
        for name, value in (("heartbeat_interval_s", heartbeat_interval_s),
                            ("heartbeat_timeout_s", heartbeat_timeout_s),
                            ("round_timeout_s", round_timeout_s),
                            ("handshake_timeout_s", handshake_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({heartbeat_timeout_s}) must exceed "
                             f"heartbeat_interval_s ({heartbeat_interval_s})")
        self.world_size = world_size
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.round_timeout_s = float(round_timeout_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.counters = Counters()
        self.peers = Peers()                 # live connections only (gone peers are removed)
        self.group = Group(new_comm_id)      # the current epoch and its update round
        # A sharded replica's processes vote on their shard's state with the same shard
        # index of the other replicas (master/replicas.py); a peer of its own with all.
        self.sync = SharedStateSync(self.counters, key=self._shard_of)
        # The DiLoCo quorum rounds (master/quorum.py), counting whole replicas.
        self.quorum = QuorumRounds(unit=self._unit_of)
        # True while a lost process's replica mates are being dropped with it.
        self._dropping = False
        self._answers = PendingAnswers()    # to this epoch's keyed pending queries
        # Whether this epoch's members answer those queries alone (quiet.py).
        self._quiet = QuietGrant(quiet_epochs)
        # What this master knows of the run, and the transitions of its restart rules.
        self._restart = RestartRules(resume_grace_s)
        self._resumption = Resumption(self.peers, self.group, self.sync, self._answers,
                                      self._restart, self.counters)

    # -- the owners' state, read-only (0 = no group has ever formed) -----------

    epoch = property(lambda self: self.group.epoch, doc="The current epoch (0: none yet).")
    comm_id = property(lambda self: self.group.comm_id, doc="The epoch's communicator id.")
    members = property(lambda self: self.group.members,
                       doc="The epoch's conns by rank, live or not.")
    left = property(lambda self: self.group.left,
                    doc="Members of this epoch gone since it began (peer ids).")
    round = property(lambda self: self.group.round, doc="The open update round, or None.")
    sync_round = property(lambda self: self.sync.round, doc="The open sync round, or None.")
    shared_revision = property(lambda self: self.sync.revision,
                               doc="The shared state's revision; None before the first sync.")
    shared_content = property(lambda self: self.sync.content,
                              doc="The shared state's content digest; None before the first sync.")

    # -- queries -------------------------------------------------------------

    def _live_members(self) -> list[int]:
        return self.group.live(self.peers)

    def pending_count(self) -> int:
        """Peers that said hello and wait for admission (a sharded replica's processes
        count once all of its shards are pending)."""
        return len(self._admissible())

    def _admissible(self) -> list[Peer]:
        return replicas.admissible(self.peers.pending())

    def _shard_of(self, conn: int) -> int:
        peer = self.peers.get(conn)
        return -1 if peer is None or peer.replica is None else peer.replica["shard"]

    def _unit_of(self, conn: int) -> str:
        peer = self.peers.get(conn)
        return f"peer:{conn}" if peer is None else replicas.unit(peer)

    def snapshot(self) -> dict:
        """JSON-able view for logs and a status page: epoch, peers, round."""
        live = self._live_members()
        rounds = [None if r is None else r.view(self.peers, live, key)
                  for r, key in ((self.round, "responded"), (self.sync_round, "voted"))]
        return {"epoch": self.epoch, "comm_id": self.comm_id,
                "world_size": len(live), "pending": self.pending_count(),
                "left": list(self.left),
                "peers": [self.peers[c].view() for c in sorted(self.peers)],
                "round": rounds[0], "sync_round": rounds[1],
                "shared_state": self.sync.view(),
                "quorum": self.quorum.view(self.peers, live),
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "heartbeat_timeout_s": self.heartbeat_timeout_s,
                "restart": self._resumption.view(),
                "counters": dataclasses.asdict(self.counters)}

    def run_record(self) -> dict | None:
        """What a master restarted with the state file needs to know the run at once
        (master/run_file.py): ``epoch``, ``comm_id``, the epoch's roster as formed
        (``peer_ids``, ``addrs`` by rank), the shared state's ``revision`` (-1: none) and
        ``content`` (32 hex, "" before the first sync). None before the first group."""
        return self._resumption.record()

    # -- entry points --------------------------------------------------------

    def start(self, now: float, record: dict | None = None) -> Actions:
        """Starts serving at ``now`` (seconds): the restart rules' first step.

        With ``record`` (``run_record()`` as a previous incarnation saved it, validated by
        master/run_file.py) the master knows the run at once: it adopts the recorded
        epoch, each rank a placeholder until its member re-registers (master/resume.py),
        and joiners are pending peers of that group from their first hello. Without
        one, ``resume_grace_s`` > 0 opens the grace window: joiners are held until it
        ends, unless members of an earlier group re-register first. Call once, before
        any connection.
        """
        act = Actions()
        if record is not None:
            self._resumption.adopt(act, record, now, "the state file")
        elif self._restart.open_window(now):
            act.events.append(
                f"no record of the run: joiners are held for {self._restart.grace_s:g} s "
                f"(resume grace window) so that members of an earlier group re-register first")
        return act

    def connect(self, now: float, addr: str = "?") -> int:
        """Registers a new control connection (state joining); returns its id."""
        return self.peers.connect(now, addr)

    def receive(self, conn: int, msg: dict, now: float) -> Actions:
        """Handles one validated peer -> master message from ``conn``.

        Messages from an unknown or already-gone connection are ignored (the
        server may still hold bytes read before it closed the connection).
        """
        act = Actions()
        peer = self.peers.get(conn)
        if peer is None:
            return act
        peer.heard(now)
        kind = msg["type"]
        if kind not in ("heartbeat", "hello"):
            self.counters.requested(kind)
        if peer.state == JOINING:
            if kind != "hello":
                self._fatal(act, peer, now, f"the first message must be hello, got {kind}",
                            cause="refused")
            else:
                self._hello(act, peer, msg, now)
        elif kind == "hello":
            self._fatal(act, peer, now, "hello sent twice", cause="refused")
        elif kind == "heartbeat":
            if "report" in msg:
                self.counters.sync_moved(peer.reported(msg["report"]))
        elif kind == "pending":
            self._pending_query(act, peer, msg)
        elif kind == "awake":
            if msg["epoch"] == self.epoch:
                self._quiet.awake(peer.conn, (msg["ops"], msg["index"]))
                self._release(act)
        elif kind == "leave":
            self._gone(act, peer, now, "left", lost=False, cause="left")
        elif kind == "update":
            self._update(act, peer, msg, now)
        elif kind == "sync":
            self._sync(act, peer, msg, now)
        elif kind == "unreached":
            self._unreached(act, peer, msg, now)
        elif kind == "ready":
            if not self._refuse(act, peer, "ready", msg["epoch"], msg.get("id", -1)):
                self.quorum.ready(act, peer.conn, peer.peer_id, msg, now, self.peers,
                                  self._live_members(), self.pending_count())
        return act

    def disconnect(self, conn: int, now: float, reason: str = "connection closed") -> Actions:
        """The connection is closed, reset or unusable (``reason`` is for the log).

        A member that disconnects without ``leave`` is dropped: it appears in
        the next ``assign``'s ``left`` like any other lost member.
        """
        act = Actions()
        peer = self.peers.get(conn)
        if peer is not None:
            self._gone(act, peer, now, f"dropped ({reason})", close=False, cause="connection")
        return act

    def tick(self, now: float) -> Actions:
        """Enforces every deadline at time ``now`` (seconds).

        Drops connections without a hello after ``handshake_timeout_s``, peers
        silent for more than ``heartbeat_timeout_s``, and members that have not
        sent ``update`` (``sync``) by the update (sync) round's deadline; the
        round then completes. Closes a quorum round whose grace window has passed.
        """
        act = Actions()
        for peer, why, cause in self.peers.silent(now, self.handshake_timeout_s,
                                                   self.heartbeat_timeout_s):
            if peer.conn in self.peers:     # not removed while handling an earlier peer
                self._fatal(act, peer, now, why, cause=cause)
        self._expire(act, self.group, self._maybe_complete, now)
        self._expire(act, self.sync, self._maybe_complete_sync, now)
        self.quorum.check(act, now, self.peers, self._live_members(), self.pending_count())
        if self._restart.window_over(now):
            act.events.append(f"resume grace window over: no member of an earlier group "
                              f"re-registered; {self.pending_count()} joiner(s) pending")
            self._maybe_bootstrap(act, now)
        return act

    def _expire(self, act: Actions, owner: Group | SharedStateSync, complete: Callable,
                now: float) -> None:
        """Past its deadline, drops the members that owe ``owner.round``; completes it.

        Only when most live members came: a round that a minority opened (a program bug,
        a peer out of step) fails for them instead, with a non-fatal error, and nobody
        is dropped; members that are gone are dropped by their heartbeat anyway.
        """
        rnd: Collective | None = owner.round
        if rnd is None or now < rnd.deadline:
            return
        live = self._live_members()
        came = [c for c in live if c in rnd.responded]
        if 2 * len(came) <= len(live):
            owner.close_round()
            why = (f"the {rnd.owed} round of epoch {rnd.epoch} was abandoned: only {len(came)} "
                   f"of {len(live)} live members joined it within {self.round_timeout_s:g} s; "
                   f"every member must call it at the same point of its program")
            act.events.append(why)
            for conn in came:
                act.refuse(conn, why, rnd.ids.get(conn, -1))
            return
        for conn in rnd.waiting(live):
            if owner.round is not rnd:
                break       # an earlier drop ended it (a new epoch abandons a sync round)
            self._fatal(act, self.peers[conn], now,
                        f"no {rnd.owed} for epoch {rnd.epoch} within "
                        f"{self.round_timeout_s:g} s (round timeout)", cause="round_timeout")
        # Dropping the last waiter completes the round inside _gone; this
        # covers a round whose waiters all vanished some other way.
        complete(act, now)

    # -- transitions ---------------------------------------------------------

    def _hello(self, act: Actions, peer: Peer, msg: dict, now: float) -> None:
        pid = msg["peer_id"]
        if msg.get("resume"):
            why = self._resumption.resume(act, peer, msg, now)
            if why is not None:
                self._fatal(act, peer, now, why, cause="refused", replaced=True)
                return
            act.sends.append((peer.conn, self._welcome(peer)))
            return
        if self.peers.claimed(pid):
            # The live peer keeps its id: a restarted process whose old
            # connection is not yet detected dead retries after the heartbeat
            # timeout has dropped the old one.
            self._fatal(act, peer, now, f"peer_id {pid!r} is already connected", cause="refused")
            return
        why = replicas.refusal(msg.get("replica"), self.peers.values())
        if why is not None:
            self._fatal(act, peer, now, why, cause="refused", layout="replica" in msg)
            return
        self.peers.hello(peer, msg)
        until = self._restart.grace_until
        held = "" if until is None else f" (held: resume grace window, {until - now:.1f} s left)"
        act.events.append(f"peer {pid} ({peer.addr}, data {peer.data_addr}) is pending{held}")
        welcome_at = len(act.sends)
        self._maybe_bootstrap(act, now)
        # The welcome goes first but reports the state after this hello, so a
        # peer admitted at once by the bootstrap reads "accepted" right away.
        act.sends.insert(welcome_at, (peer.conn, self._welcome(peer)))
        if self.pending_count():        # a quiet epoch's members answer alone: wake them
            act.sends += self._quiet.wake(self._live_members(), self.epoch)

    def _release(self, act: Actions) -> None:
        """Once every member answered ``wake`` (quiet.py): keys up to the last one answered
        alone are quiet, and the queries held meanwhile are answered."""
        for conn, msg in self._quiet.release(self._answers):
            if conn in self.peers:
                self._pending_query(act, self.peers[conn], msg)

    def _welcome(self, peer: Peer) -> dict:
        return {"type": "welcome", "peer_id": peer.peer_id, "state": peer.state,
                "epoch": self.epoch, "heartbeat_interval_s": self.heartbeat_interval_s}

    def _refuse(self, act: Actions, peer: Peer, kind: str, epoch: int, rid: int = -1) -> bool:
        """A non-fatal error unless ``peer`` is a member and ``epoch`` the current one."""
        if peer.state != ACCEPTED:
            why = f"{kind} from a pending peer: wait for your assign"
        elif epoch != self.epoch:
            why = f"{kind} for epoch {epoch}, but the current epoch is {self.epoch}"
        else:
            return False
        act.refuse(peer.conn, why, rid)
        return True

    def _pending_query(self, act: Actions, peer: Peer, msg: dict) -> None:
        """Answers ``pending``: the count now, or the answer fixed for its key."""
        rid = msg.get("id", -1)
        if msg["epoch"] < 0:
            act.reply(peer.conn, {"type": "pending_count", "count": self.pending_count()}, rid)
            return
        if self._refuse(act, peer, "pending query", msg["epoch"], rid):
            return
        if self._quiet.hold(peer.conn, msg):
            return          # answered once every member is awake (_release)
        if self._quiet.unwoken:
            # A member of a quiet epoch asks (it re-registered on a new link): the others
            # answer this key alone, 0 and quiet, so this one must get the same.
            self._answers.quiet_up_to((msg["ops"], msg["index"]))
        fixed = self._answers.answer((msg["ops"], msg["index"]), self.pending_count,
                                     self._resumption.resuming())
        if fixed is None:
            act.refuse(peer.conn, f"more than {answers.MAX_ANSWERS_PER_EPOCH} distinct "
                                  f"pending queries in epoch {self.epoch}", rid)
            return
        answer = {"type": "pending_count", "count": fixed[0]}
        if fixed[1]:
            answer["quiet"] = True
        act.reply(peer.conn, answer, rid)

    def _unreached(self, act: Actions, peer: Peer, msg: dict, now: float) -> None:
        """A member could not connect this epoch with some ranks: drops those admitted in it.

        Members of earlier epochs are left alone (a dead one is dropped by its heartbeat;
        a member cannot evict an incumbent). The dropped joiner's error names its address.
        """
        if self._refuse(act, peer, "unreached report", msg["epoch"]):
            return
        for rank in msg["ranks"][:len(self.members)]:
            if not 0 <= rank < len(self.members):
                continue
            conn = self.members[rank]
            target = self.peers.get(conn)
            if target is None or conn == peer.conn or \
                    not self.group.admitted_here(target.peer_id):
                continue
            self._fatal(act, target, now,
                        f"members could not connect to its data address {target.data_addr} "
                        f"within their connect deadline (reported by {peer.peer_id}, rank "
                        f"{peer.rank})", cause="unreachable")

    def _update(self, act: Actions, peer: Peer, msg: dict, now: float) -> None:
        if self._refuse(act, peer, "update", msg["epoch"], msg.get("id", -1)):
            return
        if self.round is None:
            self.group.open_round(now, self.round_timeout_s)
            act.events.append(f"round for epoch {self.epoch} started by {peer.peer_id}")
            self.sync.yield_to_update(act, peer.conn)
            act.sends += self._quiet.wake(self._live_members(), self.epoch, update=True)
        self.round.respond(peer.conn, msg.get("id", -1), msg["admit"], msg["done"], msg["busy"])
        self._maybe_complete(act, now)

    def _sync(self, act: Actions, peer: Peer, msg: dict, now: float) -> None:
        rid = msg.get("id", -1)
        if self._refuse(act, peer, "sync", msg["epoch"], rid):
            return
        if self.round is not None:
            act.refuse(peer.conn, f"members opened an update round of epoch {self.epoch}: "
                                  f"join it (update_topology), then sync again", rid,
                       update=True)
            return
        self.sync.vote(act, peer, msg, now, self.epoch, self.round_timeout_s)
        self._maybe_complete_sync(act, now)

    def _maybe_complete_sync(self, act: Actions, now: float) -> None:
        # A round every member voted in, with nobody pending, grants the epoch quiet.
        if self.sync.complete(act, self._live_members(), quiet=self._quiet.enabled and
                              self.pending_count() == 0 and not self._resumption.resuming()):
            self._quiet.grant()

    def _fatal(self, act: Actions, peer: Peer, now: float, why: str, cause: str,
               replaced: bool = False, replica: bool = False, layout: bool = False) -> None:
        """Sends a fatal error (``replaced``: for good, the peer's group is not the run's
        here; ``replica``: dropped with a lost process of its replica; ``layout``: its
        replica's layout was refused), closes the connection and forgets the peer."""
        msg = {"type": "error", "fatal": True, "message": why}
        for flag, value in (("replaced", replaced), ("replica", replica), ("layout", layout)):
            if value:
                msg[flag] = True
        act.sends.append((peer.conn, msg))
        self._gone(act, peer, now, f"dropped ({why})", cause=cause)

    def _gone(self, act: Actions, peer: Peer, now: float, how: str, close: bool = True,
              lost: bool = True, cause: str = "connection") -> None:
        """Forgets ``peer``. A member dropped (``lost``; not a clean ``leave``, whose
        collectives have completed) is announced to every other live member with a
        ``member_lost``, so that they abort that epoch's collectives at once. ``cause``
        is what ``Counters.drops`` counts it under.

        A process of a sharded replica takes the rest of its replica with it (each gets a
        fatal error: ``ReplicaLostError``) before any round completes, so that no epoch
        forms with a part of a replica."""
        if self._dropping:                      # a mate of a replica being dropped
            self._forget(act, peer, now, how, close, lost, cause)
            return
        mates = replicas.mates(peer, self.peers.values())
        self._dropping = True
        try:
            was = self._forget(act, peer, now, how, close, lost, cause)
            if mates:
                why = (f"replica {peer.replica['id']!r} lost its shard {peer.replica['shard']} "
                       f"(peer {peer.peer_id}): {how}")[:MAX_ERROR_CHARS]
            for mate in mates:
                if mate.conn in self.peers:
                    self._fatal(act, mate, now, why, cause="replica", replica=True)
        finally:
            self._dropping = False
        if was in (ACCEPTED, RESUMING) or mates:
            self._settle(act, now)

    def _forget(self, act: Actions, peer: Peer, now: float, how: str, close: bool,
                lost: bool, cause: str) -> str:
        """``_gone`` for one peer, but no round completes (``_settle`` does that); the
        state the peer was in."""
        self.peers.remove(peer.conn)
        self.counters.dropped(cause)
        if close:
            act.closes.append(peer.conn)
        was = peer.depart()
        if was == JOINING:
            act.events.append(f"connection {peer.addr} {how}")
            return was
        act.events.append(f"peer {peer.peer_id} ({was}) {how}")
        if was not in (ACCEPTED, RESUMING):
            return was
        self.group.lost(peer.peer_id)
        if lost:
            notice = {"type": "member_lost", "epoch": self.epoch, "peer_id": peer.peer_id,
                      "rank": peer.rank, "reason": how[:MAX_ERROR_CHARS]}
            for conn in self._live_members():
                act.sends.append((conn, dict(notice)))
        self.sync.forget(peer.conn)
        self._quiet.forget(peer.conn)
        # A member lost: the survivors recover in an update round, which their queries join.
        act.sends += self._quiet.wake(self._live_members(), self.epoch)
        self._release(act)
        if self.round is not None:
            self.round.forget(peer.conn)
        return was

    def _settle(self, act: Actions, now: float) -> None:
        """After a loss: the rounds that waited only for the lost complete."""
        self.sync.complete(act, self._live_members())
        self.quorum.check(act, now, self.peers, self._live_members(), self.pending_count())
        if self.round is not None:
            self._maybe_complete(act, now)
        elif not self._live_members():
            # The whole group is gone: form a new one from the pending peers.
            self._maybe_bootstrap(act, now)

    def _maybe_bootstrap(self, act: Actions, now: float) -> None:
        if self._live_members() or self.round is not None or self._restart.holding:
            return
        pending = self._admissible()
        need = self.world_size or 1
        if len(pending) >= need:
            chosen = pending if self.world_size == 0 else replicas.take(pending, need)
            if all(p.replica is None for p in chosen):
                # A fixed world (torchrun's RANK) keeps its ranks: peers that give a
                # rank hint in their hello's meta are ordered by it, the rest by arrival.
                chosen = sorted(chosen, key=rank_hint_key)
            self._form_group(act, [p.conn for p in chosen], joined=chosen)

    def _maybe_complete(self, act: Actions, now: float) -> None:
        rnd = self.round
        if rnd is None or rnd.waiting(self._live_members()):
            return
        self.group.close_round()
        survivors = [c for c in self.members if c in rnd.responded]
        if not survivors:
            # Everyone who started the round has gone: nobody to answer.
            act.events.append(f"round for epoch {rnd.epoch} abandoned: no member left")
            self._maybe_bootstrap(act, now)
            return
        pending = self._admissible() if rnd.admit else []
        self.counters.round_done(now - rnd.started_at)
        self._form_group(act, survivors + [p.conn for p in pending], joined=pending, rnd=rnd)

    def _form_group(self, act: Actions, conns: list[int], joined: list[Peer],
                    rnd: Round | None = None) -> None:
        """Completes a round (``rnd``, None at a bootstrap): new epoch, comm_id and ranks; an
        assign to each member, with each member's ``done`` and ``busy`` from the round (-1
        and false for joiners) when any member sent a ``done``."""
        left = self.group.form(conns, [p.peer_id for p in joined])
        self._answers.reset()
        self.counters.joined(len(joined))
        peers = [self.peers[c] for c in conns]
        for rank, p in enumerate(peers):
            p.admit(rank)
        # Queries held for the old epoch's wake are refused as stale (the new assign says why).
        stale = self._quiet.new_epoch()
        # Nobody brought state into a group of joiners only: no history but this master's.
        self._restart.formed(self.comm_id, [(p.peer_id, p.data_addr) for p in peers],
                             joiners_only=len(joined) == len(conns))
        if len(joined) == len(conns):
            self.quorum.reset()
        act.persist = True
        base = {"type": "assign", "epoch": self.epoch, "comm_id": self.comm_id,
                "world_size": len(peers),
                "addrs": [p.data_addr for p in peers],
                "peer_ids": [p.peer_id for p in peers],
                "joined": [p.peer_id for p in joined], "left": left,
                "done": [], "busy": [], **(rnd.ledger(conns) if rnd else {}),
                **replicas.roster_fields(peers)}
        for p in peers:
            act.reply(p.conn, dict(base, rank=p.rank), rnd.ids.get(p.conn, -1) if rnd else -1)
        for conn, msg in stale:
            if conn in self.peers:
                self._pending_query(act, self.peers[conn], msg)
        act.events.append(
            f"epoch {self.epoch}: world size {len(peers)}, comm_id {self.comm_id:#018x}, "
            f"joined {base['joined']}, left {left}")
        self.sync.epoch_changed(act, self.epoch)
