"""Quantized all-reduce (issue 5 A): ``Communicator.all_reduce_quantized``,
``ProcessGroupPCCL.allreduce_quantized`` and ``torch_pccl.all_reduce_quantized``.

Communicator-level tests run every rank of a group in a thread of this process
(cffi releases the GIL during each native call; every join has a deadline).
The package-level API needs a default process group per process, so that test
drives tests/harness/quantized_worker.py subprocesses (JSON lines, every wait bounded,
every process killed in a finally).

Checked: the per-element error bound against an exact float64 reference (derived
in tests/harness/quantized_worker.py), bit parity of the results across ranks, sizes 0,
1, odd, not a multiple of the block and large, world sizes 1-4, the bytes on the
wire (``Communicator.stats`` deltas against the documented formula), peers
passing other bits or block failing with MismatchError, and outputs left
unchanged by a failed op.
"""

import os
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import HARNESS, REPO
from harness.quantized_worker import error_bound, expected_bytes_sent, make_input, sha, violation
from harness.worker_process import WorkerProcess, call_all

pytestmark = [pytest.mark.timeout(180), pytest.mark.pccl_only]

T = 10.0        # seconds: op timeout of the in-process groups
JOIN_S = 30.0   # seconds: deadline of joining the threads of one collective
AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
WORKER = os.path.join(HARNESS, "quantized_worker.py")


# -- an in-process group: one thread per rank ----------------------------------------------


@pytest.fixture
def group():
    """Factory of connected Communicators (one per rank) in this process; closed after."""
    from torch_pccl.core.communicator import Communicator

    made = []

    def make(world):
        comm_id = int.from_bytes(os.urandom(8), "little")
        comms = [Communicator(r, world, comm_id, "127.0.0.1", T) for r in range(world)]
        made.extend(comms)
        addrs = [f"127.0.0.1:{c.port}" for c in comms]
        on_all(comms, lambda r, c: c.connect(addrs))
        return comms

    yield make
    for c in made:
        c.abort()
        c.close()


def on_all(comms, fn):
    """Runs fn(rank, comm) on every rank at once; returns results or raises the first error."""
    results = collect(comms, fn)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def collect(comms, fn):
    """Runs fn(rank, comm) on every rank at once; returns each result or exception."""
    out = [None] * len(comms)

    def run(r):
        try:
            out[r] = fn(r, comms[r])
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a rank hung past the join deadline"
    return out


def reduce_all(comms, inputs, bits, op, block, **kw):
    """Quantized all-reduce of inputs[r] on rank r into fresh outputs; returns the outputs."""
    outs = [torch.full_like(x, float("nan")) for x in inputs]
    on_all(comms, lambda r, c: c.all_reduce_quantized(inputs[r], outs[r], bits=bits,
                                                      block=block, op=op, **kw))
    return outs


def assert_parity_and_bound(outs, inputs, bits, block, op, what):
    digests = {sha(o) for o in outs}
    assert len(digests) == 1, f"{what}: ranks differ in their result bytes"
    exact, bound = error_bound(inputs, bits, block, op == AVG)
    worst = violation(outs[0], exact, bound)
    assert worst <= 0, f"{what}: an element exceeds its error bound by {worst:.3g}"


# -- correctness ---------------------------------------------------------------------------

SIZES = (0, 1, 7, 255, 257, 4099)


@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_bound_and_parity(group, world):
    comms = group(world)
    for numel in SIZES:
        for bits in (8, 4):
            for op, block in ((AVG, 256), (SUM, 64)):
                seed = numel * 31 + bits + block
                inputs = [make_input(seed, r, numel) for r in range(world)]
                outs = reduce_all(comms, inputs, bits, op, block)
                assert_parity_and_bound(outs, inputs, bits, block, op,
                                        f"world {world} n={numel} int{bits} {op} block {block}")


def test_large_odd_size(group):
    comms = group(4)
    numel = 1_000_003  # odd, not a multiple of any block, world size or chunk
    inputs = [make_input(5, r, numel) for r in range(4)]
    for bits in (8, 4):
        outs = reduce_all(comms, inputs, bits, AVG, 1000)
        assert_parity_and_bound(outs, inputs, bits, 1000, AVG, f"large int{bits}")


def test_in_place_and_16_bit_inputs(group):
    comms = group(3)
    inputs = [make_input(9, r, 5000) for r in range(3)]
    tensors = [x.clone() for x in inputs]
    on_all(comms, lambda r, c: c.all_reduce_quantized(tensors[r], bits=8, block=128, op=AVG))
    assert_parity_and_bound(tensors, inputs, 8, 128, AVG, "in place")
    for dtype in (torch.float16, torch.bfloat16):
        low = [x.to(dtype) for x in inputs]
        outs = reduce_all(comms, low, 8, AVG, 128)
        assert len({sha(o) for o in outs}) == 1
        # The float32 result rounded once more to the 16-bit type.
        exact, bound = error_bound(low, 8, 128, True)
        tol = bound + exact.abs() * torch.finfo(dtype).eps
        assert bool(((outs[0].double() - exact).abs() <= tol).all()), dtype


def test_block_edge_cases_and_non_finite(group):
    comms = group(2)
    # block 1 (one scale per element: exact up to rounding of the scale) and the largest block.
    inputs = [make_input(3, r, 999) for r in range(2)]
    for block in (1, 65535):
        outs = reduce_all(comms, inputs, 8, SUM, block)
        assert_parity_and_bound(outs, inputs, 8, block, SUM, f"block {block}")
    # A zero block stays exactly zero; an inf or NaN poisons only its own block.
    x = torch.ones(12)
    x[:4] = 0.0
    y = x.clone()
    y[9] = float("inf")
    outs = reduce_all(comms, [x, y], 8, SUM, 4)
    assert sha(outs[0]) == sha(outs[1])
    assert bool((outs[0][:4] == 0).all()) and bool((outs[0][4:8] == 2).all())
    assert bool(outs[0][8:].isnan().all())


def test_bytes_on_the_wire(group):
    """Communicator.stats deltas equal the documented traffic, ~1/4 (int8) and ~1/8 (int4)
    of the float32 all_reduce's."""
    world, numel = 3, 100_003
    comms = group(world)
    inputs = [make_input(4, r, numel) for r in range(world)]
    plain = on_all(comms, lambda r, c: sent_by(c, lambda: c.all_reduce(inputs[r].clone())))
    for bits in (8, 4):
        for block in (32, 256):
            sent = on_all(comms, lambda r, c: sent_by(c, lambda: c.all_reduce_quantized(
                inputs[r].clone(), bits=bits, block=block)))
            for r in range(world):
                assert sent[r] == expected_bytes_sent(numel, world, r, bits, block), (bits, block, r)
            ratio = sum(sent) / sum(plain)
            assert ratio < bits / 32 + 1 / block + 0.01, (bits, block, ratio)


def sent_by(comm, fn):
    before = comm.stats()[0]
    fn()
    return comm.stats()[0] - before


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ("bits", "block", "plain"))
def test_mismatch_fails_every_rank_and_leaves_outputs(group, kind):
    """A peer with other bits or another block (or a plain all_reduce) is named a mismatch."""
    from torch_pccl import MismatchError, PcclError

    comms = group(3)
    inputs = [make_input(2, r, 1000) for r in range(3)]
    outs = [torch.zeros(1000) for _ in range(3)]

    def call(r, c):
        if kind == "plain" and r == 2:
            return c.all_reduce(inputs[r], outs[r])
        bits = 4 if kind == "bits" and r == 1 else 8
        block = 128 if kind == "block" and r == 1 else 256
        return c.all_reduce_quantized(inputs[r], outs[r], bits=bits, block=block)

    results = collect(comms, call)
    assert all(isinstance(e, PcclError) for e in results), results
    assert any(isinstance(e, MismatchError) for e in results), results
    if kind != "plain":
        assert any("int4" in str(e) or "block" in str(e) for e in results), results
    assert all(bool((o == 0).all()) for o in outs), "a failed op wrote an output"


def test_timeout_leaves_output_unchanged(group):
    """A peer that never joins: the op times out and the output is not touched."""
    from torch_pccl import PcclTimeoutError

    comms = group(2)
    x = make_input(1, 0, 10_000)
    out = torch.full_like(x, 7.0)
    with pytest.raises(PcclTimeoutError):
        comms[0].all_reduce_quantized(x, out, bits=4, timeout_s=0.3)
    assert bool((out == 7.0).all())


def test_invalid_arguments_raise_before_the_network(group):
    from torch_pccl import InvalidArgumentError

    (comm,) = group(1)
    x = torch.ones(10)
    bad = [dict(bits=5), dict(bits=True), dict(block=0), dict(block=65536), dict(block=2.0),
           dict(op=dist.ReduceOp.MAX)]
    for kw in bad:
        with pytest.raises(InvalidArgumentError):
            comm.all_reduce_quantized(x, **kw)
    for t in (torch.ones(10, dtype=torch.float64), torch.ones(10, 2).t()):
        with pytest.raises(InvalidArgumentError):
            comm.all_reduce_quantized(t)
    with pytest.raises(InvalidArgumentError):
        comm.all_reduce_quantized(x, torch.ones(11))
    assert comm.error() == 0  # caller errors are not sticky
    comm.all_reduce_quantized(x)
    assert bool((x == 1).all())  # world 1, exactly representable: 1 * (127/127) == 1


# -- package level and process group: one process per rank -----------------------------------


class Rank(WorkerProcess):
    def __init__(self, tmp_path, port, rank, world):
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        super().__init__(f"rank{rank}", [sys.executable, WORKER, str(port), str(rank), str(world),
                                         str(T)], env, tmp_path / f"rank{rank}.stderr")


def test_package_level_api_across_processes(tmp_path):
    """torch_pccl.all_reduce_quantized (sync and async) and ProcessGroupPCCL.allreduce_quantized
    on a 3-process default group, then a bits mismatch: MismatchError, tensors unchanged."""
    world = 3
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ranks = []
    try:
        ranks = [Rank(tmp_path, store.port, r, world) for r in range(world)]
        for p in ranks:
            p.recv(120, "ready")
        cases = [dict(seed=1, numel=10_007, bits=8, op="AVG"),
                 dict(seed=2, numel=513, bits=4, op="SUM", block=64, async_op=True),
                 dict(seed=3, numel=0, bits=8, op="AVG", async_op=True),
                 dict(seed=4, numel=3000, bits=4, op="AVG", block=1024, via="group")]
        for case in cases:
            res = call_all(ranks, "reduce", 60, **case)
            assert len({r["sha"] for r in res}) == 1, f"{case}: results differ across ranks"
            assert all(r["violation"] <= 0 for r in res), f"{case}: bound exceeded {res}"
            expect_work = case.get("async_op", False) or case.get("via") == "group"
            assert all(r["returned_work"] == expect_work for r in res), case
        res = call_all(ranks, "mismatch", 2 * T + 30, numel=1000, bits_by_rank=[8, 4, 8],
                       block_by_rank=[256, 256, 256])
        types = [r["error"]["type"] if r["error"] else None for r in res]
        assert "MismatchError" in types and None not in types, types
        assert all(r["unchanged"] for r in res), "a failed op changed a tensor"
    finally:
        for p in ranks:
            p.close()
