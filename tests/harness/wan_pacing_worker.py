"""One rank of a pccl group inside a WAN emulator host, reporting its pacing as it goes
(tests/core/test_wan_pacing.py).

    python wan_pacing_worker.py RANK WORLD STORE_ADDR:PORT PLAN_JSON

Forms the group over ``tcp://STORE`` with the settings of the environment (the tests set
none, or one PCCL_PACING), then prints JSON lines: ``{"event": "formed", "pacing": P}``
right after ``init_process_group`` (so after the group's warm-up; with the streams per
peer the path's rate controller picks, ``"stripe": S``, and the seconds ``init_process_group`` took,
``"init_s"``), then one per step of
the plan, a list of:

- ``{"op": "all_reduce", "bytes": N, "reps": K}``: K all-reduces of N bytes of float32
  ones, each after a barrier; ``{"event": "ops", "seconds": [...], "pacing": [P, ...],
  "stripe": S}`` with P after each op and S the stripe the path's controller picks next;
- ``{"op": "idle", "seconds": S}``: no traffic at all for S seconds (the idle period is
  what the test is about), then ``{"event": "idled", "pacing": P}``;
- ``{"op": "wait"}``: ``{"event": "waiting"}``, then blocks until the driver writes a line
  to stdin (it changes the emulated link meanwhile).

P is ``[estimate, cap, last_rate]`` of the streams to the ring successor, bytes/s
(``Communicator.pacing``; the largest ``last_rate`` of the lanes). Ends with
``{"event": "result"}``.
"""

import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_pccl.c10d.process_group import pccl_group


def main() -> None:
    rank, world, store, plan = sys.argv[1:5]
    rank, world, plan = int(rank), int(world), json.loads(plan)
    torch.set_num_threads(1)
    if os.environ.get("WAN_WORKER_DEBUG"):      # the warm-up's and pacing's debug lines
        logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)d %(message)s")
    start = time.monotonic()
    dist.init_process_group("pccl", init_method=f"tcp://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    init_s = time.monotonic() - start
    comm = pccl_group().communicator
    successor = (rank + 1) % world

    def pacing() -> list[float]:
        return [*comm.pacing(successor), max(lane.last_rate(successor) for lane in comm.lanes)]

    def stripe() -> int:
        return comm.lane_set.path_state(successor)[1]

    def emit(event: str, **fields) -> None:
        print(json.dumps({"event": event, **fields}), flush=True)

    emit("formed", pacing=pacing(), stripe=stripe(), init_s=init_s)
    for step in plan:
        if step["op"] == "all_reduce":
            t = torch.ones(step["bytes"] // 4)
            seconds, seen = [], []
            for _ in range(step["reps"]):
                t.fill_(1.0)
                dist.barrier()
                start = time.monotonic()
                dist.all_reduce(t)
                seconds.append(time.monotonic() - start)
                assert torch.all(t == world)
                seen.append(pacing())
            emit("ops", seconds=seconds, pacing=seen, stripe=stripe())
        elif step["op"] == "idle":
            time.sleep(step["seconds"])
            emit("idled", pacing=pacing())
        elif step["op"] == "wait":
            emit("waiting")
            if not sys.stdin.readline():
                raise SystemExit("the driver closed stdin")
    dist.barrier()
    emit("result")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
