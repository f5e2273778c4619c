"""Forming a device mesh's groups: gloo and pccl side by side, on this machine (issue 39).

    python benchmarks/mesh_setup.py                      # meshes 2x2 and 2x4, 5 rounds
    python benchmarks/mesh_setup.py --meshes 2x2 --rounds 3

A sharded replica's processes build their groups once per life: the default group, then
``init_device_mesh("cpu", shape)`` (one subgroup per row and per column of the mesh) and a first
collective on every dimension. For each mesh the script spawns its ``rows x cols`` processes on
127.0.0.1 (``run_world`` of benchmarks/_harness.py) once per backend, gloo first in odd rounds and
pccl first in even ones, so that noise from other work on the machine hits both alike. A row's
time is the slowest rank's ``init_process_group`` (up to a barrier after it) + ``init_device_mesh``
+ one 4-byte all-reduce on each mesh dimension (timed from that barrier: the subgroups alone), and
the median over rounds is compared. Each rank runs a full garbage collection before its clock
starts (in both backends; see ``rank_main``). Two goals, each pccl <= gloo: forming the mesh's subgroups,
and the whole setup (the default group included).

Writes ``results.json`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import time

from _harness import HOST, machine, print_header, run_world, write_json


def rank_main(rank: int, world: int, store_port: int, cfg: dict, conn) -> None:
    """One rank: time the default group, the mesh's subgroups and a first op on each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # ``import torch`` leaves the collector one gen-1 pass short of a full collection of its
    # ~170k objects (about 75 ms here): whichever backend allocates a few thousand objects
    # next pays it inside the timed window, at a moment that depends on allocation counts, not
    # on the backend's work. Collecting once, in both backends, before the clock starts times
    # forming the groups, not that debt.
    gc.collect()
    store = dist.TCPStore(HOST, store_port, world, is_master=False)
    started = time.monotonic()
    dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    # Every rank starts the mesh together: "mesh" then times forming the subgroups alone, not
    # the skew of the default group's ranks (the slowest rank's wait is in "group").
    dist.barrier()
    joined = time.monotonic()
    mesh = init_device_mesh("cpu", tuple(cfg["shape"]), mesh_dim_names=("dp", "tp"))
    for name in ("dp", "tp"):
        dist.all_reduce(torch.ones(1), group=mesh.get_group(name))
    done = time.monotonic()
    times = torch.tensor([joined - started, done - joined, done - started], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if conn is not None:
        conn.send([{"init_s": times[0].item(), "mesh_s": times[1].item(),
                    "total_s": times[2].item()}])
        conn.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", nargs="+", default=["2x2", "2x4"], help="ROWSxCOLS shapes")
    p.add_argument("--rounds", type=int, default=5, help="repeats per backend and mesh")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per world")
    p.add_argument("--out", default="runs/bench_mesh_setup")
    args = p.parse_args()
    print_header("mesh setup: init_process_group + init_device_mesh + a first op per dimension")
    rows = []
    for spec in args.meshes:
        shape = [int(x) for x in spec.lower().split("x")]
        world = shape[0] * shape[1]
        seen: dict[str, list[dict]] = {"gloo": [], "pccl": []}
        for rnd in range(args.rounds):
            order = ("gloo", "pccl") if rnd % 2 == 0 else ("pccl", "gloo")
            for backend in order:
                cfg = {"backend": backend, "shape": shape, "timeout": args.timeout}
                seen[backend] += run_world(world, cfg, rank_main, f"mesh-{backend}")
        med = {b: {k: statistics.median(r[k] for r in seen[b]) for k in seen[b][0]}
               for b in seen}
        ratio = med["pccl"]["total_s"] / med["gloo"]["total_s"]
        mesh_ratio = med["pccl"]["mesh_s"] / med["gloo"]["mesh_s"]
        # Each round's own pccl/gloo ratio: the two ran back to back, so their ratio shows
        # how much of a difference of medians is the machine's noise.
        paired = [p["mesh_s"] / g["mesh_s"] for p, g in zip(seen["pccl"], seen["gloo"])]
        rows.append({"mesh": spec, "world": world, "gloo": med["gloo"], "pccl": med["pccl"],
                     "runs": seen, "ratio": ratio, "goal_met": ratio <= 1.0,
                     "mesh_ratio": mesh_ratio, "mesh_goal_met": mesh_ratio <= 1.0,
                     "mesh_ratio_per_round": paired})
        print(f"{spec:>5} ({world} ranks): gloo {med['gloo']['total_s']:.2f} s "
              f"(group {med['gloo']['init_s']:.2f}, mesh {med['gloo']['mesh_s'] * 1e3:.1f} ms); "
              f"pccl {med['pccl']['total_s']:.2f} s (group {med['pccl']['init_s']:.2f}, mesh "
              f"{med['pccl']['mesh_s'] * 1e3:.1f} ms)")
        print(f"       subgroups (mesh) pccl/gloo {mesh_ratio:.2f} "
              f"{'<= 1.0 met' if mesh_ratio <= 1.0 else '<= 1.0 NOT met'} (per round "
              f"{min(paired):.2f} .. {max(paired):.2f}, pccl faster in "
              f"{sum(r <= 1.0 for r in paired)} of {len(paired)}); whole setup "
              f"pccl/gloo {ratio:.2f} {'<= 1.0 met' if ratio <= 1.0 else '<= 1.0 NOT met'}")
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "results.json"), {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
