"""Elastic membership costs: the hot path of a pccl:// group, and update_topology().

    python benchmarks/membership.py                        # worlds 2 4 8, about 2 minutes
    python benchmarks/membership.py --worlds 2 4 --reps 3

For each world size n the script starts a master in a thread of this process (``start_in_thread``,
``--world-size n``) and spawns n member processes on 127.0.0.1 that join it with
``init_process_group(backend="pccl", init_method="pccl://...")``, plus one spare process per join
measured, which waits for a go signal before it registers.

(a) Hot path (worlds in ``--hot-worlds``, default 2 and 4). Each member also builds a fixed group
   of the same ranks bootstrapped from a TCPStore, as under torchrun (a ``ProcessGroupPCCL`` on
   ``Communicator.bootstrap``; a pccl:// world refuses ``new_group``). For every size the two
   groups alternate op by op (the order flips every iteration), both called the same way
   (``pg.allreduce([t]).wait()``, blocking), each op preceded by a 1-element all-reduce on its
   own group to line the ranks up. An op's time is the slowest rank's; a size's figure is the
   median. The master's message handler is wrapped to count every message it receives by type;
   the counts over the timed loop are reported: heartbeats only (each peer sends one every
   heartbeat interval from its heartbeat thread, whatever the ops), no ``pending`` or
   ``update``: the collectives themselves never talk to the master.
(b) update_topology() (every world): its time on each member, slowest member, median over
   ``--reps`` calls, with no change (nobody pending) and with one peer joining (a spare
   registered and pending before the call; the members poll ``peers_pending()`` until the master
   has it). After each join the new world checks an all-reduce, the spare leaves with
   ``destroy_process_group()`` and the members run one more update, timed as "one peer leaving"
   (it includes the leaver's own shutdown after its last op).

Prints a table and writes ``results.json`` to ``--out`` (default runs/bench_membership).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _harness import (HOST, KIB, MIB, format_size, iterations_for, machine, print_header, stop,
                      supervise, write_results)
from torch_pccl.master import start_in_thread

POLL_S = 0.02  # period of the members' peers_pending() poll while a spare registers


# --------------------------------------------------------------------------- processes


def _join(master: str, cfg: dict, peer_id: str) -> None:
    torch.set_num_threads(1)  # many processes share the cores
    os.environ["PCCL_TIMEOUT"] = str(cfg["op_timeout"])  # per-op deadline
    os.environ["PCCL_PEER_ID"] = peer_id
    # The timeout bounds the admission wait (pending).
    dist.init_process_group(backend="pccl", init_method=f"pccl://{master}",
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))


def _spare(index: int, master: str, cfg: dict, go) -> None:
    """A late peer: waits for ``go``, registers (pending), is admitted, checks one op, leaves."""
    torch.set_num_threads(1)
    if not go.wait(cfg["timeout"]):
        return  # not needed (an earlier failure)
    _join(master, cfg, f"spare{index}")
    check = torch.zeros(1, dtype=torch.float64)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)  # matches the members' first op after joining
    dist.destroy_process_group()  # a clean leave


def _member(index: int, world: int, master: str, store_port: int, cfg: dict, spare_go,
            conn) -> None:
    import torch_pccl
    from torch_pccl.c10d.process_group import ProcessGroupPCCL, pccl_group
    from torch_pccl.core.communicator import Communicator

    _join(master, cfg, f"member{index}")
    rank = dist.get_rank()
    elastic = pccl_group()  # the default group's ProcessGroupPCCL (c10d may wrap it)
    result: dict = {"hot_path": [], "update": {}}
    try:
        if world in cfg["hot_worlds"]:
            # The fixed group: same ranks, bootstrapped from a store as under torchrun.
            store = dist.TCPStore(HOST, store_port, world, is_master=False,
                                  timeout=datetime.timedelta(seconds=cfg["timeout"]))
            comm = Communicator.bootstrap(dist.PrefixStore("fixed", store), rank, world,
                                          cfg["op_timeout"], prefix="pccl")
            fixed = ProcessGroupPCCL(comm, cfg["op_timeout"])
            try:
                groups = {"fixed": fixed, "elastic": elastic}
                for nbytes in cfg["sizes"]:
                    result["hot_path"].append(
                        _time_size(nbytes, rank, world, cfg, groups, conn))
            finally:
                fixed.shutdown()
        result["update"] = _time_updates(rank, world, cfg, spare_go, torch_pccl)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        conn.send(("done", result))


def _mark(conn, label: str) -> dict:
    """Rank 0 asks the parent to record the master's message counts now; returns them."""
    conn.send(("mark", label))
    return conn.recv()


def _time_size(nbytes: int, rank: int, world: int, cfg: dict, groups: dict, conn) -> dict:
    # About 64 MiB of payload per group and size, 10 .. 200 timed ops, at least 2 warm-ups.
    warmup, timed = iterations_for(nbytes, cfg["iters"], payload=64 * MIB, timed_range=(10, 200),
                                   min_warmup=2)
    labels = list(groups)
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    one = torch.zeros(1)
    elapsed = torch.zeros(len(labels), timed, dtype=torch.float64)
    before = after = None
    for i in range(warmup + timed):
        if i == warmup and rank == 0:
            before = _mark(conn, "start")
        order = range(len(labels)) if i % 2 == 0 else reversed(range(len(labels)))
        for b in order:
            pg = groups[labels[b]]
            tensor.fill_(1.0)
            pg.allreduce([one]).wait()  # line the ranks up on the group being timed
            start = time.perf_counter()
            pg.allreduce([tensor]).wait()
            stop = time.perf_counter()
            if i >= warmup:
                elapsed[b, i - warmup] = stop - start
            if i == warmup + timed - 1 and not bool((tensor == world).all()):
                raise RuntimeError(f"{labels[b]}: wrong all_reduce result at {nbytes} bytes")
    if rank == 0:
        after = _mark(conn, "stop")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # slowest rank per op
    row = {"world": world, "bytes": nbytes, "warmup": warmup, "iterations": timed}
    for b, label in enumerate(labels):
        per_op = elapsed[b].tolist()
        row[label] = {"median_ms": 1e3 * statistics.median(per_op),
                      "min_ms": 1e3 * min(per_op), "max_ms": 1e3 * max(per_op)}
    row["ratio"] = row["elastic"]["median_ms"] / row["fixed"]["median_ms"]
    if rank == 0:
        row["master_messages"] = {k: after["counts"].get(k, 0) - before["counts"].get(k, 0)
                                  for k in set(after["counts"]) | set(before["counts"])}
        row["timed_loop_s"] = after["t"] - before["t"]
    return row


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_updates(rank: int, world: int, cfg: dict, spare_go, torch_pccl) -> dict:
    out = {"no_change": [], "join": [], "leave": []}
    for _ in range(cfg["reps"]):
        start = time.perf_counter()
        change = torch_pccl.update_topology()
        seconds = time.perf_counter() - start
        if change.world_size != world or change.joined or change.left:
            raise RuntimeError(f"no-change update changed the world: {change}")
        out["no_change"].append(_slowest(seconds))
    for j in range(cfg["reps"]):
        if rank == 0:
            spare_go[j].set()
        # Poll a condition of the master (every rank gets the same answer), bounded.
        deadline = time.monotonic() + cfg["timeout"]
        while not torch_pccl.peers_pending():
            if time.monotonic() > deadline:
                raise TimeoutError("the spare peer never registered with the master")
            time.sleep(POLL_S)
        start = time.perf_counter()
        change = torch_pccl.update_topology()
        seconds = time.perf_counter() - start
        if change.world_size != world + 1 or len(change.joined) != 1:
            raise RuntimeError(f"join update: unexpected {change}")
        out["join"].append(_slowest(seconds))  # the spare's MAX all-reduce contributes 0
        start = time.perf_counter()
        change = torch_pccl.update_topology()  # waits for the spare's leave
        seconds = time.perf_counter() - start
        if change.world_size != world or len(change.left) != 1:
            raise RuntimeError(f"leave update: unexpected {change}")
        out["leave"].append(_slowest(seconds))
    ones = torch.ones(1024)
    dist.all_reduce(ones)
    if not bool((ones == world).all()):
        raise RuntimeError("wrong all_reduce result after the updates")
    return out


# --------------------------------------------------------------------------- the parent


class MessageCounter:
    """Wraps the master state's ``receive`` to count the messages it handles, by type."""

    def __init__(self, master):
        self.counts: collections.Counter = collections.Counter()
        state = master.server.state
        inner = state.receive

        def receive(conn, msg, now):
            self.counts[msg["type"]] += 1
            return inner(conn, msg, now)

        state.receive = receive  # set before any peer connects


def run_world(world: int, cfg: dict) -> dict:
    """Master + ``world`` members + ``reps`` spares; returns rank 0's results."""
    master = start_in_thread(HOST, 0, world_size=world,
                             heartbeat_interval_s=cfg["heartbeat_interval"],
                             heartbeat_timeout_s=cfg["heartbeat_timeout"])
    counter = MessageCounter(master)
    store = dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=True)
    spare_go = [ctx.Event() for _ in range(cfg["reps"])]
    members = [ctx.Process(target=_member, name=f"member{i}",
                           args=(i, world, master.address, store.port, cfg, spare_go,
                                 child_end))
               for i in range(world)]
    spares = [ctx.Process(target=_spare, name=f"spare{j}",
                          args=(j, master.address, cfg, spare_go[j]))
              for j in range(cfg["reps"])]
    procs = members + spares
    for p in procs:
        p.start()
    result = None

    def receive(conn) -> bool:
        nonlocal result
        kind, payload = conn.recv()
        if kind == "mark":  # rank 0 asks for the master's message counts now
            conn.send({"counts": dict(counter.counts), "t": time.perf_counter()})
            return True
        result = payload  # "done": rank 0's results, its last message
        return False

    try:
        supervise(procs, parent_end, cfg["timeout"], receive, f"world {world}")
    finally:
        for s in spare_go:
            s.set()  # spares never started exit at once
        stop(procs)
        parent_end.close()
        master.stop()
    if result is None:
        raise RuntimeError(f"world {world}: rank 0 sent no results")
    result["master_totals"] = dict(counter.counts)
    return result


# --------------------------------------------------------------------------- report


def print_tables(results: dict, cfg: dict) -> None:
    print("(a) blocking all_reduce between membership changes: elastic (pccl://) vs fixed "
          "(store) pccl group")
    header = (f"{'world':>5} {'size':>8} {'fixed ms':>9} {'elastic ms':>11} {'ratio':>6}  "
              f"master messages during the timed loop")
    print_header(header)
    for world, res in results.items():
        for r in res["hot_path"]:
            msgs = ", ".join(f"{k} {v}" for k, v in sorted(r["master_messages"].items())
                             if v) or "none"
            print(f"{world:>5} {format_size(r['bytes']):>8} {r['fixed']['median_ms']:>9.3f} "
                  f"{r['elastic']['median_ms']:>11.3f} {r['ratio']:>6.2f}  {msgs} "
                  f"in {r['timed_loop_s']:.2f} s")
    others = sorted({k for res in results.values() for r in res["hot_path"]
                     for k, v in r["master_messages"].items() if v and k != "heartbeat"})
    print(f"master messages other than heartbeats (1 per peer per "
          f"{cfg['heartbeat_interval']:g} s, from a thread) during the timed loops: "
          f"{', '.join(others) if others else 'none'}")
    print(f"\n(b) update_topology(), slowest member, median (min .. max) of {cfg['reps']} "
          f"calls, ms")
    header = f"{'peers':>5} {'no change':>22} {'one joining':>22} {'one leaving':>22}"
    print_header(header)

    def cell(values):
        ms = [1e3 * v for v in values]
        return f"{statistics.median(ms):.1f} ({min(ms):.1f} .. {max(ms):.1f})"

    for world, res in results.items():
        u = res["update"]
        print(f"{world:>5} {cell(u['no_change']):>22} {cell(u['join']):>22} "
              f"{cell(u['leave']):>22}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8],
                   help="member counts for update_topology (default 2 4 8)")
    p.add_argument("--hot-worlds", type=int, nargs="*", default=[2, 4],
                   help="member counts for the hot-path comparison (default 2 4)")
    p.add_argument("--sizes", type=int, nargs="+", default=[4 * KIB, 1 * MIB],
                   help="all_reduce sizes in bytes (default 4096 1048576)")
    p.add_argument("--iters", type=int, default=None, help="timed ops per size (default: by size)")
    p.add_argument("--reps", type=int, default=3,
                   help="update_topology calls per kind and world (default 3)")
    p.add_argument("--op-timeout", type=float, default=30.0, help="per-op deadline, seconds")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds (default 10: 9 processes share 2 cores at world 8)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per world")
    p.add_argument("--out", default="runs/bench_membership", help="folder for results.json")
    args = p.parse_args(argv)
    if min(args.worlds) < 1 or args.reps < 1 or (args.iters is not None and args.iters < 1):
        p.error("--worlds, --reps and --iters must be at least 1")
    if any(s <= 0 or s % 4 for s in args.sizes):
        p.error("--sizes must be positive multiples of 4 bytes")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = {"sizes": args.sizes, "iters": args.iters, "reps": args.reps,
           "hot_worlds": args.hot_worlds, "op_timeout": args.op_timeout,
           "heartbeat_interval": args.heartbeat_interval,
           "heartbeat_timeout": args.heartbeat_timeout, "timeout": args.timeout}
    started = time.perf_counter()
    results = {}
    for world in args.worlds:
        print(f"world {world}: {world} members + {args.reps} spares ...", file=sys.stderr,
              flush=True)
        results[world] = run_world(world, cfg)
    seconds = time.perf_counter() - started
    print_tables(results, cfg)
    os.makedirs(args.out, exist_ok=True)
    doc = {
        "hot_path": "blocking allreduce([t]).wait() of float32 SUM on a pccl:// group and on a "
                    "store-bootstrapped pccl group of the same ranks, alternating; per op the "
                    "slowest rank; median of ops; master messages counted by type over the "
                    "timed loop",
        "update": "update_topology() seconds, slowest member per call",
        "config": cfg,
        "machine": machine(),
        "seconds": round(seconds, 1),
        "worlds": {str(k): v for k, v in results.items()},
    }
    write_results(args.out, doc, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
