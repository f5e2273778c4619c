"""Blocking float32 all_reduce: gloo and pccl side by side, in one run, on this machine.

    python benchmarks/allreduce.py                      # worlds 2 and 4, 4 KiB .. 64 MiB
    python benchmarks/allreduce.py --worlds 2 --sizes 1MiB 16MiB
    python benchmarks/allreduce.py --encrypt --worlds 2 --sizes 16MiB 64MiB   # issue 28

For each world size the script spawns that many processes on 127.0.0.1 (``run_world`` of
benchmarks/_harness.py). Each process joins the default group with the candidate backend (pccl) and
a second group, ``new_group``, with the baseline (gloo), so both backends run over the same
processes at the same time. For every message size the two backends alternate op by op (the order
flips every iteration), so a burst of noise from another process on the machine hits both alike.
Each timed op is preceded by a barrier on its own group, so every op starts with all ranks lined up
by the backend that is being timed. An op's time is the slowest rank's (``all_reduce(MAX)`` of the
elapsed times) and a size's figure is the median over its iterations. Bus bandwidth follows
nccl-tests: ``2 (n - 1) / n * bytes / time``.

Writes ``results.json`` and ``allreduce.png`` to ``--out`` and prints the table, with, per row,
whether the project's goal holds: pccl/gloo <= 0.8 at >= 16 MiB and <= 1.0 from 4 KiB to 1 MiB.

``--encrypt`` compares pccl with itself instead: both groups have the same shared secret, the
baseline with ``PCCL_ENCRYPT=0`` (authenticated, plain frames), the candidate encrypting
every frame (AES-256-GCM records, docs/security.md). Goal: encrypted / plain <= 1.5 at
16 MiB and above.
"""

from __future__ import annotations

import argparse
import datetime
import os
import secrets
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _harness import (HOST, MIB, format_size, iterations_for, machine, parse_size, print_header,
                      run_world, write_json)

DEFAULT_SIZES = ["4KiB", "16KiB", "64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB"]


def goal_for(nbytes: int, encrypt: bool = False) -> float | None:
    """The candidate/baseline time ratio the project aims for at this size (None: no goal
    set): pccl/gloo, or with ``encrypt`` encrypted/plain pccl."""
    if encrypt:
        return 1.5 if nbytes >= 16 * MIB else None
    if nbytes >= 16 * MIB:
        return 0.8
    if nbytes <= 1 * MIB:
        return 1.0
    return None


def bus_bandwidth(nbytes: int, world: int, seconds: float) -> float:
    """GB/s moved per rank by a ring all-reduce (the nccl-tests 'busbw' convention)."""
    return 2 * (world - 1) / world * nbytes / seconds / 1e9


# --------------------------------------------------------------------------- one rank


def _worker(rank: int, world: int, port: int, cfg: dict, conn) -> None:
    """One benchmark process: join both groups, time every size, send rank 0's rows to ``conn``."""
    torch.set_num_threads(1)  # several ranks share the cores: see examples/train_lm.py
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    baseline, candidate = cfg["backends"]
    labels = cfg["labels"]
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout)
    if cfg["encrypt"]:
        # Read when each group's communicator is created: the default group encrypts, the
        # baseline group has the same secret and sends in the clear.
        os.environ["PCCL_SECRET"] = cfg["secret"]
        os.environ["PCCL_ENCRYPT"] = "1"
    dist.init_process_group(candidate, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        if cfg["encrypt"]:
            os.environ["PCCL_ENCRYPT"] = "0"
        groups = {labels[0]: dist.new_group(backend=baseline), labels[1]: dist.group.WORLD}
        sync = groups[labels[0]]  # the MAX of the timings and the final barrier
        rows = [_time_size(nbytes, rank, world, cfg, groups, sync) for nbytes in cfg["sizes"]]
        dist.barrier(group=sync)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        conn.send(rows)


def _time_size(nbytes: int, rank: int, world: int, cfg: dict, groups: dict, sync) -> dict:
    labels = cfg["labels"]
    warmup, timed = iterations_for(nbytes, cfg["iters"])
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    expected = world * (world + 1) / 2  # sum over ranks of (rank + 1): exact in float32
    elapsed = torch.zeros(len(labels), timed, dtype=torch.float64)

    for i in range(warmup + timed):
        order = range(len(labels)) if i % 2 == 0 else reversed(range(len(labels)))
        for b in order:
            group = groups[labels[b]]
            tensor.fill_(rank + 1)  # fresh input each op: repeated SUMs would overflow
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            stop = time.perf_counter()
            if i >= warmup:
                elapsed[b, i - warmup] = stop - start
            if i == warmup + timed - 1 and not bool((tensor == expected).all()):
                raise RuntimeError(f"{labels[b]}: wrong all_reduce result at {nbytes} bytes")

    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=sync)  # slowest rank per op
    row = {"world": world, "bytes": nbytes, "warmup": warmup, "iterations": timed}
    for b, label in enumerate(labels):
        per_op = elapsed[b].tolist()
        median = statistics.median(per_op)
        row[label] = {
            "median_ms": 1e3 * median,
            "min_ms": 1e3 * min(per_op),
            "max_ms": 1e3 * max(per_op),
            "busbw_GBps": bus_bandwidth(nbytes, world, median),
        }
    row["ratio"] = row[labels[1]]["median_ms"] / row[labels[0]]["median_ms"]
    goal = goal_for(nbytes, cfg["encrypt"])
    row["goal"] = goal
    row["goal_met"] = None if goal is None else row["ratio"] <= goal
    return row


# --------------------------------------------------------------------------- report


def print_table(rows: list[dict], labels: list[str]) -> None:
    base, cand = labels
    header = (
        f"{'world':>5} {'size':>8} {base + ' ms':>10} {cand + ' ms':>10} "
        f"{base + ' GB/s':>11} {cand + ' GB/s':>11} {cand + '/' + base:>10}  goal"
    )
    print_header(header)
    for r in rows:
        if r["goal"] is None:
            verdict = "(none)"
        else:
            verdict = f"<= {r['goal']:.1f} {'met' if r['goal_met'] else 'NOT met'}"
        print(
            f"{r['world']:>5} {format_size(r['bytes']):>8} "
            f"{r[base]['median_ms']:>10.3f} {r[cand]['median_ms']:>10.3f} "
            f"{r[base]['busbw_GBps']:>11.3f} {r[cand]['busbw_GBps']:>11.3f} "
            f"{r['ratio']:>10.2f}  {verdict}"
        )


def plot(rows: list[dict], labels: list[str], path: str) -> None:
    """Time and bus bandwidth against message size, one line per backend and world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.8))
    worlds = sorted({r["world"] for r in rows})
    styles = ["-", "--", ":", "-."]
    for b, label in enumerate(labels):
        for w, world in enumerate(worlds):
            mine = [r for r in rows if r["world"] == world]
            x = [r["bytes"] for r in mine]
            kw = dict(color=f"C{b}", ls=styles[w % len(styles)], marker="o", ms=3,
                      label=f"{label}, {world} ranks")  # fmt: skip
            ax_t.plot(x, [r[label]["median_ms"] for r in mine], **kw)
            ax_bw.plot(x, [r[label]["busbw_GBps"] for r in mine], **kw)
    for ax, ylabel in ((ax_t, "median time per all_reduce (ms, slowest rank)"),
                       (ax_bw, "bus bandwidth (GB/s)")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["bytes"] for r in rows})
        ax.set_xticks(sizes, [format_size(s) for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("message size (float32)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"blocking all_reduce on 127.0.0.1, {os.cpu_count()} CPUs: {' vs '.join(labels)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    p.add_argument("--sizes", type=parse_size, nargs="+",
                   default=[parse_size(s) for s in DEFAULT_SIZES],
                   help="message sizes, e.g. 4KiB 1MiB 64MiB (default: 4 KiB .. 64 MiB)")
    p.add_argument("--backends", nargs=2, default=["gloo", "pccl"],
                   metavar=("BASELINE", "CANDIDATE"),
                   help="the two backends compared; ratio = CANDIDATE / BASELINE")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per size (default: by size)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per world size")
    p.add_argument("--encrypt", action="store_true",
                   help="compare encrypted pccl links with plain ones (both with a shared "
                        "secret) instead of pccl with gloo")
    p.add_argument("--out", default="runs/bench_allreduce",
                   help="folder for results.json and allreduce.png")  # fmt: skip
    args = p.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    if min(args.worlds) < 1:
        p.error("--worlds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base, cand = args.backends
    # Same backend twice (e.g. to test this script without pccl built) needs distinct labels.
    labels = [base, cand if cand != base else cand + "#2"]
    if args.encrypt:
        base, cand = "pccl", "pccl"
        labels = ["plain", "encrypted"]
    cfg = {
        "backends": [base, cand],
        "labels": labels,
        "encrypt": args.encrypt,
        "secret": secrets.token_hex(32),
        "sizes": args.sizes,
        "iters": args.iters,
        "timeout": args.timeout,
    }
    started = time.perf_counter()
    rows = []
    for world in args.worlds:
        print(f"world {world}: running {len(args.sizes)} sizes ...", file=sys.stderr, flush=True)
        rows += run_world(world, cfg, _worker, "allreduce-bench")
    seconds = time.perf_counter() - started

    print_table(rows, labels)
    os.makedirs(args.out, exist_ok=True)
    result = {
        "backends": labels,
        "timing": "blocking all_reduce(SUM) of float32; per op the slowest rank; median of ops",
        "busbw": "2 (n - 1) / n * bytes / time",
        "machine": machine(),
        "seconds": round(seconds, 1),
        "rows": rows,
    }
    write_json(os.path.join(args.out, "results.json"), result)
    plot(rows, labels, os.path.join(args.out, "allreduce.png"))
    print(f"\n{seconds:.0f} s; wrote {args.out}/results.json and {args.out}/allreduce.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
