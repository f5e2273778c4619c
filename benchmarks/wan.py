"""All-reduce across emulated WAN links: gloo and pccl side by side, in one run (root only).

Builds its own links: every rank is a network namespace joined to the others by the
project's userspace TUN forwarder (tests/harness/wanem.py; this kernel has no netem),
with a one-way delay, a rate, a 50 ms tail-drop queue and optional random loss per
directed pair. Scenarios (issue "WAN data plane"):

  a  2 peers, 1 Gbit/s, 100 ms RTT: one 64 MiB float32 all_reduce: gloo, pccl with one
     stream, pccl striped (PCCL_STREAMS) as configured by default (unpaced), paced at the
     link's rate (PCCL_PACING=<rate>, what an operator who knows the link sets) and with
     measured pacing (PCCL_PACING=auto, experimental), and pccl's int8
     all_reduce_quantized
  b  the same link with 0.01 % loss: gloo and pccl striped, unpaced and paced at the rate
  c  4 peers on 1 Gbit/s, 50 ms RTT, where the pairs (0,1) and (2,3) run at 100 Mbit/s:
     the rank-order ring crosses both, another ring avoids them: pccl in rank order, then
     after torch_pccl.optimize_topology() (measured, not told)
  d  2 peers as in (a), sizes 1 .. 256 MiB: gloo and pccl striped

Link utilisation = bytes each rank sends / seconds / rate (a ring all-reduce sends
2 (W-1)/W of the tensor from every rank; for W = 2, the tensor once). Prints a table with
the ratios and each goal met or not, writes results.json and wan.png, shows a progress bar.

    sudo python benchmarks/wan.py                 # every scenario, ~5 minutes
    sudo python benchmarks/wan.py --scenarios a c  # some
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STORE_PORT = 29670
MIB = 1 << 20
GOALS = {
    "a_util": 0.85, "a_vs_gloo": 6.0, "a_int8": 3.0, "b_util": 0.60, "c_gain": 5.0,
}


# -------------------------------------------------------------------------- worker side


def worker(cfg: dict) -> None:
    """One rank, inside its namespace: init, warm up, time the plan, print one JSON result."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group(cfg["backend"], init_method=f"tcp://{cfg['store']}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(
                                seconds=cfg["timeout"]))
    dist.all_reduce(torch.ones(1024))                 # links up, windows opened a little
    out = {"event": "result", "rank": rank, "rows": []}
    for step in cfg["plan"]:
        if step["op"] == "optimize":
            import torch_pccl

            choice = torch_pccl.optimize_topology(probe_bytes=step["probe_bytes"])
            out["rows"].append({"op": "optimize", "order": list(choice.order),
                                "seconds": choice.seconds,
                                "bandwidth": [list(r) for r in choice.bandwidth]})
            continue
        t = torch.ones(step["bytes"] // 4)
        times = []
        for _ in range(step["reps"]):
            dist.barrier()
            start = time.monotonic()
            if step["op"] == "int8":
                import torch_pccl

                torch_pccl.all_reduce_quantized(t, bits=8, op=dist.ReduceOp.SUM)
            else:
                dist.all_reduce(t)
            times.append(time.monotonic() - start)
        out["rows"].append({**step, "times": times})
    dist.barrier()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


# -------------------------------------------------------------------------- driver side


def run_group(w, backend: str, plan: list[dict], env_extra: dict, timeout_s: float) -> dict:
    """Runs one group (one process per host of ``w``); rank 0's result."""
    from _harness import child_env

    # gloo would pick the address of the hostname (127.0.0.1): give it the WAN device.
    env = child_env(GLOO_SOCKET_IFNAME="wan0", **env_extra)
    procs = []
    for r in range(w.k):
        cfg = {"rank": r, "world": w.k, "backend": backend, "plan": plan,
               "store": f"{w.addrs[0]}:{STORE_PORT}", "timeout": timeout_s}
        procs.append(w.popen(r, [sys.executable, os.path.abspath(__file__), "--worker",
                                 json.dumps(cfg)], env=env, label=f"{backend} rank {r}"))
    try:
        results = [p.finish(timeout_s + 60) for p in procs]
    finally:
        for p in procs:
            p.close()
    return results[0]


def best(row: dict) -> float:
    return min(row["times"])


def sent_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) / world * nbytes


def scenario_rows(args) -> list[dict]:
    from harness.wanem import Link, wan

    rows = []
    rate, streams = args.rate_mbit, args.streams
    pccl_env = {"PCCL_MASTER": "0"}
    fast = Link(delay_ms=args.rtt_ms / 2, rate_mbit=rate)
    jobs = []
    if "a" in args.scenarios:
        size = 64 * MIB
        plan = [{"op": "all_reduce", "bytes": size, "reps": args.reps}]
        jobs += [("a", 2, fast, {}, "gloo", plan, {}, "gloo"),
                 ("a", 2, fast, {}, "pccl", plan, {**pccl_env, "PCCL_STREAMS": "1"},
                  "pccl, 1 stream"),
                 ("a", 2, fast, {}, "pccl", plan, {**pccl_env, "PCCL_STREAMS": str(streams)},
                  f"pccl, {streams} streams"),
                 ("a", 2, fast, {}, "pccl", plan,
                  {**pccl_env, "PCCL_STREAMS": str(streams), "PCCL_PACING": f"{rate:g}"},
                  f"pccl, {streams} streams, paced"),
                 ("a", 2, fast, {}, "pccl", plan,
                  {**pccl_env, "PCCL_STREAMS": str(streams), "PCCL_PACING": "auto"},
                  f"pccl, {streams} streams, auto"),
                 ("a", 2, fast, {}, "pccl", [{**plan[0], "op": "int8"}],
                  {**pccl_env, "PCCL_STREAMS": str(streams)}, f"pccl int8, {streams} streams")]
    if "b" in args.scenarios:
        lossy = Link(delay_ms=args.rtt_ms / 2, rate_mbit=rate, loss=1e-4)
        plan = [{"op": "all_reduce", "bytes": 64 * MIB, "reps": args.reps}]
        jobs += [("b", 2, lossy, {}, "gloo", plan, {}, "gloo"),
                 ("b", 2, lossy, {}, "pccl", plan, {**pccl_env, "PCCL_STREAMS": str(streams)},
                  f"pccl, {streams} streams"),
                 ("b", 2, lossy, {}, "pccl", plan,
                  {**pccl_env, "PCCL_STREAMS": str(streams), "PCCL_PACING": f"{rate:g}"},
                  f"pccl, {streams} streams, paced")]
    if "c" in args.scenarios:
        link = Link(delay_ms=25, rate_mbit=rate)
        slow = Link(delay_ms=25, rate_mbit=rate / 10)
        over = {(0, 1): slow, (1, 0): slow, (2, 3): slow, (3, 2): slow}
        step = {"op": "all_reduce", "bytes": 16 * MIB, "reps": args.reps}
        plan = [step, {"op": "optimize", "probe_bytes": 4 * MIB}, step]
        jobs += [("c", 4, link, over, "pccl", plan, {**pccl_env, "PCCL_STREAMS": str(streams)},
                  f"pccl, {streams} streams")]
    if "d" in args.scenarios:
        plan = [{"op": "all_reduce", "bytes": s * MIB, "reps": 1} for s in args.sizes_mib]
        jobs += [("d", 2, fast, {}, "gloo", plan, {}, "gloo"),
                 ("d", 2, fast, {}, "pccl", plan, {**pccl_env, "PCCL_STREAMS": str(streams)},
                  f"pccl, {streams} streams")]
    from tqdm import tqdm

    for scenario, k, link, over, backend, plan, env, label in tqdm(jobs, desc="wan",
                                                                    unit="group"):
        with wan(k, link, overrides=over) as w:
            if args.no_idle_restart:
                for i in range(k):
                    w.run(i, ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], 10)
            w.check_connectivity()
            res = run_group(w, backend, plan, env, args.timeout)
            cpu = w.stats()["cpu_s"]
        rows.append({"scenario": scenario, "world": k, "label": label, "backend": backend,
                     "rows": res["rows"], "forwarder_cpu_s": cpu})
    return rows


def summarise(results: list[dict], args) -> list[str]:
    """Prints the table; returns the goal lines."""
    rate_bps = args.rate_mbit * 1e6 / 8
    lines, goals, by = [], [], {}
    print(f"\n{'scenario':<9}{'group':<28}{'size':>8}{'best s':>9}{'util':>7}  notes")
    for res in results:
        for row in res["rows"]:
            if row["op"] == "optimize":
                print(f"{res['scenario']:<9}{res['label']:<28}{'':>8}{row['seconds']:>9.2f}"
                      f"{'':>7}  optimize_topology -> ring {row['order']}")
                continue
            s = best(row)
            util = sent_bytes(row["bytes"], res["world"]) / s / rate_bps
            key = (res["scenario"], res["label"], row["bytes"], row["op"])
            by.setdefault(key, []).append(s)
            note = ("int8 all_reduce_quantized (util: of the float32 bytes it stands for)"
                    if row["op"] == "int8" else row["op"])
            every = " ".join(f"{x:.2f}" for x in row["times"])
            print(f"{res['scenario']:<9}{res['label']:<28}{row['bytes'] // MIB:>6}Mi{s:>9.3f}"
                  f"{util:>7.0%}  {note}; every repetition: {every} s")
    streams = args.streams

    def t(scenario, label, size, op="all_reduce", i=0):
        got = by.get((scenario, label, size * MIB, op))
        return got[i] if got and len(got) > i else None

    if "a" in args.scenarios:
        g, p1 = t("a", "gloo", 64), t("a", "pccl, 1 stream", 64)
        q = t("a", f"pccl int8, {streams} streams", 64, "int8")
        for how in ("", ", paced", ", auto"):
            ps = t("a", f"pccl, {streams} streams{how}", 64)
            util = sent_bytes(64 * MIB, 2) / ps / rate_bps
            name = {"": "default (unpaced)", ", paced": "PCCL_PACING=link rate",
                    ", auto": "PCCL_PACING=auto"}[how]
            goals.append(f"(a) {name}: utilisation {util:.0%} (goal >= 85 %), {g / ps:.1f}x "
                         f"gloo (goal >= 6x), {p1 / ps:.1f}x one stream: "
                         f"{'met' if util >= GOALS['a_util'] and g / ps >= GOALS['a_vs_gloo'] else 'NOT met'}")
        ps = t("a", f"pccl, {streams} streams", 64)
        goals.append(f"(a) int8 rate / float32 rate (default) {ps / q:.1f}x (goal >= 3x): "
                     f"{'met' if ps / q >= GOALS['a_int8'] else 'NOT met'}")
    if "b" in args.scenarios:
        g = t("b", "gloo", 64)
        for how, name in (("", "default (unpaced)"), (", paced", "PCCL_PACING=link rate")):
            ps = t("b", f"pccl, {streams} streams{how}", 64)
            util = sent_bytes(64 * MIB, 2) / ps / rate_bps
            goals.append(f"(b) {name}: utilisation with 0.01 % loss {util:.0%} (goal >= 60 %), "
                         f"gloo {sent_bytes(64 * MIB, 2) / g / rate_bps:.0%}: "
                         f"{'met' if util >= GOALS['b_util'] else 'NOT met'}")
    if "c" in args.scenarios:
        before = t("c", f"pccl, {streams} streams", 16, i=0)
        after = t("c", f"pccl, {streams} streams", 16, i=1)
        goals.append(f"(c) optimised ring {before / after:.1f}x faster than rank order "
                     f"(goal >= 5x): {'met' if before / after >= GOALS['c_gain'] else 'NOT met'}")
    for line in goals:
        print(line)
    return goals


def plot(results: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        if res["scenario"] != "d":
            continue
        rows = [r for r in res["rows"] if r["op"] == "all_reduce"]
        sizes = [r["bytes"] / MIB for r in rows]
        util = [sent_bytes(r["bytes"], res["world"]) / best(r) / (args.rate_mbit * 1e6 / 8)
                for r in rows]
        ax.plot(sizes, util, marker="o", label=res["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("all_reduce size (MiB, float32)")
    ax.set_ylabel("share of the link")
    ax.set_title(f"2 peers, {args.rate_mbit:g} Mbit/s, {args.rtt_ms:g} ms RTT (emulated)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=["a", "b", "c", "d"],
                   choices=["a", "b", "c", "d"])
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate (default 1000)")
    p.add_argument("--rtt-ms", type=float, default=100.0, help="RTT of (a, b, d) (default 100)")
    p.add_argument("--streams", type=int, default=None,
                   help="pccl's PCCL_STREAMS for the striped groups (default: torch_pccl's)")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--reps", type=int, default=4,
                   help="timed repetitions (best is kept; every one is printed)")
    p.add_argument("--no-idle-restart", action="store_true",
                   help="net.ipv4.tcp_slow_start_after_idle=0 in every host")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per group")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_wan"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.streams is None:
        from torch_pccl import config

        args.streams = config.DEFAULT_STREAMS
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from harness.wanem import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"wan.py: the WAN emulator cannot run here: {reason}", file=sys.stderr)
        return 2
    started = time.monotonic()
    results = scenario_rows(args)
    goals = summarise(results, args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                   "results": results, "goals": goals,
                   "seconds": time.monotonic() - started}, f, indent=1)
    if "d" in args.scenarios:
        plot(results, args, os.path.join(args.out, "wan.png"))
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
