"""One elastic peer for tests/elastic/test_churn.py, driven over stdin/stdout with JSON lines.

``python tests/harness/churn_worker.py MASTER_ADDR TIMEOUT_S VALUE`` imports torch,
prints ``{"event": "started", ...}`` and then waits as a *standby*: it
registers with the master (``init_process_group(init_method="pccl://...")``)
only when the test sends ``{"cmd": "join"}``, so a replacement peer's
start-up (importing torch) overlaps the previous round instead of adding to
it. After ``ready`` it runs one command per stdin line, as
tests/harness/elastic_worker.py does (it reuses its helpers).

Every peer contributes ``base(n) + VALUE`` (``base`` = ``arange(n) % 251``,
float32, exact), so after a SUM over ``k`` peers ``t - k * base(n)`` is the
sum of their VALUEs in every element: a result that mixes worlds, misses a
peer's chunk or counts one twice shows up as a wrong or non-uniform residue.
"""

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

import torch_pccl
# Run as a script, this file has tests/harness first on sys.path; "harness" needs tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.elastic_worker import emit, error_record, standby_then_serve, world  # noqa: E402

VALUE = 0.0
LAST = {}   # the tensor of the all_reduce that failed, kept for the retry


def base(n):
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.float32)


def sha(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def residue(t):
    """What the peers' VALUEs sum to in ``t`` after a SUM over the current world."""
    r = t - dist.get_world_size() * base(t.numel())
    return {"residue": r[0].item(), "uniform": bool((r == r[0]).all())}


def loop(n, max_s):
    """All-reduces ``base(n) + VALUE`` until one fails (or ``max_s`` passes).

    On the failure it reports the error, how long that op ran, and whether
    the input is bit-identical to what it was before the op (sha256 of the
    bytes against the template the op started from).
    """
    template = base(n) + VALUE
    t = torch.empty_like(template)
    emit(event="looping")
    deadline = time.monotonic() + max_s
    done = 0
    while time.monotonic() < deadline:
        t.copy_(template)
        started = time.monotonic()
        try:
            dist.all_reduce(t)
        except torch_pccl.PcclError as exc:
            LAST["t"] = t
            return {"error": error_record(exc, started), "done": done,
                    "sha_before": sha(template), "sha_after": sha(t), **world()}
        done += 1
    return {"error": None, "done": done}


def retry(mode):
    """Finishes the failed all_reduce on the smaller world, on the tensor it left."""
    t = LAST.pop("t")
    out = {}
    if mode == "update":
        # The network error is sticky until update_topology: one more op fails at once.
        probe = torch.zeros(8)
        started = time.monotonic()
        try:
            dist.all_reduce(probe)
            out["sticky"] = None
        except torch_pccl.PcclError as exc:
            out["sticky"] = error_record(exc, started)
        change = torch_pccl.update_topology()
        dist.all_reduce(t)
        changes = [change]
    else:
        changes = torch_pccl.all_reduce_with_retry(t)
    return {**out, **residue(t), "changes": len(changes),
            "left": [list(c.left) for c in changes], "joined": [list(c.joined) for c in changes],
            **world()}


def check(n=1000):
    t = base(n) + VALUE
    dist.all_reduce(t)
    return {**residue(t), **world()}


def update():
    change = torch_pccl.update_topology()
    return {"joined": list(change.joined), "left": list(change.left), **world()}


COMMANDS = {
    "loop": loop,
    "retry": retry,
    "check": check,
    "update": update,
    "pending": lambda: {"pending": torch_pccl.peers_pending()},
}


def main():
    global VALUE
    torch.set_num_threads(1)
    master, timeout_s, VALUE = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    emit(event="started", pid=os.getpid())
    standby_then_serve(master, timeout_s, COMMANDS)


if __name__ == "__main__":
    main()
