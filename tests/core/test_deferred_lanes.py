"""Lanes on demand: ``Communicator.connect(defer_lanes=True)`` connects lane 0 alone, and
``connect_deferred_lanes`` the others later (``pcclCommConnectLaneRange``).

- Three ranks in threads: after the connect each has one lane; the later lanes connect
  while lane 0 runs a collective that waits for a rank which connects them only after it
  (so a later range that held lane 0 would deadlock), take lane 0's ring order, and reduce.
- A peer by hand (the hello layout of wire.hpp): a connection for lane 1 that arrives while
  rank 0 still accepts lane 0 waits for lane 1's connect instead of being refused, and is
  answered then; one more than the later lanes can have is closed (the stash is bounded).
"""

import socket
import struct
import threading

import pytest
import torch

from torch_pccl.core.communicator import Communicator

pytestmark = pytest.mark.timeout(60)

T = 10.0
MAGIC, VERSION, KIND_PLAIN = 0x4C434350, 1, 1
HELLO = struct.Struct("<IHHQIIHHHH")


def _hello(comm_id, rank, world, lane, lanes):
    return HELLO.pack(MAGIC, VERSION, KIND_PLAIN, comm_id, rank, world, lane, 0, lanes, 1)


def _read(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _threads(jobs):
    """Runs each job in a thread; returns {key: result or exception} once all ended."""
    out = {}

    def run(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - asserted by the caller
            out[key] = e

    threads = [threading.Thread(target=run, args=(k, fn)) for k, fn in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * T)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return out


def test_later_lanes_connect_beside_a_collective_on_lane_0_and_keep_its_ring_order():
    world, lanes = 3, 3
    comms = [Communicator(r, world, 777, "127.0.0.1", T) for r in range(world)]
    addrs = [f"127.0.0.1:{c.port}" for c in comms]
    try:
        _threads({r: (lambda c=c: c.connect(addrs, lanes=lanes, defer_lanes=True))
                  for r, c in enumerate(comms)})
        assert [len(c.lanes) for c in comms] == [1] * world
        assert [c.deferred_lanes for c in comms] == [lanes - 1] * world
        order = [2, 0, 1]
        _threads({r: (lambda c=c: c.set_ring_order(order)) for r, c in enumerate(comms)})

        bufs = [torch.full((5,), float(r + 1)) for r in range(world)]
        done = threading.Event()

        def rank2():
            # Lane 0 first: it finishes only if ranks 0 and 1 run it while their later
            # lanes wait for this rank.
            comms[2].all_reduce(bufs[2])
            done.set()
            return comms[2].connect_deferred_lanes()

        out = _threads({0: comms[0].connect_deferred_lanes, 1: comms[1].connect_deferred_lanes,
                        "r0": lambda: comms[0].all_reduce(bufs[0]),
                        "r1": lambda: comms[1].all_reduce(bufs[1]), 2: rank2})
        assert done.is_set()
        for key, value in out.items():
            assert not isinstance(value, Exception), (key, value)
        assert [b.tolist() for b in bufs] == [[6.0] * 5] * world
        assert [len(c.lanes) for c in comms] == [lanes] * world
        assert [c.deferred_lanes for c in comms] == [0] * world
        assert {lane.ring_order for c in comms for lane in c.lanes} == {tuple(order)}
        assert comms[0].connect_deferred_lanes().lanes == comms[0].lanes  # nothing left

        for k in range(1, lanes):
            vals = [torch.full((3,), float(10 * k + r)) for r in range(world)]
            _threads({r: (lambda r=r: comms[r].lanes[k].all_reduce(vals[r]))
                      for r in range(world)})
            assert [v.tolist() for v in vals] == [[float(30 * k + 3)] * 3] * world
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("surplus", [False, True])
def test_a_connection_for_a_later_lane_that_comes_first_waits_for_its_lane(surplus):
    comm_id, world, lanes = 31337, 2, 2
    comm = Communicator(0, world, comm_id, "127.0.0.1", T)
    addrs = [f"127.0.0.1:{comm.port}", "127.0.0.1:9"]
    socks = []
    try:
        # Rank 1, by hand: lane 1 first (as a peer already past lane 0 would), then lane 0.
        early = socket.create_connection(("127.0.0.1", comm.port), timeout=T)
        early.sendall(_hello(comm_id, 1, world, 1, lanes))
        socks.append(early)
        if surplus:  # one more than lane 1 has: rank 1 has one link there
            extra = socket.create_connection(("127.0.0.1", comm.port), timeout=T)
            extra.sendall(_hello(comm_id, 1, world, 1, lanes))
            socks.append(extra)
        lane0 = socket.create_connection(("127.0.0.1", comm.port), timeout=T)
        socks.append(lane0)
        # Sent once the early ones are surely accepted: rank 0 reads in arrival order.
        connect = threading.Thread(target=comm.connect, args=(addrs,),
                                   kwargs={"lanes": lanes, "defer_lanes": True})
        connect.start()
        lane0.sendall(_hello(comm_id, 1, world, 0, lanes))
        reply = HELLO.unpack(_read(lane0, HELLO.size))
        connect.join(T)
        assert not connect.is_alive() and len(comm.lanes) == 1
        assert reply[4] == 0 and reply[6] == 0 and reply[8] == lanes   # rank 0, lane 0, of 2

        early.settimeout(0.3)
        with pytest.raises(socket.timeout):
            early.recv(1)                    # kept, not answered: lane 1 is not connecting
        comm.connect_deferred_lanes()
        assert len(comm.lanes) == lanes
        early.settimeout(T)
        reply = HELLO.unpack(_read(early, HELLO.size))
        assert reply[4] == 0 and reply[6] == 1                          # rank 0, lane 1
        if surplus:
            socks[1].settimeout(T)
            assert socks[1].recv(1) == b"", "a connection past the stash's bound was kept"
    finally:
        for s in socks:
            s.close()
        comm.close()
