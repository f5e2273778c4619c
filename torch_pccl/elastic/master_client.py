"""MasterClient: the peer side of the master's control protocol (docs/membership.md).

``MasterClient`` holds one TCP connection to the master: it says hello with
this peer's data-plane address, then a reader thread dispatches the master's
messages and a heartbeat thread keeps the peer alive while the caller is
blocked (in ``init_process_group``, in a collective, in ``update_topology``).
Every wait has a deadline. No tensor data goes through here, and nothing here
runs on the hot path: a collective between membership changes sends nothing
to the master.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .. import config
from ..errors import (
    AuthenticationError,
    PcclError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    UpdateInProgressError,
)
from ..master import auth, protocol

log = logging.getLogger("torch_pccl")

# Bound on one blocking send to the master: a master that takes no bytes for
# this long is treated as gone.
_SEND_TIMEOUT_S = 5.0
_READ_CHUNK = 65536


@dataclass(frozen=True)
class Assignment:
    """One ``assign`` from the master: this peer's place in membership epoch ``epoch``.

    Attributes:
        epoch: the membership epoch (1, 2, ...).
        comm_id: the epoch's 64-bit communicator id (same on every member).
        rank: this peer's rank, 0 .. world_size-1.
        world_size: members in the epoch.
        addrs: data-plane ``"host:port"`` of each rank.
        peer_ids: master-level id of each rank.
        joined: peer ids admitted in this epoch.
        left: peer ids gone since the previous epoch (left or dropped).
        done: per rank, the all-or-nothing exchanges its member had completed in the
            previous epoch (-1: none counted, a joiner); () when the round had no counts.
    """

    epoch: int
    comm_id: int
    rank: int
    world_size: int
    addrs: tuple[str, ...]
    peer_ids: tuple[str, ...]
    joined: tuple[str, ...]
    left: tuple[str, ...]
    done: tuple[int, ...] = ()

    @classmethod
    def from_message(cls, msg: dict) -> Assignment:
        """Builds an Assignment from a validated ``assign`` message."""
        return cls(epoch=msg["epoch"], comm_id=msg["comm_id"], rank=msg["rank"],
                   world_size=msg["world_size"], addrs=tuple(msg["addrs"]),
                   peer_ids=tuple(msg["peer_ids"]), joined=tuple(msg["joined"]),
                   left=tuple(msg["left"]), done=tuple(msg["done"]))


def default_peer_id() -> str:
    """``hostname-pid-random``: unique per process, readable in the master's log."""
    host = socket.gethostname()[:32] or "peer"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class MasterClient:
    """One peer's connection to the master.

    ``MasterClient(master_addr, data_addr)`` connects, sends hello and waits
    for the welcome; then a heartbeat thread sends a heartbeat every
    ``heartbeat_interval_s`` (told by the master) until ``close()``.

    Requests (``request_update``, ``request_sync``, ``pending_count``) are
    answered in order and are serialised by a lock, one at a time. Errors, all ``PcclError``:
    ``PcclTimeoutError`` when a deadline passes; ``PeerLostError`` when the
    connection to the master is lost or the master dropped this peer with a
    fatal ``error`` (the reason or the master's message in the text; sticky:
    every later call raises it again); ``PcclError`` with the master's message
    for a non-fatal ``error`` (a refused request; the connection stays up).
    """

    def __init__(self, master_addr: str, data_addr: str, peer_id: str | None = None,
                 timeout_s: float = 30.0, meta: dict | None = None,
                 secret: bytes | None = None):
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

        Raises:
            protocol.ProtocolError: a malformed address or peer id.
            AuthenticationError: the master refused this peer's proof, has no secret
                while this peer has one (or the reverse), or could not prove the secret.
            PeerLostError: the master cannot be reached, closed the connection
                or refused the hello (e.g. a duplicate peer id; its message).
            PcclTimeoutError: no welcome within ``timeout_s``.
            ValueError: a malformed ``PCCL_SECRET`` / ``PCCL_SECRET_FILE``.
        """
        host, port = protocol.parse_addr(master_addr)
        self.master_addr = master_addr
        self.data_addr = data_addr
        self.peer_id = peer_id or default_peer_id()
        hello = protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                                 "version": protocol.VERSION, "peer_id": self.peer_id,
                                 "data_addr": data_addr, "meta": meta or {}})
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._replies: deque[dict] = deque()      # pending_count / non-fatal error
        self._assigns: deque[dict] = deque()
        self._sync_results: deque[dict] = deque()
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
        deadline = time.monotonic() + timeout_s
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise PeerLostError(f"cannot connect to the master at {master_addr}: {e}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Bounds each send; the reader treats a recv timeout as "nothing yet".
        self._sock.settimeout(_SEND_TIMEOUT_S)
        if self._secret is not None:
            try:
                self._authenticate(deadline)
            except BaseException:
                self._sock.close()
                raise
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

    def pending_count(self, timeout_s: float = 10.0, key: tuple[int, int, int] | None = None) -> int:
        """Returns how many peers wait for admission (one round trip to the master).

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
        return reply["count"]

    def report_unreached(self, epoch: int, ranks: list[int]) -> None:
        """Tells the master which ranks of ``epoch`` this member could not connect with.

        The master drops those it admitted in ``epoch`` (joiners), never incumbents.
        No answer. Raises ``PeerLostError`` if the master is gone.
        """
        self._send({"type": "unreached", "epoch": int(epoch), "ranks": [int(r) for r in ranks]})

    def leave(self) -> None:
        """Tells the master this peer leaves (a clean departure), then closes. Never raises."""
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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        me = threading.current_thread()
        for t in (self._heartbeat, self._reader):
            if t.is_alive() and t is not me:
                t.join(timeout_s)
        self._sock.close()

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
        with self._request_lock:
            with self._cond:
                # Requests are serialised, so whatever is queued now answers an
                # earlier request that timed out (or is a notice such as an
                # abandoned sync): it must not be taken for this one's answer.
                self._replies.clear()
                self._sync_results.clear()
            self._send(msg)         # a bad field raises ProtocolError before any byte is sent

            def answer():
                if answers:
                    return answers.popleft()
                while self._replies and self._replies[0]["type"] == "error":
                    err = self._replies.popleft()
                    # "join the update round" concerns a sync this peer gave up on,
                    # unless this request is a sync.
                    if err["update"] and name != "sync":
                        continue
                    return err
                return None

            reply = self._wait(answer, timeout_s, what)
        if reply["type"] == "error":
            cls = UpdateInProgressError if reply["update"] else PcclError
            raise cls(f"the master refused the {name}: {reply['message']}")
        return reply

    def _authenticate(self, deadline: float) -> None:
        """The peer's side of ``master.auth``'s challenge-response, before the hello and
        before the reader thread starts (so the challenge is read here)."""
        nonce = auth.new_nonce()
        self._send_raw(protocol.encode({"type": "auth", "magic": protocol.MAGIC,
                                        "version": protocol.VERSION, "nonce": nonce}))
        decoder = protocol.Decoder(protocol.TO_PEER)
        msgs: list[dict] = []
        while not msgs:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PcclTimeoutError(f"timed out waiting for the master's challenge "
                                       f"(master {self.master_addr})")
            self._sock.settimeout(min(left, _SEND_TIMEOUT_S))
            try:
                data = self._sock.recv(_READ_CHUNK)
            except socket.timeout:
                continue
            except OSError as e:
                raise PeerLostError(f"lost the connection to the master at {self.master_addr} "
                                    f"while authenticating: {e}") from None
            if not data:
                raise PeerLostError(f"the master at {self.master_addr} closed the connection "
                                    f"while authenticating")
            msgs = decoder.feed(data)
        self._sock.settimeout(_SEND_TIMEOUT_S)
        msg = msgs[0]
        if msg["type"] == "error":
            cls = AuthenticationError if msg["auth"] else PeerLostError
            raise cls(f"the master at {self.master_addr} refused this peer: {msg['message']}")
        if msg["type"] != "challenge" or len(msgs) > 1:
            raise ProtocolError(f"the master at {self.master_addr} answered auth with "
                                f"{msg['type']}, not a challenge")
        if not auth.same(msg["proof"], auth.master_proof(self._secret, nonce, msg["nonce"])):
            raise AuthenticationError(
                f"the master at {self.master_addr} could not prove this peer's shared secret "
                f"(the secrets differ, or it is not the run's master): not joining it")
        self._send_raw(protocol.encode({"type": "auth_proof", "proof": auth.peer_proof(
            self._secret, nonce, msg["nonce"])}))

    def _wait(self, take, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
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
        self._send_raw(protocol.encode(msg))

    def _send_raw(self, frame: bytes) -> None:
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as e:
            # A partial frame breaks the stream: the connection is unusable.
            err = PeerLostError(f"lost the connection to the master at {self.master_addr}: "
                                f"send failed: {e}")
            self._fail(err)
            raise self._sticky() from None

    def _sticky(self) -> PcclError:
        # A fresh exception per raise: one object re-raised from several
        # threads would pile up their tracebacks.
        return type(self._failure)(str(self._failure))

    def _fail(self, err: PcclError) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = err
            self._cond.notify_all()
        self._stop.set()

    def _heartbeat_loop(self) -> None:
        frame = protocol.encode({"type": "heartbeat"})
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                self._send_raw(frame)
            except PcclError:
                return

    def _read_loop(self) -> None:
        decoder = protocol.Decoder(protocol.TO_PEER)
        why = "the master closed the connection"
        try:
            while not self._stop.is_set():
                try:
                    data = self._sock.recv(_READ_CHUNK)
                except socket.timeout:
                    continue
                if not data:
                    break
                for msg in decoder.feed(data):
                    self._dispatch(msg)
        except protocol.ProtocolError as e:
            why = f"bad message from the master: {e}"
        except OSError as e:
            why = f"connection to the master failed: {e}"
        self._fail(PeerLostError(f"lost the connection to the master at {self.master_addr}: "
                                 f"{why}"))

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
            elif kind == "error" and msg["fatal"]:
                if self._failure is None:
                    # The master closes the connection after a fatal error.
                    cls = AuthenticationError if msg["auth"] else PeerLostError
                    self._failure = cls(
                        f"the master at {self.master_addr} dropped this peer: {msg['message']}")
            else:                                   # pending_count, non-fatal error
                self._replies.append(msg)
            self._cond.notify_all()
