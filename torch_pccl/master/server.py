"""The master's asyncio TCP server around ``MembershipState``.

The server moves bytes and reads the clock; every decision is the state
machine's. One event loop, per connection a reader task (the connection
handler) and a writer task, plus one ticker task enforcing deadlines.

Nothing here waits on one peer without a deadline:
- the first message (hello) must arrive within ``handshake_timeout_s``, and
  later a message at least every ``heartbeat_timeout_s`` (both in state.py);
- outgoing messages go through a bounded per-connection queue drained by the
  writer task with ``send_timeout_s``; a peer whose queue fills up or that does
  not take its bytes in time is dropped, so a slow reader never delays others;
- a bad frame (garbage, oversize length, wrong magic or version, a frame cut
  short by EOF) is logged with the remote address and closes only that
  connection.

With a shared secret, a connection proves it first (control/auth.py); when the peer
asked for encryption, everything after its ``auth_proof`` travels both ways as sealed
records (control/seal.py), and a record that fails its check is logged with the address
and closes that connection. A peer with the secret that did not ask is admitted with a
warning naming it (its control traffic is in the clear).

The master relays no tensor data: it hands out addresses, ranks and ids.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from .. import config
from ..control import auth, protocol, seal
from ..control.protocol import ProtocolError
from ..errors import IntegrityError
from . import run_file, status
from .state import MembershipState
from .status import StatusLog
from .thread import MasterThread

log = logging.getLogger("torch_pccl.master")

_READ_CHUNK = 65536


def _format_peername(peername) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)


def _loopback_only(host: str) -> bool:
    """Whether listening on ``host`` admits connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:          # another host name: assume it is reachable from elsewhere
        return False


class _Conn:
    """One control connection: its streams, outgoing queue and tasks."""

    def __init__(self, cid: int, addr: str, reader, writer, max_queued: int):
        self.cid = cid
        self.addr = addr
        self.reader = reader
        self.writer = writer
        self.queue: asyncio.Queue = asyncio.Queue(max_queued)
        self.closing = False
        self.reader_task: asyncio.Task | None = None
        self.writer_task: asyncio.Task | None = None
        self.authed = False                 # passed the shared-secret exchange
        self.peer_nonce: str | None = None  # set by its auth message
        self.nonce: str | None = None       # the master's challenge to it
        self.encrypt = False                # its auth asked for sealed records
        # Set when its auth_proof is accepted, if it asked for encryption: everything
        # sent is sealed from then on, and what it sends after the proof is opened.
        self.sealer: seal.Sealer | None = None
        self.opener: seal.Opener | None = None
        self.warned_plain = False           # the "in the clear" warning was logged


class MasterServer:
    """The membership master over TCP.

    Args:
        host: address to listen on ("0.0.0.0" for every IPv4 interface).
        port: TCP port; 0 picks a free one (read it from ``port`` after start).
        world_size: bootstrap size, see ``MembershipState`` (0 = form a group
            as soon as one peer is pending).
        heartbeat_interval_s: how often peers are told to send a message (seconds;
            None: ``config.heartbeat_interval_s()``, env ``PCCL_HEARTBEAT_INTERVAL``).
        heartbeat_timeout_s: a peer silent this long is dropped and the other
            members are told (seconds; None: ``config.heartbeat_timeout_s()``).
        round_timeout_s: members missing from an update round this long after
            it started are dropped (seconds).
        handshake_timeout_s: a new connection must send its hello within this.
        send_timeout_s: a peer that does not take queued bytes within this is
            dropped (seconds).
        max_queued_messages: per-connection outgoing queue bound (>= 4); a
            peer whose queue is full is dropped.
        tick_interval_s: how often deadlines are checked (seconds); defaults
            to half the heartbeat interval, at most 0.5 s. Deadlines fire at
            most this late.
        secret: the run's shared secret (bytes; None: ``config.secret()``, from
            ``PCCL_SECRET`` / ``PCCL_SECRET_FILE``; ``b""``: none even if set). With one,
            a connection must pass the challenge-response of ``control.auth`` before its
            hello is read; one that does not is refused and logged with its address.
            Past it, the connection is sealed (``control.seal``) when the peer asked for
            it; the master has no setting of its own for that, and the proofs bind the
            peer's choice.
        http_host, http_port: where to serve the status page, ``/api/status`` and
            ``/metrics`` (master/http.py) from this server's event loop; ``http_port``
            None (the default): no HTTP server; 0: a free port (read ``http_port`` after
            start). Loopback by default: the page names every peer's address. With a
            secret, every request must carry ``auth.status_token(secret)`` (``?token=``
            or ``Authorization: Bearer``).
        resume_grace_s: the resume grace window (seconds; see ``MembershipState``): 0
            (the default, for a master that starts with its run, as torchrun's rank 0
            does) forms a group from joiners at once; ``pccl-master`` passes
            ``config.resume_grace_s``. Not applied when ``state_file`` holds a record.
        state_file: a path where the run's record (epoch, roster, shared-state revision)
            is kept (master/run_file.py): read at ``start`` (a record there is adopted at
            once), rewritten atomically whenever it changes. None: no file.
        quiet_epochs: grant quiet epochs (``MembershipState``; docs/membership.md,
            "Quiet epochs"); off by default.

    Raises:
        ValueError: from ``MembershipState`` for inconsistent durations, or a
            malformed ``PCCL_HEARTBEAT_*`` variable; from ``start``, a state file that
            is not a valid record.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, world_size: int = 0,
                 heartbeat_interval_s: float | None = None,
                 heartbeat_timeout_s: float | None = None,
                 round_timeout_s: float = config.ROUND_TIMEOUT_S,
                 handshake_timeout_s: float = config.HANDSHAKE_TIMEOUT_S,
                 send_timeout_s: float = 5.0, max_queued_messages: int = 256,
                 tick_interval_s: float | None = None, secret: bytes | None = None,
                 http_host: str = "127.0.0.1", http_port: int | None = None,
                 resume_grace_s: float = 0.0, state_file: str | None = None,
                 quiet_epochs: bool = False):
        if heartbeat_interval_s is None:
            heartbeat_interval_s = config.heartbeat_interval_s()
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = config.heartbeat_timeout_s()
        self.state = MembershipState(world_size=world_size,
                                     heartbeat_interval_s=heartbeat_interval_s,
                                     heartbeat_timeout_s=heartbeat_timeout_s,
                                     round_timeout_s=round_timeout_s,
                                     handshake_timeout_s=handshake_timeout_s,
                                     resume_grace_s=resume_grace_s,
                                     quiet_epochs=quiet_epochs)
        self.state_file = state_file
        # One step may queue a few messages to one peer at once (welcome, then
        # assign), so the bound has a floor.
        if not send_timeout_s > 0 or max_queued_messages < 4:
            raise ValueError("send_timeout_s must be > 0 and max_queued_messages >= 4")
        self.host = host
        self.port = port
        self.send_timeout_s = float(send_timeout_s)
        self.max_queued_messages = int(max_queued_messages)
        self.tick_interval_s = float(tick_interval_s or min(0.5, heartbeat_interval_s / 2))
        self._server: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task | None = None
        self._conns: dict[int, _Conn] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        if secret is None:
            secret = config.secret()
        self._secret = bytes(secret) or None if secret is not None else None
        self.http_host = http_host
        self.http_port = http_port
        self._http = None               # the status page's aiohttp runner, when serving
        self.log = StatusLog()          # recent events and history for the status page

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (``[host]:port`` for IPv6)."""
        return _format_peername((self.host, self.port))

    def _now(self) -> float:
        return self._loop.time()

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Binds and starts serving; sets ``port``.

        Raises:
            OSError: the address cannot be bound (in use, no such interface).
            ValueError: the state file cannot be read or is not a valid record
                (run_file.load).
        """
        self._loop = asyncio.get_running_loop()
        try:
            record = run_file.load(self.state_file) if self.state_file else None
        except OSError as e:
            raise ValueError(f"cannot read the state file {self.state_file}: {e}") from None
        # Before any connection is served: the run is known, or the grace window opens.
        self._apply(self.state.start(self._now(), record))
        # asyncio sets TCP_NODELAY on TCP transports, so small control
        # messages are not held back by Nagle (PCCL's master lost ~50 ms so).
        self._server = await asyncio.start_server(self._handle, self.host, self.port,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.create_task(self._tick_loop())
        if self.http_port is not None:
            await self._start_http()
        log.info("pccl-master listening on %s (world_size %d, heartbeat %g/%g s, round %g s, "
                 "%s)", self.address, self.state.world_size, self.state.heartbeat_interval_s,
                 self.state.heartbeat_timeout_s, self.state.round_timeout_s,
                 "shared secret required" if self._secret else "no authentication")
        if self._secret is None and not _loopback_only(self.host):
            log.warning("pccl-master listens on %s without a shared secret: anyone who can "
                        "reach this port can join the run, read its state and send it "
                        "updates; set PCCL_SECRET or PCCL_SECRET_FILE (or --secret-file) on "
                        "the master and every peer (docs/security.md)", self.address)

    async def _start_http(self) -> None:
        # Imported here: aiohttp is needed only by a master that serves the page.
        from . import http

        token = auth.status_token(self._secret) if self._secret else None
        self._http, self.http_port = await http.start(self, self.http_host, self.http_port,
                                                      token)
        where = _format_peername((self.http_host, self.http_port))
        log.info("pccl-master status page on http://%s/%s (JSON /api/status, Prometheus "
                 "/metrics)", where, f"?token={token}" if token else "")
        if token is None and not _loopback_only(self.http_host):
            log.warning("the status page on %s is open to anyone who can reach it and "
                        "names every peer's address; set a shared secret to require a "
                        "token (docs/status-page.md)", where)

    def status(self) -> dict:
        """The status page's document (``master.status.build``; call on the server's loop)."""
        return status.build(self.state.snapshot(), self._now(), self.log, self.address)

    async def stop(self) -> None:
        """Stops accepting, tells every peer the master is shutting down, closes all."""
        if self._server is None:
            return
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        self._server.close()
        self._ticker.cancel()
        for c in list(self._conns.values()):
            self._send(c, {"type": "error", "fatal": True, "stopping": True,
                           "message": "master is shutting down"})
            self._close(c)
        tasks = [c.reader_task for c in self._conns.values() if c.reader_task is not None]
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=self.send_timeout_s + 1.0)
            for t in stuck:
                t.cancel()
            if stuck:
                await asyncio.wait(stuck, timeout=1.0)
        await asyncio.gather(self._ticker, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        log.info("pccl-master on %s stopped", self.address)

    def snapshot(self) -> dict:
        """The state machine's snapshot (call on the server's loop)."""
        return self.state.snapshot()

    def start_in_thread(self, timeout_s: float = 10.0) -> MasterThread:
        """Runs this (not yet started) server on its own event loop in a daemon thread.

        For a process of the job hosting the master. Returns once listening.

        Raises:
            OSError: the address cannot be bound.
            TimeoutError: the server did not start within ``timeout_s`` seconds.
        """
        return MasterThread(self, timeout_s)

    # -- the ticker ----------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            # A periodic timer, not synchronisation: deadlines fire at most
            # tick_interval_s late.
            await asyncio.sleep(self.tick_interval_s)
            try:
                self._apply(self.state.tick(self._now()))
                self.log.sample(self.state.snapshot)
            except Exception:   # a bug must not stop every deadline for good
                log.exception("pccl-master: tick failed")

    # -- per connection ------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        addr = _format_peername(writer.get_extra_info("peername"))
        cid = self.state.connect(self._now(), addr)
        c = _Conn(cid, addr, reader, writer, self.max_queued_messages)
        c.reader_task = asyncio.current_task()
        c.writer_task = asyncio.create_task(self._write_loop(c))
        self._conns[cid] = c
        log.debug("connection %d from %s", cid, addr)
        try:
            await self._read_loop(c)
        except Exception:
            log.exception("%s: unexpected error; closing", addr)
            self._lost(c, "internal error")
        finally:
            try:
                await asyncio.wait_for(asyncio.shield(c.writer_task), self.send_timeout_s + 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                c.writer_task.cancel()
                writer.transport.abort()
            self._conns.pop(cid, None)

    async def _read_loop(self, c: _Conn) -> None:
        # A Decoder, then the connection's Opener from the message after an accepted
        # auth_proof that asked for encryption on (the bytes after it in the same read
        # included).
        reader = protocol.Decoder(protocol.TO_MASTER)
        while not c.closing:
            try:
                data = await c.reader.read(_READ_CHUNK)
            except (ConnectionError, OSError) as e:
                self._lost(c, f"read error: {e}")
                return
            if c.closing:
                return
            if not data:
                if reader.buffered:
                    log.warning("%s: connection closed inside a frame (%d bytes buffered)",
                                c.addr, reader.buffered)
                    self._lost(c, "truncated frame at EOF")
                else:
                    self._lost(c, "connection closed")
                return
            try:
                reader.push(data)
                while not c.closing and (msg := reader.pop()) is not None:
                    if self._admitted(c, msg):
                        self._apply(self.state.receive(c.cid, msg, self._now()))
                    if c.opener is not None and reader is not c.opener:
                        c.opener.push(reader.take_rest())
                        reader = c.opener
            except IntegrityError as e:
                log.warning("%s: integrity error, closing the connection: %s", c.addr, e)
                self._lost(c, f"integrity error: {e}")
                return
            except ProtocolError as e:
                log.warning("%s: protocol error: %s; closing the connection", c.addr, e)
                self._send(c, {"type": "error", "fatal": True, "message": f"protocol error: {e}"})
                self._apply(self.state.disconnect(c.cid, self._now(), f"protocol error: {e}"))
                self._close(c)
                return

    def _admitted(self, c: _Conn, msg: dict) -> bool:
        """The shared-secret gate (``control.auth``): True when ``msg`` may go to the state
        machine; runs the challenge-response for the messages before it (and sets up the
        connection's seal when the peer asked for it), and refuses the connection when that
        fails."""
        kind = msg["type"]
        if self._secret is None:
            if kind in ("auth", "auth_proof"):
                self._refuse(c, "this master has no shared secret, and the peer has one "
                                "(set the same PCCL_SECRET on both, or on neither)")
                return False
            return True
        if c.authed:
            if kind in ("auth", "auth_proof"):
                self._refuse(c, f"{kind} sent again after authenticating")
                return False
            if kind == "hello" and c.sealer is None and not c.warned_plain:
                c.warned_plain = True
                log.warning("%s (peer %s) joined a run with a shared secret without "
                            "encryption (PCCL_ENCRYPT=0 on it, or an older release): its "
                            "control traffic is in the clear (docs/security.md)",
                            c.addr, msg["peer_id"])
            return True
        if kind == "auth" and c.nonce is None:
            c.peer_nonce, c.nonce, c.encrypt = msg["nonce"], auth.new_nonce(), msg["encrypt"]
            self._send(c, {"type": "challenge", "nonce": c.nonce,
                           "proof": auth.master_proof(self._secret, c.peer_nonce, c.nonce,
                                                      encrypt=c.encrypt)})
            return False
        if kind == "auth_proof" and c.nonce is not None:
            if auth.same(msg["proof"], auth.peer_proof(self._secret, c.peer_nonce, c.nonce,
                                                       encrypt=c.encrypt)):
                c.authed = True
                if c.encrypt:
                    send, receive = seal.record_keys(self._secret, c.peer_nonce, c.nonce,
                                                     "master")
                    c.sealer = seal.Sealer(send)
                    c.opener = seal.Opener(receive, protocol.TO_MASTER, f"the peer at {c.addr}")
                return False
            self._refuse(c, "wrong shared secret (its proof does not match)")
            return False
        self._refuse(c, f"it sent {kind} without authenticating, and this master requires "
                        f"the shared secret (PCCL_SECRET or PCCL_SECRET_FILE)")
        return False

    def _refuse(self, c: _Conn, reason: str) -> None:
        """Closes a connection that failed authentication, telling it why; logs its address."""
        log.warning("%s: refused: %s", c.addr, reason)
        self._send(c, {"type": "error", "fatal": True, "auth": True,
                       "message": f"authentication failed: {reason}"})
        self._apply(self.state.disconnect(c.cid, self._now(), "failed authentication"))
        self._close(c)

    async def _write_loop(self, c: _Conn) -> None:
        w = c.writer
        try:
            while True:
                data = await c.queue.get()
                if data is None:
                    break
                w.write(data)
                await asyncio.wait_for(w.drain(), self.send_timeout_s)
            # Closing: flush what is queued (e.g. a fatal error), then close,
            # but never wait on the peer longer than send_timeout_s.
            await asyncio.wait_for(w.drain(), self.send_timeout_s)
            w.close()
            await asyncio.wait_for(w.wait_closed(), self.send_timeout_s)
        except asyncio.TimeoutError:
            log.warning("%s: did not take its messages within %g s; dropping",
                        c.addr, self.send_timeout_s)
            self._lost(c, "send timeout")
            w.transport.abort()
        except (ConnectionError, OSError) as e:
            self._lost(c, f"write error: {e}")
            w.transport.abort()

    # -- applying the state machine's actions --------------------------------

    def _apply(self, act) -> None:
        for line in act.events:
            log.info("%s", line)
            self.log.event(line)
        if act.persist and self.state_file:
            self._save()
        for cid, msg in act.sends:
            c = self._conns.get(cid)
            if c is not None:
                self._send(c, msg)
        for cid in act.closes:
            c = self._conns.get(cid)
            if c is not None:
                self._close(c)

    def _save(self) -> None:
        """Writes the run's record before the messages announcing it go out, so the file
        is never behind what a member was told (at most one epoch ahead: run_file)."""
        record = self.state.run_record()
        if record is None:
            return
        try:
            run_file.save(self.state_file, record)
        except OSError as e:
            # The run goes on; a restart without a current file falls back on the
            # members' re-registrations (MembershipState._adoptable).
            log.error("cannot write the state file %s: %s", self.state_file, e)

    def _send(self, c: _Conn, msg: dict) -> None:
        if c.closing:
            return
        frame = protocol.encode(msg)
        if c.sealer is not None:
            frame = c.sealer.seal_frame(frame)
        try:
            c.queue.put_nowait(frame)
        except asyncio.QueueFull:
            log.warning("%s: %d messages queued and unsent; dropping",
                        c.addr, self.max_queued_messages)
            self._lost(c, "outgoing queue full", flush=False)

    def _lost(self, c: _Conn, reason: str, flush: bool = True) -> None:
        """The connection failed (EOF, I/O error, too slow): drop its peer, close it."""
        if c.closing:
            return
        if self._secret is not None and not c.authed:
            log.warning("%s: refused: %s before proving the shared secret (%s)", c.addr,
                        reason, "it may hold another secret" if c.nonce is not None
                        else "it did not authenticate")
        self._close(c, flush)
        self._apply(self.state.disconnect(c.cid, self._now(), reason))

    def _close(self, c: _Conn, flush: bool = True) -> None:
        """Closes after queued messages are flushed (``flush``) or at once."""
        if c.closing:
            return
        c.closing = True
        if flush:
            try:
                c.queue.put_nowait(None)     # the writer flushes, then closes
                return
            except asyncio.QueueFull:
                pass
        c.writer.transport.abort()
        if c.writer_task is not None and c.writer_task is not asyncio.current_task():
            c.writer_task.cancel()


def start_in_thread(host: str = "127.0.0.1", port: int = 0, **kwargs) -> MasterThread:
    """Starts a ``MasterServer(host, port, **kwargs)`` in a background thread.

    Returns a ``MasterThread`` with ``.port`` and ``.stop()``.

    Raises:
        OSError: the address cannot be bound.
        ValueError: inconsistent options (see ``MembershipState``).
    """
    return MasterServer(host, port, **kwargs).start_in_thread()
