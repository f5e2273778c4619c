"""The master's control connections and the peers behind them: ``Peer`` and ``Peers``.

Peers are addressed by *connection id* (an int from ``Peers.connect``), not by
``peer_id``: a connection has no peer_id before its hello, and a newcomer that claims a
live peer's id must get its error without touching the live peer. Lifecycle (a peer's
``state``; docs/membership.md has the diagram)::

    joining --hello--> pending --admitted at a round--> accepted --> gone
       \\                  \\________________________________________/^
        \\__ no hello within handshake_timeout_s, bad first message __/

A member of a resumed epoch that has not re-registered yet is a placeholder in state
``resuming``: no connection, dropped like any silent member after the heartbeat timeout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

JOINING = "joining"
PENDING = "pending"
ACCEPTED = "accepted"
RESUMING = "resuming"
GONE = "gone"


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
    # Its sharded replica (the hello's ``replica``: id, shard, shards, layout,
    # description); None for a peer of its own (master/replicas.py).
    replica: dict | None = None

    def introduce(self, msg: dict, state: str, rank: int = -1) -> None:
        """Takes the identity a ``hello`` (``msg``) gives: peer id, data address, meta."""
        self.peer_id, self.data_addr, self.meta = msg["peer_id"], msg["data_addr"], msg["meta"]
        self.replica = msg.get("replica")
        self.state, self.rank = state, rank

    def admit(self, rank: int) -> None:
        """Makes the peer the member of ``rank`` in a new epoch."""
        self.state, self.rank = ACCEPTED, rank

    def depart(self) -> str:
        """The peer is gone (removed from ``Peers``); returns the state it had."""
        was, self.state = self.state, GONE
        return was

    def heard(self, now: float) -> None:
        """A message from the peer arrived at ``now`` (seconds)."""
        self.last_seen = now

    def reported(self, report: dict) -> int:
        """A heartbeat's ``report`` updates what the status page shows of the peer.
        Returns the growth of its reported ``sync_bytes`` (>= 0)."""
        grown = report.get("sync_bytes", 0) - self.report.get("sync_bytes", 0)
        self.report.update(report)
        return max(grown, 0)

    def view(self) -> dict:
        """JSON-able view for the status document."""
        return {"conn": self.conn, "peer_id": self.peer_id, "state": self.state,
                "rank": self.rank, "addr": self.addr, "data_addr": self.data_addr,
                "meta": self.meta, "last_seen": self.last_seen, "report": dict(self.report),
                "replica": None if self.replica is None else
                {k: self.replica[k] for k in ("id", "shard", "shards")}}


class Peers(Mapping):
    """The live connections by id (gone peers are removed): a read-only mapping
    ``conn -> Peer``, changed through ``connect``, ``placeholder``, ``hello`` and
    ``remove``."""

    def __init__(self):
        self._by_conn: dict[int, Peer] = {}
        self._next_conn = 0
        self._next_arrival = 0

    def __getitem__(self, conn: int) -> Peer:
        return self._by_conn[conn]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_conn)

    def __len__(self) -> int:
        return len(self._by_conn)

    def connect(self, now: float, addr: str) -> int:
        """Registers a new control connection (state joining) at ``now``; returns its id."""
        self._next_conn += 1
        self._by_conn[self._next_conn] = Peer(conn=self._next_conn, addr=addr,
                                              connected_at=now, last_seen=now)
        return self._next_conn

    def placeholder(self, now: float, peer_id: str, data_addr: str, rank: int) -> int:
        """A rank of an adopted epoch whose member has not re-registered yet; returns its id."""
        conn = self.connect(now, "(not re-registered yet)")
        self._by_conn[conn].introduce({"peer_id": peer_id, "data_addr": data_addr, "meta": {}},
                                      RESUMING, rank)
        return conn

    def hello(self, peer: Peer, msg: dict) -> None:
        """``peer`` said hello: pending, after every peer that said it before."""
        peer.introduce(msg, PENDING)
        peer.arrival = self._next_arrival
        self._next_arrival += 1

    def remove(self, conn: int) -> Peer:
        """Forgets connection ``conn``; returns its peer."""
        return self._by_conn.pop(conn)

    def claimed(self, peer_id: str) -> bool:
        """Whether a peer past its hello holds ``peer_id``."""
        return any(p.peer_id == peer_id and p.state != JOINING for p in self._by_conn.values())

    def pending(self) -> list[Peer]:
        """Peers that said hello and wait for admission, in arrival order."""
        return sorted((p for p in self._by_conn.values() if p.state == PENDING),
                      key=lambda p: p.arrival)

    def pending_count(self) -> int:
        """How many peers wait for admission."""
        return sum(p.state == PENDING for p in self._by_conn.values())

    def silent(self, now: float, handshake_s: float, heartbeat_s: float) -> list[tuple]:
        """``(peer, why, cause)`` for each connection past a deadline at ``now``: no hello
        within ``handshake_s``, or no message for more than ``heartbeat_s`` (seconds)."""
        out = []
        for p in self._by_conn.values():
            if p.state == JOINING:
                if now - p.connected_at > handshake_s:
                    out.append((p, f"no hello within {handshake_s:g} s", "handshake"))
            elif now - p.last_seen > heartbeat_s:
                out.append((p, f"no message for {now - p.last_seen:.1f} s "
                               f"(heartbeat timeout {heartbeat_s:g} s)", "heartbeat"))
        return out


def rank_hint_key(peer: Peer) -> tuple:
    """Sort key of a fixed world's bootstrap: peers that give a rank hint in their hello's
    meta (torchrun's RANK) by it, the rest after them by arrival."""
    hint = peer.meta.get("rank") if isinstance(peer.meta, dict) else None
    if isinstance(hint, int) and not isinstance(hint, bool) and hint >= 0:
        return (0, hint, peer.arrival)
    return (1, 0, peer.arrival)
