"""MasterClient: the peer side of the master's control protocol (docs/membership.md).

``MasterClient`` holds one TCP connection to the master: it says hello with
this peer's data-plane address, then a reader thread dispatches the master's
messages and a heartbeat thread keeps the peer alive while the caller is
blocked (in ``init_process_group``, in a collective, in ``update_topology``).
Every wait has a deadline. No tensor data goes through here, and nothing here
runs on the hot path: a collective between membership changes sends nothing
to the master. The connection itself is ``master_link.MasterLink``; re-registering
with a master that comes back is ``reconnect.reconnect``.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from .. import config
from ..errors import (
    IntegrityError,
    PcclError,
    PcclTimeoutError,
    PeerLostError,
    UpdateInProgressError,
)
from ..control import protocol
from .assignment import Assignment, default_peer_id
from .master_link import MasterLink, refusal_class
from .reconnect import reconnect, rejoin

log = logging.getLogger("torch_pccl")

_RESEND = object()      # a request's connection was replaced before its answer came


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
                 secret: bytes | None = None, encrypt: bool | None = None):
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
                connection runs the challenge-response of ``master.auth`` before the
                hello, and a master that cannot prove the secret is refused.
            encrypt: with a secret, seal everything after the handshake both ways
                (``control.seal``; None: ``config.encrypt()``, env ``PCCL_ENCRYPT``, on).
                Without a secret nothing is sealed.

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
        self._host, self._port = protocol.parse_addr(master_addr)
        self.master_addr = master_addr
        self.data_addr = data_addr
        self.peer_id = peer_id or default_peer_id()
        self._meta = meta or {}
        hello = protocol.encode(self._hello())
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._replies: deque[dict] = deque()      # pending_count / non-fatal error
        self._assigns: deque[dict] = deque()
        self._sync_results: deque[dict] = deque()
        self._quorum_replies: deque[dict] = deque(maxlen=16)
        # The latest closed quorum rounds, round -> announcement (asked for or not).
        self._quorums: dict[int, dict] = {}
        # The last ready sent ahead (send_ready): (round, message, generation sent on).
        self._early: tuple[int, dict, int] | None = None
        self._welcome: dict | None = None
        self._failure: PcclError | None = None
        self._closing = False
        self._stop = threading.Event()
        self.heartbeat_interval_s = 1.0
        # Called on the reader thread with each validated ``member_lost`` message
        # (a member of an epoch was dropped); must not block. See Membership.
        self._on_member_lost: Callable[[dict], None] | None = None
        # The latest notices, replayed to a handler installed after they came.
        self._lost_notices: deque[dict] = deque(maxlen=64)
        self._secret = config.secret() if secret is None else (bytes(secret) or None)
        self._encrypt = config.encrypt() if encrypt is None else bool(encrypt)
        # Set by a member (Membership): what it re-registers with after losing the master.
        self._resume_source: Callable[[], dict] | None = None
        self._report_source: Callable[[], dict] | None = None
        self._reconnect_s = config.master_reconnect_s()
        self._away = False          # the connection broke; the reconnect thread runs
        self._generation = 0        # connections made after the first
        self._reconnector: threading.Thread | None = None
        self._last_id = 0           # of requests: each try carries a new one (see _exchange)
        self._master_stopping = False   # the master's last error said it is stopping
        self._link = self._dial(time.monotonic() + timeout_s)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"pccl-master-reader-{self.peer_id}")
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"pccl-master-heartbeat-{self.peer_id}")
        try:
            self._send_raw(hello)
            self._reader.start()
            welcome = self._wait(lambda: self._welcome, timeout_s, "the master's welcome")
        except BaseException:
            self.close()
            raise
        self.heartbeat_interval_s = float(welcome["heartbeat_interval_s"])
        self._heartbeat.start()

    # -- requests ------------------------------------------------------------

    def wait_assignment(self, timeout_s: float) -> Assignment:
        """Waits up to ``timeout_s`` seconds for the first ``assign`` (admission).

        The peer stays pending until the master forms a group with it: at
        bootstrap, or at the end of an update round of the current members.

        Raises:
            PcclTimeoutError: not admitted within ``timeout_s``.
            PeerLostError: the master went away or dropped this peer.
        """
        msg = self._wait(lambda: self._assigns.popleft() if self._assigns else None,
                         timeout_s, "admission by the master (still pending)")
        return Assignment.from_message(msg)

    def request_update(self, epoch: int, timeout_s: float, admit: bool = True,
                       done: int = -1) -> Assignment:
        """Joins the master's update round for ``epoch``; returns the next epoch's assignment.

        Blocks until every live member of ``epoch`` has asked too (or the
        master's round deadline drops the missing ones), at most ``timeout_s``
        seconds. ``admit`` False asks for a recovery round: pending peers are
        not admitted in it (by any member's say). ``done``: the all-or-nothing
        exchanges this member completed in ``epoch`` (-1: not counted); the
        assignment's ``done`` lists every member's.

        Raises:
            PcclTimeoutError: no answer within ``timeout_s``.
            PcclError: the master refused (stale epoch, not a member); its message.
            PeerLostError: the connection to the master is lost, or the master
                dropped this peer (e.g. it missed the round's deadline).
        """
        msg = self._request({"type": "update", "epoch": int(epoch), "admit": bool(admit),
                             "done": int(done)},
                            self._assigns, timeout_s, f"the update round of epoch {epoch}",
                            "update")
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
        return self._request(msg, self._sync_results, timeout_s,
                             f"the shared-state sync of epoch {epoch}", "sync")

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
        with self._cond:
            early = self._early
        if early is not None and early[0] == int(round_):
            return self._wait_early(early, timeout_s)
        return self._request(self._ready_message(epoch, round_, tokens, stale, min_peers,
                                                 grace_s),
                             self._quorum_replies, timeout_s,
                             f"the close of quorum round {round_}", "ready")

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
        with self._cond:
            self._last_id += 1
            msg["id"] = self._last_id
            self._early = (int(round_), msg, self._generation)
        try:
            self._send(msg)
        except PeerLostError:
            if self._failure is not None:
                raise

    @staticmethod
    def _ready_message(epoch, round_, tokens, stale, min_peers, grace_s) -> dict:
        msg = {"type": "ready", "epoch": int(epoch), "round": int(round_),
               "tokens": int(tokens), "stale": int(stale), "min_peers": int(min_peers),
               "grace_s": float(grace_s)}
        protocol.encode(msg)        # a bad field raises ProtocolError before any byte is sent
        return msg

    def _wait_early(self, early: tuple[int, dict, int], timeout_s: float) -> dict:
        """Waits for the answer to ``send_ready``'s message (``request_quorum``'s)."""
        round_, msg, gen = early
        what = f"the close of quorum round {round_}"
        deadline = time.monotonic() + timeout_s

        def take():
            if round_ in self._quorums:
                return self._quorums[round_]
            for err in self._replies:
                if err["type"] == "error" and err.get("id") == msg["id"]:
                    self._replies.remove(err)
                    return err
            if self._away or self._generation != gen:
                return _RESEND
            return None

        while True:
            got = self._wait_until(take, deadline, timeout_s, what)
            if got is not _RESEND:
                break
            # The connection was replaced: the master may never have seen it. Again, on
            # the new connection (an answer to the old one is not waited for).
            gen = self._wait_until(lambda: None if self._away else self._generation,
                                   deadline, timeout_s, what)
            try:
                self._send(msg)
            except PeerLostError:
                if self._failure is not None:
                    raise
        with self._cond:
            self._early = None
        if got["type"] == "error":
            raise PcclError(f"the master refused the ready: {got['message']}")
        return got

    def closed_quorum(self, round_: int) -> dict | None:
        """The announcement of quorum round ``round_`` if the master closed it (one of the
        latest 16), else None; never blocks."""
        with self._cond:
            return self._quorums.get(int(round_))

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
        reply = self._request(msg, self._replies, timeout_s, "the master's pending count",
                              "pending query")
        return reply["count"], reply.get("quiet", False)

    def report_unreached(self, epoch: int, ranks: list[int]) -> None:
        """Tells the master which ranks of ``epoch`` this member could not connect with.

        The master drops those it admitted in ``epoch`` (joiners), never incumbents.
        No answer. Dropped while the master is away (a master that comes back has not
        admitted anyone in that epoch). Raises ``PeerLostError`` if the master is gone.
        """
        if self._away:
            return
        self._send({"type": "unreached", "epoch": int(epoch), "ranks": [int(r) for r in ranks]})

    def leave(self) -> None:
        """Tells the master this peer leaves (a clean departure), then closes. Never raises."""
        # The master closes the connection after a leave: not a loss to reconnect from.
        self._resume_source = None
        try:
            if self._failure is None:
                self._send({"type": "leave"})
        except PcclError:
            pass
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the threads and closes the connection. Idempotent; never raises.

        Without ``leave()`` first the master sees a dropped peer.
        """
        with self._cond:
            self._closing = True
            if self._failure is None:
                self._failure = PeerLostError("the connection to the master was closed")
            self._cond.notify_all()
        self._stop.set()
        self._link.shutdown()
        me = threading.current_thread()
        for t in (self._heartbeat, self._reconnector, self._reader):
            if t is None:
                continue
            if t.is_alive() and t is not me:
                t.join(timeout_s)
        self._link.close()

    def set_report_source(self, source: Callable[[], dict]) -> None:
        """Makes every heartbeat carry ``source()``, this peer's status report (protocol
        ``_report``: step, bytes, op, ring, links, sync bytes) for the master's status page.
        Called on the heartbeat thread; a source that raises sends the heartbeat without."""
        self._report_source = source

    def set_resume_source(self, source: Callable[[], dict]) -> None:
        """Makes this client reconnect when it loses the master (see the class).

        ``source()`` returns the ``resume`` record of the hello (protocol._resume):
        ``epoch``, ``comm_id``, ``rank``, ``peer_ids``, ``addrs``, ``revision`` (-1:
        none) and ``last_key`` (the last pending query answered alone, or [-1, -1]).
        """
        self._resume_source = source

    @property
    def away(self) -> bool:
        """True while the connection to the master is lost and being re-established."""
        return self._away

    @property
    def sealed(self) -> bool:
        """Whether the current connection's traffic after the handshake is sealed
        (``control.seal``): the run has a secret and encryption is on."""
        return self._link.sealed

    def set_member_lost_handler(self, handler: Callable[[dict], None]) -> None:
        """Calls ``handler(msg)`` for every ``member_lost`` notice, from now and already received.

        ``msg`` is the validated message (``epoch``, ``peer_id``, ``rank``,
        ``reason``): the master dropped that member of that epoch. The handler
        runs on the reader thread (or, for notices that came before, on this
        one) and must not block; it may see a notice twice. Its exceptions are
        logged, never raised.
        """
        with self._cond:
            self._on_member_lost = handler
            earlier = list(self._lost_notices)
        for msg in earlier:
            self._call_handler(handler, msg)

    @staticmethod
    def _call_handler(handler, msg: dict) -> None:
        try:
            handler(msg)
        except Exception:  # noqa: BLE001 - the reader must outlive a bad handler
            log.exception("pccl: member_lost handler failed")

    @property
    def failure(self) -> PcclError | None:
        """The sticky error once the connection is lost or closed, else None."""
        return self._failure

    # -- internals -----------------------------------------------------------

    def _request(self, msg: dict, answers: deque, timeout_s: float, what: str,
                 name: str) -> dict:
        """Sends ``msg`` and waits for its answer in ``answers`` or a non-fatal error.

        Raises ``PcclError("the master refused the <name>: ...")`` for the error.
        """
        protocol.encode(msg)        # a bad field raises ProtocolError before any byte is sent
        deadline = time.monotonic() + timeout_s
        with self._request_lock:
            while True:
                # While the master is away, wait for the reconnect (within this deadline).
                gen = self._wait_until(lambda: None if self._away else self._generation,
                                       deadline, timeout_s, what)
                reply = self._exchange(msg, answers, gen, deadline, timeout_s, what, name)
                if reply is not _RESEND:
                    break
        if reply["type"] == "error":
            cls = UpdateInProgressError if reply["update"] else PcclError
            raise cls(f"the master refused the {name}: {reply['message']}")
        return reply

    def _exchange(self, msg: dict, answers: deque, gen: int, deadline: float,
                  timeout_s: float, what: str, name: str):
        """One try of ``_request`` on connection ``gen``: the answer, or ``_RESEND``.

        The try carries a fresh ``id`` that its answer echoes; anything else queued (a
        late answer to a request that timed out, or one sent on a lost connection) is
        dropped, so it can never be taken for this one's answer.
        """
        self._last_id += 1
        rid = self._last_id
        msg = dict(msg, id=rid)
        with self._cond:
            # Requests are serialised, so whatever is queued now answers an
            # earlier request that timed out (or is a notice such as an
            # abandoned sync): it must not be taken for this one's answer.
            self._replies.clear()
            self._sync_results.clear()
        try:
            self._send(msg)
        except PeerLostError:
            if self._failure is not None:
                raise
            return _RESEND          # the connection broke under the send: after the reconnect

        def answer():
            if self._away or self._generation != gen:
                return _RESEND
            while answers:
                reply = answers.popleft()
                if reply.pop("id", None) == rid:
                    return reply
            while self._replies and self._replies[0]["type"] == "error":
                err = self._replies.popleft()
                if err.pop("id", None) == rid:
                    return err
            return None

        return self._wait_until(answer, deadline, timeout_s, what)

    def _hello(self, resume: dict | None = None) -> dict:
        msg = {"type": "hello", "magic": protocol.MAGIC, "version": protocol.VERSION,
               "peer_id": self.peer_id, "data_addr": self.data_addr, "meta": self._meta}
        if resume:
            msg["resume"] = resume
        return msg

    def _dial(self, deadline: float) -> MasterLink:
        """A new connection to the master, authenticated when there is a secret."""
        return MasterLink(self._host, self._port, self.master_addr, self._secret, deadline,
                          self._encrypt)

    # -- outliving the master ------------------------------------------------

    def _lost_master(self, why: str, cls: type[PcclError] = PeerLostError) -> None:
        """The reader's connection broke: a member reconnects in the background, anyone
        else fails (sticky) with a ``cls``."""
        err = cls(f"lost the connection to the master at {self.master_addr}: {why}")
        if self._resume_source is None or self._stop.is_set() or self._closing:
            self._fail(err)
            return
        with self._cond:
            if self._failure is not None:
                return
            self._away = True
            self._cond.notify_all()
        # A master that said it is stopping is expected to be gone (the end of a torchrun
        # job, whose rank 0 stops its master as the others finish; an operator's
        # restart): _reconnect_loop warns only if it stays away.
        log.log(logging.DEBUG if self._master_stopping else logging.WARNING,
                "pccl: %s; collectives go on, membership changes wait; reconnecting for up "
                "to %g s", err, self._reconnect_s)
        self._reconnector = threading.Thread(target=self._reconnect_loop, args=(why,),
                                             daemon=True,
                                             name=f"pccl-master-reconnect-{self.peer_id}")
        self._reconnector.start()

    def _reconnect_loop(self, why: str) -> None:
        try:
            back = reconnect(self._rejoin, self._stop, self.master_addr, self._reconnect_s,
                             why, stopping=self._master_stopping)
        except PcclError as e:
            self._fail(e)
            return
        if back is None:
            return
        self.heartbeat_interval_s = back.heartbeat_interval_s
        with self._send_lock:
            old, self._link = self._link, back.link
        old.close()
        if self._stop.is_set():         # closed meanwhile: close() saw the old link
            back.link.close()
            return
        for msg in back.rest:
            self._dispatch(msg)
        with self._cond:
            self._away = False
            self._master_stopping = False
            self._generation += 1
            self._cond.notify_all()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"pccl-master-reader-{self.peer_id}")
        self._reader.start()
        log.log(logging.INFO if back.quiet else logging.WARNING,
                "pccl: re-registered with the master at %s", self.master_addr)

    def _rejoin(self, deadline: float) -> tuple[MasterLink, float, list[dict]]:
        """One reconnect attempt (``reconnect.rejoin``) on a new link, closed if it fails."""
        link = self._dial(deadline)
        try:
            hello = protocol.encode(self._hello(self._resume_source()))
            return (link, *rejoin(link, hello, self.master_addr, deadline))
        except BaseException:
            link.close()
            raise

    # -- waiting and sending -------------------------------------------------

    def _wait(self, take, timeout_s: float, what: str):
        return self._wait_until(take, time.monotonic() + timeout_s, timeout_s, what)

    def _wait_until(self, take, deadline: float, timeout_s: float, what: str):
        with self._cond:
            while True:
                got = take()
                if got is not None:
                    return got
                if self._failure is not None:
                    raise self._sticky()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PcclTimeoutError(
                        f"timed out after {timeout_s:g} s waiting for {what} "
                        f"(master {self.master_addr})")
                self._cond.wait(left)

    def _send(self, msg: dict) -> None:
        if self._failure is not None:
            raise self._sticky()
        if self._away:
            raise PeerLostError(f"the master at {self.master_addr} is away (reconnecting)")
        self._send_raw(protocol.encode(msg))

    def _send_raw(self, frame: bytes) -> None:
        with self._send_lock:
            link = self._link
        try:
            link.send(frame)
        except OSError as e:
            # A partial frame breaks the stream: the connection is unusable.
            err = PeerLostError(f"lost the connection to the master at {self.master_addr}: "
                                f"send failed: {e}")
            if self._resume_source is None:
                self._fail(err)
                raise self._sticky() from None
            link.shutdown()         # the reader sees it and reconnects
            raise err from None

    def _sticky(self) -> PcclError:
        # A fresh exception per raise: one object re-raised from several
        # threads would pile up their tracebacks.
        return type(self._failure)(str(self._failure))

    def _fail(self, err: PcclError) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = err
            # Not away any more: gone for good, so the next request raises the failure
            # instead of waiting for (or answering without) a master.
            self._away = False
            self._cond.notify_all()
        self._stop.set()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            if self._away:
                continue            # the re-registration counts as the next sign of life
            try:
                self._send_raw(self._heartbeat_frame())
            except PcclError:
                if self._failure is not None:
                    return

    def _heartbeat_frame(self) -> bytes:
        source = self._report_source
        if source is not None:
            try:
                return protocol.encode({"type": "heartbeat", "report": source()})
            except Exception:  # noqa: BLE001 - a report is optional; the heartbeat is not
                log.debug("status report failed; heartbeat sent without it", exc_info=True)
        return protocol.encode({"type": "heartbeat"})

    def _read_loop(self) -> None:
        link = self._link
        why = "the master closed the connection"
        try:
            while not self._stop.is_set():
                msgs = link.recv()
                if msgs is None:
                    break
                for msg in msgs:
                    self._dispatch(msg)
        except protocol.ProtocolError as e:
            self._fail(PeerLostError(f"lost the connection to the master at "
                                     f"{self.master_addr}: bad message from the master: {e}"))
            return
        except IntegrityError as e:
            # The master proved the secret; something on the path changed its bytes. This
            # link is dead; a member's next one has fresh keys.
            self._lost_master(str(e), IntegrityError)
            return
        except OSError as e:
            why = f"connection to the master failed: {e}"
        self._lost_master(why)

    def _dispatch(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "member_lost":
            with self._cond:
                self._lost_notices.append(msg)
                handler = self._on_member_lost
            if handler is not None:
                self._call_handler(handler, msg)
            return
        with self._cond:
            if kind == "welcome":
                self._welcome = msg
            elif kind == "assign":
                self._assigns.append(msg)
            elif kind == "sync_result":
                self._sync_results.append(msg)
            elif kind == "quorum":
                self._quorums[msg["round"]] = {k: v for k, v in msg.items() if k != "id"}
                while len(self._quorums) > 16:
                    del self._quorums[min(self._quorums)]
                if "id" in msg:
                    self._quorum_replies.append(msg)
            elif kind == "error" and msg["fatal"]:
                if msg["stopping"] and self._resume_source is not None:
                    # A member waits for the master's restart (its EOF follows). At the end
                    # of a torchrun job, rank 0 stops its master while others finish.
                    self._master_stopping = True
                elif self._failure is None:
                    # The master closes the connection after a fatal error.
                    self._failure = refusal_class(msg)(
                        f"the master at {self.master_addr} dropped this peer: {msg['message']}")
                    if msg["replaced"]:
                        log.error("pccl: %s", self._failure)
            else:                                   # pending_count, non-fatal error
                self._replies.append(msg)
            self._cond.notify_all()
