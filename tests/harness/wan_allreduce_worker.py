"""One rank of a process group inside a WAN emulator host (tests/harness/wanem.py).

    python wan_allreduce_worker.py RANK WORLD STORE_ADDR:PORT BACKEND NBYTES REPS

Forms the group over ``tcp://STORE`` (the settings, e.g. PCCL_STREAMS, come from the
environment), warms the links up with a small all_reduce, then times REPS all_reduces of
NBYTES of float32 ones, each after a barrier, and prints one JSON line
``{"event": "result", "seconds": [...], "ok": bool, "pacing": {...}}`` (ok: the values are
the world size; pacing, for pccl: peer rank -> [estimate, cap] in bytes/s, as
``Communicator.pacing`` reports them after the last op).
"""

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_pccl.c10d.process_group import pccl_group


def main() -> None:
    rank, world, store, backend, nbytes, reps = sys.argv[1:7]
    rank, world, nbytes, reps = int(rank), int(world), int(nbytes), int(reps)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(256))
    t = torch.ones(nbytes // 4)
    seconds, ok = [], True
    for _ in range(reps):
        t.fill_(1.0)
        dist.barrier()
        start = time.monotonic()
        dist.all_reduce(t)
        seconds.append(time.monotonic() - start)
        ok = ok and bool(torch.all(t == world))
    pacing = {}
    if backend == "pccl":
        comm = pccl_group().communicator
        pacing = {p: list(comm.pacing(p)) for p in range(world) if p != rank}
    print(json.dumps({"event": "result", "seconds": seconds, "ok": ok, "pacing": pacing}),
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
