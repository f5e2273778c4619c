"""Encrypted data links (native/src/seal.cpp, handshake.cpp, sealed_link.cpp; docs/security.md).

Ranks run as threads of this process on loopback, each with its own communicator. A relay
(tests/harness/relay.py) sits in the one link of a world of 2, as a man in the middle who
knows the frame sizes: it records what passes, and flips a bit in a record, drops one,
swaps two, or sends an old one again. The receiving rank must fail the op promptly with
``IntegrityError`` naming the peer, the other rank must fail too, neither may return a
wrong result or a half-written tensor, and a new group must work afterwards. One test plays
rank 1 by hand with Python's ``cryptography`` from the construction docs/security.md gives:
the native side and the documented construction must agree. Every wait is bounded.
"""

import hashlib
import hmac
import os
import socket
import struct
import threading
import time

import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from harness.relay import DOWN, UP, Relay
from harness.threads import on_threads

from torch_pccl.core.communicator import Communicator
from torch_pccl.errors import AuthenticationError, IntegrityError, PcclError

pytestmark = pytest.mark.timeout(120)

SECRET = b"0123456789abcdef-the-run's-secret"
T = 5.0                 # seconds: every op's deadline
N = 1024                # float32 elements: a world-2 all-reduce sends N/2 per frame
PAYLOAD = N // 2 * 4 + 16   # a sealed payload record
HEADER = 56                 # a sealed frame header
# Rank 1 connects to rank 0 through the relay: UP is rank 1 -> rank 0. Its first records
# are the handshake (hello + nonce, then its proof); then per op two frames (the
# reduce-scatter's and the all-gather's), each a header record and a payload record.
HANDSHAKE = {UP: [64, 32], DOWN: [96]}
FRAMES = [HEADER, PAYLOAD] * 2 * 3      # three ops' worth


def _comms(encrypt=(True, True), comm_id=None):
    comm_id = comm_id or int.from_bytes(os.urandom(8), "little")
    comms = [Communicator(r, 2, comm_id, "127.0.0.1", T) for r in range(2)]
    for c, e in zip(comms, encrypt):
        c.set_secret(SECRET)
        c.set_encryption(e)
    return comms


def _run(comms, addrs, tensors, ops=1):
    """Connects both ranks to ``addrs`` and all-reduces ``tensors[r]`` ``ops`` times on
    threads; per rank ("ok", seconds) or (the exception, seconds into the failing op)."""
    out = [None, None]

    def rank(r):
        try:
            comms[r].connect(addrs)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[r] = (e, 0.0)
            return
        for _ in range(ops):
            start = time.monotonic()
            try:
                comms[r].all_reduce(tensors[r])
            except Exception as e:  # noqa: BLE001
                out[r] = (e, time.monotonic() - start)
                return
        out[r] = ("ok", 0.0)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(6 * T)
    assert not any(t.is_alive() for t in threads), "a rank did not return"
    return out


def _through(relay_port, comms):
    # Rank 1 reaches rank 0 through the relay; rank 0 never connects (it accepts).
    return [f"127.0.0.1:{relay_port}", f"127.0.0.1:{comms[1].port}"]


def _direct(comms):
    return [f"127.0.0.1:{c.port}" for c in comms]


def test_an_encrypted_group_gives_the_plain_result_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(100_003, generator=g) for _ in range(2)]
    results = {}
    for encrypt in (False, True):
        comms = _comms((encrypt, encrypt))
        tensors = [x.clone() for x in inputs]
        try:
            assert _run(comms, _direct(comms), tensors, ops=2) == [("ok", 0.0)] * 2
        finally:
            for c in comms:
                c.close()
        assert torch.equal(tensors[0], tensors[1])
        results[encrypt] = tensors[0]
    assert torch.equal(results[True], results[False])


def _flip(index, byte=20):
    def edit(direction, i, record, history):
        if direction == UP and i == index:
            record = bytearray(record)
            record[byte] ^= 0x10
            return [bytes(record)]
        return [record]
    return edit


def _drop(index):
    def edit(direction, i, record, history):
        return [] if direction == UP and i == index else [record]
    return edit


def _swap(index):
    """Holds record ``index`` and sends it after the next one."""
    held = {}

    def edit(direction, i, record, history):
        if direction != UP:
            return [record]
        if i == index:
            held["r"] = record
            return []
        if i == index + 1:
            return [record, held.pop("r")]
        return [record]
    return edit


def _replay(old, new):
    """Sends, in place of records ``new`` and ``new + 1`` (a frame of a later op), the
    records ``old`` and ``old + 1`` (a frame recorded earlier)."""
    def edit(direction, i, record, history):
        if direction == UP and i in (new, new + 1):
            return [history[old + i - new]]
        return [record]
    return edit


# Record indexes on UP: 0-1 handshake, 2-3 op 1's reduce-scatter frame, 4-5 its all-gather
# frame, 6-7 op 2's reduce-scatter frame, ...
TAMPERING = {
    "a bit flipped in a payload": (_flip(3), "a frame's payload"),
    "a bit flipped in a header": (_flip(2), "a frame header"),
    "a bit flipped in a tag": (_flip(3, byte=PAYLOAD - 1), "a frame's payload"),
    "a record dropped": (_drop(2), "a frame header"),
    "two records swapped": (_swap(2), "a frame header"),
    "an old frame replayed": (_replay(2, 6), "a frame header"),
}


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_a_record_tampered_with_on_the_path_fails_the_op_on_both_ranks(case):
    edit, what = TAMPERING[case]
    comms = _comms()
    inputs = [torch.full((N,), float(r + 1)) for r in range(2)]
    tensors = [x.clone() for x in inputs]
    # Only UP is cut into records: what rank 0 sends back (its ABORT) passes as it comes.
    sizes = {UP: HANDSHAKE[UP] + FRAMES, DOWN: HANDSHAKE[DOWN]}
    try:
        with Relay(comms[0].port, sizes, edit) as relay:
            out = _run(comms, _through(relay.port, comms), tensors, ops=2)
    finally:
        for c in comms:
            c.close()
    (got0, secs0), (got1, secs1) = out
    # Rank 0 receives the tampered record: a specific error naming the sender.
    assert isinstance(got0, IntegrityError), out
    assert "rank 1" in str(got0) and what in str(got0), got0
    # Rank 1 is told, at once, not left to its deadline.
    assert isinstance(got1, PcclError) and not isinstance(got1, TimeoutError), out
    assert "integrity" in str(got1), got1
    assert secs0 < T / 2 and secs1 < T / 2, (secs0, secs1)
    # No wrong result, no half-written tensor: a rank holds its input, or the true sum of
    # the ops that completed before the tampered one.
    for r in range(2):
        assert any(torch.equal(tensors[r], inputs[r] * 0 + v) for v in (r + 1, 3.0)), r
    # The group is rebuilt and works: a new communicator pair, without the relay.
    comms = _comms()
    tensors = [torch.full((N,), float(r + 1)) for r in range(2)]
    try:
        assert _run(comms, _direct(comms), tensors) == [("ok", 0.0)] * 2
    finally:
        for c in comms:
            c.close()
    assert all(torch.equal(t, torch.full((N,), 3.0)) for t in tensors)


def _pattern():
    # 64 bytes that are 16 distinct finite float32 values.
    return torch.arange(1, 17, dtype=torch.float32) * 1.25 + 0.0625


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_passive_capture_does_not_contain_the_tensor(encrypt):
    pattern = _pattern()
    needle = pattern.numpy().tobytes()
    assert len(needle) == 64
    comms = _comms((encrypt, encrypt))
    tensors = [pattern.repeat(4096) for _ in range(2)]      # 256 KiB each
    try:
        with Relay(comms[0].port) as relay:
            assert _run(comms, _through(relay.port, comms), tensors) == [("ok", 0.0)] * 2
            captured = bytes(relay.captured[UP]) + bytes(relay.captured[DOWN])
    finally:
        for c in comms:
            c.close()
    assert torch.equal(tensors[0], (pattern * 2).repeat(4096))
    assert len(captured) > 2 * 256 * 1024 // 2      # the frames did pass through the relay
    # Plain links carry the pattern as is (so this test can fail); encrypted ones never.
    assert (needle in captured) != encrypt


@pytest.mark.parametrize("plain", [0, 1])
def test_a_peer_that_does_not_encrypt_is_refused_and_told_why(plain, capfd):
    encrypt = [True, True]
    encrypt[plain] = False
    comms = _comms(tuple(encrypt))
    tensors = [torch.ones(N) for _ in range(2)]
    try:
        out = _run(comms, _direct(comms), tensors)
    finally:
        for c in comms:
            c.close()
    connector = out[1][0]
    assert isinstance(connector, AuthenticationError), out
    says = "the peer does not encrypt its links" if plain == 0 else \
        "the peer encrypts its links, and this rank does not"
    assert says in str(connector) and "PCCL_ENCRYPT" in str(connector), connector
    assert not out[0][0] == "ok"        # the acceptor never counts the refused link
    err = capfd.readouterr().err
    assert "rejected a connection from 127.0.0.1:" in err and "PCCL_ENCRYPT" in err


# -- by hand: rank 1 speaks the documented construction ----------------------------------

MAGIC, VERSION, KIND_SEALED = 0x4C434350, 1, 3


def _read(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "rank 0 closed the connection"
        data += chunk
    return data


def _keys(hello_c, hello_a, nonce_c, nonce_a):
    """docs/security.md: HKDF-SHA256, salt = both nonces, info = label NUL both hellos."""
    okm = HKDF(algorithm=hashes.SHA256(), length=88, salt=nonce_c + nonce_a,
               info=b"pccl data-plane v1 record keys\0" + hello_c + hello_a).derive(SECRET)
    return (okm[:32], okm[32:44]), (okm[44:76], okm[76:88])


def _nonce(iv, n):
    return bytes(a ^ b for a, b in zip(iv, n.to_bytes(12, "big")))


def test_the_documented_construction_interoperates_with_the_native_one():
    comm_id = int.from_bytes(os.urandom(8), "little")
    comm = Communicator(0, 2, comm_id, "127.0.0.1", T)
    comm.set_secret(SECRET)                 # encryption is on by default with a secret
    tensor = torch.ones(N)
    result = {}

    def rank0():
        try:
            comm.connect([f"127.0.0.1:{comm.port}", "127.0.0.1:9"])
            comm.all_reduce(tensor)
            result["ok"] = True
        except Exception as e:  # noqa: BLE001
            result["error"] = e

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", comm.port), timeout=T) as s:
            hello_c = struct.pack("<IHHQIIHHHH", MAGIC, VERSION, KIND_SEALED, comm_id, 1, 2,
                                  0, 0, 1, 1)
            nonce_c = os.urandom(32)
            s.sendall(hello_c + nonce_c)
            reply = _read(s, 96)
            hello_a, nonce_a = reply[:32], reply[32:64]
            assert struct.unpack_from("<H", hello_a, 6)[0] == KIND_SEALED
            s.sendall(hmac.new(SECRET, b"pccl data-plane v1 connect\0" + hello_c + hello_a +
                               nonce_c + nonce_a, hashlib.sha256).digest())
            (up_key, up_iv), (down_key, down_iv) = _keys(hello_c, hello_a, nonce_c, nonce_a)
            down, up = AESGCM(down_key), AESGCM(up_key)
            sent = 0
            for n_frame, value in ((0, 2.0), (1, 3.0)):   # reduce-scatter, all-gather
                # Rank 0's frame: records 2n and 2n+1 of its direction.
                header = down.decrypt(_nonce(down_iv, 2 * n_frame), _read(s, HEADER), None)
                assert struct.unpack_from("<H", header)[0] == 0xF7A3       # the frame magic
                length = struct.unpack_from("<Q", header, 32)[0]
                assert length == N // 2 * 4
                payload = down.decrypt(_nonce(down_iv, 2 * n_frame + 1), _read(s, length + 16),
                                       None)
                # Its reduce-scatter frame carries its input; its all-gather the reduced half.
                assert payload == torch.full((N // 2,), 1.0 + 2.0 * n_frame).numpy().tobytes()
                # Answer with the same header and a payload of our own, sealed in order.
                mine = torch.full((N // 2,), value).numpy().tobytes()
                s.sendall(up.encrypt(_nonce(up_iv, sent), header, None) +
                          up.encrypt(_nonce(up_iv, sent + 1), mine, None))
                sent += 2
            thread.join(2 * T)
    finally:
        thread.join(2 * T)
        comm.close()
    assert result == {"ok": True}, result
    # Rank 0 reduced its half with our 2.0 (1 + 2) and took our 3.0 for the other half.
    assert torch.equal(tensor, torch.full((N,), 3.0))


def test_any_source_receives_peek_sealed_headers_without_consuming_them():
    """World 3, two streams per peer, encrypted. Rank 1 sends tag 9 first and rank 2 sends
    tag 4: a receive of tag 4 from any source opens rank 1's sealed header to pass it over
    (without taking its record number) and takes rank 2's; rank 1's message is then
    received by source and tag, and a last any-source receive takes rank 1's second."""
    comm_id = int.from_bytes(os.urandom(8), "little")
    comms = [Communicator(r, 3, comm_id, "127.0.0.1", T) for r in range(3)]
    for c in comms:
        c.set_secret(SECRET)
    addrs = _direct(comms)
    sent_9 = threading.Event()

    def rank(r):
        comms[r].connect(addrs, streams=2)
        if r == 1:
            comms[1].send(torch.full((N,), 1.0), 0, tag=9)
            sent_9.set()
            comms[1].send(torch.full((N + 1,), 11.0), 0, tag=4)
            return None
        if r == 2:
            assert sent_9.wait(T)
            comms[2].send(torch.full((N,), 2.0), 0, tag=4)
            return None
        got = []
        t = torch.empty(N)
        got.append((comms[0].recv_any_source(t, tag=4), t.clone()))
        comms[0].recv(t, 1, tag=9)
        got.append((1, t.clone()))
        u = torch.empty(N + 1)
        got.append((comms[0].recv_any_source(u, tag=4), u.clone()))
        return got

    try:
        got = on_threads(rank, 3, deadline_s=6 * T)[0]
    finally:
        for c in comms:
            c.close()
    assert [(src, float(x[0]), x.numel()) for src, x in got] == \
        [(2, 2.0, N), (1, 1.0, N), (1, 11.0, N + 1)]
    assert all(bool((x == x[0]).all()) for _, x in got)
