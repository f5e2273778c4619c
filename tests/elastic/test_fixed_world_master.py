"""A fixed world (torchrun / env:// / tcp://) gets a master started for the job on rank 0:
c10d's ranks are kept, and update_topology()/peers_pending() work there too.
PCCL_MASTER=0 keeps the plain store bootstrap (no master)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.pccl_only]

WORKER = textwrap.dedent("""
    import datetime, json, sys, torch, torch.distributed as dist, torch_pccl
    torch.set_num_threads(1)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("pccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    out = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    t = torch.full((7,), float(rank + 1))
    dist.all_reduce(t)
    out["sum"] = t[0].item()
    try:
        out["pending"] = torch_pccl.peers_pending()
        change = torch_pccl.update_topology()
        out["after"] = [change.rank, change.world_size, change.epoch]
        t = torch.ones(3)
        dist.all_reduce(t)
        out["sum_after"] = t[0].item()
    except torch_pccl.InvalidUsageError as exc:
        out["no_master"] = str(exc)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world, env_extra):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    # Started highest rank first, so arrival order at the master is the reverse of the ranks.
    procs = {r: subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(port)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in reversed(range(world))}
    try:
        outs = {r: p.communicate(timeout=90) for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for r, (out, err) in outs.items():
        assert procs[r].returncode == 0, f"rank {r}: {err[-2000:]}"
        results[r] = json.loads(out.strip().splitlines()[-1])
    return results


def test_fixed_world_keeps_its_ranks_and_can_update_topology():
    world = 3
    results = _run_world(world, {"PCCL_MASTER": "1"})
    for r, res in results.items():
        assert (res["rank"], res["world"]) == (r, world)
        assert res["sum"] == world * (world + 1) / 2
        assert res["pending"] is False
        assert res["after"][:2] == [r, world] and res["after"][2] == 2  # epoch 1 -> 2, same world
        assert res["sum_after"] == world


def test_master_can_be_turned_off():
    results = _run_world(2, {"PCCL_MASTER": "0"})
    for r, res in results.items():
        assert (res["rank"], res["world"], res["sum"]) == (r, 2, 3.0)
        assert "not formed through a master" in res["no_master"]
