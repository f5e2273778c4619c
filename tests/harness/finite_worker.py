"""One rank of a pccl group for tests/algorithms/test_finite.py, driven over stdin/stdout
with JSON lines.

``python tests/harness/finite_worker.py STORE_PORT RANK WORLD_SIZE TIMEOUT_S`` joins the
default group (backend pccl, a fixed world: rank 0 starts its automatic master, so
the group has master peer ids and DiLoCo runs on it), prints ``{"event": "ready"}``
and answers one command per stdin line (tests/harness/worker_process.py drives it).
Inputs are built from (seed, rank) (``quantized_worker.make_input``), so every rank
computes the expected result of the others itself; results come back as sha256
digests, never as tensors.

- ``whoami``: this rank's master peer id and data address;
- ``reduce``: ``torch_pccl.all_reduce_finite`` of this rank's input, some ranks'
  inputs poisoned with inf or NaN; returns the result's digest, the digest of the
  expected result (the plain ``dist.all_reduce`` / ``all_reduce_quantized`` of the
  same inputs when nothing is poisoned; else the accepted ranks' inputs added in
  rank order and divided by their count) and the ``FiniteResult``;
- ``all_rejected``: every rank's input holds a NaN; the error and whether the
  tensor kept its value;
- ``bad_arguments``: the exception class of each bad call, then a good one;
- ``diloco``: a few outer rounds of ``DiLoCo`` on a tiny model; one rank sets its
  local parameters to NaN before one outer step; per round, whether the outer
  parameters are finite, their digest, and ``OuterStep.rejected``.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import torch_pccl
# Run as a script, this file has tests/harness first on sys.path; "harness" needs tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.quantized_worker import _error, make_input, serve, sha  # noqa: E402
from torch_pccl.algorithms.finite import group_members  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
POISON = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def whoami():
    peer_id, addr = group_members()[dist.get_rank()]
    return {"rank": dist.get_rank(), "peer_id": peer_id, "addr": addr}


def _input(seed, rank, numel, dtype, poison):
    """Rank's input; ``poison`` maps a rank (a str: JSON keys) to "nan", "inf" or "-inf",
    written at two places of that rank's input."""
    x = make_input(seed, rank, numel, DTYPES[dtype])
    kind = poison.get(str(rank))
    if kind is not None:
        x[numel // 3] = POISON[kind]
        x[-1] = POISON[kind]
    return x


def _expected(seed, numel, dtype, op, accepted):
    """The accepted ranks' inputs added in rank order (float32 for 16-bit types), divided by
    their count for AVG: what all_reduce_finite documents for its slow path."""
    xs = [make_input(seed, r, numel, DTYPES[dtype]) for r in accepted]
    wide = torch.float32 if DTYPES[dtype] == torch.bfloat16 else DTYPES[dtype]
    acc = xs[0].to(wide)
    for x in xs[1:]:
        acc.add_(x)
    if op == "AVG":
        acc.div_(len(accepted))
    return acc.to(DTYPES[dtype])


def reduce(seed, numel, op, bits=0, dtype="float32", poison=None):
    poison = poison or {}
    rank, world = dist.get_rank(), dist.get_world_size()
    red = getattr(dist.ReduceOp, op)
    t = _input(seed, rank, numel, dtype, poison)
    res = torch_pccl.all_reduce_finite(t, op=red, bits=bits)
    if poison:
        expected = _expected(seed, numel, dtype, op,
                             [r for r in range(world) if str(r) not in poison])
    else:      # the same inputs through the plain collective
        expected = _input(seed, rank, numel, dtype, poison)
        if bits:
            torch_pccl.all_reduce_quantized(expected, bits=bits, op=red)
        else:
            dist.all_reduce(expected, op=red)
    return {"sha": sha(t), "expected_sha": sha(expected),
            "finite": bool(torch.isfinite(t).all()), "rejected": list(res.rejected),
            "peer_ids": list(res.peer_ids), "addrs": list(res.addrs),
            "world_size": res.world_size, "accepted": res.accepted}


def all_rejected(numel, bits=0):
    t = make_input(7, dist.get_rank(), numel)
    t[numel // 2] = float("nan")
    before = t.clone()
    started = time.monotonic()
    try:
        torch_pccl.all_reduce_finite(t, bits=bits)
    except torch_pccl.PcclError as exc:
        error = _error(exc, started)
    else:
        error = None
    return {"error": error, "unchanged": bool(torch.equal(t.view(torch.int32),
                                                          before.view(torch.int32)))}


def diloco(reject, rounds, poison_round, poison_rank, sync_every=3, quantization=None):
    """``rounds`` outer rounds of DiLoCo (Linear 6 -> 4, inner SGD, the default Nesterov
    outer optimizer); before the outer step of round ``poison_round`` (1-based), rank
    ``poison_rank`` sets its local parameters to NaN."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)            # different initial weights: the constructor syncs
    model = torch.nn.Linear(6, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = torch_pccl.DiLoCo(model, inner, sync_every=sync_every, quantization=quantization,
                          reject_nonfinite=reject)
    g = torch.Generator().manual_seed(rank)
    out = []
    for rnd in range(1, rounds + 1):
        for i in range(sync_every):
            x = torch.randn(8, 6, generator=g)
            loss = model(x).square().mean()
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()
            if rnd == poison_round and rank == poison_rank and i == sync_every - 1:
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(float("nan"))
            o = d.step()
        outer = d.outer_parameters
        out.append({"step": o.step, "rejected": list(o.rejected),
                    "finite": all(bool(torch.isfinite(p).all()) for p in outer),
                    "sha": sha(torch.cat([p.reshape(-1) for p in outer]))})
    return {"rounds": out}


def bad_arguments():
    """Each bad call's exception class (checked before any collective, so the ranks need
    not agree on them); then a good call, which must still work."""
    cases = {"int32": dict(tensor=torch.ones(3, dtype=torch.int32)),
             "max": dict(tensor=torch.ones(3), op=dist.ReduceOp.MAX),
             "bits5": dict(tensor=torch.ones(3), bits=5),
             "bits_true": dict(tensor=torch.ones(3), bits=True),
             "transposed": dict(tensor=torch.ones(4, 2).t()),
             "float64_int8": dict(tensor=torch.ones(3, dtype=torch.float64), bits=8)}
    out = {}
    for name, kw in cases.items():
        try:
            torch_pccl.all_reduce_finite(**kw)
        except Exception as exc:  # noqa: BLE001 - the test asserts on the class
            out[name] = [c.__name__ for c in type(exc).__mro__]
        else:
            out[name] = None
    t = torch.full((5,), float(dist.get_rank()))
    torch_pccl.all_reduce_finite(t, op=dist.ReduceOp.SUM)
    return {"errors": out, "after": t.tolist()}


COMMANDS = {"whoami": whoami, "reduce": reduce, "all_rejected": all_rejected,
            "bad_arguments": bad_arguments, "diloco": diloco}


def main():
    serve(COMMANDS)


if __name__ == "__main__":
    main()
