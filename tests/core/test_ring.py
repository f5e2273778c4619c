"""A ring in another order than the ranks (Communicator.set_ring_order): every ring
collective gives bit-identical results on every rank and the same values as rank order,
with rank-ordered layouts (ranks on threads in this process)."""

import pytest
import torch
from harness.threads import on_threads

from torch_pccl import Communicator
from torch_pccl.errors import InvalidArgumentError, PcclError

W = 4
ORDERS = ([0, 2, 1, 3], [3, 2, 1, 0], [1, 3, 0, 2])
OUTPUTS_PER_SIZE = 8        # all-reduce, all-gather, reduce-scatter, 4 broadcasts, int all-reduce
REDUCE_SCATTER = 2          # the one output that differs per rank by design


def _ring_collectives(comm, r):
    """Exact inputs (small integers), so any summation order gives the same values."""
    out = []
    for n in (1, 5, 1003, 40_000):
        x = (torch.arange(n, dtype=torch.float32) % 17) * (r + 1) - 3 * r
        a = x.clone()
        comm.all_reduce(a)
        out.append(a)
        g = torch.empty(W * n)
        comm.all_gather(x, g)
        out.append(g)
        rs = torch.empty(n)
        comm.reduce_scatter(torch.cat([x + k for k in range(W)]), rs)
        out.append(rs)
        for root in range(W):
            b = x.clone()
            comm.broadcast(b, root)
            out.append(b)
        ints = torch.arange(n, dtype=torch.int64) * (r + 7)
        comm.all_reduce(ints)
        out.append(ints)
    comm.barrier()
    return out


def _run(order):
    comms = [Communicator(r, W, 61, "127.0.0.1", 10.0) for r in range(W)]
    addrs = [f"127.0.0.1:{c.port}" for c in comms]

    def body(r):
        comms[r].connect(addrs, lanes=2, streams=2)
        comms[r].set_option("chunk_bytes", 8192)
        if order is not None:
            comms[r].set_ring_order(order)
        assert comms[r].ring_order == tuple(order or range(W))
        return _ring_collectives(comms[r], r) + _ring_collectives(comms[r].lanes[1], r)

    try:
        return on_threads(body, W)
    finally:
        for c in comms:
            c.close()


def test_reordered_rings_match_rank_order_and_agree_on_every_rank():
    reference = _run(None)
    for order in ORDERS:
        results = _run(order)
        for i, expected in enumerate(reference[0]):
            for r in range(W):
                assert torch.equal(results[r][i], reference[r][i]), (order, r, i)
        for i in range(len(results[0])):
            if i % OUTPUTS_PER_SIZE != REDUCE_SCATTER:
                assert all(torch.equal(results[r][i], results[0][i]) for r in range(W)), (order, i)


def test_the_order_is_what_the_ring_follows():
    """Ranks that disagree on the order send where nobody listens: the op fails (so the
    order really steers the traffic) instead of succeeding in rank order."""
    comms = [Communicator(r, 3, 63, "127.0.0.1", 2.0) for r in range(3)]
    addrs = [f"127.0.0.1:{c.port}" for c in comms]

    def body(r):
        comms[r].connect(addrs)
        comms[r].set_ring_order([0, 1, 2] if r == 0 else [0, 2, 1])
        try:
            comms[r].all_reduce(torch.ones(10_000))
        except PcclError as e:
            return e
        return None

    try:
        errors = on_threads(body, 3, deadline_s=30.0)
    finally:
        for c in comms:
            c.close()
    assert all(isinstance(e, PcclError) for e in errors), errors


def test_bad_ring_orders_are_refused():
    comm = Communicator(0, 1, 62, "127.0.0.1", 5.0)
    try:
        comm.connect([f"127.0.0.1:{comm.port}"])
        for bad in ([1], [0, 0], [], [0.0]):
            with pytest.raises(InvalidArgumentError, match="permutation"):
                comm.set_ring_order(bad)
        comm.set_ring_order([0])
        assert comm.ring_order == (0,)
    finally:
        comm.close()
