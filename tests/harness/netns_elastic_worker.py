"""One elastic peer in its own network namespace, for tests/elastic/test_netns_elastic.py.

    ip netns exec NS python tests/harness/netns_elastic_worker.py MASTER_HOST:PORT JOIN_TIMEOUT_S

Driven over stdin/stdout with JSON lines (one command, one answer), like
tests/harness/elastic_worker.py, except that it imports torch first and joins only on
the ``join`` command, so the parent can start every process at once (imports in
parallel) and still decide when each peer registers with the master. Group op
timeout: env PCCL_TIMEOUT. Errors of the commands are reported, not raised.
"""

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_pccl
# Run as a script, this file has tests/harness first on sys.path; "harness" needs tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.data import make_input, pack  # noqa: E402
from harness.netns_worker import tcp_sockets  # noqa: E402
from torch_pccl.elastic.topology import elastic_group  # noqa: E402

N = 100_003          # elements of the checked all_reduces (odd: uneven chunks)
LOOP_N = 200_003     # elements per all_reduce of the kill loop


def emit(**msg):
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def error_record(exc, started):
    now = time.monotonic()
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc), "call_start": started, "error_time": now,
            "elapsed": now - started, "traceback": traceback.format_exc()[-3000:]}


def world():
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "epoch": torch_pccl.epoch(),
            "group_ranks": dist.get_process_group_ranks(dist.group.WORLD)}


def digest(t):
    return pack(t, raw=False)["digest"]


def join(master, timeout_s):
    dist.init_process_group(backend="pccl", init_method=f"pccl://{master}",
                            timeout=timedelta(seconds=timeout_s))
    return world()


def listener():
    """The data-plane listener's address, and what this namespace really has listening there."""
    lst = elastic_group(None).membership.listener
    socks = tcp_sockets()
    return {"host": lst.host, "port": lst.port, "address": lst.address,
            "listening": [local for state, local, _ in socks
                          if state == "LISTEN" and local[1] == lst.port],
            "loopback": [s for s in socks if s[1][0].startswith("127.") or s[1][0] == "::1"]}


def all_reduce(seed):
    """SUM of make_input(seed, rank) in float32 and int64; digests of the results."""
    rank = dist.get_rank()
    out = {"input_rank": rank}
    for dtype in ("float32", "int64"):
        t = make_input(seed, rank, N, dtype)
        started = time.monotonic()
        try:
            dist.all_reduce(t)
        except torch_pccl.PcclError as exc:
            return {"error": error_record(exc, started), **out}
        out[dtype] = digest(t)
    return {"error": None, **out, **world()}


def loop_all_reduce(max_s=30.0):
    """All-reduces until one fails (or ``max_s`` passes); reports the failure."""
    t = torch.ones(LOOP_N)
    done = 0
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            dist.all_reduce(t)
        except torch_pccl.PcclError as exc:
            return {"error": error_record(exc, started), "done": done}
        t.fill_(1.0)
        done += 1
        if done == 3:
            emit(event="looping")
    return {"error": None, "done": done}


def retry_all_reduce(seed):
    """all_reduce_with_retry of inputs made with the rank held *before* the call."""
    rank = dist.get_rank()
    out = {"input_rank": rank}
    tensors = {dtype: make_input(seed, rank, N, dtype) for dtype in ("float32", "int64")}
    changes = []
    for dtype, t in tensors.items():
        changes += torch_pccl.all_reduce_with_retry(t)
        out[dtype] = digest(t)
    return {**out, "changes": [[c.epoch, c.world_size, list(c.left), list(c.joined)]
                               for c in changes], **world()}


def update():
    change = torch_pccl.update_topology()
    return {"change_epoch": change.epoch, "change_world_size": change.world_size,
            "joined": list(change.joined), "left": list(change.left), **world()}


COMMANDS = {
    "join": join,
    "listener": listener,
    "all_reduce": all_reduce,
    "loop_all_reduce": loop_all_reduce,
    "retry_all_reduce": retry_all_reduce,
    "update": update,
    "pending": lambda: {"pending": torch_pccl.peers_pending()},
}


def main():
    torch.set_num_threads(1)
    master, join_timeout_s = sys.argv[1], float(sys.argv[2])
    emit(event="started", pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        if name == "join":
            cmd = {"master": master, "timeout_s": join_timeout_s}
        try:
            emit(event=name, **COMMANDS[name](**cmd))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            emit(event=name, exception=error_record(exc, time.monotonic()))


if __name__ == "__main__":
    main()
