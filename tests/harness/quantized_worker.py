"""Inputs, the error bound of the quantized all-reduce, and one rank of a pccl group for
tests/algorithms/test_quantized.py, driven over stdin/stdout with JSON lines.

``python tests/harness/quantized_worker.py STORE_PORT RANK WORLD_SIZE TIMEOUT_S`` joins the
default group (backend pccl) through the test's TCPStore, prints ``{"event": "ready"}``
and answers one command per stdin line (``{"cmd": NAME, ...}``) with one line
(tests/harness/worker_process.py drives it). Each rank builds its input from (seed, rank)
and checks its result against the float64 reference and the bound itself, so no
tensor crosses the pipe: results come back as sha256 digests and the largest
violation of the bound.

The bound (per element i in block b of ``block`` elements, W ranks, q = 127 for
8 bits and 7 for 4 bits, s_r = absmax_b(x_r) / q the scale of rank r's input
block): each contribution is quantized once, with error at most s_r / 2 (round
to nearest); the owner sums in float32 (relative error below W * 2^-24 of the sum
of magnitudes); AVG divides by W; the result y is quantized once with scale
absmax_b(y) / q <= (absmax_b(exact) + E_in) / q. Hence

    |out_i - exact_i| <= E_in + (absmax_b(exact) + E_in) / (2 q) + slack,
    E_in = sum_r s_r / 2 (divided by W for AVG),  slack = 1e-6 * sum_r absmax_b(x_r).

(The owner's own slice is exact, so E_in over-counts one rank: the bound is not tight.)
"""

import hashlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

QMAX = {8: 127, 4: 7}


def make_input(seed, rank, numel, dtype=torch.float32):
    """Rank's input: normal values scaled by (rank + 1), with a few large outliers."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 1)
    x = torch.randn(numel, generator=g, dtype=torch.float64) * (rank + 1)
    if numel:
        x[torch.randint(0, numel, (max(1, numel // 500),), generator=g)] *= 50
    return x.to(dtype)


def _block_absmax(x, block):
    """absmax over each block of ``block`` elements of a 1-D float64 tensor, per element."""
    n = x.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, dtype=torch.float64)
    padded[:n] = x.abs()
    return padded.view(nb, block).amax(dim=1).repeat_interleave(block)[:n]


def error_bound(inputs, bits, block, avg):
    """(exact float64 reference, per-element bound) for the quantized all-reduce of ``inputs``."""
    xs = [x.double().reshape(-1) for x in inputs]
    w = len(xs)
    exact = sum(xs)
    amax = [_block_absmax(x, block) for x in xs]
    e_in = sum(a / QMAX[bits] / 2 for a in amax)
    if avg:
        exact, e_in = exact / w, e_in / w
    slack = 1e-6 * sum(amax)
    bound = e_in + (_block_absmax(exact, block) + e_in) / (2 * QMAX[bits]) + slack
    return exact, bound


def violation(out, exact, bound):
    """The largest (|out - exact| - bound), <= 0 when every element is within its bound."""
    if out.numel() == 0:
        return 0.0
    return float(((out.double().reshape(-1) - exact).abs() - bound).max())


def sha(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def slices(count, world, block):
    """Each owner's (begin, size) in elements, as native/src/quantize.cpp cuts them."""
    blocks = -(-count // block)
    base, rem = divmod(blocks, world)
    out = []
    for r in range(world):
        b0 = r * base + min(r, rem)
        nb = base + (1 if r < rem else 0)
        begin = min(count, b0 * block)
        out.append((begin, min(count, (b0 + nb) * block) - begin))
    return out


def message_bytes(n, bits, block):
    return -(-n // block) * 4 + (n if bits == 8 else (n + 1) // 2)


def expected_bytes_sent(count, world, rank, bits, block, chunk_bytes=1 << 20, header=40):
    """Bytes a rank sends: phase 1 its input's slice for each other owner, phase 2 its result
    to every other rank; each message in frames of at most chunk_bytes, one 40-byte header each."""
    def framed(nbytes):
        return nbytes + header * max(1, -(-nbytes // chunk_bytes))
    msgs = [message_bytes(size, bits, block) for _, size in slices(count, world, block)]
    return sum(framed(m) for p, m in enumerate(msgs) if p != rank) + (world - 1) * framed(msgs[rank])


# -- the worker process ----------------------------------------------------------


def _emit(**msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _error(exc, started):
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc), "elapsed": time.monotonic() - started}


def reduce(seed, numel, bits, op, block=256, async_op=False, via="package"):
    """All-reduces this rank's input; checks it against the bound here."""
    import torch_pccl

    rank, world = dist.get_rank(), dist.get_world_size()
    t = make_input(seed, rank, numel)
    red = getattr(dist.ReduceOp, op)
    if via == "package":
        work = torch_pccl.all_reduce_quantized(t, bits=bits, op=red, async_op=async_op,
                                               block=block)
        returned = work is not None
        if async_op:
            work.wait()
    else:  # the process group's own method
        pg = dist.group.WORLD  # the ProcessGroupPCCL itself (the backend's creator returns it)
        assert isinstance(pg, torch_pccl.ProcessGroupPCCL), type(pg)
        work = pg.allreduce_quantized(t, bits=bits, block=block, op=red,
                                      timeout=timedelta(seconds=30))
        returned = work is not None
        work.wait()
    exact, bound = error_bound([make_input(seed, r, numel) for r in range(world)], bits, block,
                               op == "AVG")
    return {"sha": sha(t), "violation": violation(t, exact, bound), "returned_work": returned}


def mismatch(numel, bits_by_rank, block_by_rank):
    """Calls with this rank's bits and block; reports the error and whether t is unchanged."""
    import torch_pccl

    rank = dist.get_rank()
    t = make_input(1, rank, numel)
    before = t.clone()
    started = time.monotonic()
    try:
        torch_pccl.all_reduce_quantized(t, bits=bits_by_rank[rank], block=block_by_rank[rank])
    except torch_pccl.PcclError as exc:
        return {"error": _error(exc, started), "unchanged": bool(torch.equal(t, before))}
    return {"error": None, "unchanged": bool(torch.equal(t, before))}


COMMANDS = {"reduce": reduce, "mismatch": mismatch}


def main():
    serve(COMMANDS)


def serve(commands):
    """Joins the store-bootstrapped pccl world given on the command line (PORT RANK WORLD
    TIMEOUT_S), says "ready", then answers each stdin command with ``commands[name]``'s
    event (or its exception) until "exit" or EOF."""
    torch.set_num_threads(1)
    port, rank, world, timeout_s = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                    float(sys.argv[4]))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("pccl", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    _emit(event="ready", pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "exit":
            break
        started = time.monotonic()
        try:
            _emit(event=name, **commands[name](**cmd))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            _emit(event=name, exception={**_error(exc, started),
                                         "traceback": traceback.format_exc()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
