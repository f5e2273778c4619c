"""The membership state machine of the master: pure, no I/O, no clock.

Every entry point takes the current time ``now`` (seconds, any monotonic
origin) and returns an ``Actions``: messages to send, connections to close,
and one-line events for the log. The asyncio server (server.py) only moves
bytes and the clock; everything that decides who is in the group is here, so
tests drive it by hand, deadlines included, without sockets or sleeps.

Peers are addressed by *connection id* (an int from ``connect``), not by
``peer_id``: a connection has no peer_id before its hello, and a newcomer that
claims a live peer's id must get its error without touching the live peer.

Lifecycle (docs/membership.md has the diagram)::

    joining --hello--> pending --admitted at a round--> accepted --> gone
       \\                  \\________________________________________/^
        \\__ no hello within handshake_timeout_s, bad first message __/

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
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Callable

from .. import config
from . import answers, protocol
from .answers import PendingAnswers
from .counters import Counters
from .election import Vote, elect
from .restart import REREGISTRATION, STATE_FILE, RestartRules

JOINING = "joining"
PENDING = "pending"
ACCEPTED = "accepted"
# A member of a resumed epoch that has not re-registered yet: no connection, dropped
# like any silent member after the heartbeat timeout (see MembershipState._resume).
RESUMING = "resuming"
GONE = "gone"


@dataclasses.dataclass
class Actions:
    """What the server must do after one state-machine step.

    Attributes:
        sends: ``(conn, message)`` in order; messages are protocol dicts.
        closes: connections to close after their queued messages are flushed.
        events: human-readable lines (joins, leaves, drops, epochs) for INFO logs.
        persist: the run's record (``MembershipState.run_record``: epoch, roster, shared
            state) changed; a master with a state file writes it before sending.
    """

    sends: list = dataclasses.field(default_factory=list)
    closes: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    persist: bool = False     # the run's record changed: rewrite the state file (run_record)

    def to(self, conn: int, kind: str) -> list[dict]:
        """The messages of type ``kind`` sent to ``conn`` (for tests)."""
        return [m for c, m in self.sends if c == conn and m["type"] == kind]


@dataclasses.dataclass
class Peer:
    """One control connection and, after its hello, the peer behind it."""

    conn: int
    addr: str                 # the control connection's remote address (logs only)
    connected_at: float       # seconds, the caller's clock
    last_seen: float          # seconds; refreshed by every message
    state: str = JOINING
    peer_id: str = ""
    data_addr: str = ""
    meta: dict = dataclasses.field(default_factory=dict)
    arrival: int = 0          # order of hellos; pending peers are admitted in this order
    rank: int = -1            # rank in the current epoch while accepted
    report: dict = dataclasses.field(default_factory=dict)   # its last heartbeat report


@dataclasses.dataclass
class Round:
    """An update round in progress for ``epoch``."""

    owed = "update"             # the message each member owes (not a field)

    epoch: int
    started_at: float
    deadline: float
    responded: set = dataclasses.field(default_factory=set)   # conns that sent update
    admit: bool = True        # False once any member asked for a recovery round
    done: dict = dataclasses.field(default_factory=dict)      # conn -> its `done`
    ids: dict = dataclasses.field(default_factory=dict)       # conn -> its request's `id`


@dataclasses.dataclass
class SyncRound:
    """A shared-state sync round in progress for ``epoch``."""

    owed = "sync"

    epoch: int
    started_at: float
    deadline: float
    votes: dict = dataclasses.field(default_factory=dict)     # conn -> Vote
    ids: dict = dataclasses.field(default_factory=dict)       # conn -> its request's `id`

    @property
    def responded(self):
        return self.votes.keys()


def _answering(msg: dict, rid: int) -> dict:
    """``msg`` as the answer to the request whose ``id`` was ``rid`` (-1: it had none), so
    the peer can tell it from a late answer to an earlier request."""
    if rid >= 0:
        msg["id"] = rid
    return msg


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
                 resume_grace_s: float = 0.0,
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
        self._new_comm_id = new_comm_id or (lambda: secrets.randbits(64))
        self.epoch = 0                 # 0 = no group has ever formed
        self.comm_id = 0
        self.peers: dict[int, Peer] = {}   # live connections only (gone peers are removed)
        self.members: list[int] = []       # conns of the current epoch, by rank (live or not)
        self.left: list[str] = []          # members of this epoch gone since it began
        self.round: Round | None = None
        self.sync_round: SyncRound | None = None
        self._joined: set[str] = set()     # peer ids admitted in the current epoch
        # The answers to this epoch's keyed pending queries.
        self._answers = PendingAnswers()
        self.shared_revision: int | None = None   # set by the first successful sync
        self.shared_content: str | None = None
        self._next_conn = 0
        self._next_arrival = 0
        self.counters = Counters()
        # What this master knows of the run: the restart rules (see start, _resume).
        self._restart = RestartRules(resume_grace_s)

    # -- queries -------------------------------------------------------------

    def _live_members(self) -> list[int]:
        return [c for c in self.members if c in self.peers]

    def _pending(self) -> list[Peer]:
        return sorted((p for p in self.peers.values() if p.state == PENDING),
                      key=lambda p: p.arrival)

    def pending_count(self) -> int:
        """Peers that said hello and wait for admission."""
        return sum(p.state == PENDING for p in self.peers.values())

    def snapshot(self) -> dict:
        """JSON-able view for logs and a status page: epoch, peers, round."""
        peers = [{"conn": p.conn, "peer_id": p.peer_id, "state": p.state, "rank": p.rank,
                  "addr": p.addr, "data_addr": p.data_addr, "meta": p.meta,
                  "last_seen": p.last_seen, "report": dict(p.report)}
                 for p in sorted(self.peers.values(), key=lambda p: p.conn)]
        return {"epoch": self.epoch, "comm_id": self.comm_id,
                "world_size": len(self._live_members()), "pending": self.pending_count(),
                "left": list(self.left), "peers": peers,
                "round": self._round_view(self.round, "responded"),
                "sync_round": self._round_view(self.sync_round, "voted"),
                "shared_state": {"revision": self.shared_revision,
                                 "content": self.shared_content},
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "heartbeat_timeout_s": self.heartbeat_timeout_s,
                "restart": self._restart_view(),
                "counters": dataclasses.asdict(self.counters)}

    def _restart_view(self) -> dict:
        """The restart rules now: how the run was learnt (``source``), the grace window's
        end (``grace_until``, the caller's clock; None when none runs), the joiners it
        holds, the members not re-registered yet and those that did."""
        return self._restart.view(
            held=[p.peer_id for p in self._pending()],
            resuming=[self.peers[c].peer_id for c in self._live_members()
                      if self.peers[c].state == RESUMING])

    def run_record(self) -> dict | None:
        """What a master restarted with the state file needs to know the run at once
        (master/run_file.py): ``epoch``, ``comm_id``, the epoch's roster as formed
        (``peer_ids``, ``addrs`` by rank), the shared state's ``revision`` (-1: none) and
        ``content`` (32 hex, "" before the first sync). None before the first group."""
        roster = self._restart.roster
        if self.epoch == 0 or not roster:
            return None
        return {"epoch": self.epoch, "comm_id": self.comm_id,
                "peer_ids": [pid for pid, _ in roster],
                "addrs": [addr for _, addr in roster],
                "revision": -1 if self.shared_revision is None else self.shared_revision,
                "content": self.shared_content or ""}

    def _round_view(self, rnd: Round | SyncRound | None, responded_key: str) -> dict | None:
        if rnd is None:
            return None
        return {"epoch": rnd.epoch, "started_at": rnd.started_at, "deadline": rnd.deadline,
                responded_key: sorted(self.peers[c].peer_id for c in rnd.responded),
                "waiting": sorted(self.peers[c].peer_id for c in self._waiting(rnd))}

    def _waiting(self, rnd: Round | SyncRound) -> list[int]:
        """Live members that still owe ``rnd`` their message."""
        return [c for c in self._live_members() if c not in rnd.responded]

    # -- entry points --------------------------------------------------------

    def start(self, now: float, record: dict | None = None) -> Actions:
        """Starts serving at ``now`` (seconds): the restart rules' first step.

        With ``record`` (``run_record()`` as a previous incarnation saved it, validated by
        master/run_file.py) the master knows the run at once: it adopts the recorded
        epoch, each rank a placeholder until its member re-registers (see ``_resume``),
        and joiners are pending peers of that group from their first hello. Without
        one, ``resume_grace_s`` > 0 opens the grace window: joiners are held until it
        ends, unless members of an earlier group re-register first. Call once, before
        any connection.
        """
        act = Actions()
        if record is not None:
            self._adopt(act, record, now, "the state file")
        elif self._restart.open_window(now):
            act.events.append(
                f"no record of the run: joiners are held for {self._restart.grace_s:g} s "
                f"(resume grace window) so that members of an earlier group re-register first")
        return act

    def connect(self, now: float, addr: str = "?") -> int:
        """Registers a new control connection (state joining); returns its id."""
        self._next_conn += 1
        conn = self._next_conn
        self.peers[conn] = Peer(conn=conn, addr=addr, connected_at=now, last_seen=now)
        return conn

    def receive(self, conn: int, msg: dict, now: float) -> Actions:
        """Handles one validated peer -> master message from ``conn``.

        Messages from an unknown or already-gone connection are ignored (the
        server may still hold bytes read before it closed the connection).
        """
        act = Actions()
        peer = self.peers.get(conn)
        if peer is None:
            return act
        peer.last_seen = now
        kind = msg["type"]
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
                report = msg["report"]
                grown = report.get("sync_bytes", 0) - peer.report.get("sync_bytes", 0)
                if grown > 0:
                    self.counters.sync_bytes += grown
                peer.report.update(report)
        elif kind == "pending":
            self._pending_query(act, peer, msg)
        elif kind == "leave":
            self._gone(act, peer, now, "left", lost=False, cause="left")
        elif kind == "update":
            self._update(act, peer, msg["epoch"], now, msg["admit"], msg["done"],
                         msg.get("id", -1))
        elif kind == "sync":
            self._sync(act, peer, msg, now)
        elif kind == "unreached":
            self._unreached(act, peer, msg, now)
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
        round then completes.
        """
        act = Actions()
        for peer in list(self.peers.values()):
            if peer.conn not in self.peers:
                continue        # removed while handling an earlier peer this tick
            if peer.state == JOINING:
                if now - peer.connected_at > self.handshake_timeout_s:
                    self._fatal(act, peer, now,
                                f"no hello within {self.handshake_timeout_s:g} s",
                                cause="handshake")
            elif now - peer.last_seen > self.heartbeat_timeout_s:
                self._fatal(act, peer, now,
                            f"no message for {now - peer.last_seen:.1f} s "
                            f"(heartbeat timeout {self.heartbeat_timeout_s:g} s)",
                            cause="heartbeat")
        self._expire(act, "round", self._maybe_complete, now)
        self._expire(act, "sync_round", self._maybe_complete_sync, now)
        if self._restart.window_over(now):
            act.events.append(f"resume grace window over: no member of an earlier group "
                              f"re-registered; {self.pending_count()} joiner(s) pending")
            self._maybe_bootstrap(act, now)
        return act

    def _expire(self, act: Actions, attr: str, complete: Callable, now: float) -> None:
        """Past its deadline, drops the members that owe round ``self.<attr>``; completes it.

        Only when most live members came: a round that a minority opened (a program bug,
        a peer out of step) fails for them instead, with a non-fatal error, and nobody
        is dropped; members that are gone are dropped by their heartbeat anyway.
        """
        rnd = getattr(self, attr)
        if rnd is None or now < rnd.deadline:
            return
        live = self._live_members()
        came = [c for c in live if c in rnd.responded]
        if 2 * len(came) <= len(live):
            setattr(self, attr, None)
            why = (f"the {rnd.owed} round of epoch {rnd.epoch} was abandoned: only {len(came)} "
                   f"of {len(live)} live members joined it within {self.round_timeout_s:g} s; "
                   f"every member must call it at the same point of its program")
            act.events.append(why)
            for conn in came:
                act.sends.append((conn, _answering({"type": "error", "fatal": False,
                                                    "message": why}, rnd.ids.get(conn, -1))))
            return
        for conn in self._waiting(rnd):
            if getattr(self, attr) is not rnd:
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
            self._resume(act, peer, msg, now)
            return
        if any(p.peer_id == pid and p.state != JOINING for p in self.peers.values()):
            # The live peer keeps its id: a restarted process whose old
            # connection is not yet detected dead retries after the heartbeat
            # timeout has dropped the old one.
            self._fatal(act, peer, now, f"peer_id {pid!r} is already connected", cause="refused")
            return
        peer.peer_id = pid
        peer.data_addr = msg["data_addr"]
        peer.meta = msg["meta"]
        peer.state = PENDING
        peer.arrival = self._next_arrival
        self._next_arrival += 1
        until = self._restart.grace_until
        held = "" if until is None else f" (held: resume grace window, {until - now:.1f} s left)"
        act.events.append(f"peer {pid} ({peer.addr}, data {peer.data_addr}) is pending{held}")
        welcome_at = len(act.sends)
        self._maybe_bootstrap(act, now)
        # The welcome goes first but reports the state after this hello, so a
        # peer admitted at once by the bootstrap reads "accepted" right away.
        act.sends.insert(welcome_at, (peer.conn, {
            "type": "welcome", "peer_id": pid, "state": peer.state, "epoch": self.epoch,
            "heartbeat_interval_s": self.heartbeat_interval_s}))

    def _resume(self, act: Actions, peer: Peer, msg: dict, now: float) -> None:
        """A member of an epoch re-registers (the master restarted, or its connection broke).

        A re-registration for another epoch than the master's adopts that epoch when
        ``_adoptable`` says the member's group is the run's (a master that knows no group,
        a state file nobody confirmed yet, or a group of joiners only with less history):
        its comm_id and ranks, each rank a placeholder (state ``RESUMING``) until its
        member re-registers too; a placeholder silent for the heartbeat timeout is dropped
        like a lost member, and the others are told. Collectives never stopped (they do
        not use the master). Until every member is back, and for every key a member
        answered alone while the master was away, keyed pending queries answer 0, so
        members still agree on every answer. A re-registration that does not match the
        master's epoch, comm_id, rank and peer id after that is refused for good (fatal,
        ``replaced``): the group moved on without that member.
        """
        r, pid = msg["resume"], msg["peer_id"]
        if (r["epoch"], r["comm_id"]) != (self.epoch, self.comm_id) and self._adoptable(r):
            if self._live_members():
                self._give_way(act, r, pid)
            self._adopt(act, r, now, f"{pid}'s re-registration")
        rank = r["rank"]
        old = self.peers.get(self.members[rank]) if rank < len(self.members) else None
        if (r["epoch"], r["comm_id"]) != (self.epoch, self.comm_id) or old is None or \
                old.peer_id != pid:
            self._fatal(act, peer, now, f"cannot resume rank {rank} of epoch {r['epoch']}: the "
                                        f"group is at epoch {self.epoch} without it",
                        cause="refused", replaced=True)
            return
        # Take over the old record: a placeholder, or a connection not yet seen dead.
        self.counters.resumes += 1
        del self.peers[old.conn]
        if old.state == ACCEPTED:
            act.closes.append(old.conn)
        for rnd in (self.round, self.sync_round):
            if rnd is not None and old.conn in rnd.responded:
                if isinstance(rnd, SyncRound):
                    rnd.votes[peer.conn] = rnd.votes.pop(old.conn)
                else:
                    rnd.responded.discard(old.conn)
                    rnd.responded.add(peer.conn)
                    if old.conn in rnd.done:
                        rnd.done[peer.conn] = rnd.done.pop(old.conn)
        peer.peer_id, peer.data_addr, peer.meta = pid, msg["data_addr"], msg["meta"]
        peer.state, peer.rank = ACCEPTED, rank
        self.members[rank] = peer.conn
        self._answers.quiet_up_to(tuple(r["last_key"]))
        if r["revision"] > (-1 if self.shared_revision is None else self.shared_revision):
            self.shared_revision = r["revision"]
            act.persist = True
        self._restart.resumed(pid)
        act.events.append(f"peer {pid} ({peer.addr}) re-registered as rank {rank} of epoch "
                          f"{self.epoch}")
        act.sends.append((peer.conn, {
            "type": "welcome", "peer_id": pid, "state": ACCEPTED, "epoch": self.epoch,
            "heartbeat_interval_s": self.heartbeat_interval_s}))

    def _adoptable(self, r: dict) -> bool:
        """Whether re-registration ``r`` carries the run (``RestartRules.adoptable``)."""
        live = self._live_members()
        return self._restart.adoptable(
            r, live=bool(live), unconfirmed=all(self.peers[c].state == RESUMING for c in live),
            shared_revision=self.shared_revision, epoch=self.epoch)

    def _give_way(self, act: Actions, r: dict, pid: str) -> None:
        """The current group yields to ``pid``'s resumed group (``_adoptable``): each of
        its live members is told so (fatal, ``replaced``) and forgotten; pending peers stay
        pending and join the resumed group at its members' next round."""
        why = (f"the run's earlier group re-registered (epoch {r['epoch']}, shared-state "
               f"revision {r['revision']}, by {pid}) and takes precedence over this group "
               f"(epoch {self.epoch}, formed from joiners only after the master restarted); "
               f"re-join as a new peer to receive the run's state")
        for conn in self._live_members():
            gone = self.peers.pop(conn)
            if gone.state == RESUMING:
                continue        # a placeholder of a state file nobody confirmed: no peer
            gone.state = GONE
            self.counters.dropped("replaced")
            act.sends.append((conn, {"type": "error", "fatal": True, "replaced": True,
                                     "message": why}))
            act.closes.append(conn)
            act.events.append(f"peer {gone.peer_id} (rank {gone.rank}) dropped: {why}")
        self.members, self.round, self.sync_round = [], None, None

    def _adopt(self, act: Actions, r: dict, now: float, source: str) -> None:
        """Takes record ``r`` (a re-registration's ``resume``, or the state file's
        ``run_record``) as the current epoch: its comm_id, its ranks as placeholders,
        its shared-state revision (and content, from a file). Ends the grace window: the
        run is known, and held joiners are pending peers of this group."""
        self.epoch, self.comm_id = r["epoch"], r["comm_id"]
        self.members, self.left, self._joined = [], [], set()
        self._answers.reset()
        self.round = self.sync_round = None
        roster = list(zip(r["peer_ids"], r["addrs"]))
        for rank, (member, addr) in enumerate(roster):
            conn = self.connect(now, "(not re-registered yet)")
            placeholder = self.peers[conn]
            placeholder.state, placeholder.peer_id = RESUMING, member
            placeholder.data_addr, placeholder.rank = addr, rank
            self.members.append(conn)
        self.shared_revision = None if r["revision"] < 0 else r["revision"]
        self.shared_content = r.get("content") or None
        held = self.pending_count() if self._restart.holding else 0
        self._restart.adopted(self.comm_id, roster,
                              STATE_FILE if source == "the state file" else REREGISTRATION)
        act.persist = True
        act.events.append(f"resumed epoch {self.epoch} (comm_id {self.comm_id:#018x}, world "
                          f"size {len(self.members)}) from {source}")
        if held:
            act.events.append(f"resume grace window over: {held} held joiner(s) are pending "
                              f"peers of the resumed group")

    def _resuming(self) -> bool:
        return any(self.peers[c].state == RESUMING for c in self._live_members())

    def _refuse(self, act: Actions, peer: Peer, kind: str, epoch: int, rid: int = -1) -> bool:
        """A non-fatal error unless ``peer`` is a member and ``epoch`` the current one."""
        if peer.state != ACCEPTED:
            why = f"{kind} from a pending peer: wait for your assign"
        elif epoch != self.epoch:
            why = f"{kind} for epoch {epoch}, but the current epoch is {self.epoch}"
        else:
            return False
        act.sends.append((peer.conn, _answering({"type": "error", "fatal": False,
                                                 "message": why}, rid)))
        return True

    def _pending_query(self, act: Actions, peer: Peer, msg: dict) -> None:
        """Answers ``pending``: the count now, or the answer fixed for its key."""
        rid = msg.get("id", -1)
        if msg["epoch"] < 0:
            act.sends.append((peer.conn, _answering({"type": "pending_count",
                                                     "count": self.pending_count()}, rid)))
            return
        if self._refuse(act, peer, "pending query", msg["epoch"], rid):
            return
        key = (msg["ops"], msg["index"])
        fixed = self._answers.answer(key, self.pending_count, self._resuming())
        if fixed is None:
            act.sends.append((peer.conn, _answering({
                "type": "error", "fatal": False,
                "message": f"more than {answers.MAX_ANSWERS_PER_EPOCH} distinct pending queries "
                           f"in epoch {self.epoch}"}, rid)))
            return
        answer = {"type": "pending_count", "count": fixed[0]}
        if fixed[1]:
            answer["quiet"] = True
        act.sends.append((peer.conn, _answering(answer, rid)))

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
            if target is None or conn == peer.conn or target.peer_id not in self._joined:
                continue
            self._fatal(act, target, now,
                        f"members could not connect to its data address {target.data_addr} "
                        f"within their connect deadline (reported by {peer.peer_id}, rank "
                        f"{peer.rank})", cause="unreachable")

    def _update(self, act: Actions, peer: Peer, epoch: int, now: float,
                admit: bool = True, done: int = -1, rid: int = -1) -> None:
        if self._refuse(act, peer, "update", epoch, rid):
            return
        if self.round is None:
            self.round = Round(epoch=self.epoch, started_at=now,
                               deadline=now + self.round_timeout_s)
            act.events.append(f"round for epoch {self.epoch} started by {peer.peer_id}")
            self._abandon_sync_for_update(act, peer.conn)
        self.round.responded.add(peer.conn)   # a repeated update is harmless
        self.round.ids[peer.conn] = rid
        if done >= 0:
            self.round.done[peer.conn] = done
        # A member recovering from a loss mid-step cannot take a joiner in there: the
        # joiner starts at the top of its program (docs/membership.md).
        self.round.admit = self.round.admit and admit
        self._maybe_complete(act, now)

    def _abandon_sync_for_update(self, act: Actions, initiator: int) -> None:
        """An update round started while a sync round is open in the same epoch: members
        recovering from a loss (or admitting peers) are in the one, the others in the
        other, and neither can complete. The update wins: the voters still waiting on the
        sync (not ``initiator``, who gave it up) are told to join it."""
        rnd, self.sync_round = self.sync_round, None
        if rnd is None:
            return
        why = (f"the shared-state sync of epoch {rnd.epoch} was abandoned: members opened an "
               f"update round of that epoch; join it, then sync again")
        act.events.append(why)
        for conn in rnd.votes:
            if conn != initiator:
                act.sends.append((conn, _answering({"type": "error", "fatal": False,
                                                    "update": True, "message": why},
                                                   rnd.ids.get(conn, -1))))

    def _sync(self, act: Actions, peer: Peer, msg: dict, now: float) -> None:
        rid = msg.get("id", -1)
        if self._refuse(act, peer, "sync", msg["epoch"], rid):
            return
        if self.round is not None:
            act.sends.append((peer.conn, _answering({
                "type": "error", "fatal": False, "update": True,
                "message": f"members opened an update round of epoch {self.epoch}: join it "
                           f"(update_topology), then sync again"}, rid)))
            return
        if self.sync_round is None:
            self.sync_round = SyncRound(epoch=self.epoch, started_at=now,
                                        deadline=now + self.round_timeout_s)
            act.events.append(f"sync for epoch {self.epoch} started by {peer.peer_id}")
        # A repeated vote replaces the earlier one.
        self.sync_round.votes[peer.conn] = Vote(
            rank=peer.rank, peer_id=peer.peer_id, revision=msg["revision"],
            strategy=msg["strategy"], fresh=msg["fresh"], content=msg["content"])
        self.sync_round.ids[peer.conn] = rid
        self._maybe_complete_sync(act, now)

    def _maybe_complete_sync(self, act: Actions, now: float) -> None:
        rnd = self.sync_round
        if rnd is None or self._waiting(rnd):
            return
        self.sync_round = None
        if not rnd.votes:
            act.events.append(f"sync for epoch {rnd.epoch} abandoned: no voter left")
            return
        result = elect(list(rnd.votes.values()), self.shared_revision)
        self.counters.sync_rounds += 1
        if result["error"]:
            act.events.append(f"sync for epoch {rnd.epoch} failed: {result['error']}")
        else:
            self.shared_revision = result["revision"]
            self.shared_content = result["content"]
            act.persist = True
            act.events.append(
                f"sync for epoch {rnd.epoch}: revision {result['revision']}, content "
                f"{result['content'][:8]}, sources {result['sources']}, "
                f"outdated {result['outdated']}")
        msg = dict(result, type="sync_result", epoch=rnd.epoch)
        for conn in rnd.votes:
            act.sends.append((conn, _answering(dict(msg), rnd.ids.get(conn, -1))))

    def _fatal(self, act: Actions, peer: Peer, now: float, why: str, cause: str,
               replaced: bool = False) -> None:
        """Sends a fatal error (``replaced``: for good, the peer's group is not the run's
        here), closes the connection and forgets the peer."""
        msg = {"type": "error", "fatal": True, "message": why}
        if replaced:
            msg["replaced"] = True
        act.sends.append((peer.conn, msg))
        self._gone(act, peer, now, f"dropped ({why})", cause=cause)

    def _gone(self, act: Actions, peer: Peer, now: float, how: str, close: bool = True,
              lost: bool = True, cause: str = "connection") -> None:
        """Forgets ``peer``. A member dropped (``lost``; not a clean ``leave``, whose
        collectives have completed) is announced to every other live member with a
        ``member_lost``, so that they abort that epoch's collectives at once. ``cause``
        is what ``Counters.drops`` counts it under."""
        del self.peers[peer.conn]
        self.counters.dropped(cause)
        if close:
            act.closes.append(peer.conn)
        was = peer.state
        peer.state = GONE
        if was == JOINING:
            act.events.append(f"connection {peer.addr} {how}")
            return
        act.events.append(f"peer {peer.peer_id} ({was}) {how}")
        if was not in (ACCEPTED, RESUMING):
            return
        self.left.append(peer.peer_id)
        if lost:
            notice = {"type": "member_lost", "epoch": self.epoch, "peer_id": peer.peer_id,
                      "rank": peer.rank, "reason": how[:protocol.MAX_ERROR_CHARS]}
            for conn in self._live_members():
                act.sends.append((conn, dict(notice)))
        if self.sync_round is not None:
            self.sync_round.votes.pop(peer.conn, None)     # a gone member's vote is void
            self._maybe_complete_sync(act, now)
        if self.round is not None:
            self.round.responded.discard(peer.conn)
            self._maybe_complete(act, now)
        elif not self._live_members():
            # The whole group is gone: form a new one from the pending peers.
            self._maybe_bootstrap(act, now)

    def _maybe_bootstrap(self, act: Actions, now: float) -> None:
        if self._live_members() or self.round is not None or self._restart.holding:
            return
        pending = self._pending()
        need = self.world_size or 1
        if len(pending) >= need:
            chosen = pending if self.world_size == 0 else pending[:self.world_size]
            # A fixed world (torchrun's RANK) keeps its ranks: peers that give a
            # rank hint in their hello's meta are ordered by it, the rest by arrival.
            chosen = sorted(chosen, key=_rank_hint_key)
            self._form_group(act, [p.conn for p in chosen], joined=chosen, now=now)

    def _maybe_complete(self, act: Actions, now: float) -> None:
        rnd = self.round
        if rnd is None or self._waiting(rnd):
            return
        self.round = None
        survivors = [c for c in self.members if c in rnd.responded]
        if not survivors:
            # Everyone who started the round has gone: nobody to answer.
            act.events.append(f"round for epoch {rnd.epoch} abandoned: no member left")
            self._maybe_bootstrap(act, now)
            return
        pending = self._pending() if rnd.admit else []
        self.counters.round_done(now - rnd.started_at)
        self._form_group(act, survivors + [p.conn for p in pending], joined=pending, now=now,
                         done=rnd.done, ids=rnd.ids)

    def _form_group(self, act: Actions, conns: list[int], joined: list[Peer], now: float,
                    done: dict | None = None, ids: dict | None = None) -> None:
        """Completes a round: new epoch, comm_id and ranks; an assign to each member, with
        each member's ``done`` from the round (-1 for joiners) when any member sent one."""
        comm_id = self._new_comm_id()
        while comm_id == self.comm_id:      # fresh for each group (pcclCommCreate needs it)
            comm_id = self._new_comm_id()
        self.epoch += 1
        self.comm_id = comm_id
        self._answers.reset()
        self._joined = {p.peer_id for p in joined}
        self.counters.joins += len(joined)
        for p in joined:
            p.state = ACCEPTED
        self.members = list(conns)
        peers = [self.peers[c] for c in conns]
        for rank, p in enumerate(peers):
            p.rank = rank
        # Nobody brought state into a group of joiners only: no history but this master's.
        self._restart.formed(comm_id, [(p.peer_id, p.data_addr) for p in peers],
                             joiners_only=len(joined) == len(conns))
        act.persist = True
        left, self.left = self.left, []
        base = {"type": "assign", "epoch": self.epoch, "comm_id": comm_id,
                "world_size": len(peers),
                "addrs": [p.data_addr for p in peers],
                "peer_ids": [p.peer_id for p in peers],
                "joined": [p.peer_id for p in joined], "left": left,
                "done": [done.get(c, -1) for c in conns] if done else []}
        for p in peers:
            act.sends.append((p.conn, _answering(dict(base, rank=p.rank),
                                                 (ids or {}).get(p.conn, -1))))
        act.events.append(
            f"epoch {self.epoch}: world size {len(peers)}, comm_id {comm_id:#018x}, "
            f"joined {base['joined']}, left {left}")
        rnd, self.sync_round = self.sync_round, None
        if rnd is not None:
            # After the assigns: a voter blocked in update_topology() takes its
            # assign first; the error is for the sync it has given up on.
            why = (f"membership changed during shared-state sync "
                   f"(epoch {rnd.epoch} -> {self.epoch})")
            act.events.append(f"sync for epoch {rnd.epoch} abandoned: {why}")
            for conn in rnd.votes:
                act.sends.append((conn, _answering({"type": "error", "fatal": False,
                                                    "message": why}, rnd.ids.get(conn, -1))))


def _rank_hint_key(peer: Peer) -> tuple:
    hint = peer.meta.get("rank") if isinstance(peer.meta, dict) else None
    if isinstance(hint, int) and not isinstance(hint, bool) and hint >= 0:
        return (0, hint, peer.arrival)
    return (1, 0, peer.arrival)
