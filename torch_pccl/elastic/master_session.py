"""MasterSession: one peer's connection to its master across links (docs/membership.md).

The session dials (``master_link.MasterLink``: the shared-secret proof, sealing), says
hello with the peer's data-plane address and waits for the welcome; then a reader
thread files the master's messages in the ``Mailbox`` (mailbox.py) and a ``Heartbeat``
(heartbeat.py) keeps the peer alive. A member (once it sets a resume source) outlives
its master: when the link breaks, a thread re-registers with the same address
(``reconnect.reconnect``) and the session swaps the new link in. A fatal ``error`` from
the master, a lost link of a peer that does not reconnect, and ``stop`` become the
mailbox's sticky failure. What a request waits for is the mailbox's.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .. import config
from ..errors import IntegrityError, PcclError, PeerLostError
from ..control import protocol
from .heartbeat import Heartbeat
from .mailbox import Mailbox
from .master_link import MasterLink, refusal_class
from .reconnect import reconnect, rejoin

log = logging.getLogger("torch_pccl")


class MasterSession:
    """One peer's session with the master at ``master_addr``.

    Constructing it validates the hello and dials; ``start`` says hello and waits for the
    welcome. Errors are those of ``MasterClient`` (master_client.py), its façade.

    Args:
        master_addr: the master's ``"host:port"`` (``"[v6]:port"``).
        data_addr: this peer's data-plane listener, ``"host:port"``.
        peer_id: this peer's id (1-64 printable characters).
        meta: a JSON object shown in the master's snapshot.
        secret: the run's shared secret (None: ``config.secret()``; ``b""``: none).
        encrypt: with a secret, seal the traffic (None: ``config.encrypt()``).
        mailbox: where the master's messages go, and the failure every wait checks.
        on_notice: called on the reader thread with each ``member_lost`` and ``wake``
            message.
        timeout_s: deadline in seconds for connecting.

    Raises:
        protocol.ProtocolError: a malformed address, peer id or data address.
        ValueError: a malformed ``PCCL_SECRET`` / ``PCCL_SECRET_FILE`` / ``PCCL_ENCRYPT``
            / ``PCCL_MASTER_RECONNECT``.
        PeerLostError, AuthenticationError, PcclTimeoutError, IntegrityError: as
            ``MasterLink``.
    """

    def __init__(self, master_addr: str, data_addr: str, peer_id: str, meta: dict,
                 secret: bytes | None, encrypt: bool | None, mailbox: Mailbox,
                 on_notice: Callable[[dict], None], timeout_s: float,
                 replica: dict | None = None):
        self._host, self._port = protocol.parse_addr(master_addr)
        self.master_addr = master_addr
        self._data_addr = data_addr
        self._peer_id = peer_id
        self._meta = meta
        self._replica = replica
        self._hello_frame = protocol.encode(self._hello())     # a bad field raises here
        self._mailbox = mailbox
        self._on_notice = on_notice
        self._send_lock = threading.Lock()      # guards the swap of _link
        self._links = 0                         # links swapped in since the first (``links``)
        self._secret = config.secret() if secret is None else (bytes(secret) or None)
        self._encrypt = config.encrypt() if encrypt is None else bool(encrypt)
        # Set by a member (Membership): what it re-registers with after losing the master.
        self._resume_source: Callable[[], dict] | None = None
        self._reconnect_s = config.master_reconnect_s()
        self._closing = False
        self._master_stopping = False   # the master's last error said it is stopping
        self._stop = threading.Event()
        self._reconnector: threading.Thread | None = None
        self.heartbeat_interval_s = 1.0     # the master's, seconds (the welcome's)
        self._heartbeat = Heartbeat(self, f"pccl-master-heartbeat-{peer_id}")
        self._link = self._dial(time.monotonic() + timeout_s)
        self._reader = self._new_reader()

    def start(self, timeout_s: float) -> None:
        """Says hello, waits up to ``timeout_s`` seconds for the welcome, then starts the
        heartbeat. The caller closes the session if this raises.

        Raises:
            PeerLostError: the master closed the connection or refused the hello.
            PcclTimeoutError: no welcome within ``timeout_s``.
            IntegrityError: a sealed record from the master failed its check.
        """
        self.send_frame(self._hello_frame)
        self._reader.start()
        welcome = self._mailbox.wait_welcome(timeout_s)
        self.heartbeat_interval_s = float(welcome["heartbeat_interval_s"])
        self._heartbeat.start()

    # -- state ----------------------------------------------------------------

    @property
    def away(self) -> bool:
        """True while the link is lost and being re-established."""
        return self._mailbox.away

    @property
    def links(self) -> int:
        """How many times this session re-registered on a new link (0 on its first): what
        the master granted on one link, a restarted master does not know of."""
        return self._links

    @property
    def failure(self) -> PcclError | None:
        """The sticky error once the connection is lost for good or closed, else None."""
        return self._mailbox.failure

    @property
    def sealed(self) -> bool:
        """Whether the current link's traffic after the handshake is sealed."""
        return self._link.sealed

    def set_resume_source(self, source: Callable[[], dict] | None) -> None:
        """Makes the session reconnect when it loses the master, re-registering with
        ``source()``'s ``resume`` record; None: fail instead (a peer that leaves)."""
        self._resume_source = source

    def set_report_source(self, source: Callable[[], dict]) -> None:
        """Makes every heartbeat carry ``source()``, this peer's status report."""
        self._heartbeat.set_report_source(source)

    def wait_stop(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` seconds for the session to stop; whether it has."""
        return self._stop.wait(timeout_s)

    # -- sending --------------------------------------------------------------

    def send(self, msg: dict) -> None:
        """Sends ``msg`` on the current link.

        Raises:
            PcclError: the sticky failure.
            PeerLostError: the link is away (reconnecting) or broke under the send (a
                member's reader then reconnects).
        """
        self._mailbox.raise_failure()
        if self._mailbox.away:
            raise PeerLostError(f"the master at {self.master_addr} is away (reconnecting)")
        self.send_frame(protocol.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        """Sends one encoded frame on the current link.

        Raises:
            PeerLostError: the send failed (for a peer that does not reconnect, a copy of
                the sticky failure it became).
        """
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
                raise self._mailbox.sticky() from None
            link.shutdown()         # the reader sees it and reconnects
            raise err from None

    # -- stopping -------------------------------------------------------------

    def stop(self) -> None:
        """Makes every wait fail (``PeerLostError``: closed, unless a failure came first)
        and stops the threads' loops. Idempotent; never raises."""
        self._closing = True
        self._mailbox.fail(PeerLostError("the connection to the master was closed"),
                           keep_away=True)
        self._stop.set()
        self._link.shutdown()

    def close(self, timeout_s: float) -> None:
        """``stop``, then waits up to ``timeout_s`` seconds for each thread and closes
        the link. Idempotent; never raises."""
        self.stop()
        self._heartbeat.join(timeout_s)
        me = threading.current_thread()
        for t in (self._reconnector, self._reader):
            if t is not None and t.is_alive() and t is not me:
                t.join(timeout_s)
        self._link.close()

    def _fail(self, err: PcclError) -> None:
        self._mailbox.fail(err)
        self._stop.set()

    # -- reading --------------------------------------------------------------

    def _new_reader(self) -> threading.Thread:
        return threading.Thread(target=self._read_loop, daemon=True,
                                name=f"pccl-master-reader-{self._peer_id}")

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
        if kind in ("member_lost", "wake"):
            self._on_notice(msg)
        elif kind == "error" and msg["fatal"]:
            if msg["stopping"] and self._resume_source is not None:
                # A member waits for the master's restart (its EOF follows). At the end of
                # a torchrun job, rank 0 stops its master while others finish.
                self._master_stopping = True
                return
            # The master closes the connection after a fatal error.
            err = refusal_class(msg)(
                f"the master at {self.master_addr} dropped this peer: {msg['message']}")
            if self._mailbox.fail(err, keep_away=True) and msg["replaced"]:
                log.error("pccl: %s", err)
        else:
            self._mailbox.deliver(msg)

    # -- outliving the master -------------------------------------------------

    def _hello(self, resume: dict | None = None) -> dict:
        msg = {"type": "hello", "magic": protocol.MAGIC, "version": protocol.VERSION,
               "peer_id": self._peer_id, "data_addr": self._data_addr, "meta": self._meta}
        if self._replica is not None:
            msg["replica"] = dict(self._replica)
        if resume:
            msg["resume"] = resume
        return msg

    def _dial(self, deadline: float) -> MasterLink:
        """A new link to the master, authenticated when there is a secret."""
        return MasterLink(self._host, self._port, self.master_addr, self._secret, deadline,
                          self._encrypt)

    def _lost_master(self, why: str, cls: type[PcclError] = PeerLostError) -> None:
        """The reader's link broke: a member reconnects in the background, anyone else
        fails (sticky) with a ``cls``."""
        err = cls(f"lost the connection to the master at {self.master_addr}: {why}")
        if self._resume_source is None or self._stop.is_set() or self._closing:
            self._fail(err)
            return
        if not self._mailbox.lose():
            return
        # A master that said it is stopping is expected to be gone (the end of a torchrun
        # job, whose rank 0 stops its master as the others finish; an operator's
        # restart): reconnect.reconnect warns only if it stays away.
        log.log(logging.DEBUG if self._master_stopping else logging.WARNING,
                "pccl: %s; collectives go on, membership changes wait; reconnecting for up "
                "to %g s", err, self._reconnect_s)
        self._reconnector = threading.Thread(target=self._reconnect_loop, args=(why,),
                                             daemon=True,
                                             name=f"pccl-master-reconnect-{self._peer_id}")
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
            self._links += 1
        old.close()
        if self._stop.is_set():         # closed meanwhile: stop() saw the old link
            back.link.close()
            return
        for msg in back.rest:
            self._dispatch(msg)
        self._master_stopping = False
        self._mailbox.restore()
        self._reader = self._new_reader()
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
