"""Concurrent collectives: N async all_reduces issued back to back on K lanes, over slow links.

    python benchmarks/lanes.py                    # world 4, 8 ops of 4 and 64 KiB, 5 ms, K=1 2 4
    python benchmarks/lanes.py --delay-ms 0 --sizes 1MiB --lanes 1 4

Each of the W ranks is a process on 127.0.0.1 that builds a ``Communicator`` with K lanes and a
``ProcessGroupPCCL`` on it (as ``init_process_group`` would with ``PCCL_LANES=K``). The ranks
connect to each other through a relay in this process: one listening port per rank, every
connection forwarded to that rank's real port, every chunk of bytes, in both directions,
delivered ``--delay-ms`` after it arrived (in order), as on a WAN link; 0 forwards at once.
(No ``tc netem`` needed, which many containers lack.) A rep is: barrier, ``--ops`` async
all_reduces of one size issued back to back, wait for all; its time is the slowest rank's, the
row's figure the median over ``--reps`` reps after one warm-up. A ring all-reduce is 2 (W - 1)
steps of at least one delay each, so one lane needs at least ops * 2 (W - 1) * delay; K lanes
run K ops at once (column "floor": that bound divided by min(K, ops)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from _harness import KIB, child_env, format_size, kill_all, parse_size, print_header


# --------------------------------------------------------------------------- worker


def worker(rank: int, world: int, lanes: int, comm_id: int, sizes: list[int], ops: int,
           reps: int) -> None:
    """One rank. stdout: {"port"}; stdin: the relay addresses; stdout: {"medians"}."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    from torch_pccl import Communicator
    from torch_pccl.c10d.process_group import ProcessGroupPCCL

    torch.set_num_threads(1)
    comm = Communicator(rank, world, comm_id, "127.0.0.1", 60.0)
    print(json.dumps({"port": comm.port}), flush=True)
    addrs = json.loads(sys.stdin.readline())
    comm.connect(addrs, lanes=lanes)
    pg = ProcessGroupPCCL(comm)
    max_opts = c10d.AllreduceOptions()
    max_opts.reduceOp = c10d.ReduceOp.MAX
    medians = {}
    for size in sizes:
        tensors = [torch.ones(size // 4) for _ in range(ops)]
        times = []
        for _ in range(reps + 1):
            pg.barrier().wait()
            start = time.perf_counter()
            works = [pg.allreduce([t]) for t in tensors]
            for work in works:
                work.wait()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            pg.allreduce([elapsed], max_opts).wait()  # the slowest rank's time
            times.append(elapsed.item())
        medians[str(size)] = statistics.median(times[1:])
    print(json.dumps({"lanes": pg.num_lanes, "medians": medians}), flush=True)
    pg.shutdown()


# --------------------------------------------------------------------------- relay


class Relay:
    """Forwards 127.0.0.1:<listen port i> to 127.0.0.1:<target i>, each chunk ``delay`` s late."""

    def __init__(self, targets: list[int], delay: float):
        self.targets, self.delay = targets, delay
        self.loop = asyncio.new_event_loop()
        self.ports: list[int] = []
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(30)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            for target in self.targets:
                server = await asyncio.start_server(
                    lambda r, w, t=target: self._serve(r, w, t), "127.0.0.1", 0)
                self.ports.append(server.sockets[0].getsockname()[1])

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader, writer, target: int) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, chunk = await queue.get()
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    writer.close()
                    return
                writer.write(chunk)
                await writer.drain()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                chunk = await reader.read(1 << 20)
                queue.put_nowait((self.loop.time() + self.delay, chunk))
                if not chunk:
                    break
        finally:
            await task

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# --------------------------------------------------------------------------- driver


def run(args, lanes: int) -> dict:
    env = child_env()
    comm_id = int.from_bytes(os.urandom(8), "little")
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", str(r), "--world",
         str(args.world), "--lanes", str(lanes), "--comm-id", str(comm_id), "--ops",
         str(args.ops), "--reps", str(args.reps), "--sizes", *[str(s) for s in args.sizes]],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for r in range(args.world)]
    relay = None
    try:
        ports = [json.loads(p.stdout.readline())["port"] for p in procs]
        relay = Relay(ports, args.delay_ms / 1000)
        addrs = json.dumps([f"127.0.0.1:{port}" for port in relay.ports])
        for p in procs:
            p.stdin.write(addrs + "\n")
            p.stdin.flush()
        result = json.loads(procs[0].stdout.readline())
        for p in procs:
            p.wait(timeout=args.deadline_s)
        return result
    finally:
        kill_all(procs, 5)
        if relay is not None:
            relay.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[4 * KIB, 64 * KIB],
                        help="bytes per all_reduce (float32): 4096, 64KiB, 1MiB, ...")
    parser.add_argument("--ops", type=int, default=8, help="async all_reduces per rep")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay per message")
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--comm-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.world, args.lanes[0], args.comm_id, args.sizes, args.ops,
               args.reps)
        return
    results = {lanes: run(args, lanes) for lanes in args.lanes}
    print(f"world {args.world}, {args.ops} async all_reduces per rep, {args.delay_ms:g} ms "
          f"one-way delay per message (relay); median of {args.reps} reps, slowest rank")
    header = f"{'size':>8} {'lanes':>5} {'ms':>9} {'vs 1 lane':>9} {'floor ms':>9}"
    print_header(header)
    for size in args.sizes:
        base = results.get(1, {}).get("medians", {}).get(str(size))
        for lanes in args.lanes:
            rec = results[lanes]
            assert rec["lanes"] == lanes, rec
            seconds = rec["medians"][str(size)]
            floor = args.ops * 2 * (args.world - 1) * args.delay_ms / min(lanes, args.ops)
            ratio = f"{base / seconds:.2f}x" if base else ""
            print(f"{format_size(size):>8} {lanes:>5} {seconds * 1e3:>9.1f} {ratio:>9} "
                  f"{floor:>9.1f}")


if __name__ == "__main__":
    main()
