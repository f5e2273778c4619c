"""One connection from a peer to its master: dialing, the shared-secret challenge-response,
bounded sends, and reads through the protocol's decoder (docs/membership.md,
docs/security.md). With a secret and encryption on, everything after the handshake is
sealed both ways (``control.seal``): the peer seals from its hello on, and opens what
the master sends after the challenge. ``MasterSession`` (master_session.py) holds one at
a time and replaces it when a restarted master comes back; the protocol itself (hello,
requests, heartbeats) is the session's and the client's.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import socket
import threading
import time

from .. import config
from ..errors import (
    AuthenticationError,
    GroupReplacedError,
    PcclError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    ReplicaLayoutError,
    ReplicaLostError,
)
from ..control import auth, protocol, seal

_READ_CHUNK = 65536


def refusal_class(error: dict) -> type[PcclError]:
    """The exception class for the master's fatal ``error`` message: ``AuthenticationError``
    (``auth``), ``GroupReplacedError`` (``replaced``: refused for good), else
    ``ReplicaLostError`` (``replica``: another process of this peer's replica was lost),
    ``ReplicaLayoutError`` (``layout``), else ``PeerLostError``."""
    if error["auth"]:
        return AuthenticationError
    if error["layout"]:
        return ReplicaLayoutError
    if error["replica"]:
        return ReplicaLostError
    return GroupReplacedError if error["replaced"] else PeerLostError


class MasterLink:
    """A TCP connection to the master at ``host:port``, authenticated when there is a secret.

    Args:
        host, port: the master's address (``protocol.parse_addr``).
        master_addr: the same as ``"host:port"``, for messages.
        secret: the run's shared secret, or None: none. With one, the peer's side of
            ``control.auth``'s challenge-response runs before anything else is sent.
        deadline: ``time.monotonic()`` by which connecting and authenticating end.
        encrypt: with a secret, ask for sealed records after the handshake
            (``control.seal``; ``config.encrypt()``, ``PCCL_ENCRYPT``); ignored without one.

    Raises:
        PeerLostError: the master cannot be reached, or closed the connection.
        AuthenticationError: the master refused this peer's proof, or could not prove
            the secret (it is not the run's master).
        ProtocolError: the master answered the challenge with something else.
        IntegrityError: a sealed record from the master failed its check already.
        PcclTimeoutError: ``deadline`` passed first.
    """

    def __init__(self, host: str, port: int, master_addr: str, secret: bytes | None,
                 deadline: float, encrypt: bool = False):
        self.master_addr = master_addr
        # A Decoder, then an Opener from the first message after the challenge when
        # the connection is sealed; messages it completed at that switch wait in _pending.
        self._reader: protocol.Decoder = protocol.Decoder(protocol.TO_PEER)
        self._pending: list[dict] = []
        self._sealer: seal.Sealer | None = None
        self._send_lock = threading.Lock()
        try:
            self._sock = socket.create_connection(
                (host, port), timeout=max(0.001, deadline - time.monotonic()))
        except OSError as e:
            raise PeerLostError(f"cannot connect to the master at {master_addr}: {e}") \
                from None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Bounds each send; a read treats a timeout as "nothing yet".
            self._sock.settimeout(config.MASTER_SEND_TIMEOUT_S)
            if secret is not None:
                self._authenticate(secret, deadline, encrypt)
        except BaseException:
            self._sock.close()
            raise

    @property
    def sealed(self) -> bool:
        """Whether this connection's traffic after the handshake is sealed."""
        return self._sealer is not None

    def send(self, frame: bytes) -> None:
        """Sends one encoded frame whole (as a sealed record when the connection is
        sealed), at most ``config.MASTER_SEND_TIMEOUT_S`` per send.

        Raises:
            OSError: the connection failed (a partial frame: it is unusable).
        """
        with self._send_lock:
            if self._sealer is not None:
                frame = self._sealer.seal_frame(frame)
            self._sock.sendall(frame)

    def recv(self) -> list[dict] | None:
        """The messages of one read (none when nothing came within the send bound), or
        None when the master closed the connection.

        Raises:
            OSError: the connection failed.
            ProtocolError: the master sent a malformed message.
            IntegrityError: a sealed record from the master failed its check (altered,
                dropped, replayed or reordered on the way); sticky, the link is dead.
        """
        if self._pending:
            msgs, self._pending = self._pending, []
            return msgs
        try:
            data = self._sock.recv(_READ_CHUNK)
        except socket.timeout:
            return []
        if not data:
            return None
        return self._reader.feed(data)

    def read_first(self, deadline: float, what: str) -> list[dict]:
        """Reads until at least one message is in (before a reader thread runs).

        Raises:
            PcclTimeoutError: ``deadline`` passed first (``what`` names the wait).
            PeerLostError: the connection failed or was closed.
            ProtocolError: a malformed message.
            IntegrityError: a sealed record failed its check.
        """
        msgs, self._pending = self._pending, []
        while not msgs:
            data = self._recv_before(deadline, what)
            if data:
                msgs = self._reader.feed(data)
        self._sock.settimeout(config.MASTER_SEND_TIMEOUT_S)
        return msgs

    def shutdown(self) -> None:
        """Shuts both directions down, so a reader blocked on it returns. Never raises."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Closes the socket. Never raises."""
        self._sock.close()

    def _authenticate(self, secret: bytes, deadline: float, encrypt: bool) -> None:
        """The peer's side of ``control.auth``'s challenge-response, before the hello; then
        the switch to sealed records when ``encrypt``."""
        nonce = auth.new_nonce()
        self._sock.sendall(protocol.encode({"type": "auth", "magic": protocol.MAGIC,
                                            "version": protocol.VERSION, "nonce": nonce,
                                            "encrypt": encrypt}))
        msg = self._read_plain(deadline, "the master's challenge")
        if msg["type"] == "error":
            raise refusal_class(msg)(
                f"the master at {self.master_addr} refused this peer: {msg['message']}")
        if msg["type"] != "challenge":
            raise ProtocolError(f"the master at {self.master_addr} answered auth with "
                                f"{msg['type']}, not a challenge")
        if not auth.same(msg["proof"], auth.master_proof(secret, nonce, msg["nonce"],
                                                         encrypt=encrypt)):
            raise AuthenticationError(
                f"the master at {self.master_addr} could not prove this peer's shared secret "
                f"(the secrets differ, it is not the run's master, or the connection was "
                f"tampered with): not joining it")
        self._sock.sendall(protocol.encode({"type": "auth_proof", "proof": auth.peer_proof(
            secret, nonce, msg["nonce"], encrypt=encrypt)}))
        rest = b""
        if encrypt:
            send, receive = seal.record_keys(secret, nonce, msg["nonce"], "peer")
            rest = self._reader.take_rest()
            self._reader = seal.Opener(receive, protocol.TO_PEER,
                                       f"the master at {self.master_addr}")
            self._sealer = seal.Sealer(send)
        # What came after the challenge in the same read (nothing from a master that keeps
        # to the protocol, which waits for the proof) is the next reader's.
        self._pending = self._reader.feed(rest)

    def _read_plain(self, deadline: float, what: str) -> dict:
        """The next plain message, leaving whatever came after it buffered.

        Raises:
            PcclTimeoutError, PeerLostError, ProtocolError: as ``read_first``.
        """
        while (msg := self._reader.pop()) is None:
            self._reader.push(self._recv_before(deadline, what))
        self._sock.settimeout(config.MASTER_SEND_TIMEOUT_S)
        return msg

    def _recv_before(self, deadline: float, what: str) -> bytes:
        """One read bounded by ``deadline`` and the send bound: the bytes that came, or
        ``b""`` when none did within the bound.

        Raises:
            PcclTimeoutError: ``deadline`` passed (``what`` names the wait).
            PeerLostError: the connection failed or was closed.
        """
        left = deadline - time.monotonic()
        if left <= 0:
            raise PcclTimeoutError(f"timed out waiting for {what} (master {self.master_addr})")
        self._sock.settimeout(min(left, config.MASTER_SEND_TIMEOUT_S))
        try:
            data = self._sock.recv(_READ_CHUNK)
        except socket.timeout:
            return b""
        except OSError as e:
            raise PeerLostError(f"lost the connection to the master at "
                                f"{self.master_addr} waiting for {what}: {e}") from None
        if not data:
            raise PeerLostError(f"the master at {self.master_addr} closed the "
                                f"connection before {what}")
        return data
