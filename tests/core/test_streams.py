"""Striping: one operation's chunks dealt over S TCP streams per peer, to whichever has room.

- every collective (and p2p, transfer batches, the quantized all-reduce) gives
  bit-identical results on every rank with 1, 2 and 3 streams, the same bytes as
  with one stream, on sizes that do not divide evenly into chunks or ranks
  (in this process: ranks on threads, small chunks so every op spreads over
  every stream);
- the same, every link sealed with a secret (encrypted, 2 lanes x 3 streams);
- a receive from any source finds each peer's next message whichever streams carry it
  (plain and encrypted);
- a stripe set between ops (the first k of the connected streams) is what the next op
  uses; the stripe a group picks grows with the bandwidth-delay product, bounded;
- peers with different stream counts refuse each other;
- PCCL_STREAMS reaches the process group, whose async all-reduces on 4 lanes x 3
  streams are correct;
- one stream shut down mid-operation (as a middlebox reset would) fails the
  op on every rank promptly, as a lost peer, with every input intact;
- one stream made slow (a relay passes it at 512 KiB/s) takes few frames, and the op
  ends in a fraction of the time it would wait for that stream's round-robin share.
"""

import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist
from harness.data import (
    assert_identical_across_ranks,
    assert_reduced,
    make_input,
    unpack,
)
from harness.relay import UP, Relay
from harness.threads import on_threads

from torch_pccl import Communicator
from torch_pccl.errors import InvalidArgumentError, PcclError

W = 3                       # ranks on threads
CHUNK = 4096                # bytes: small, so every op has many chunks per peer
SIZES = (1, 7, 1000, 12_347)  # elements: not multiples of the chunk or of W
T = 5.0                     # seconds: op timeout of the process-group tests


def _communicators(streams, lanes=1, world=W, comm_id=41, secret=None):
    comms = [Communicator(r, world, comm_id, "127.0.0.1", 10.0) for r in range(world)]
    for c in comms:
        c.set_secret(secret or b"")     # b"": none, even with PCCL_SECRET set
    addrs = [f"127.0.0.1:{c.port}" for c in comms]

    def connect(r):
        comms[r].connect(addrs, lanes=lanes, streams=streams)
        comms[r].set_option("chunk_bytes", CHUNK)

    on_threads(connect, world)
    return comms


def _every_collective(comm, r):
    """Runs each kind of operation on odd sizes; returns its outputs in a fixed order."""
    n_ranks, out = comm.world_size, []
    for n in SIZES:
        g = torch.Generator().manual_seed(1000 * n + r)
        x = torch.randn(n, generator=g)
        a = x.clone()
        comm.all_reduce(a)
        out.append(a)
        ints = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64)
        comm.all_reduce(ints, op=dist.ReduceOp.SUM)
        out.append(ints)
        h = x.to(torch.bfloat16)
        comm.all_reduce(h, op=dist.ReduceOp.AVG)
        out.append(h)
        gathered = torch.empty(n * n_ranks)
        comm.all_gather(x, gathered)
        out.append(gathered)
        scattered = torch.empty(n)
        comm.reduce_scatter(torch.randn(n * n_ranks, generator=g), scattered)
        out.append(scattered)
        b = x.clone()
        comm.broadcast(b, root=n_ranks - 1)
        out.append(b)
        q = x.clone()
        comm.all_reduce_quantized(q, bits=8, block=64, op=dist.ReduceOp.AVG)
        out.append(q)
        counts = [(n + p + r) % 5 * 300 + 1 for p in range(n_ranks)]     # uneven, per peer
        recv_counts = [(n + r + p) % 5 * 300 + 1 for p in range(n_ranks)]
        send = torch.randn(sum(counts), generator=g)
        recv = torch.empty(sum(recv_counts))
        comm.all_to_all_v(send, counts, _offsets(counts), recv, recv_counts, _offsets(recv_counts))
        out.append(recv)
        right, left = (r + 1) % n_ranks, (r - 1) % n_ranks
        got = torch.empty(n + 3)
        comm.p2p_batch([(True, torch.randn(n + 3, generator=g), right, 5),
                        (False, got, left, 5)])
        out.append(got)
        landed = torch.empty(2 * n + 1)
        comm.transfer_batch([(True, torch.randn(2 * n + 1, generator=g), right, 6),
                             (False, landed, left, 6)])
        out.append(landed)
    return out


def _offsets(counts):
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


def _run_all(streams, lanes=1, lane=0, secret=None):
    comms = _communicators(streams, lanes, secret=secret)
    try:
        return on_threads(lambda r: _every_collective(comms[r].lanes[lane], r), W)
    finally:
        for c in comms:
            c.close()


# Per size, _every_collective's outputs in order; those at these positions are the same on
# every rank by definition (all-reduces, all-gather, broadcast, quantized all-reduce);
# reduce-scatter, all-to-all, p2p and transfers give each rank its own.
SAME_ON_EVERY_RANK = (0, 1, 2, 3, 5, 6)


def _per_size(results):
    return len(results[0]) // len(SIZES)


def test_every_operation_is_bit_identical_with_one_two_and_three_streams():
    reference = _run_all(streams=1)
    per_size = _per_size(reference)
    for streams in (2, 3):
        results = _run_all(streams)
        for i in range(len(reference[0])):
            for r in range(W):
                # Every rank's output equals its one-stream output, byte for byte
                # (collectives: and so equal on every rank, as they are with one stream).
                assert torch.equal(results[r][i], reference[r][i]), (
                    f"{streams} streams: output {i} of rank {r} differs from one stream")
            if i % per_size in SAME_ON_EVERY_RANK:
                assert all(torch.equal(results[r][i], results[0][i]) for r in range(W)), i
    # The integer sum is exact: the striped result is the true one, not just a stable one.
    for k, n in enumerate(SIZES):
        expected = sum(torch.randint(-1000, 1000, (n,), dtype=torch.int64,
                                     generator=_after_randn(1000 * n + r, n))
                       for r in range(W))
        assert torch.equal(results[0][k * per_size + 1], expected)


def _after_randn(seed, n):
    # The generator state _every_collective draws its integers from (after one randn).
    g = torch.Generator().manual_seed(seed)
    torch.randn(n, generator=g)
    return g


def _slow_stream_all_reduce(numel, slow, rate, secret=None):
    """World 2 with 4 streams, rank 1 reaching rank 0 through a relay that passes what rank
    1 sends on stream ``slow`` at ``rate`` bytes/s (the others as they come): one
    all-reduce of ``numel`` float32. Returns (seconds of the slower rank, the bytes each
    of rank 1's streams carried to rank 0, in stream order, the results)."""
    comms = [Communicator(r, 2, 53, "127.0.0.1", 60.0) for r in range(2)]
    for c in comms:
        c.set_secret(secret or b"")
    with Relay(comms[0].port, pace=lambda hello: rate if _stream_of(hello) == slow else None,
               timeout=60.0) as relay:
        addrs = [f"127.0.0.1:{relay.port}", f"127.0.0.1:{comms[1].port}"]
        try:
            on_threads(lambda r: comms[r].connect(addrs, streams=4), 2)
            for c in comms:
                c.set_option("chunk_bytes", 256 << 10)
            outs = [torch.full((numel,), float(r + 1)) for r in range(2)]

            def reduce(r):
                start = time.monotonic()
                comms[r].all_reduce(outs[r])
                return time.monotonic() - start

            seconds = max(on_threads(reduce, 2, deadline_s=120.0))
        finally:
            for c in comms:
                c.close()
        carried = [0] * 4
        for conn in relay.connections:
            carried[_stream_of(conn["opening"])] += conn[UP]
    return seconds, carried, outs


def _stream_of(hello):
    return struct.unpack_from("<H", hello, 26)[0]   # the hello's stream field (protocol.md)


@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-secret"], ids=["plain", "sealed"])
def test_a_slow_stream_takes_few_frames_and_does_not_hold_the_op(secret):
    """One of four streams is slow (512 KiB/s; a congested path under one TCP stream): dealt
    round-robin, a quarter of an all-reduce's 32 MiB would wait for it (16 s); dealt to the
    streams with room, it carries a few frames and the op ends in a fraction of that, with
    exact results, plain or encrypted."""
    numel, rate = 8 << 20, 512 << 10                 # 32 MiB of float32 each way
    seconds, carried, outs = _slow_stream_all_reduce(numel, slow=2, rate=rate, secret=secret)
    for out in outs:
        assert torch.equal(out, torch.full_like(out, 3.0))
    total = sum(carried)
    assert total >= numel * 4, carried               # every frame went through the relay
    round_robin = total / 4 / rate                   # what the slow stream alone would take
    assert carried[2] < total / 10, carried          # a quarter when dealt round-robin
    assert seconds < round_robin / 3, (seconds, round_robin, carried)


@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-secret"], ids=["plain", "sealed"])
def test_receives_from_any_source_find_each_peers_next_message_on_any_stream(secret):
    """Messages of ~10 chunks each (so every one spreads over all three streams): rank 1
    sends tags 5 then 6, rank 2 tags 6 then 5. Rank 0 receiving tag 5 from any source
    gets rank 1's (rank 2's next message has tag 6 wherever its frames are), then both tag
    6 messages, then rank 2's tag 5, each with its own bytes."""
    comms = _communicators(streams=3, comm_id=59, secret=secret)
    n = 10_000

    def message(src, tag):
        return torch.arange(n, dtype=torch.float32) + 1000 * src + tag

    def rank(r):
        c = comms[r]
        if r == 1:
            c.send(message(1, 5), 0, tag=5)
            c.send(message(1, 6), 0, tag=6)
        elif r == 2:
            c.send(message(2, 6), 0, tag=6)
            c.send(message(2, 5), 0, tag=5)
        else:
            got = []
            for tag in (5, 6, 6, 5):
                t = torch.empty(n)
                src = c.recv_any_source(t, tag=tag)
                assert torch.equal(t, message(src, tag)), (src, tag)
                got.append((src, tag))
            return got

    try:
        got = on_threads(rank, W)[0]
    finally:
        for c in comms:
            c.close()
    assert got[0] == (1, 5) and got[3] == (2, 5), got
    assert sorted(got[1:3]) == [(1, 6), (2, 6)], got


def test_every_operation_over_encrypted_striped_lanes_gives_the_plain_bytes():
    """With a secret every link of every lane and stream is sealed (docs/security.md):
    the same bytes as plain links, for every kind of operation, on the second lane too."""
    reference = _run_all(streams=1)
    for lane in (0, 1):
        results = _run_all(streams=3, lanes=2, lane=lane, secret=b"0123456789abcdef-secret")
        for i in range(len(reference[0])):
            for r in range(W):
                assert torch.equal(results[r][i], reference[r][i]), (lane, i, r)


def test_a_second_lane_stripes_too():
    results = _run_all(streams=2, lanes=2, lane=1)
    per_size = _per_size(results)
    assert per_size > max(SAME_ON_EVERY_RANK)
    for i in range(len(results[0])):
        if i % per_size in SAME_ON_EVERY_RANK:
            assert all(torch.equal(results[r][i], results[0][i]) for r in range(W)), i


def _bytes_acked_to(port):
    """Per TCP socket of this process whose far end is ``port``, in fd order: the bytes the
    peer acknowledged (TCP_INFO's tcpi_bytes_acked, a u64 at offset 120)."""
    acked = []
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM \
                    and s.getpeername()[1] == port:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 128)
                acked.append(struct.unpack_from("Q", info, 120)[0])
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only
    return acked


def test_a_stripe_set_between_ops_uses_that_many_of_the_streams():
    """Three streams connected, the stripe set to 2 then 3 on both ranks between ops: the
    third stream carries nothing at 2 and its share at 3, and every result is exact."""
    comms = _communicators(streams=3, world=2, comm_id=47)
    try:
        assert [c.stripe for c in comms] == [3, 3]
        numel = 1 << 16                   # 256 KiB: 64 chunks per peer at CHUNK

        def step(stripe):
            for c in comms:
                c.lane_set.set_stripe(stripe)
            before = _bytes_acked_to(comms[0].port)     # rank 1's streams to rank 0
            outs = [torch.full((numel,), float(r + 1)) for r in range(2)]
            on_threads(lambda r: comms[r].all_reduce(outs[r]), 2)
            for out in outs:
                assert torch.equal(out, torch.full_like(out, 3.0))
            after = _bytes_acked_to(comms[0].port)
            return [b - a for a, b in zip(before, after)]

        two, three = step(2), step(3)
        assert len(two) == 3 and [c.stripe for c in comms] == [3, 3]
        assert sorted(d > 0 for d in two) == [False, True, True], two
        assert all(d > 0 for d in three), three
        with pytest.raises(InvalidArgumentError, match="stripe"):
            comms[0].lane_set.set_stripe(4)
    finally:
        for c in comms:
            c.close()


def test_a_group_picks_its_stripe_only_between_hosts_and_paced():
    from torch_pccl import config
    from torch_pccl.core.communicator import stripe_ceiling

    assert stripe_ceiling(2, 4) == config.STRIPE_MAX
    assert stripe_ceiling(64, 4) == config.DEFAULT_STREAMS     # sockets bounded
    assert config.DEFAULT_STREAMS <= stripe_ceiling(9, 4) < config.STRIPE_MAX


def test_peers_with_different_stream_counts_refuse_each_other():
    comms = [Communicator(r, 2, 43, "127.0.0.1", 2.0) for r in range(2)]
    addrs = [f"127.0.0.1:{c.port}" for c in comms]
    try:
        errors = [None, None]

        def connect(r):
            try:
                comms[r].connect(addrs, streams=(2, 1)[r], timeout_s=2.0)
            except PcclError as e:
                errors[r] = e

        on_threads(connect, 2, deadline_s=20.0)
        assert all(isinstance(e, PcclError) for e in errors), errors
    finally:
        for c in comms:
            c.close()
    with pytest.raises(InvalidArgumentError, match="streams"):
        Communicator(0, 1, 44, "127.0.0.1", 2.0).connect(["127.0.0.1:1"], streams=0)


def test_process_group_stripes_with_pccl_streams(fresh_group, monkeypatch):
    monkeypatch.setenv("PCCL_STREAMS", "3")
    pool = fresh_group(3, 30.0)
    assert [info["streams"] for info in pool.run("streams_info")] == [3, 3, 3]
    seed = 4242
    sizes = (1, 100_003, 7, 0, 3_001, 250_000, 17, 1 << 20)
    results = pool.run("async_all_reduces", seed, sizes, deadline_s=60)
    for i, n in enumerate(sizes):
        per_rank = [res["results"][i] for res in results]
        assert_identical_across_ranks(per_rank, f"async all_reduce #{i} ({n} elements)")
        inputs = [make_input(seed + i, r, n, "float32", "SUM") for r in range(3)]
        assert_reduced(unpack(per_rank[0]), inputs, "SUM", "float32", f"all_reduce #{i}")


def test_one_stream_cut_mid_operation_fails_every_rank_promptly(fresh_group, monkeypatch):
    """Ranks 0 and 2 are inside a 1M-element all_reduce (8 chunks per peer, both streams busy)
    when rank 1 shuts down one of its two streams to rank 0: every rank fails as a lost peer
    within T, and no tensor changed."""
    monkeypatch.setenv("PCCL_STREAMS", "2")
    monkeypatch.setenv("PCCL_LANES", "1")
    pool = fresh_group(3, T)
    ports = [info["port"] for info in pool.run("streams_info")]
    numel = 1 << 20
    for r in (0, 2):
        pool.send(r, "all_reduce_recording_error", numel)
    pool.send(1, "all_reduce_after_cutting_a_stream", numel, ports[0])
    for r in range(3):
        res = pool.result(r, T + 10, "the all_reduce with a stream cut")
        rec = res["error"]
        assert rec is not None, f"rank {r}: the all_reduce succeeded over a cut stream"
        assert {"PeerLostError", "RemoteError"} & set(rec["mro"]), (r, rec["type"], rec["message"])
        assert rec["elapsed"] < T, f"rank {r} failed after {rec['elapsed']:.2f}s, not promptly"
        assert res["unchanged"], f"rank {r}: a failed all_reduce modified its tensor"
        if r == 1:
            assert res["streams_to_peer"] == 2


def test_auto_streams_stripes_between_hosts_only():
    from torch_pccl import config
    from torch_pccl.core.communicator import auto_streams

    assert auto_streams(["127.0.0.1:5000", "127.0.0.2:5001", "[::1]:5002"]) == 1
    remote = config.DEFAULT_STREAMS
    assert remote > 1
    assert auto_streams(["127.0.0.1:5000", "198.18.0.2:5001"]) == remote
    assert auto_streams(["10.0.0.1:1", "10.0.0.2:1"]) == remote
    assert auto_streams(["localhost:5000", "127.0.0.1:1"]) == remote    # not provably local


def test_a_group_on_one_host_keeps_one_stream_unless_told(fresh_group, monkeypatch):
    monkeypatch.delenv("PCCL_STREAMS", raising=False)
    pool = fresh_group(2, 30.0)
    assert [info["streams"] for info in pool.run("streams_info")] == [1, 1]
