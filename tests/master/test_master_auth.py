"""The master's shared-secret challenge-response (torch_pccl/control/auth.py, master/server.py,
elastic/master_client.py): right secret in, everything else out, and a recorded handshake
cannot be replayed. Every wait is bounded."""

import logging
import socket

import pytest
from harness.master_log import MasterWarnings

from torch_pccl.elastic.master_client import MasterClient
from torch_pccl.errors import AuthenticationError
from torch_pccl.control import auth, protocol
from torch_pccl.master.server import MasterServer, start_in_thread

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0
SECRET = b"correct horse battery staple 42"
FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, handshake_timeout_s=2.0)


@pytest.fixture
def master():
    m = start_in_thread("127.0.0.1", 0, world_size=0, secret=SECRET, **FAST)
    yield m
    m.stop()


def _client(m, secret, peer_id="p"):
    return MasterClient(m.address, "127.0.0.1:40000", peer_id=peer_id, timeout_s=WAIT_S,
                        secret=secret)


def _recv(sock, decoder):
    msgs = []
    while not msgs:
        data = sock.recv(65536)
        if not data:
            return None                      # the master closed the connection
        msgs = decoder.feed(data)
    return msgs[0]


def test_the_right_secret_joins_and_is_admitted(master):
    c = _client(master, SECRET)
    try:
        assert c.wait_assignment(WAIT_S).world_size == 1
        assert [p["peer_id"] for p in master.snapshot()["peers"]] == ["p"]
    finally:
        c.close()


@pytest.mark.parametrize("secret, says", [
    (b"", "requires the shared secret"),                      # no secret at all
    (b"not the secret, but long enough", "the secrets differ"),
])
def test_a_stranger_is_refused_named_in_the_log_and_sees_no_state(master, secret, says):
    member = _client(master, SECRET, "member")
    try:
        member.wait_assignment(WAIT_S)
        with MasterWarnings("refused", "127.0.0.1:") as refusals:
            with pytest.raises(AuthenticationError, match=says):
                _client(master, secret, "stranger")
            # The refusal names the stranger's address; the group is untouched.
            assert refusals.seen.wait(WAIT_S), "the master logged no refusal"
        snap = master.snapshot()
        assert [p["peer_id"] for p in snap["peers"]] == ["member"] and snap["epoch"] == 1
        assert member.pending_count(WAIT_S) == 0 and member.failure is None
    finally:
        member.close()


def test_a_stranger_learns_nothing_before_it_proves_the_secret(master):
    """What a stranger gets for a hello, and for an auth it cannot complete: an error, and
    a challenge holding only nonces and a proof; never a welcome, an assign or an address."""
    member = _client(master, SECRET, "member")
    try:
        member.wait_assignment(WAIT_S)
        with socket.create_connection(("127.0.0.1", master.port), timeout=WAIT_S) as s:
            s.sendall(protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                                       "version": protocol.VERSION, "peer_id": "x",
                                       "data_addr": "127.0.0.1:9"}))
            d = protocol.Decoder(protocol.TO_PEER)
            msg = _recv(s, d)
            assert msg["type"] == "error" and msg["auth"] and msg["fatal"]
            assert _recv(s, d) is None
        with socket.create_connection(("127.0.0.1", master.port), timeout=WAIT_S) as s:
            s.sendall(protocol.encode({"type": "auth", "magic": protocol.MAGIC,
                                       "version": protocol.VERSION, "nonce": "0" * 64}))
            d = protocol.Decoder(protocol.TO_PEER)
            msg = _recv(s, d)
            assert msg["type"] == "challenge" and set(msg) == {"type", "nonce", "proof"}
            s.sendall(protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                                       "version": protocol.VERSION, "peer_id": "x",
                                       "data_addr": "127.0.0.1:9"}))
            msg = _recv(s, d)
            assert msg["type"] == "error" and msg["auth"]
            assert _recv(s, d) is None
    finally:
        member.close()


def test_a_replayed_handshake_is_refused(master):
    """Record a real peer's auth and proof byte for byte, replay them on a new connection:
    the master's new nonce makes the recorded proof wrong."""
    recorded = []
    with socket.create_connection(("127.0.0.1", master.port), timeout=WAIT_S) as s:
        nonce = auth.new_nonce()
        first = protocol.encode({"type": "auth", "magic": protocol.MAGIC,
                                 "version": protocol.VERSION, "nonce": nonce})
        s.sendall(first)
        d = protocol.Decoder(protocol.TO_PEER)
        challenge = _recv(s, d)
        proof = protocol.encode({"type": "auth_proof", "proof": auth.peer_proof(
            SECRET, nonce, challenge["nonce"])})
        hello = protocol.encode({"type": "hello", "magic": protocol.MAGIC,
                                 "version": protocol.VERSION, "peer_id": "real",
                                 "data_addr": "127.0.0.1:40001"})
        recorded = [first, proof, hello]
        for frame in recorded[1:]:
            s.sendall(frame)
        assert _recv(s, d)["type"] == "welcome"           # the original is let in
    with socket.create_connection(("127.0.0.1", master.port), timeout=WAIT_S) as s:
        d = protocol.Decoder(protocol.TO_PEER)
        s.sendall(recorded[0])
        replay_challenge = _recv(s, d)
        assert replay_challenge["nonce"] != challenge["nonce"]
        s.sendall(recorded[1] + recorded[2])
        msg = _recv(s, d)
        assert msg["type"] == "error" and msg["auth"] and "wrong shared secret" in msg["message"]
        assert _recv(s, d) is None
    assert "real" not in [p["peer_id"] for p in master.snapshot()["peers"]]


def test_a_peer_refuses_a_master_that_cannot_prove_the_secret():
    other = start_in_thread("127.0.0.1", 0, secret=b"the impostor's own secret", **FAST)
    try:
        with pytest.raises(AuthenticationError, match="could not prove this peer's shared secret"):
            MasterClient(other.address, "127.0.0.1:40000", peer_id="p", timeout_s=WAIT_S,
                         secret=SECRET)
        assert not [p for p in other.snapshot()["peers"] if p["peer_id"]]   # no hello read
    finally:
        other.stop()


def test_one_side_without_a_secret_is_a_clear_error():
    plain = start_in_thread("127.0.0.1", 0, secret=b"", **FAST)
    try:
        with pytest.raises(AuthenticationError, match="no shared secret"):
            MasterClient(plain.address, "127.0.0.1:40000", peer_id="p", timeout_s=WAIT_S,
                         secret=SECRET)
        c = MasterClient(plain.address, "127.0.0.1:40000", peer_id="q", timeout_s=WAIT_S,
                         secret=b"")
        c.close()       # without a secret on either side: as before
    finally:
        plain.stop()


def test_secret_from_the_environment_and_the_warning_without_one(monkeypatch, tmp_path,
                                                                  caplog):
    path = tmp_path / "secret"
    path.write_text(SECRET.decode() + "\n")
    monkeypatch.setenv("PCCL_SECRET_FILE", str(path))
    monkeypatch.delenv("PCCL_SECRET", raising=False)
    m = start_in_thread("127.0.0.1", 0, **FAST)       # the master reads the file
    try:
        c = MasterClient(m.address, "127.0.0.1:40000", peer_id="env", timeout_s=WAIT_S)
        c.close()
        monkeypatch.setenv("PCCL_SECRET", "short")
        with pytest.raises(ValueError, match="PCCL_SECRET: the shared secret must be"):
            MasterClient(m.address, "127.0.0.1:40000", peer_id="bad", timeout_s=WAIT_S)
    finally:
        m.stop()
    monkeypatch.delenv("PCCL_SECRET")
    monkeypatch.delenv("PCCL_SECRET_FILE")
    with caplog.at_level(logging.WARNING, logger="torch_pccl.master"):
        open_master = start_in_thread("0.0.0.0", 0, **FAST)
        open_master.stop()
        loopback = start_in_thread("127.0.0.1", 0, **FAST)
        loopback.stop()
    warnings = [r.getMessage() for r in caplog.records if "without a shared secret" in
                r.getMessage()]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0]


def test_cli_reads_the_secret_file(tmp_path):
    from torch_pccl.master.__main__ import _parser
    assert "--secret-file" in _parser().format_help()
    path = tmp_path / "s"
    path.write_text("too short\n")
    from torch_pccl.master.__main__ import main
    with pytest.raises(SystemExit):
        main(["--port", "0", "--secret-file", str(path)])
    assert MasterServer("127.0.0.1", 0, secret=SECRET)._secret == SECRET
