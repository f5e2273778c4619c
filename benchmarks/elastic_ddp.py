"""What ElasticDDP costs per step, side by side with torch's plain DDP on the same pccl group.

    python benchmarks/elastic_ddp.py                 # world 2 and 3, the main job's model
    python benchmarks/elastic_ddp.py --worlds 2 --blocks 10

W processes on 127.0.0.1 join one ``pccl://`` master (started here). Each trains two copies of
the main job's model (examples/_model.py's ``CharTransformer``, 0.35 M parameters, AdamW) on
random tokens: one wrapped in ``DistributedDataParallel`` (what a user of a fixed world runs),
one in ``torch_pccl.ElasticDDP`` with the documented loop (forward, backward, ``step()``,
``boundary()``). Blocks of ``--steps`` steps alternate between the two (DDP, elastic, DDP, ...)
so that drift of the machine hits both alike; each block's time is rank 0's, after a barrier.
Reported per world size: median seconds per step of each, their ratio, and where ElasticDDP's
extra time goes (``step()``: buffer broadcast and the one-element vote; ``boundary()``: one
pending query to the master), medians over every step of every block.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

from _harness import REPO, child_env, machine, print_header, stop


def worker(rank_hint: int, master: str, steps: int, blocks: int, conn) -> None:
    """One peer: alternating blocks of plain DDP and ElasticDDP; rank 0 sends the timings."""
    import torch
    import torch.distributed as dist

    import torch_pccl

    sys.path.insert(0, os.path.join(REPO, "examples"))
    from _model import CharTransformer

    torch.set_num_threads(1)
    dist.init_process_group(backend="pccl", init_method=f"pccl://{master}?peer_id=p{rank_hint}")
    rank = dist.get_rank()

    def build():
        torch.manual_seed(0)
        net = CharTransformer(65, 64, 96, 3, 4)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)

    plain_net, plain_opt = build()
    plain = torch.nn.parallel.DistributedDataParallel(plain_net)
    elastic_net, elastic_opt = build()
    elastic = torch_pccl.ElasticDDP(elastic_net, elastic_opt)
    gen = torch.Generator().manual_seed(rank)

    def batch():
        x = torch.randint(65, (16, 64), generator=gen)
        return x, torch.roll(x, -1, 1)

    def plain_step(_):
        x, y = batch()
        plain_opt.zero_grad()
        plain(x, y).backward()
        plain_opt.step()

    def elastic_step(parts):
        x, y = batch()
        elastic_opt.zero_grad()
        elastic(x, y).backward()
        t0 = time.perf_counter()
        elastic.step()
        t1 = time.perf_counter()
        elastic.boundary()
        parts["step"].append(t1 - t0)
        parts["boundary"].append(time.perf_counter() - t1)

    per_step = {"ddp": [], "elastic": []}
    parts = {"step": [], "boundary": []}
    for b in range(blocks + 1):             # the first pair of blocks warms up
        for name, fn in (("ddp", plain_step), ("elastic", elastic_step)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fn(parts)
            dist.barrier()
            if b:
                per_step[name].append((time.perf_counter() - start) / steps)
        if not b:
            parts = {"step": [], "boundary": []}
    if rank == 0:
        conn.send({"ddp": statistics.median(per_step["ddp"]),
                   "elastic": statistics.median(per_step["elastic"]),
                   "vote": statistics.median(parts["step"]),
                   "boundary": statistics.median(parts["boundary"])})
    dist.destroy_process_group()


def run(world: int, steps: int, blocks: int) -> dict:
    from torch_pccl.master import start_in_thread

    master = start_in_thread("127.0.0.1", 0, world_size=world)
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    os.environ.update(child_env())
    procs = [ctx.Process(target=worker, args=(r, master.address, steps, blocks, send))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        if not recv.poll(600):
            raise TimeoutError(f"world {world}: no result within 600 s")
        result = recv.recv()
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"world {world}: a peer exited with {p.exitcode}")
        return result
    finally:
        stop(procs)
        master.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    p.add_argument("--blocks", type=int, default=5, help="measured blocks of each (default 5)")
    args = p.parse_args(argv)
    print_header(f"ElasticDDP vs DistributedDataParallel, same pccl group, loopback; "
                 f"{args.blocks} x {args.steps} steps each; {machine()}")
    print(f"{'world':>5} {'DDP s/step':>11} {'elastic s/step':>15} {'ratio':>6} "
          f"{'step() s':>9} {'boundary() s':>13}")
    for world in args.worlds:
        r = run(world, args.steps, args.blocks)
        print(f"{world:>5} {r['ddp']:>11.4f} {r['elastic']:>15.4f} "
              f"{r['elastic'] / r['ddp']:>6.2f} {r['vote']:>9.4f} {r['boundary']:>13.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
