"""The sealed master connection (torch_pccl/control/seal.py, control/auth.py's mode binding,
master/server.py, elastic/master_link.py): the documented construction is what the code
does; a record altered, dropped, replayed or reordered fails on the side that receives it;
nothing after the handshake is readable on the wire; a flipped ``encrypt`` flag fails the
proofs; a peer with ``PCCL_ENCRYPT=0`` still joins, and the master warns. Masters run in
threads of this process, behind a relay thread that can record and change the bytes;
every wait is bounded."""

import hashlib
import hmac
import json
import socket
import threading
import time

import pytest
from harness.master_log import MasterWarnings
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from torch_pccl.control import auth, protocol, seal
from torch_pccl.elastic.master_client import MasterClient
from torch_pccl.elastic.master_link import MasterLink
from torch_pccl.errors import (
    AuthenticationError,
    GroupReplacedError,
    IntegrityError,
    PeerLostError,
)
from torch_pccl.master.server import start_in_thread

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0
SECRET = b"correct horse battery staple 42"
FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, handshake_timeout_s=2.0)
PEER_NONCE = "11" * 32
MASTER_NONCE = "22" * 32
PEER_ID = "sealed-peer-7"
DATA_ADDR = "127.0.0.1:40007"


# ---------------------------------------------------------------------------
# the records alone


def _pair(peer_nonce=PEER_NONCE, master_nonce=MASTER_NONCE):
    """(the peer's sealer, the master's opener) of one connection."""
    send, _ = seal.record_keys(SECRET, peer_nonce, master_nonce, "peer")
    _, receive = seal.record_keys(SECRET, peer_nonce, master_nonce, "master")
    return seal.Sealer(send), seal.Opener(receive, protocol.TO_MASTER, "the peer at 10.0.0.9:5")


def _heartbeat(step):
    return protocol.encode({"type": "heartbeat", "report": {"step": step}})


def _records(sealer, n):
    return [sealer.seal_frame(_heartbeat(i)) for i in range(n)]


def test_records_round_trip_in_order_and_byte_by_byte():
    sealer, opener = _pair()
    frames = [_heartbeat(i) for i in range(5)]
    big = protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                           "version": protocol.VERSION, "peer_id": "p", "data_addr": DATA_ADDR,
                           "meta": {"pad": "x" * (protocol.MAX_MESSAGE_BYTES - 120)}})
    frames.append(big)
    stream = b"".join(sealer.seal_frame(f) for f in frames)
    got = []
    for i in range(len(stream)):            # one byte at a time: framing is the opener's
        got += opener.feed(stream[i:i + 1])
    assert got == [protocol.decode_payload(f[protocol.HEADER_BYTES:]) for f in frames]
    assert opener.buffered == 0
    # A record is its length, then the ciphertext and the tag: 16 bytes longer than the frame.
    assert len(stream) == sum(len(f) + seal.TAG_BYTES for f in frames)
    with pytest.raises(ValueError):
        sealer.seal(b"x" * (protocol.MAX_MESSAGE_BYTES + 1))


@pytest.mark.parametrize("where", ["ciphertext first byte", "ciphertext last byte",
                                   "tag first byte", "tag last byte"])
def test_a_flipped_bit_in_the_body_fails_and_the_stream_stays_dead(where):
    sealer, opener = _pair()
    r0, r1, r2 = _records(sealer, 3)
    h, tag = protocol.HEADER_BYTES, seal.TAG_BYTES
    at = {"ciphertext first byte": h, "ciphertext last byte": len(r1) - tag - 1,
          "tag first byte": len(r1) - tag, "tag last byte": len(r1) - 1}[where]
    bad = bytearray(r1)
    bad[at] ^= 0x10
    assert opener.feed(r0) == [protocol.decode_payload(_heartbeat(0)[h:])]
    with pytest.raises(IntegrityError, match=r"record 1 from the peer at 10\.0\.0\.9:5 failed"):
        opener.feed(bytes(bad))
    with pytest.raises(IntegrityError):     # sticky: a good record after it is not read
        opener.feed(r2)


@pytest.mark.parametrize("bit", range(32))
def test_a_flipped_bit_in_the_length_fails(bit):
    """The length is the associated data: a changed one either breaks the bound at once or
    misaligns the records so that a tag fails (given the bytes that follow)."""
    sealer, opener = _pair()
    pad = {"type": "hello", "magic": protocol.MAGIC, "version": protocol.VERSION,
           "peer_id": "p", "data_addr": DATA_ADDR, "meta": {"pad": "y" * 4000}}
    records = [sealer.seal_frame(protocol.encode(pad)) for _ in range(20)]
    bad = bytearray(records[0])
    bad[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(IntegrityError, match="the peer at 10.0.0.9:5"):
        opener.feed(bytes(bad) + b"".join(records[1:]))


@pytest.mark.parametrize("order", ["dropped", "replayed", "swapped"])
def test_a_dropped_replayed_or_reordered_record_fails(order):
    sealer, opener = _pair()
    r0, r1, r2 = _records(sealer, 3)
    stream = {"dropped": [r0, r2], "replayed": [r0, r1, r1], "swapped": [r0, r2, r1]}[order]
    got = []
    with pytest.raises(IntegrityError, match="altered, dropped, replayed or reordered"):
        for record in stream:
            got += opener.feed(record)
    assert len(got) == {"dropped": 1, "replayed": 2, "swapped": 1}[order]


def test_a_plain_frame_where_a_record_is_due_fails():
    _, opener = _pair()
    with pytest.raises(IntegrityError):
        opener.feed(_heartbeat(0) + _heartbeat(1))
    _, opener = _pair()
    with pytest.raises(IntegrityError, match=r"announces 1 bytes, outside 17 \.\. 65552"):
        opener.feed(b"\x01\x00\x00\x00{")


def test_keys_differ_per_direction_and_per_connection_and_mirror_between_sides():
    p_send, p_recv = seal.record_keys(SECRET, PEER_NONCE, MASTER_NONCE, "peer")
    m_send, m_recv = seal.record_keys(SECRET, PEER_NONCE, MASTER_NONCE, "master")
    assert (p_send, p_recv) == (m_recv, m_send)
    assert p_send.key != p_recv.key and p_send.iv != p_recv.iv
    assert len(p_send.key) == 32 and len(p_send.iv) == 12
    others = [seal.record_keys(SECRET, "33" * 32, MASTER_NONCE, "peer"),
              seal.record_keys(SECRET, PEER_NONCE, "33" * 32, "peer"),
              seal.record_keys(b"another secret, also long enough", PEER_NONCE, MASTER_NONCE,
                               "peer")]
    keys = {k.key for pair in others for k in pair} | {p_send.key, p_recv.key}
    assert len(keys) == 8
    # A record sealed for one direction does not open as the other's.
    opener = seal.Opener(p_recv, protocol.TO_MASTER, "x")
    with pytest.raises(IntegrityError):
        opener.feed(seal.Sealer(p_send).seal_frame(_heartbeat(0)))
    with pytest.raises(ValueError):
        seal.record_keys(SECRET, PEER_NONCE, MASTER_NONCE, "relay")


def test_the_documented_construction_is_what_the_code_does():
    """docs/security.md's words, computed here with pyca/cryptography directly: HKDF-SHA256
    (RFC 5869) over the secret, salt = both nonces, the info label, 88 bytes split
    key/IV/key/IV; AES-256-GCM with TLS 1.3's nonce (RFC 8446 5.3) and the length as AAD."""
    okm = HKDF(algorithm=hashes.SHA256(), length=88,
               salt=bytes.fromhex(PEER_NONCE) + bytes.fromhex(MASTER_NONCE),
               info=b"pccl-master v1 record keys").derive(SECRET)
    to_master_key, to_master_iv = okm[0:32], okm[32:44]
    to_peer_key, to_peer_iv = okm[44:76], okm[76:88]
    send, receive = seal.record_keys(SECRET, PEER_NONCE, MASTER_NONCE, "peer")
    assert (send.key, send.iv, receive.key, receive.iv) == \
        (to_master_key, to_master_iv, to_peer_key, to_peer_iv)

    sealer = seal.Sealer(seal.record_keys(SECRET, PEER_NONCE, MASTER_NONCE, "master")[0])
    for seq in range(3):
        frame = _heartbeat(seq)
        record = sealer.seal_frame(frame)
        header, body = record[:4], record[4:]
        assert int.from_bytes(header, "little") == len(body) == len(frame) - 4 + 16
        padded = seq.to_bytes(8, "big").rjust(12, b"\0")
        nonce = bytes(a ^ b for a, b in zip(to_peer_iv, padded))
        assert AESGCM(to_peer_key).decrypt(nonce, body, header) == frame[4:]


def test_the_proofs_bind_the_mode_and_keep_the_plain_bytes():
    """encrypt false: today's HMAC message; true: the same with NUL "aes-256-gcm" appended."""
    pn, mn = PEER_NONCE, MASTER_NONCE
    for label, prove in ((b"pccl-master v1 peer proof", auth.peer_proof),
                         (b"pccl-master v1 master proof", auth.master_proof)):
        plain = label + b"\0" + pn.encode() + b"\0" + mn.encode()
        assert prove(SECRET, pn, mn) == prove(SECRET, pn, mn, encrypt=False) == \
            hmac.new(SECRET, plain, hashlib.sha256).hexdigest()
        assert prove(SECRET, pn, mn, encrypt=True) == \
            hmac.new(SECRET, plain + b"\0aes-256-gcm", hashlib.sha256).hexdigest()


def test_the_decoder_hands_over_what_follows_the_last_plain_message():
    """auth_proof and the first sealed record in one read: the decoder stops at the proof."""
    sealer, opener = _pair()
    proof = protocol.encode({"type": "auth_proof", "proof": "ab" * 32})
    hello = protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                             "version": protocol.VERSION, "peer_id": "p",
                             "data_addr": DATA_ADDR})
    first = sealer.seal_frame(hello)
    decoder = protocol.Decoder(protocol.TO_MASTER)
    decoder.push(proof + first[:10])
    assert decoder.pop()["type"] == "auth_proof"
    assert decoder.pop() is None and decoder.buffered == 10
    assert decoder.take_rest() == first[:10] and decoder.buffered == 0
    opener.push(first[:10])
    assert opener.pop() is None
    assert opener.feed(first[10:]) == [protocol.decode_payload(hello[4:], protocol.TO_MASTER)]


# ---------------------------------------------------------------------------
# a real master and a real peer behind a relay


def _flip(frame):
    bad = bytearray(frame)
    bad[protocol.HEADER_BYTES] ^= 0x01       # the first byte of the ciphertext
    return bytes(bad)


class Relay:
    """A TCP relay between peers and the master that splits each direction into frames
    (plain or sealed: both start with the 4-byte length) and records them as they came.
    ``actions[(direction, index)]`` changes frame ``index`` of the first connection's
    ``"up"`` (peer -> master) or ``"down"`` direction: ``"flip"`` (one ciphertext bit),
    ``"drop"``, ``"replay"`` (sent twice), ``"swap"`` (sent after the next one), or a
    function of the frame returning its replacement; ``arm(direction, action)`` does it to
    the next frame of that direction."""

    def __init__(self, master_port, actions=None):
        self.master_port = master_port
        self.actions = dict(actions or {})
        self.frames = {}                    # (connection, direction) -> frames as they came
        self.master_side = []               # per connection: its "host:port" at the master
        self._cond = threading.Condition()
        self._socks = []
        self._threads = []
        self._held = {}
        self._armed = {}
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._spawn(self._accept_loop)

    def _spawn(self, target, *args):
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self):
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return                      # closed
            up = socket.create_connection(("127.0.0.1", self.master_port), timeout=WAIT_S)
            up.settimeout(None)
            with self._cond:
                conn = len(self.master_side)
                self.master_side.append("127.0.0.1:%d" % up.getsockname()[1])
                self._socks += [down, up]
            self._spawn(self._pump, conn, "up", down, up)
            self._spawn(self._pump, conn, "down", up, down)

    def arm(self, direction, action):
        """Applies ``action`` to the next frame of ``direction`` on the first connection."""
        with self._cond:
            self._armed[direction] = action

    def _out(self, conn, direction, index, frame):
        action = self.actions.get((direction, index)) if conn == 0 else None
        if conn == 0 and action is None:
            with self._cond:
                action = self._armed.pop(direction, None)
        if (direction, index - 1) in self._held:
            return [frame, self._held.pop((direction, index - 1))]
        if action is None:
            return [frame]
        if action == "flip":
            return [_flip(frame)]
        if action == "drop":
            return []
        if action == "replay":
            return [frame, frame]
        if action == "swap":
            self._held[(direction, index)] = frame
            return []
        return [action(frame)]

    def _pump(self, conn, direction, src, dst):
        buf = bytearray()
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    dst.sendall(bytes(buf))
                    break
                buf += data
                while len(buf) >= 4:
                    n = 4 + int.from_bytes(buf[:4], "little")
                    if len(buf) < n:
                        break
                    frame = bytes(buf[:n])
                    del buf[:n]
                    with self._cond:
                        got = self.frames.setdefault((conn, direction), [])
                        index = len(got)
                        got.append(frame)
                        self._cond.notify_all()
                    for out in self._out(conn, direction, index, frame):
                        dst.sendall(out)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wait_frames(self, direction, n, conn=0):
        """The first ``n`` frames of that direction, once they came (AssertionError after
        ``WAIT_S``)."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: len(self.frames.get((conn, direction), ())) >= n, WAIT_S)
            assert ok, f"fewer than {n} frames {direction} within {WAIT_S} s"
            return list(self.frames[(conn, direction)][:n])

    def close(self):
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._cond:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(WAIT_S)


@pytest.fixture
def master():
    m = start_in_thread("127.0.0.1", 0, world_size=0, secret=SECRET, **FAST)
    yield m
    m.stop()


@pytest.fixture
def relays(master):
    made = []

    def make(actions=None):
        made.append(Relay(master.port, actions))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _client(relay, secret=SECRET, encrypt=None):
    return MasterClient(relay.address, DATA_ADDR, peer_id=PEER_ID, timeout_s=WAIT_S,
                        secret=secret, encrypt=encrypt)


def _member(relay):
    """A client admitted alone (epoch 1) that re-registers with what it was assigned."""
    c = _client(relay)
    a = c.wait_assignment(WAIT_S)
    c.set_resume_source(lambda: {"epoch": a.epoch, "comm_id": a.comm_id, "rank": a.rank,
                                 "peer_ids": list(a.peer_ids), "addrs": list(a.addrs),
                                 "revision": -1, "last_key": [-1, -1]})
    return c


@pytest.mark.parametrize("mode", ["sealed", "PCCL_ENCRYPT=0", "no secret"])
def test_nothing_after_the_handshake_is_readable_on_the_wire(mode, monkeypatch):
    """A passive capture: with encryption, no message after auth_proof (up) or the
    challenge (down) shows a word of its JSON; with PCCL_ENCRYPT=0 they all do, the peer
    works, and the master warns once naming its address and id; without a secret, as
    before (no auth, no warning)."""
    secret = b"" if mode == "no secret" else SECRET
    if mode == "PCCL_ENCRYPT=0":
        monkeypatch.setenv("PCCL_ENCRYPT", "0")
    else:
        monkeypatch.delenv("PCCL_ENCRYPT", raising=False)
    m = start_in_thread("127.0.0.1", 0, world_size=0, secret=secret, **FAST)
    relay = Relay(m.port)
    try:
        with MasterWarnings("without encryption") as plain_warnings:
            c = _client(relay, secret)
            try:
                assert c.sealed == (mode == "sealed")
                assert c.wait_assignment(WAIT_S).world_size == 1
                assert c.pending_count(WAIT_S) == 0
                handshake = 0 if mode == "no secret" else 2
                up = relay.wait_frames("up", handshake + 4)    # hello, pending, 2 heartbeats
                down = relay.wait_frames("down", handshake // 2 + 3)  # welcome, assign, count
            finally:
                c.close()
        if mode != "no secret":
            sent_auth = json.loads(up[0][4:])
            assert sent_auth["type"] == "auth" and sent_auth["encrypt"] == (mode == "sealed")
            assert json.loads(up[1][4:])["type"] == "auth_proof"
            assert json.loads(down[0][4:])["type"] == "challenge"
        after = b"".join(up[handshake:]) + b"".join(down[handshake // 2:])
        words = [PEER_ID.encode(), b'"hello"', b"heartbeat", b"welcome", b"assign",
                 b"pending", b"40007", b"pccl-master", b'"type"']
        if mode == "sealed":
            assert [w for w in words if w in after] == []
            assert plain_warnings.lines == []
        else:
            assert [w for w in words if w not in after] == []
            assert all(f[4:5] == b"{" for f in up + down)       # every frame plain JSON
        if mode == "PCCL_ENCRYPT=0":
            assert len(plain_warnings.lines) == 1
            line = plain_warnings.lines[0]
            assert relay.master_side[0] in line and PEER_ID in line and "in the clear" in line
        elif mode == "no secret":
            assert plain_warnings.lines == []
    finally:
        relay.close()
        m.stop()


@pytest.mark.parametrize("action", ["flip", "drop", "replay", "swap"])
def test_a_changed_record_toward_the_master_drops_that_connection(master, relays, action):
    """Heartbeats are frames 3, 4, ... up (auth, auth_proof, hello first). The master logs
    an integrity warning naming the connection's address and closes it; the peer (no
    member that reconnects) then fails with PeerLostError as for a lost master."""
    relay = relays({("up", 3): action})
    with MasterWarnings("integrity error") as integrity:
        c = _client(relay)
        try:
            c.wait_assignment(WAIT_S)
            started = time.monotonic()
            assert integrity.seen.wait(WAIT_S), "the master logged no integrity error"
            line = integrity.lines[0]
            assert relay.master_side[0] in line and "failed its AES-256-GCM check" in line
            with pytest.raises(PeerLostError, match="lost the connection to the master"):
                c.pending_count(WAIT_S)
            assert time.monotonic() - started < WAIT_S
            assert PEER_ID not in [p["peer_id"] for p in master.snapshot()["peers"]]
        finally:
            c.close()


def test_a_member_dropped_for_a_changed_record_is_refused_like_any_dropped_member(master,
                                                                                  relays):
    """As for a connection the master lost: the master drops the member, and the group
    (here itself alone) went on without it, so its re-registration is refused for good."""
    relay = relays()
    with MasterWarnings("integrity error") as integrity:
        c = _member(relay)
        try:
            relay.arm("up", "flip")                 # the next heartbeat
            assert integrity.seen.wait(WAIT_S), "the master logged no integrity error"
            with pytest.raises(GroupReplacedError, match="the group is at epoch 1 without it"):
                c.pending_count(WAIT_S)
        finally:
            c.close()


@pytest.mark.parametrize("action", ["flip", "drop", "replay", "swap"])
def test_a_changed_record_toward_the_peer_raises_integrity_error_from_the_link(master, relays,
                                                                            action):
    """Down: challenge (plain), then welcome and assign, the first two sealed records."""
    relay = relays({("down", 1): action})
    deadline = time.monotonic() + WAIT_S
    link = MasterLink("127.0.0.1", relay.port, relay.address, SECRET, deadline, encrypt=True)
    try:
        assert link.sealed
        link.send(protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                                   "version": protocol.VERSION, "peer_id": PEER_ID,
                                   "data_addr": DATA_ADDR}))
        got = []
        with pytest.raises(IntegrityError, match=f"from the master at {relay.address}"):
            while time.monotonic() < deadline:
                msgs = link.recv()
                assert msgs is not None, "the master closed the connection"
                got += msgs
        assert [m["type"] for m in got] in ([], ["welcome"])
    finally:
        link.close()


def test_a_changed_record_toward_a_client_fails_it_with_integrity_error(master, relays):
    """A MasterClient (no member that reconnects) fails sticky with IntegrityError. Down:
    challenge, welcome, assign, then the pending_count answer (frame 3)."""
    relay = relays({("down", 3): "flip"})
    c = _client(relay)
    try:
        c.wait_assignment(WAIT_S)
        started = time.monotonic()
        with pytest.raises(IntegrityError, match=f"record 2 from the master at {relay.address}"):
            c.pending_count(WAIT_S)
        assert time.monotonic() - started < WAIT_S
        assert isinstance(c.failure, IntegrityError)
        with pytest.raises(IntegrityError):
            c.pending_count(WAIT_S)
    finally:
        c.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed->plain", "plain->sealed"])
def test_a_flipped_encrypt_flag_fails_the_proofs(master, relays, encrypt):
    """A man in the middle rewrites the auth's flag: the master's proof covers the mode it
    read, the peer checks it against the mode it asked for, and refuses the master."""
    def rewrite(frame):
        msg = json.loads(frame[4:])
        msg["encrypt"] = not msg["encrypt"]
        return protocol.encode(msg)

    relay = relays({("up", 0): rewrite})
    with pytest.raises(AuthenticationError, match="could not prove this peer's shared secret"):
        _client(relay, encrypt=encrypt)
    assert [p for p in master.snapshot()["peers"] if p["peer_id"]] == []


def test_a_member_reconnects_with_fresh_keys_after_a_changed_record_toward_it(master, relays):
    """A member treats it as a lost connection: it reconnects (through the relay again,
    sealed, with new nonces and so new keys), re-registers, and its request is answered."""
    relay = relays({("down", 3): "flip"})
    c = _member(relay)
    try:
        assert c.pending_count(WAIT_S) == 0        # sent again on the new connection
        assert c.failure is None and c.sealed and len(relay.master_side) == 2
        first, second = relay.wait_frames("up", 1, 0)[0], relay.wait_frames("up", 1, 1)[0]
        assert json.loads(first[4:])["nonce"] != json.loads(second[4:])["nonce"]
        assert [p["peer_id"] for p in master.snapshot()["peers"]] == [PEER_ID]
    finally:
        c.close()
