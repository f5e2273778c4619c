"""Concurrent collectives: a group's K lanes (K TCP connections per peer, each a communicator).

The n-th collective of a group runs on lane n % K (env PCCL_LANES, default 4), so async
collectives issued back to back are in flight at once and may finish in any order; a lane's
failure stays on that lane unless its cause (a dead peer) reaches the others too. Covered here:
the native multi-lane connect (pcclCommConnectLanes) through cffi, the Communicator's lane
ownership, PCCL_LANES, and groups of worker processes (tests/harness/workers.py).
"""

import signal
import socket
import struct
import threading
import time
import zlib

import pytest

from harness.data import assert_identical_across_ranks, assert_reduced, make_input, unpack

pytestmark = [pytest.mark.timeout(120), pytest.mark.pccl_only]

T = 3.0  # seconds: the op timeout of the groups that are broken on purpose


def seed_of(*params):
    return zlib.crc32(repr(params).encode()) % 100_000


# --- native: pcclCommConnectLanes -----------------------------------------------------------------


def _native():
    from torch_pccl.core.native import ffi, lib

    return ffi, lib


def _create(ffi, lib, world_size, comm_id):
    comms, ports = [], []
    for r in range(world_size):
        c = ffi.new("pcclComm_t*")
        assert lib.pcclCommCreate(c, r, world_size, comm_id, b"127.0.0.1") == lib.pcclSuccess
        comms.append(c[0])
        port = ffi.new("int*")
        lib.pcclCommGetPort(c[0], port)
        ports.append(port[0])
    return comms, ports


def _connect_lanes(ffi, lib, comms, ports, nlanes, timeout_ms=5000):
    """Connects every rank in its own thread; returns (result codes, per-rank lane handles)."""
    addrs = [ffi.new("char[]", f"127.0.0.1:{p}".encode()) for p in ports]
    array = ffi.new("char*[]", addrs)
    outs = [ffi.new("pcclComm_t[]", max(1, n - 1)) for n in nlanes]
    rcs = [None] * len(comms)

    def run(r):
        rcs[r] = lib.pcclCommConnectLanes(comms[r], array, nlanes[r], outs[r], timeout_ms)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_ms / 1000 + 10)
    assert not any(t.is_alive() for t in threads), "pcclCommConnectLanes did not return"
    return rcs, outs


def _all_reduce_threads(ffi, lib, jobs, numel=1000):
    """Starts one thread per (comm, value) job: an all_reduce SUM of `numel` float32 `value`s."""
    results = {}

    def run(key, comm, value):
        buf = ffi.new("float[]", [float(value)] * numel)
        rc = lib.pcclAllReduce(comm, buf, buf, numel, lib.pcclFloat32, lib.pcclSum, 0, 10_000)
        results[key] = (rc, buf[0], buf[numel - 1])

    threads = {key: threading.Thread(target=run, args=(key, comm, value))
               for key, (comm, value) in jobs.items()}
    for t in threads.values():
        t.start()
    return threads, results


def test_native_lanes_run_at_once_and_refuse_bad_hellos():
    """3 ranks x 3 lanes: lanes 1 and 2 finish while lane 0 waits for a rank that has not
    called it yet. Before the peers connect, rank 0 refuses hellos naming lane 5 of 2 and
    a lane count other than its own; the group still forms."""
    ffi, lib = _native()
    world, nlanes, comm_id = 3, 3, 4242
    comms, ports = _create(ffi, lib, world, comm_id)
    intruders, outs = [], []
    try:
        for lane, lanes in ((5, 2), (1, 4)):
            conn = socket.create_connection(("127.0.0.1", ports[0]), timeout=5)
            conn.sendall(b"PCCL" + struct.pack("<HHQIIII", 1, 1, comm_id, 2, world, lane, lanes))
            intruders.append(conn)
        rcs, outs = _connect_lanes(ffi, lib, comms, ports, [nlanes] * world)
        assert rcs == [lib.pcclSuccess] * world
        lanes = [[comms[r]] + [outs[r][i] for i in range(nlanes - 1)] for r in range(world)]
        for conn in intruders:
            try:
                assert conn.recv(1) == b"", "a refused hello was answered"
            except ConnectionResetError:
                pass
        # Lane 0 on ranks 0 and 1 only: it cannot finish before rank 2 calls it.
        held, held_results = _all_reduce_threads(
            ffi, lib, {r: (lanes[r][0], r + 1) for r in (0, 1)})
        others, results = _all_reduce_threads(
            ffi, lib, {(r, k): (lanes[r][k], 10 * k + r) for r in range(world) for k in (1, 2)})
        for t in others.values():
            t.join(20)
        for k in (1, 2):
            expected = float(sum(10 * k + r for r in range(world)))
            for r in range(world):
                assert results[(r, k)] == (lib.pcclSuccess, expected, expected), (r, k)
        assert all(t.is_alive() for t in held.values()), "lane 0 finished without rank 2"
        late, late_results = _all_reduce_threads(ffi, lib, {2: (lanes[2][0], 3)})
        for t in [*held.values(), *late.values()]:
            t.join(20)
        for r, res in {**held_results, **late_results}.items():
            assert res == (lib.pcclSuccess, 6.0, 6.0), (r, res)
    finally:
        for conn in intruders:
            conn.close()
        for out in outs:
            for i in range(nlanes - 1):
                lib.pcclCommDestroy(out[i])  # NULL is accepted
        for comm in comms:
            lib.pcclCommDestroy(comm)


def test_native_lane_count_mismatch_fails_to_connect():
    """Rank 0 opens 2 lanes, rank 1 asks for 3: neither connects, no lane handle is returned."""
    ffi, lib = _native()
    comms, ports = _create(ffi, lib, 2, 99)
    try:
        start = time.monotonic()
        rcs, outs = _connect_lanes(ffi, lib, comms, ports, [2, 3], timeout_ms=1500)
        assert time.monotonic() - start < 10
        assert lib.pcclSuccess not in rcs, rcs
        assert rcs[0] == lib.pcclTimeout, rcs  # it refused rank 1's hellos and kept waiting
        for out, n in zip(outs, (2, 3)):
            assert all(out[i] == ffi.NULL for i in range(n - 1))
    finally:
        for c in comms:
            lib.pcclCommDestroy(c)


def test_native_lane_arguments_and_independence():
    """Bad arguments are caller errors (the comm stays usable); a world of one gets its lanes;
    aborting one lane leaves the others working."""
    ffi, lib = _native()
    comms, ports = _create(ffi, lib, 1, 7)
    comm = comms[0]
    addrs = ffi.new("char*[]", [ffi.new("char[]", f"127.0.0.1:{ports[0]}".encode())])
    out = ffi.new("pcclComm_t[]", 64)
    lanes = []
    try:
        for n, arg in ((0, out), (65, out), (3, ffi.NULL)):
            assert lib.pcclCommConnectLanes(comm, addrs, n, arg, 1000) == lib.pcclInvalidArgument
        assert lib.pcclCommConnectLanes(comm, addrs, 3, out, 0) == lib.pcclInvalidArgument
        assert lib.pcclCommConnectLanes(comm, addrs, 3, out, 1000) == lib.pcclSuccess
        lanes = [out[0], out[1]]
        assert lib.pcclCommConnect(lanes[0], addrs, 1000) == lib.pcclInvalidUsage  # connected
        port = ffi.new("int*")
        assert lib.pcclCommGetPort(lanes[1], port) == lib.pcclSuccess and port[0] == ports[0]
        assert lib.pcclCommAbort(lanes[0]) == lib.pcclSuccess
        buf = ffi.new("float[]", [2.0] * 4)
        for handle, rc in ((lanes[0], lib.pcclAborted), (lanes[1], lib.pcclSuccess),
                           (comm, lib.pcclSuccess)):
            assert lib.pcclAllReduce(handle, buf, buf, 4, lib.pcclFloat32, lib.pcclSum, 0,
                                     1000) == rc
        assert buf[3] == 2.0
    finally:
        for handle in lanes:
            lib.pcclCommDestroy(handle)
        lib.pcclCommDestroy(comm)


# --- Communicator and PCCL_LANES ------------------------------------------------------------------


def test_communicator_owns_its_lanes():
    import torch

    from torch_pccl import Communicator
    from torch_pccl.errors import AbortedError, InvalidArgumentError

    comm = Communicator(0, 1, 5, "127.0.0.1", 5.0)
    try:
        addrs = [f"127.0.0.1:{comm.port}"]
        for bad in (0, 65, 2.0):
            with pytest.raises(InvalidArgumentError):
                comm.connect(addrs, lanes=bad)
        assert comm.lanes == (comm,)
        comm.connect(addrs, lanes=3)
        lanes = comm.lanes
        assert len(lanes) == 3 and lanes[0] is comm
        assert all((lane.rank, lane.world_size) == (0, 1) for lane in lanes)
        t = torch.arange(6, dtype=torch.float32)
        for lane in lanes:
            lane.all_reduce(t)
        assert torch.equal(t, torch.arange(6, dtype=torch.float32))
        comm.set_option("chunk_bytes", 1 << 16)
        assert comm.stats() == tuple(map(sum, zip(*(lane.stats() for lane in lanes))))
        comm.abort()
        for lane in lanes:
            with pytest.raises(AbortedError):
                lane.all_reduce(t)
    finally:
        comm.close()
    assert all(lane.closed for lane in lanes)


def test_an_unclosed_communicator_with_lanes_is_freed_when_dropped():
    # No reference cycle between a communicator and its lanes: dropping the last
    # reference frees every lane's native handle at once, without waiting for a full gc.
    import gc
    import weakref

    from torch_pccl import Communicator

    comm = Communicator(0, 1, 6, "127.0.0.1", 5.0)
    comm.connect([f"127.0.0.1:{comm.port}"], lanes=3)
    refs = [weakref.ref(lane) for lane in comm.lanes] + [weakref.ref(comm.lane_set)]
    gc.disable()
    try:
        del comm
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()


def test_pccl_lanes_env(monkeypatch):
    from torch_pccl import config
    from torch_pccl.core.native import MAX_LANES

    monkeypatch.delenv("PCCL_LANES", raising=False)
    assert config.lanes(MAX_LANES) == config.DEFAULT_LANES == 4
    monkeypatch.setenv("PCCL_LANES", "1")
    assert config.lanes(MAX_LANES) == 1
    for bad in ("0", "65", "two", "2.5"):
        monkeypatch.setenv("PCCL_LANES", bad)
        with pytest.raises(ValueError, match="PCCL_LANES"):
            config.lanes(MAX_LANES)


# --- process groups ------------------------------------------------------------------------------

SIZES = (1, 100_003, 7, 65_536, 0, 3_001, 250_000, 17)  # 8 async all_reduces, different sizes


def check_all(results, seed, sizes, world_size, op="SUM"):
    for i, n in enumerate(sizes):
        per_rank = [res["results"][i] for res in results]
        assert_identical_across_ranks(per_rank, f"async all_reduce #{i} ({n} elements)")
        inputs = [make_input(seed + i, r, n, "float32", op) for r in range(world_size)]
        assert_reduced(unpack(per_rank[0]), inputs, op, "float32", f"async all_reduce #{i}")


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_eight_async_all_reduces_in_flight(pools, world_size):
    from torch_pccl import config
    from torch_pccl.core.native import MAX_LANES

    pool = pools.get(world_size)
    lanes = config.lanes(MAX_LANES)  # the workers inherit this process's PCCL_LANES (default 4)
    assert pool.run("lanes_info") == [{"num_lanes": lanes, "comm_lanes": lanes}] * world_size
    for op in ("SUM", "AVG"):
        seed = seed_of("eight", world_size, op)
        results = pool.run("async_all_reduces", seed, SIZES, op, deadline_s=60)
        check_all(results, seed, SIZES, world_size, op)
        for res in results:
            assert sorted(res["order"]) == list(range(len(SIZES)))


def test_ops_finish_out_of_issue_order(pools):
    """Rank 1 holds lane 0: the second all_reduce (lane 1) finishes first on every rank, and a
    barrier issued after both waits for the first."""
    from torch_pccl import config
    from torch_pccl.core.native import MAX_LANES

    if config.lanes(MAX_LANES) < 2:
        pytest.skip("needs PCCL_LANES >= 2")
    pool = pools.get(2)
    seed = seed_of("out_of_order")
    for r in range(2):
        pool.send(r, "held_lane_out_of_order", seed, 4099)
    states = [pool.recv(r, 30, "b_done") for r in range(2)]
    for r, (tag, state) in enumerate(states):
        assert tag == "b_done", (r, tag, state)
        assert state == {"a_pending": True, "barrier_pending": True}, (r, state)
    for r in range(2):
        pool.conns[r].send("go")
    results = [pool.result(r, 30, "held_lane_out_of_order") for r in range(2)]
    for key, s in (("a", seed), ("b", seed + 1)):
        per_rank = [res[key] for res in results]
        assert_identical_across_ranks(per_rank, key)
        inputs = [make_input(s, r, 4099, "float32") for r in range(2)]
        assert_reduced(unpack(per_rank[0]), inputs, "SUM", "float32", key)
    assert all(res["a_done_at_barrier"] for res in results)


def test_lanes_1_keeps_one_op_at_a_time(fresh_group, monkeypatch):
    monkeypatch.setenv("PCCL_LANES", "1")
    pool = fresh_group(2, 30.0)
    assert pool.run("lanes_info") == [{"num_lanes": 1, "comm_lanes": 1}] * 2
    seed = seed_of("one_lane")
    results = pool.run("async_all_reduces", seed, SIZES, deadline_s=60)
    check_all(results, seed, SIZES, 2)
    for res in results:
        assert res["order"] == list(range(len(SIZES))), "one lane runs ops in issue order"


def test_sigkilled_peer_fails_every_op_in_flight(fresh_group):
    """Rank 1 never calls; the survivors' 8 async all_reduces (4 in flight, one per lane, and 4
    queued) all fail once it is SIGKILLed, within 2 T, and leave their tensors unchanged."""
    pool = fresh_group(3, T)
    pool.run("all_reduce", 1, 1000, "float32", "SUM", deadline_s=30)  # links up and working
    victim, survivors = 1, (0, 2)
    pool.send(victim, "wait_for_parent")
    for r in survivors:
        pool.send(r, "async_all_reduces_expecting_errors", [200_000 + i for i in range(8)])
    assert pool.recv(victim, 30) == ("waiting", victim)
    for r in survivors:
        assert pool.recv(r, 30) == ("entering", r)
    pool.kill(victim, signal.SIGKILL)
    for r in survivors:
        res = pool.result(r, 2 * T + 10, "the failed all_reduces")
        for i, rec in enumerate(res["errors"]):
            assert rec is not None, f"rank {r}: op {i} succeeded without rank {victim}"
            assert {"PeerLostError", "RemoteError"} & set(rec["mro"]), (
                f"rank {r} op {i}: {rec['type']}: {rec['message']}")
            assert rec["elapsed"] < 2 * T, f"rank {r} op {i}: failed after {rec['elapsed']:.2f}s"
        assert all(res["unchanged"]), f"rank {r}: a failed all_reduce modified its tensor"


@pytest.mark.parametrize("world_size", (2, 3))
def test_mismatch_on_one_lane_spares_the_others(fresh_group, world_size):
    pool = fresh_group(world_size, T)
    seed = seed_of("mismatch_lane", world_size)
    results = pool.run("mismatch_on_one_lane", seed, 513, deadline_s=2 * T + 10)
    names = []
    for r, res in enumerate(results):
        for key in ("bad", "again"):
            rec = res[key]
            assert rec is not None, f"rank {r}: the {key} op on the mismatched lane succeeded"
            assert rec["type"] in ("MismatchError", "RemoteError"), (r, key, rec["message"])
        names.append(res["bad"]["type"])
    assert "MismatchError" in names, names
    for i in range(len(results[0]["goods"])):
        per_rank = [res["goods"][i] for res in results]
        assert_identical_across_ranks(per_rank, f"other lane #{i}")
        inputs = [make_input(seed + i, r, 513, "float32") for r in range(world_size)]
        assert_reduced(unpack(per_rank[0]), inputs, "SUM", "float32", f"other lane #{i}")
