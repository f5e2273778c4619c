"""MasterClient: the peer side of the master's control protocol (docs/membership.md).

``MasterClient`` is a façade over three parts, one concern each: ``MasterSession``
(master_session.py) holds the connection to the master (hello and welcome, the reader
thread, sealing through ``master_link.MasterLink``, re-registering with a master that
comes back through ``reconnect``), with the ``Heartbeat`` (heartbeat.py) that keeps the
peer alive while the caller is blocked (in ``init_process_group``, in a collective, in
``update_topology``); the ``Mailbox`` (mailbox.py) matches the master's answers to the
requests by id, and every wait has a deadline. No tensor data goes through here, and
nothing here runs on the hot path: a collective between membership changes sends nothing
to the master.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from ..errors import PcclError, UpdateInProgressError
from ..control import protocol
from .assignment import Assignment, default_peer_id
from .mailbox import Mailbox
from .master_session import MasterSession

log = logging.getLogger("torch_pccl")

# The latest notices of each type, replayed to a handler installed after they came.
_NOTICES_KEPT = 64
_NOTICES = ("member_lost", "wake")      # the master's unsolicited messages (MasterSession)


class MasterClient:
    """One peer's connection to the master.

    ``MasterClient(master_addr, data_addr)`` connects, sends hello and waits
    for the welcome; then a heartbeat thread sends a heartbeat every
    ``heartbeat_interval_s`` (told by the master) until ``close()``.

    Requests (``request_update``, ``request_sync``, ``pending_count``) are
    answered in order and are serialised by a lock, one at a time.

    A member (once ``set_resume_source`` is called) outlives its master: when the
    connection breaks, ``away`` turns True and a thread reconnects to the same address
    with backoff, for up to ``config.master_reconnect_s()`` seconds; it proves the secret
    again and re-registers with the source's ``resume`` record (its epoch, ranks and
    shared-state revision), so a restarted master rebuilds the group from its members.
    Requests made meanwhile wait for it (within their own timeouts) and are sent again on
    the new connection. Errors, all ``PcclError``:
    ``PcclTimeoutError`` when a deadline passes; ``PeerLostError`` when the
    connection to the master is lost or the master dropped this peer with a
    fatal ``error`` (the reason or the master's message in the text; sticky:
    every later call raises it again); ``PcclError`` with the master's message
    for a non-fatal ``error`` (a refused request; the connection stays up);
    ``GroupReplacedError`` (a ``PeerLostError``, sticky, logged at ERROR when it happens)
    when the master refused this member for good: a re-registration its group moved on
    from, or its group of joiners gave way to a resumed one (docs/membership.md, "When the
    master restarts"); ``IntegrityError`` (sticky) when a sealed record from the master
    failed its check (docs/security.md) and this client is no member that reconnects (a
    member treats it as a lost connection, logged at WARNING, and reconnects with fresh
    keys).
    """

    def __init__(self, master_addr: str, data_addr: str, peer_id: str | None = None,
                 timeout_s: float = 30.0, meta: dict | None = None,
                 secret: bytes | None = None, encrypt: bool | None = None,
                 replica: dict | None = None):
        """Connects to the master and registers this peer (state pending or accepted).

        Args:
            master_addr: the master's ``"host:port"`` (``"[v6]:port"``).
            data_addr: this peer's data-plane listener, ``"host:port"``.
            peer_id: this peer's id (1-64 printable characters; default
                ``default_peer_id()``).
            timeout_s: deadline in seconds for connecting and for the welcome.
            meta: optional JSON object shown in the master's snapshot.
            secret: the run's shared secret (None: ``config.secret()``, from
                ``PCCL_SECRET`` / ``PCCL_SECRET_FILE``; ``b""``: none). With one, the
                connection runs the challenge-response of ``control.auth`` before the
                hello, and a master that cannot prove the secret is refused.
            encrypt: with a secret, seal everything after the handshake both ways
                (``control.seal``; None: ``config.encrypt()``, env ``PCCL_ENCRYPT``, on).
                Without a secret nothing is sealed.
            replica: this process's place in a sharded replica (docs/sharded-replicas.md):
                ``{"id": str, "shard": int, "shards": int, "layout": 32 hex or "",
                "description": str}``; None: a peer of its own.

        Raises:
            protocol.ProtocolError: a malformed address or peer id.
            AuthenticationError: the master refused this peer's proof, has no secret
                while this peer has one (or the reverse), or could not prove the secret.
            PeerLostError: the master cannot be reached, closed the connection
                or refused the hello (e.g. a duplicate peer id; its message).
            PcclTimeoutError: no welcome within ``timeout_s``.
            IntegrityError: a sealed record from the master failed its check (altered,
                dropped, replayed or reordered on the way).
            ValueError: a malformed ``PCCL_SECRET`` / ``PCCL_SECRET_FILE`` /
                ``PCCL_ENCRYPT``.
        """
        self.master_addr = master_addr
        self.data_addr = data_addr
        self.peer_id = peer_id or default_peer_id()
        self._notices_lock = threading.Lock()
        # Per notice type (``member_lost``: a member of an epoch was dropped; ``wake``: the
        # epoch's quiet grant ends), the handler called on the reader thread (must not
        # block; see Membership) and the notices kept for a handler set later: one may
        # come before the Membership exists.
        self._handlers: dict[str, Callable[[dict], None] | None] = dict.fromkeys(_NOTICES)
        self._notices: dict[str, deque[dict]] = {
            kind: deque(maxlen=_NOTICES_KEPT) for kind in _NOTICES}
        self._mailbox = Mailbox(master_addr)
        self._session = MasterSession(master_addr, data_addr, self.peer_id, meta or {},
                                      secret, encrypt, self._mailbox, self._notice,
                                      timeout_s, replica)
        try:
            self._session.start(timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def heartbeat_interval_s(self) -> float:
        """The interval between heartbeats the master asks for, seconds (the welcome's;
        a master that comes back may change it)."""
        return self._session.heartbeat_interval_s

    # -- requests ------------------------------------------------------------

    def wait_assignment(self, timeout_s: float) -> Assignment:
        """Waits up to ``timeout_s`` seconds for the first ``assign`` (admission).

        The peer stays pending until the master forms a group with it: at
        bootstrap, or at the end of an update round of the current members.

        Raises:
            PcclTimeoutError: not admitted within ``timeout_s``.
            PeerLostError: the master went away or dropped this peer.
        """
        return Assignment.from_message(self._mailbox.wait_admission(timeout_s))

    def request_update(self, epoch: int, timeout_s: float, admit: bool = True,
                       done: int = -1, busy: bool = False) -> Assignment:
        """Joins the master's update round for ``epoch``; returns the next epoch's assignment.

        Blocks until every live member of ``epoch`` has asked too (or the
        master's round deadline drops the missing ones), at most ``timeout_s``
        seconds. ``admit`` False asks for a recovery round: pending peers are
        not admitted in it (by any member's say). ``done``: the all-or-nothing
        exchanges this member completed in ``epoch`` (-1: not counted); the
        assignment's ``done`` lists every member's. ``busy``: this member comes from
        inside its next exchange (the assignment's ``busy`` lists every member's).

        Raises:
            PcclTimeoutError: no answer within ``timeout_s``.
            PcclError: the master refused (stale epoch, not a member); its message.
            PeerLostError: the connection to the master is lost, or the master
                dropped this peer (e.g. it missed the round's deadline).
        """
        msg = self._request({"type": "update", "epoch": int(epoch), "admit": bool(admit),
                             "done": int(done), "busy": bool(busy)},
                            timeout_s, f"the update round of epoch {epoch}", "update")
        return Assignment.from_message(msg)

    def request_sync(self, epoch: int, revision: int, strategy: str, fresh: bool,
                     content: str, timeout_s: float) -> dict:
        """Votes in the master's shared-state sync round of ``epoch``; returns its result.

        Blocks until every live member of ``epoch`` has voted (or the master's
        round deadline drops the missing ones), at most ``timeout_s`` seconds.

        Args:
            epoch: the current membership epoch.
            revision: the revision of the shared state this peer syncs.
            strategy: one of ``protocol.SYNC_STRATEGIES``.
            fresh: True while this process has not completed a sync in the group.
            content: this peer's content digest, 32 lowercase hex characters.
            timeout_s: deadline in seconds.

        Returns:
            The validated ``sync_result`` message (the same on every voter):
            ``revision``, ``content``, ``sources``, ``outdated`` and ``error``
            (non-empty when the election failed; the caller interprets it).

        Raises:
            protocol.ProtocolError: a field out of range (unknown strategy,
                content not 32 lowercase hex characters); nothing is sent.
            PcclTimeoutError: no result within ``timeout_s``.
            PcclError: the master refused the vote (stale epoch, not a member)
                or abandoned the round because the membership changed.
            PeerLostError: the connection to the master is lost, or the master
                dropped this peer (e.g. it missed the round's deadline).
        """
        msg = {"type": "sync", "epoch": int(epoch), "revision": int(revision),
               "strategy": strategy, "fresh": bool(fresh), "content": content}
        return self._request(msg, timeout_s, f"the shared-state sync of epoch {epoch}",
                             "sync")

    def request_quorum(self, epoch: int, round_: int, tokens: int, stale: int,
                       min_peers: int, grace_s: float, timeout_s: float) -> dict:
        """Tells the master this member is ready for quorum round ``round_`` (an outer
        step) and waits for the round to close (master/quorum.py).

        Args:
            epoch: the current membership epoch.
            round_: the round (the shared-state revision it starts from, equal on every
                member).
            tokens: what this member trained on since it last took part (>= 0).
            stale: the rounds that closed without it since (>= 0).
            min_peers: the quorum rule: ready members that close the round ...
            grace_s: ... this many seconds after the quorum was reached (>= 0).
            timeout_s: deadline in seconds.

        Returns:
            The ``quorum`` announcement: ``round``, ``peer_ids``, ``tokens`` and ``stale``
            of its participants (this member is not among them when it came after the close).

        Raises:
            PcclTimeoutError: the round did not close within ``timeout_s``.
            PcclError: the master refused (another epoch or round, not a member).
            PeerLostError: the master went away for good or dropped this peer.
        """
        what = f"the close of quorum round {round_}"
        got = self._mailbox.collect_ahead(int(round_), self._session.send, timeout_s, what)
        if got is None:
            return self._request(self._ready_message(epoch, round_, tokens, stale,
                                                     min_peers, grace_s),
                                 timeout_s, what, "ready")
        if got["type"] == "error":
            raise PcclError(f"the master refused the ready: {got['message']}")
        return got

    def send_ready(self, epoch: int, round_: int, tokens: int, stale: int, min_peers: int,
                   grace_s: float) -> None:
        """``request_quorum``'s ``ready``, sent now without waiting (same arguments): a
        member about to be ready (one inner step before) hides the master's round trip
        behind that step. A later ``request_quorum`` for the same round waits for its
        answer instead of asking again, and sends it again if the connection was replaced
        meanwhile. Dropped while the master is away (sent again then).

        Raises:
            PeerLostError: the master dropped this peer or went away for good.
        """
        msg = self._ready_message(epoch, round_, tokens, stale, min_peers, grace_s)
        self._mailbox.ask_ahead(int(round_), msg, self._session.send)

    @staticmethod
    def _ready_message(epoch, round_, tokens, stale, min_peers, grace_s) -> dict:
        msg = {"type": "ready", "epoch": int(epoch), "round": int(round_),
               "tokens": int(tokens), "stale": int(stale), "min_peers": int(min_peers),
               "grace_s": float(grace_s)}
        protocol.encode(msg)        # a bad field raises ProtocolError before any byte is sent
        return msg

    def closed_quorum(self, round_: int) -> dict | None:
        """The announcement of quorum round ``round_`` if the master closed it (one of the
        latest 16), else None; never blocks."""
        return self._mailbox.closed_quorum(int(round_))

    def pending_count(self, timeout_s: float = 10.0, key: tuple[int, int, int] | None = None) -> int:
        """How many peers wait for admission: ``pending_answer(timeout_s, key)``'s count
        (same arguments and errors)."""
        return self.pending_answer(timeout_s, key)[0]

    def pending_answer(self, timeout_s: float = 10.0,
                       key: tuple[int, int, int] | None = None) -> tuple[int, bool]:
        """How many peers wait for admission (one round trip to the master), and whether
        the answer is *quiet*: given alone by a member while the master was away, or while
        members re-register with a new one (docs/membership.md, "When the master dies").

        Args:
            timeout_s: deadline in seconds.
            key: ``(epoch, ops, index)``: the ``index``-th query after the
                ``ops``-th collective of ``epoch``; the master answers every member
                asking the same key with the count it had when the key was first
                asked. None: the count now.

        Raises:
            PcclTimeoutError: no answer within ``timeout_s`` seconds.
            PcclError: the master refused (not a member, another epoch); its message.
            PeerLostError: the master went away or dropped this peer.
        """
        msg = {"type": "pending"}
        if key is not None:
            msg.update(epoch=int(key[0]), ops=int(key[1]), index=int(key[2]))
        reply = self._request(msg, timeout_s, "the master's pending count", "pending query")
        return reply["count"], reply.get("quiet", False)

    def report_unreached(self, epoch: int, ranks: list[int]) -> None:
        """Tells the master which ranks of ``epoch`` this member could not connect with.

        The master drops those it admitted in ``epoch`` (joiners), never incumbents.
        No answer. Dropped while the master is away (a master that comes back has not
        admitted anyone in that epoch). Raises ``PeerLostError`` if the master is gone.
        """
        if self._session.away:
            return
        self._session.send({"type": "unreached", "epoch": int(epoch),
                            "ranks": [int(r) for r in ranks]})

    def leave(self) -> None:
        """Tells the master this peer leaves (a clean departure), then closes. Never raises."""
        # The master closes the connection after a leave: not a loss to reconnect from.
        self._session.set_resume_source(None)
        try:
            if self.failure is None:
                self._session.send({"type": "leave"})
        except PcclError:
            pass
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the threads and closes the connection. Idempotent; never raises.

        Without ``leave()`` first the master sees a dropped peer.
        """
        self._session.close(timeout_s)

    def set_report_source(self, source: Callable[[], dict]) -> None:
        """Makes every heartbeat carry ``source()``, this peer's status report (protocol
        ``_report``: step, bytes, op, ring, links, sync bytes) for the master's status page.
        Called on the heartbeat thread; a source that raises sends the heartbeat without."""
        self._session.set_report_source(source)

    def set_resume_source(self, source: Callable[[], dict]) -> None:
        """Makes this client reconnect when it loses the master (see the class).

        ``source()`` returns the ``resume`` record of the hello (``control.schemas.validate_resume``):
        ``epoch``, ``comm_id``, ``rank``, ``peer_ids``, ``addrs``, ``revision`` (-1:
        none) and ``last_key`` (the last pending query answered alone, or [-1, -1]).
        """
        self._session.set_resume_source(source)

    @property
    def away(self) -> bool:
        """True while the connection to the master is lost and being re-established."""
        return self._session.away

    @property
    def sealed(self) -> bool:
        """Whether the current connection's traffic after the handshake is sealed
        (``control.seal``): the run has a secret and encryption is on."""
        return self._session.sealed

    def set_member_lost_handler(self, handler: Callable[[dict], None]) -> None:
        """Calls ``handler(msg)`` for every ``member_lost`` notice, from now and already received.

        ``msg`` is the validated message (``epoch``, ``peer_id``, ``rank``,
        ``reason``): the master dropped that member of that epoch. The handler
        runs on the reader thread (or, for notices that came before, on this
        one) and must not block; it may see a notice twice. Its exceptions are
        logged, never raised.
        """
        self._set_handler("member_lost", handler)

    @property
    def links(self) -> int:
        """Re-registrations on a new link so far (0 on the first link): a quiet grant holds
        only on the link it came on (``PendingKeys.answer_granted``)."""
        return self._session.links

    def set_wake_handler(self, handler: Callable[[dict], None]) -> None:
        """Calls ``handler(msg)`` for every ``wake`` (``epoch``: its quiet grant ends), from
        now and already received, on the reader thread (or this one); must not block."""
        self._set_handler("wake", handler)

    def send_awake(self, epoch: int, key: tuple[int, int]) -> None:
        """Answers the master's ``wake`` of ``epoch``: ``key`` (ops, index) is the last
        pending query answered alone under its grant. Never raises: with the link away,
        the master that comes back knows of no grant and asks for no answer."""
        try:
            self._session.send({"type": "awake", "epoch": int(epoch), "ops": int(key[0]),
                                "index": int(key[1])})
        except PcclError as e:
            log.info("pccl: the awake for epoch %d was not sent: %s", epoch, e)

    @property
    def failure(self) -> PcclError | None:
        """The sticky error once the connection is lost or closed, else None."""
        return self._session.failure

    def wait_failure(self, timeout_s: float) -> PcclError | None:
        """``failure``, waiting up to ``timeout_s`` seconds for one to come (a copy)."""
        return self._mailbox.wait_failure(timeout_s)

    # -- internals -----------------------------------------------------------

    def _request(self, msg: dict, timeout_s: float, what: str, name: str) -> dict:
        """Sends ``msg`` and waits for its answer (``Mailbox.ask``).

        Raises ``PcclError("the master refused the <name>: ...")`` (an
        ``UpdateInProgressError`` when the error says so) for a non-fatal error.
        """
        protocol.encode(msg)        # a bad field raises ProtocolError before any byte is sent
        reply = self._mailbox.ask(msg, self._session.send, timeout_s, what)
        if reply["type"] == "error":
            cls = UpdateInProgressError if reply["update"] else PcclError
            raise cls(f"the master refused the {name}: {reply['message']}")
        return reply

    def _set_handler(self, kind: str, handler: Callable[[dict], None]) -> None:
        """``handler`` for notices of ``kind`` from now, called at once for those kept."""
        with self._notices_lock:
            self._handlers[kind] = handler
            earlier = list(self._notices[kind])
        for msg in earlier:
            self._call_handler(handler, msg)

    def _notice(self, msg: dict) -> None:
        """The session's reader got a ``member_lost`` or a ``wake``: kept, and handed to
        its handler if there is one."""
        kind = msg["type"]
        with self._notices_lock:
            self._notices[kind].append(msg)
            handler = self._handlers[kind]
        if handler is not None:
            self._call_handler(handler, msg)

    @staticmethod
    def _call_handler(handler, msg: dict) -> None:
        try:
            handler(msg)
        except Exception:  # noqa: BLE001 - the reader must outlive a bad handler
            log.exception("pccl: %s handler failed", msg.get("type"))
