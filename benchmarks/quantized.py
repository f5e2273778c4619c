"""Quantized all-reduce: bytes on the wire, time and error of int8 / int4 against float32.

    python benchmarks/quantized.py                    # worlds 2 and 4, 1 / 16 / 64 MiB
    python benchmarks/quantized.py --worlds 3 --sizes 4MiB --block 128 --iters 10
    python benchmarks/quantized.py --rate-mbit 1000 --sizes 16MiB 64MiB   # capped links (root)

For each world size the script spawns that many processes on 127.0.0.1 (the spawning and the
deadlines are benchmarks/_harness.py's ``run_world``); each joins the default group with
backend pccl. For every message size (float32 values) three methods alternate op by op, the
order flipping every iteration: ``dist.all_reduce(AVG)`` (float32 ring) and
``torch_pccl.all_reduce_quantized(bits=8 | 4, op=AVG, block=--block)``. Every timed op starts
after a barrier and works on a fresh copy of the rank's input (normal values times rank + 1,
made outside the timed region). An op's time is the slowest rank's (``all_reduce(MAX)`` of
the elapsed times), a figure the median over iterations. Bytes are the deltas of
``Communicator.stats()`` (payload plus 40-byte frame headers) around one op, averaged over
the ranks. Errors are measured once per size on rank 0 against the exact float64 average of
every rank's input: the RMS error relative to the RMS of the result, and the largest absolute
error relative to the largest magnitude. Every rank's result of every method is checked to
be bit-identical across ranks (sha256).

With ``--rate-mbit R`` (root only) every rank runs in its own network namespace
(tests/harness/netns.py: one veth per "host" on a bridge) whose egress is capped at R Mbit/s with a
token bucket (``benchmarks/_harness.set_rate``): a link-bound network, where the time
follows the bytes. Rank 0 hosts the rendezvous store in its namespace.

Prints the table and writes ``results.json`` to ``--out`` (default runs/bench_quantized).
On loopback the link is not the bottleneck, so the time column shows the cost of the codecs
on the CPU; the byte column is what a slow link pays for.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (HOST, child_env, format_size, iterations_for, machine,  # noqa: E402
                      netns_module, parse_size, print_header, run_world, set_rate,
                      write_results)

METHODS = ("float32", "int8", "int4")
STORE_PORT = 29660  # netns: rank 0's namespace is fresh, so the port is free there
DEFAULT_SIZES = ["1MiB", "16MiB", "64MiB"]


def make_input(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g) * (rank + 1)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """The first 8 bytes of the tensor's sha256 as an int64 tensor (to compare across ranks)."""
    h = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).digest()
    return torch.tensor([int.from_bytes(h[:8], "little", signed=True)])


def _worker(rank: int, world: int, port: int, cfg: dict, conn) -> None:
    """One loopback benchmark process (``run_world``'s target): rank 0 sends its rows to ``conn``."""
    rows = _run_rank(rank, world, HOST, port, False, cfg)
    if rank == 0:
        conn.send(rows)


def _run_rank(rank: int, world: int, host: str, port: int, own_store: bool, cfg: dict) -> list:
    """Joins the group (rank 0 hosts the store when ``own_store``) and times every size."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    store = dist.TCPStore(host, port, world, is_master=own_store and rank == 0, timeout=timeout)
    dist.init_process_group("pccl", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        rows = [_time_size(nbytes, rank, world, cfg) for nbytes in cfg["sizes"]]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    for row in rows:
        row["rate_mbit"] = cfg["rate_mbit"]
    return rows


def run_netns(world: int, cfg: dict, logdir: str) -> list[dict]:
    """``world`` ranks, each in its own network namespace whose uplink is capped at
    ``cfg['rate_mbit']`` (benchmarks/shared_state.py's token bucket); returns rank 0's rows."""
    netns = netns_module()
    env = child_env()
    with netns.hosts(world, logdir) as hosts:
        hosts.check_connectivity()
        set_rate(hosts, cfg["rate_mbit"])
        procs = [hosts.popen(r, [sys.executable, os.path.abspath(__file__),
                                 "--rank-of", str(r), str(world),
                                 "--store", f"{hosts.addrs[0]}:{STORE_PORT}",
                                 "--cfg", json.dumps(cfg)], env)
                 for r in range(world)]
        rows = procs[0].finish(cfg["timeout"], "rows")["rows"]
        for p in procs[1:]:
            p.finish(60, "done")
    return rows


def _netns_main(args) -> int:
    """A rank started by ``run_netns``: prints rank 0's rows, then "done", as JSON lines."""
    rank, world = args.rank_of
    host, port = args.store.rsplit(":", 1)
    rows = _run_rank(rank, world, host, int(port), True, json.loads(args.cfg))
    if rank == 0:
        print(json.dumps({"event": "rows", "rows": rows}), flush=True)
    print(json.dumps({"event": "done"}), flush=True)
    return 0


def _run(method: str, tensor: torch.Tensor, block: int) -> None:
    import torch_pccl

    if method == "float32":
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    else:
        torch_pccl.all_reduce_quantized(tensor, bits=8 if method == "int8" else 4,
                                        op=dist.ReduceOp.AVG, block=block)


def _time_size(nbytes: int, rank: int, world: int, cfg: dict) -> dict:
    numel = nbytes // 4
    comm = dist.group.WORLD.communicator
    warmup, timed = iterations_for(nbytes, cfg["iters"])
    x = make_input(rank, numel)
    elapsed = torch.zeros(len(METHODS), timed, dtype=torch.float64)
    sent = torch.zeros(len(METHODS), dtype=torch.float64)
    results = {}
    for i in range(warmup + timed):
        order = range(len(METHODS)) if i % 2 == 0 else reversed(range(len(METHODS)))
        for m in order:
            t = x.clone()
            dist.barrier()
            before = comm.stats()[0]
            start = time.perf_counter()
            _run(METHODS[m], t, cfg["block"])
            stop = time.perf_counter()
            sent[m] = comm.stats()[0] - before
            if i >= warmup:
                elapsed[m, i - warmup] = stop - start
            if i == warmup + timed - 1:
                results[METHODS[m]] = t
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank per op
    dist.all_reduce(sent, op=dist.ReduceOp.SUM)
    digests = torch.cat([_digest(results[m]) for m in METHODS])
    lowest, highest = digests.clone(), digests.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if not torch.equal(lowest, highest):
        raise RuntimeError(f"results differ across ranks at {nbytes} bytes: {digests.tolist()}")

    row = {"world": world, "bytes": nbytes, "block": cfg["block"], "iterations": timed}
    if rank == 0:
        exact = sum(make_input(r, numel).double() for r in range(world)) / world
        scale_rms = exact.pow(2).mean().sqrt().item()
        scale_max = exact.abs().max().item()
        for m, method in enumerate(METHODS):
            per_op = elapsed[m].tolist()
            err = results[method].double() - exact
            row[method] = {
                "median_ms": 1e3 * statistics.median(per_op),
                "min_ms": 1e3 * min(per_op),
                "sent_bytes_per_rank": sent[m].item() / world,
                "rel_rms_error": err.pow(2).mean().sqrt().item() / scale_rms,
                "rel_max_error": err.abs().max().item() / scale_max,
            }
        base = row["float32"]["sent_bytes_per_rank"]
        for method in METHODS:
            row[method]["bytes_vs_float32"] = row[method]["sent_bytes_per_rank"] / base
    return row


def print_table(rows: list[dict]) -> None:
    rate = rows[0]["rate_mbit"] if rows else 0
    print("link: " + (f"{rate:g} Mbit/s uplink per rank (network namespaces, tc tbf)" if rate
                      else "loopback (127.0.0.1), no cap"))
    header = (f"{'world':>5} {'size':>8} {'method':>7} {'ms':>9} {'MB sent/rank':>13} "
              f"{'vs fp32':>8} {'rel RMS err':>12} {'rel max err':>12}")
    print_header(header)
    for r in rows:
        for method in METHODS:
            c = r[method]
            print(f"{r['world']:>5} {format_size(r['bytes']):>8} {method:>7} "
                  f"{c['median_ms']:>9.2f} {c['sent_bytes_per_rank'] / 1e6:>13.3f} "
                  f"{c['bytes_vs_float32']:>8.3f} {c['rel_rms_error']:>12.2e} "
                  f"{c['rel_max_error']:>12.2e}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    p.add_argument("--sizes", type=parse_size, nargs="+",
                   default=[parse_size(s) for s in DEFAULT_SIZES],
                   help="message sizes in bytes of float32, e.g. 1MiB 64MiB")
    p.add_argument("--block", type=int, default=256, help="elements per scale (default 256)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per size (default: by size, as allreduce.py)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per world size")
    p.add_argument("--rate-mbit", type=float, default=0.0,
                   help="> 0: every rank in its own network namespace (root only) with its "
                        "uplink capped at this many Mbit/s; 0 (default): loopback")
    p.add_argument("--out", default="runs/bench_quantized", help="folder for results.json")
    # A rank of the netns mode (started by run_netns, not by hand).
    p.add_argument("--rank-of", type=int, nargs=2, metavar=("RANK", "WORLD"),
                   help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_of:
        return args
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    if min(args.worlds) < 2:
        p.error("--worlds must be at least 2")
    if not 1 <= args.block <= 65535:
        p.error("--block must be in 1 .. 65535")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_of:
        return _netns_main(args)
    cfg = {"sizes": args.sizes, "iters": args.iters, "timeout": args.timeout,
           "block": args.block, "rate_mbit": args.rate_mbit}
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    started = time.perf_counter()
    rows = []
    for world in args.worlds:
        print(f"world {world}: running {len(args.sizes)} sizes ...", file=sys.stderr, flush=True)
        if args.rate_mbit > 0:
            rows += run_netns(world, cfg, os.path.join(args.out, "logs"))
        else:
            rows += run_world(world, cfg, _worker, "quantized-bench")
    seconds = time.perf_counter() - started
    print_table(rows)
    result = {
        "timing": "blocking AVG all-reduce of float32 values; per op the slowest rank; median",
        "bytes": "Communicator.stats() bytes_sent delta per op, mean over ranks",
        "machine": machine(),
        "seconds": round(seconds, 1),
        "rows": rows,
    }
    write_results(args.out, result, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
