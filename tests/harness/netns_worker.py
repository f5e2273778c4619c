"""One rank of a multi-host test, run as ``ip netns exec NS python tests/harness/netns_worker.py ...``.

    python netns_worker.py MODE RANK WORLD_SIZE STORE_HOST STORE_PORT TIMEOUT_S OUT_DIR [SEED]

Joins ``backend="pccl"`` through ``init_method=tcp://STORE_HOST:STORE_PORT`` (rank 0
hosts the TCPStore in its own namespace), with MASTER_ADDR/PCCL_HOST unset, so
the address each rank advertises comes from the route to the store host.
Reports to the parent as JSON lines on stdout: ``{"event": "started", ...}``,
mode-specific events, then ``{"event": "result", ...}``. Large tensors go to
files in OUT_DIR. Modes:

- ``collectives``: all_reduce SUM (float32 and int64), broadcast, all_gather_into_tensor
  on odd sizes; reports SHA-256 digests, the advertised and listening addresses
  and the TCP connections seen in this namespace.
- ``kill_loop``: all_reduces in a loop; prints ``looping`` after a few, and reports
  the PcclError (type, timing) that ends the loop once the parent kills a rank.
"""

import json
import os
import socket
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
from torch_pccl.core.address import advertised_host  # noqa: E402

N_REDUCE = 1_000_003
N_BROADCAST = 100_003
N_GATHER = 10_007
LOOP_NUMEL = 200_003
LOOP_LIMIT_S = 60.0


def emit(event, **fields):
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def digest(t):
    return pack(t, raw=False)["digest"]  # SHA-256 of the tensor's bytes


def _proc_addr(text):
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        addr = socket.inet_ntop(socket.AF_INET6, raw)
        if addr.startswith("::ffff:") and "." in addr:
            addr = addr[len("::ffff:"):]
    return [addr, int(port, 16)]


def tcp_sockets():
    """This namespace's TCP sockets as (state, [local addr, port], [remote addr, port])."""
    out = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            state = {"01": "ESTABLISHED", "0A": "LISTEN"}.get(fields[3], fields[3])
            out.append([state, _proc_addr(fields[1]), _proc_addr(fields[2])])
    return out


def init(rank, world, host, port, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("pccl", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def communicator():
    """The default group's Communicator (the group itself is a ProcessGroupPCCL)."""
    group = dist.group.WORLD
    assert isinstance(group, torch_pccl.ProcessGroupPCCL), type(group)
    return group.communicator


def collectives(rank, world, host, port, timeout_s, out_dir, seed):
    init(rank, world, host, port, timeout_s)
    t = make_input(seed, rank, N_REDUCE, "float32")
    dist.all_reduce(t)
    res = {"advertised": advertised_host(dist.distributed_c10d._get_default_store()),
           "listen_port": communicator().port}
    res["sum_float32"] = digest(t)
    if rank == 0:  # the parent checks the values against a float64 reference
        t.numpy().tofile(os.path.join(out_dir, "sum_float32.bin"))

    t = make_input(seed, rank, N_REDUCE, "int64")
    dist.all_reduce(t)
    res["sum_int64"] = digest(t)

    root = world - 1
    t = make_input(seed, rank, N_BROADCAST, "float32")
    dist.broadcast(t, src=root)
    res["broadcast"] = digest(t)

    out = torch.empty(N_GATHER * world, dtype=torch.int64)
    dist.all_gather_into_tensor(out, make_input(seed, rank, N_GATHER, "int64"))
    res["all_gather"] = digest(out)

    res["sockets"] = tcp_sockets()  # links are still open: the group is alive
    dist.barrier()
    dist.destroy_process_group()
    emit("result", **res)


def kill_loop(rank, world, host, port, timeout_s, out_dir, seed):
    init(rank, world, host, port, timeout_s)
    t = make_input(seed, rank, LOOP_NUMEL, "float32")
    start = time.monotonic()
    done = 0
    while time.monotonic() - start < LOOP_LIMIT_S:
        call_start = time.monotonic()
        try:
            dist.all_reduce(t)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which judges it
            now = time.monotonic()
            emit("result", iterations=done, type=type(e).__name__,
                 mro=[c.__name__ for c in type(e).__mro__], message=str(e)[:2000],
                 call_start=call_start, error_time=now, traceback=traceback.format_exc()[-3000:])
            os._exit(0)  # the group is broken on purpose; no orderly teardown to wait for
        done += 1
        t.mul_(0.5)  # keep the values bounded
        if done == 3:
            emit("looping")
    emit("result", iterations=done, type=None)
    os._exit(0)


def main():
    mode, rank, world, host, port, timeout_s, out_dir = sys.argv[1:8]
    seed = int(sys.argv[8]) if len(sys.argv) > 8 else 1
    emit("started", pid=os.getpid())
    fn = {"collectives": collectives, "kill_loop": kill_loop}[mode]
    fn(int(rank), int(world), host, int(port), float(timeout_s), out_dir, seed)


if __name__ == "__main__":
    main()
