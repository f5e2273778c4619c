"""All-reduce across emulated WAN links: pccl as a user gets it (no PCCL_* variable set),
over fresh groups, beside gloo and the best pinned setting of the same run (root only).

Builds its own links: every rank is a network namespace joined to the others by the
project's TUN forwarder in C (tests/harness/wanem.py; this kernel has no netem), with a
one-way delay, a rate, a 50 ms tail-drop queue and optional random loss per directed pair.
Scenarios (issue "The link filled by design"); every "pccl" row runs with no PCCL_*
variable set, the rows that name a setting are there for comparison:

  a  2 peers, 1 Gbit/s, 100 ms RTT, 64 MiB float32: --groups fresh groups (10), each a loop
     of --loop all-reduces one at a time (a barrier before each) from the group's first op;
     one group that idles --idle-s (60 s) and runs one more op; pinned settings
     (PCCL_STREAMS=4/6 with PCCL_PACING=<link rate>, two groups each), gloo, int8
  b  as (a) with 0.01 % loss, two groups
  c  4 peers on 1 Gbit/s, 50 ms RTT, where the pairs (0,1) and (2,3) run at 100 Mbit/s:
     pccl in rank order, then after torch_pccl.optimize_topology() (measured, not told)
  d  as (a), sizes 1 .. 256 MiB: pccl and PCCL_PACING=off
  e  2 peers, 1 Gbit/s, 250 ms RTT, 64 MiB, two groups
  f  4 peers in a ring at 1 Gbit/s, 100 ms RTT, rank 0's uplink at 300 Mbit/s, 64 MiB
  g  as (a)'s loop with a shared secret: plain (PCCL_ENCRYPT=0) and encrypted (the default
     with a secret), two groups each, alternated
  h  as (a), the link's rate halved to 500 Mbit/s, then doubled back, while the group runs:
     the rate controller's estimate after every op

Link utilisation = bytes each rank sends / seconds / rate (a ring all-reduce sends
2 (W-1)/W of the tensor from every rank; for W = 2, the tensor once); in (f) the rate is
that of the slowest link. Every group records init_process_group's seconds (slowest rank),
the bytes a rank sent while forming it (the warm-up), the stripe and the rate estimate it
chose, and the forwarder's share of a core over its run (flagged above 70 %: then the
emulator may have set the rate) with drops by queue and by loss per link. Prints the table
and the goals with met / not met (benchmarks/_wan_report.py), writes results.json and
wan.png, shows a progress bar.

    sudo python benchmarks/wan.py                  # every scenario, ~15 minutes
    sudo python benchmarks/wan.py --scenarios a h  # some
    sudo python benchmarks/wan.py --scenarios a --groups 3 --idle-s 5   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STORE_PORT = 29670
MIB = 1 << 20
SCENARIOS = ["a", "b", "c", "d", "e", "f", "g", "h"]


# -------------------------------------------------------------------------- worker side


def worker(cfg: dict) -> None:
    """One rank, inside its namespace: init, run the plan, print one JSON result.

    A ``wait`` step prints ``{"event": "waiting"}`` and blocks until the driver writes a
    line (it changes the link meanwhile)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    started = time.monotonic()
    dist.init_process_group(cfg["backend"], init_method=f"tcp://{cfg['store']}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(
                                seconds=cfg["timeout"]))
    out = {"event": "result", "rank": rank, "rows": [], "init_s": time.monotonic() - started}
    comm = None
    if cfg["backend"] == "pccl":
        from torch_pccl.c10d.process_group import pccl_group

        comm = pccl_group().communicator
        successor = (rank + 1) % world
        out.update(warmup_bytes=comm.lane_set.stats()[0], stripe=comm.stripe,
                   estimate=comm.pacing(successor)[0])

    def estimate() -> float:
        return comm.pacing(successor)[0] * 8e-6 if comm is not None else 0.0

    for step in cfg["plan"]:
        if step["op"] == "optimize":
            import torch_pccl

            choice = torch_pccl.optimize_topology(probe_bytes=step["probe_bytes"])
            # The matrices too: a choice that kept rank order is explained by them.
            out["rows"].append({"op": "optimize", "order": list(choice.order),
                                "previous": list(choice.previous),
                                "bandwidth": [list(r) for r in choice.bandwidth],
                                "rtt_s": [list(r) for r in choice.rtt_s],
                                "bottleneck": choice.bottleneck,
                                "previous_bottleneck": choice.previous_bottleneck,
                                "seconds": choice.seconds})
            continue
        if step["op"] == "idle":
            time.sleep(step["seconds"])     # the idle period is what is measured after it
            out["rows"].append(dict(step))
            continue
        if step["op"] == "wait":
            print(json.dumps({"event": "waiting"}), flush=True)
            if not sys.stdin.readline():
                raise SystemExit("the driver closed stdin")
            out["rows"].append({"op": "set_link", **step.get("record", {})})
            continue
        t = torch.ones(step["bytes"] // 4)
        times, estimates = [], []
        for _ in range(step["reps"]):
            dist.barrier()
            start = time.monotonic()
            if step["op"] == "int8":
                import torch_pccl

                torch_pccl.all_reduce_quantized(t, bits=8, op=dist.ReduceOp.SUM)
            else:
                dist.all_reduce(t)
            times.append(time.monotonic() - start)
            estimates.append(estimate())
        out["rows"].append({**step, "times": times, "estimates_mbit": estimates})
    dist.barrier()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


# -------------------------------------------------------------------------- driver side


def run_group(w, backend: str, plan: list[dict], env_extra: dict, timeout_s: float) -> dict:
    """Runs one group (one process per host of ``w``); rank 0's result, with the slowest
    rank's ``init_s`` and the most any rank sent while forming the group."""
    from _harness import child_env

    # gloo would pick the address of the hostname (127.0.0.1): give it the WAN device.
    env = {k: v for k, v in child_env(GLOO_SOCKET_IFNAME="wan0").items()
           if not k.startswith("PCCL_")}
    env.update(PCCL_MASTER="0", **env_extra)
    procs = []
    # A wait step's links stay with the driver (the worker takes JSON).
    worker_plan = [{k: v for k, v in step.items() if k != "links"} for step in plan]
    for r in range(w.k):
        cfg = {"rank": r, "world": w.k, "backend": backend, "plan": worker_plan,
               "store": f"{w.addrs[0]}:{STORE_PORT}", "timeout": timeout_s}
        procs.append(w.popen(r, [sys.executable, os.path.abspath(__file__), "--worker",
                                 json.dumps(cfg)], env=env, label=f"{backend} rank {r}",
                             stdin=True))
    try:
        for step in plan:
            if step["op"] == "wait":
                for p in procs:
                    p.next_event(timeout_s, "waiting")
                for (i, j), link in step["links"].items():
                    w.set_link(i, j, link)
                for p in procs:
                    p.send("go")
        results = [p.finish(timeout_s + 120) for p in procs]
    finally:
        for p in procs:
            p.close()
    out = results[0]
    out["init_s"] = max(r["init_s"] for r in results)
    out["warmup_bytes"] = max(r.get("warmup_bytes", 0) for r in results)
    return out


def jobs_for(args) -> list[tuple]:
    """(scenario, hosts, link, overrides, backend, plan, env, label, bottleneck Mbit/s, tags)."""
    from harness.wanem import Link

    rate, jobs = args.rate_mbit, []
    big = 64 * MIB
    fast = Link(delay_ms=args.rtt_ms / 2, rate_mbit=rate)
    loop = [{"op": "all_reduce", "bytes": big, "reps": args.loop}]
    pinned = {"PCCL_PACING": f"{rate:g}"}
    if "a" in args.scenarios:
        jobs += [("a", 2, fast, {}, "pccl", loop, {}, "pccl", rate, ())] * args.groups
        for streams in (4, 6):
            env = {**pinned, "PCCL_STREAMS": str(streams)}
            jobs += [("a", 2, fast, {}, "pccl", loop, env,
                      f"PCCL_STREAMS={streams}, PACING=rate", rate, ("PINNED",))] * 2
        idle = [{"op": "all_reduce", "bytes": big, "reps": 2},
                {"op": "idle", "seconds": args.idle_s},
                {"op": "all_reduce", "bytes": big, "reps": 1}]
        jobs += [("a", 2, fast, {}, "pccl", idle, {}, "pccl, idle", rate, ()),
                 ("a", 2, fast, {}, "pccl", [{"op": "int8", "bytes": big, "reps": 4}], {},
                  "pccl int8", rate, ()),
                 ("a", 2, fast, {}, "gloo", [{**loop[0], "reps": 3}], {}, "gloo", rate, ())]
    if "b" in args.scenarios:
        lossy = Link(delay_ms=args.rtt_ms / 2, rate_mbit=rate, loss=1e-4)
        jobs += [("b", 2, lossy, {}, "pccl", loop, {}, "pccl", rate, ())] * 2
    if "c" in args.scenarios:
        link = Link(delay_ms=25, rate_mbit=rate)
        slow = Link(delay_ms=25, rate_mbit=rate / 10)
        over = {(0, 1): slow, (1, 0): slow, (2, 3): slow, (3, 2): slow}
        step = {"op": "all_reduce", "bytes": 16 * MIB, "reps": 3}
        jobs += [("c", 4, link, over, "pccl", [step, {"op": "optimize", "probe_bytes": 4 * MIB},
                                               step], {}, "pccl", rate / 10, ())]
    if "d" in args.scenarios:
        plan = [{"op": "all_reduce", "bytes": s * MIB, "reps": 2} for s in args.sizes_mib]
        jobs += [("d", 2, fast, {}, "pccl", plan, {}, "pccl", rate, ()),
                 ("d", 2, fast, {}, "pccl", plan, {"PCCL_PACING": "off"},
                  "pccl, PCCL_PACING=off", rate, ())]
    if "e" in args.scenarios:
        long = Link(delay_ms=125, rate_mbit=rate)
        jobs += [("e", 2, long, {}, "pccl", [{**loop[0], "reps": 5}], {}, "pccl", rate, ())] * 2
    if "f" in args.scenarios:
        up = Link(delay_ms=args.rtt_ms / 2, rate_mbit=300)
        over = {(0, j): up for j in range(1, 4)}
        jobs += [("f", 4, fast, over, "pccl", [{**loop[0], "reps": 5}], {}, "pccl", 300.0, ())]
    if "g" in args.scenarios:
        secret = {"PCCL_SECRET": secrets.token_hex(32)}
        for _ in range(2):
            jobs += [("g", 2, fast, {}, "pccl", loop, {**secret, "PCCL_ENCRYPT": "0"},
                      "pccl, secret, plain", rate, ()),
                     ("g", 2, fast, {}, "pccl", loop, secret, "pccl, secret, encrypted", rate, ())]
    if "h" in args.scenarios:
        def to(mbit):
            link = Link(delay_ms=args.rtt_ms / 2, rate_mbit=mbit)
            return {"op": "wait", "links": {(0, 1): link, (1, 0): link},
                    "record": {"rate_mbit": mbit}}
        ops = {"op": "all_reduce", "bytes": big, "reps": 5}
        jobs += [("h", 2, fast, {}, "pccl", [ops, to(rate / 2), ops, to(rate), ops], {}, "pccl",
                  rate, ())]
    return jobs


def run_all(args) -> list[dict]:
    from _wan_report import forwarder_flag
    from harness.wanem import wan
    from tqdm import tqdm

    results = []
    for scenario, k, link, over, backend, plan, env, label, mbit, tags in tqdm(
            jobs_for(args), desc="wan", unit="group"):
        with wan(k, link, overrides=over) as w:
            w.check_connectivity()
            before = w.stats()
            res = run_group(w, backend, plan, env, args.timeout)
            stats = w.stats()
        # The group's run only: the namespaces' setup is not what a row measures.
        cpu_s, wall_s = stats["cpu_s"] - before["cpu_s"], stats["wall_s"] - before["wall_s"]
        results.append({"scenario": scenario, "world": k, "label": label, "backend": backend,
                        "env": env, "tags": list(tags), "bottleneck_mbit": mbit,
                        "init_s": res["init_s"], "rows": res["rows"],
                        "warmup_mib": res.get("warmup_bytes", 0) / MIB,
                        "stripe": res.get("stripe", 0),
                        "estimate_mbit": res.get("estimate", 0) * 8e-6,
                        "forwarder_cpu_s": cpu_s, "forwarder_wall_s": wall_s,
                        "forwarder_share": cpu_s / wall_s if wall_s > 0 else 0.0,
                        "forwarder_flag": forwarder_flag(cpu_s, wall_s),
                        "link_drops": {f"{i}->{j}": {"queue": s["drop_queue"],
                                                     "loss": s["drop_loss"]}
                                       for (i, j), s in stats["links"].items()}})
    return results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate (default 1000)")
    p.add_argument("--rtt-ms", type=float, default=100.0, help="RTT of (a, b, d, f) (default 100)")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--loop", type=int, default=8, help="ops of (a)'s loop (default 8)")
    p.add_argument("--groups", type=int, default=10, help="fresh groups of (a) (default 10)")
    p.add_argument("--idle-s", type=float, default=60.0, help="(a)'s idle period (default 60)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per group")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_wan"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from harness.wanem import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"wan.py: the WAN emulator cannot run here: {reason}", file=sys.stderr)
        return 2
    import _wan_report as report

    started = time.monotonic()
    results = run_all(args)
    report.table(results)
    goals = report.goals(results)
    print()
    for line in goals:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                   "results": results, "goals": goals,
                   "seconds": time.monotonic() - started}, f, indent=1)
    report.plot(results, os.path.join(args.out, "wan.png"))
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
