"""Data-plane authentication (native/src/auth.cpp, handshake.cpp; docs/security.md).

Ranks run as threads of this process on loopback, each with its own communicator, so the
secret is set per rank with ``Communicator.set_secret``. One test plays the connecting rank
by hand over a raw socket, computing the proofs with Python's ``hmac`` from the layout
docs/security.md gives: the native side and the documented scheme must agree, and the same
recorded bytes replayed to a fresh acceptor must be refused. Every wait is bounded.
"""

import hashlib
import hmac
import os
import socket
import struct
import threading

import pytest
import torch

from torch_pccl.core.communicator import Communicator
from torch_pccl.errors import AuthenticationError

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-the-run's-secret"
T = 5.0


def _run(secrets, world=3):
    """Connects ``world`` ranks (rank r with ``secrets[r]``, None: none) and all-reduces
    rank+1; returns per rank the result list or the exception."""
    comm_id = int.from_bytes(os.urandom(8), "little")
    comms = [Communicator(r, world, comm_id, "127.0.0.1", T) for r in range(world)]
    for c, s in zip(comms, secrets):
        c.set_secret(s or b"")          # b"": none, even with PCCL_SECRET in the environment
    addrs = [f"127.0.0.1:{c.port}" for c in comms]
    out = [None] * world

    def rank(r):
        try:
            comms[r].connect(addrs)
            t = torch.full((1000,), float(r + 1))
            comms[r].all_reduce(t)
            out[r] = t
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * T)
    for c in comms:
        c.close()
    assert not any(t.is_alive() for t in threads), "a rank did not return"
    return out


def test_same_secret_everywhere_works_as_without_one():
    for secrets in ([None] * 3, [SECRET] * 3):
        out = _run(secrets)
        assert all(isinstance(t, torch.Tensor) and torch.equal(t, torch.full((1000,), 6.0))
                   for t in out), out


def test_a_wrong_secret_is_an_authentication_error_on_both_sides():
    out = _run([SECRET, SECRET, b"another secret, sixteen+ chars"])
    assert all(isinstance(e, AuthenticationError) for e in out), out
    # Rank 2 connects: it finds the acceptors' proofs wrong; they see it give up.
    assert "the secrets differ" in str(out[2])
    assert "secrets differ" in str(out[0]) and "rank 2" in str(out[0])


@pytest.mark.parametrize("who", [0, 2])
def test_a_secret_on_one_side_only_is_named(who):
    """Rank 0 accepts, rank 2 connects: each case says which side lacks the secret."""
    secrets = [SECRET] * 3
    secrets[who] = None
    out = _run(secrets)
    connector = out[2]
    assert isinstance(connector, AuthenticationError), out
    says = ("the peer has no shared secret and this rank has one" if who == 0
            else "the peer requires a shared secret and this rank has none")
    assert says in str(connector)
    # An acceptor never counts the refused link: it fails (its deadline), never succeeds.
    assert not isinstance(out[0], torch.Tensor)


# -- by hand: the documented layout, and a replay --------------------------------------


MAGIC, VERSION, KIND_AUTH = 0x4C434350, 1, 2


def _hello(comm_id, rank, world):
    return struct.pack("<IHHQIIHHHH", MAGIC, VERSION, KIND_AUTH, comm_id, rank, world,
                       0, 0, 1, 1)


def _proof(label, hello_c, hello_a, nonce_c, nonce_a):
    return hmac.new(SECRET, label + b"\0" + hello_c + hello_a + nonce_c + nonce_a,
                    hashlib.sha256).digest()


def _read(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the acceptor closed the connection"
        data += chunk
    return data


def _acceptor(comm_id):
    """Rank 0 of a world of 2 with SECRET, connecting in a thread; rank 1 is the test. Its
    links are authenticated, not encrypted: the records that follow the exchange on an
    encrypted link are tests/core/test_seal.py's."""
    comm = Communicator(0, 2, comm_id, "127.0.0.1", T)
    comm.set_secret(SECRET)
    comm.set_encryption(False)
    result = {}

    def run():
        try:
            comm.connect([f"127.0.0.1:{comm.port}", "127.0.0.1:9"])
            result["ok"] = True
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return comm, thread, result


def test_the_documented_exchange_is_accepted_and_its_replay_refused(capfd):
    comm_id = int.from_bytes(os.urandom(8), "little")
    hello_c, nonce_c = _hello(comm_id, 1, 2), os.urandom(32)

    comm, thread, result = _acceptor(comm_id)
    try:
        with socket.create_connection(("127.0.0.1", comm.port), timeout=T) as s:
            s.sendall(hello_c + nonce_c)
            reply = _read(s, 32 + 32 + 32)
            hello_a, nonce_a, proof_a = reply[:32], reply[32:64], reply[64:]
            # The acceptor's proof is what the documented formula gives.
            assert hmac.compare_digest(proof_a, _proof(b"pccl data-plane v1 accept", hello_c,
                                                       hello_a, nonce_c, nonce_a))
            proof_c = _proof(b"pccl data-plane v1 connect", hello_c, hello_a, nonce_c, nonce_a)
            s.sendall(proof_c)
            thread.join(2 * T)
            assert result == {"ok": True}, result
    finally:
        thread.join(2 * T)
        comm.close()

    # The same bytes to a new acceptor (same communicator id, as a replay would need):
    # its fresh nonce makes the recorded proof wrong.
    comm, thread, result = _acceptor(comm_id)
    try:
        with socket.create_connection(("127.0.0.1", comm.port), timeout=T) as s:
            s.sendall(hello_c + nonce_c)
            reply = _read(s, 96)
            assert reply[32:64] != nonce_a          # a fresh nonce
            s.sendall(proof_c)
            thread.join(2 * T)
    finally:
        thread.join(2 * T)
        comm.close()
    assert isinstance(result.get("error"), AuthenticationError), result
    assert "does not match" in str(result["error"])
    assert "refused rank 1 (127.0.0.1:" in capfd.readouterr().err


def test_a_stranger_that_does_not_authenticate_is_refused_and_named(capfd):
    comm_id = int.from_bytes(os.urandom(8), "little")
    comm, thread, result = _acceptor(comm_id)
    try:
        with socket.create_connection(("127.0.0.1", comm.port), timeout=T) as s:
            plain = struct.pack("<IHHQIIHHHH", MAGIC, VERSION, 1, comm_id, 1, 2, 0, 0, 1, 1)
            s.sendall(plain)
            answer = _read(s, 32)       # the acceptor's hello, so the peer can say why
            assert struct.unpack_from("<H", answer, 6)[0] == KIND_AUTH
            assert s.recv(1) == b""     # then the close: nothing else
        comm.abort()
        thread.join(2 * T)
    finally:
        thread.join(2 * T)
        comm.close()
    assert "ok" not in result
    err = capfd.readouterr().err
    assert "rejected a connection from 127.0.0.1:" in err and "did not authenticate" in err
