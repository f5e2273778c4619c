"""A training loop that members and joiners run alike, for tests/elastic/test_loop_shapes.py.

``python tests/harness/loop_worker.py MASTER_ADDR PLACEMENT SYNC`` joins a ``pccl://`` world and
runs steps of one all-reduce each, with ``if peers_pending(): update_topology()`` at the top of
the step (PLACEMENT ``top``), at its end (``end``) or both. SYNC ``after``: a
``sync_shared_state`` follows each update, and the program starts with one (how a joiner gets
the state before its first step); ``after-only``: the same without the one at the start (the
shape PCCL documents: the check at the top, so a joiner's first check runs update and sync);
``none``: no shared state. Every step's all-reduce carries [1, stop] with SUM, so every rank
must read the world size and all stop at the same step: a member asks to stop once it has
trained ``STEADY_STEPS`` steps at the target world size, a joiner once it has trained that many.
The step's simulated compute is a 20 ms sleep (not synchronisation: nothing waits on it).
Prints one JSON line at the end: worlds seen per step, changes, the shared state's digest.
"""

import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist

import torch_pccl

STEADY_STEPS = 8
MAX_STEPS = 2000


def main():
    torch.set_num_threads(1)
    master, placement, sync, target = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group(backend="pccl", init_method=f"pccl://{master}")
    joiner = torch_pccl.epoch() > 1
    state = {"w": torch.zeros(64, dtype=torch.float64)}
    revision = [0]
    changes = []
    print(json.dumps({"event": "started", "rank": dist.get_rank()}), flush=True)

    def sync_state():
        revision[0] += 1
        res = torch_pccl.sync_shared_state(state, revision[0])
        revision[0] = res.revision

    def check():
        if torch_pccl.peers_pending():
            change = torch_pccl.update_topology()
            changes.append({"epoch": change.epoch, "world_size": change.world_size,
                            "joined": list(change.joined)})
            if sync != "none":
                sync_state()

    if sync == "after":
        sync_state()
    worlds, steady = [], 0
    for _ in range(MAX_STEPS):
        if placement in ("top", "both"):
            check()
        time.sleep(0.02)
        world = dist.get_world_size()
        steady = steady + 1 if (joiner or world == target) else 0
        t = torch.tensor([1.0, float(steady >= STEADY_STEPS)], dtype=torch.float64)
        dist.all_reduce(t)
        worlds.append((world, int(t[0].item())))
        state["w"] += t[0]
        if placement in ("end", "both"):
            check()
        if t[1].item() > 0:
            break
    digest = hashlib.sha256(state["w"].numpy().tobytes()).hexdigest()
    print(json.dumps({"event": "done", "joiner": joiner, "worlds": worlds, "changes": changes,
                      "digest": digest, "epoch": torch_pccl.epoch(),
                      "rank": dist.get_rank()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
