"""All-reduce across emulated WAN links: pccl as a user gets it (no PCCL_* variable set)
beside gloo and pinned settings, in one run (root only).

Builds its own links: every rank is a network namespace joined to the others by the
project's userspace TUN forwarder (tests/harness/wanem.py; this kernel has no netem),
with a one-way delay, a rate, a 50 ms tail-drop queue and optional random loss per
directed pair. Scenarios (issue "The link filled by default"); every "pccl" row runs with
no PCCL_* variable set, the rows that name a setting are there for comparison:

  a  2 peers, 1 Gbit/s, 100 ms RTT, 64 MiB float32: a loop that issues one all-reduce at
     a time (a barrier before each) from the group's first op, then 60 s without traffic
     and one more op; gloo; pccl with PCCL_PACING=<link rate> (what an operator who knows
     the link sets) and PCCL_PACING=off; pccl's int8 all_reduce_quantized
  b  as (a) with 0.01 % loss: pccl and PCCL_PACING=off
  c  4 peers on 1 Gbit/s, 50 ms RTT, where the pairs (0,1) and (2,3) run at 100 Mbit/s:
     the rank-order ring crosses both, another ring avoids them: pccl in rank order, then
     after torch_pccl.optimize_topology() (measured, not told)
  d  as (a), sizes 1 .. 256 MiB: pccl and PCCL_PACING=off
  e  2 peers, 1 Gbit/s, 250 ms RTT, 64 MiB
  f  4 peers in a ring at 1 Gbit/s, 100 ms RTT, rank 0's uplink at 300 Mbit/s, 64 MiB
  g  as (a)'s loop, with a shared secret: links in the clear (PCCL_ENCRYPT=0) and encrypted
     (the default with a secret; docs/security.md), one group after the other; then both
     again with PCCL_PACING=<link rate>, so that the rate estimate is not part of the ratio

Link utilisation = bytes each rank sends / seconds / rate (a ring all-reduce sends
2 (W-1)/W of the tensor from every rank; for W = 2, the tensor once); in (f) the rate is
that of the slowest link. Prints a table with every op's time, per group the forwarder's
share of a core over the group's run (flagged above 70 %: then the emulator may have set the
rate) and its drops by queue and by loss per link, the goals and whether each is met, writes
results.json and wan.png, shows a progress bar.

    sudo python benchmarks/wan.py                  # every scenario, ~12 minutes
    sudo python benchmarks/wan.py --scenarios a c  # some
    sudo python benchmarks/wan.py --scenarios g    # encryption's cost (issue 28)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STORE_PORT = 29670
MIB = 1 << 20
SCENARIOS = ["a", "b", "c", "d", "e", "f", "g"]
FORWARDER_LIMIT = 0.70  # of one core: above it the emulator, not the link, may set the rate
GOALS = {"a_first": 0.70, "a_later": 0.85, "a_idle": 0.80, "a_int8": 3.0, "b_util": 0.70,
         "c_gain": 5.0, "d_util": 0.85, "e_util": 0.80, "f_util": 0.85, "g_cost": 1.05}


# -------------------------------------------------------------------------- worker side


def worker(cfg: dict) -> None:
    """One rank, inside its namespace: init, run the plan, print one JSON result."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    started = time.monotonic()
    dist.init_process_group(cfg["backend"], init_method=f"tcp://{cfg['store']}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(
                                seconds=cfg["timeout"]))
    out = {"event": "result", "rank": rank, "rows": [], "init_s": time.monotonic() - started}
    for step in cfg["plan"]:
        if step["op"] == "optimize":
            import torch_pccl

            choice = torch_pccl.optimize_topology(probe_bytes=step["probe_bytes"])
            out["rows"].append({"op": "optimize", "order": list(choice.order),
                                "seconds": choice.seconds})
            continue
        if step["op"] == "idle":
            time.sleep(step["seconds"])     # the idle period is what is measured after it
            out["rows"].append(dict(step))
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
    env = {k: v for k, v in child_env(GLOO_SOCKET_IFNAME="wan0").items()
           if not k.startswith("PCCL_")}
    env.update(PCCL_MASTER="0", **env_extra)
    procs = []
    for r in range(w.k):
        cfg = {"rank": r, "world": w.k, "backend": backend, "plan": plan,
               "store": f"{w.addrs[0]}:{STORE_PORT}", "timeout": timeout_s}
        procs.append(w.popen(r, [sys.executable, os.path.abspath(__file__), "--worker",
                                 json.dumps(cfg)], env=env, label=f"{backend} rank {r}"))
    try:
        results = [p.finish(timeout_s + 120) for p in procs]
    finally:
        for p in procs:
            p.close()
    return results[0]


def sent_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) / world * nbytes


def jobs_for(args) -> list[tuple]:
    """(scenario, hosts, link, overrides, backend, plan, env, label, bottleneck Mbit/s)."""
    from harness.wanem import Link

    rate, jobs = args.rate_mbit, []
    big = 64 * MIB
    fast = Link(delay_ms=args.rtt_ms / 2, rate_mbit=rate)
    loop = [{"op": "all_reduce", "bytes": big, "reps": args.loop}]
    if "a" in args.scenarios:
        idle = [*loop, {"op": "idle", "seconds": args.idle_s},
                {"op": "all_reduce", "bytes": big, "reps": 1}]
        jobs += [("a", 2, fast, {}, "pccl", idle, {}, "pccl", rate),
                 ("a", 2, fast, {}, "pccl", [{"op": "int8", "bytes": big, "reps": 4}], {},
                  "pccl int8", rate),
                 ("a", 2, fast, {}, "gloo", [{**loop[0], "reps": 3}], {}, "gloo", rate),
                 ("a", 2, fast, {}, "pccl", loop, {"PCCL_PACING": f"{rate:g}"},
                  "pccl, PCCL_PACING=rate", rate),
                 ("a", 2, fast, {}, "pccl", loop, {"PCCL_PACING": "off"},
                  "pccl, PCCL_PACING=off", rate)]
    if "b" in args.scenarios:
        lossy = Link(delay_ms=args.rtt_ms / 2, rate_mbit=rate, loss=1e-4)
        plan = [{"op": "all_reduce", "bytes": big, "reps": 5}]
        jobs += [("b", 2, lossy, {}, "pccl", plan, {}, "pccl", rate),
                 ("b", 2, lossy, {}, "pccl", plan, {"PCCL_PACING": "off"},
                  "pccl, PCCL_PACING=off", rate)]
    if "c" in args.scenarios:
        link = Link(delay_ms=25, rate_mbit=rate)
        slow = Link(delay_ms=25, rate_mbit=rate / 10)
        over = {(0, 1): slow, (1, 0): slow, (2, 3): slow, (3, 2): slow}
        step = {"op": "all_reduce", "bytes": 16 * MIB, "reps": 3}
        jobs += [("c", 4, link, over, "pccl", [step, {"op": "optimize", "probe_bytes": 4 * MIB},
                                               step], {}, "pccl", rate / 10)]
    if "d" in args.scenarios:
        plan = [{"op": "all_reduce", "bytes": s * MIB, "reps": 2} for s in args.sizes_mib]
        jobs += [("d", 2, fast, {}, "pccl", plan, {}, "pccl", rate),
                 ("d", 2, fast, {}, "pccl", plan, {"PCCL_PACING": "off"},
                  "pccl, PCCL_PACING=off", rate)]
    if "e" in args.scenarios:
        long = Link(delay_ms=125, rate_mbit=rate)
        jobs += [("e", 2, long, {}, "pccl", [{"op": "all_reduce", "bytes": big, "reps": 5}],
                  {}, "pccl", rate)]
    if "f" in args.scenarios:
        up = Link(delay_ms=args.rtt_ms / 2, rate_mbit=300)
        over = {(0, j): up for j in range(1, 4)}
        jobs += [("f", 4, fast, over, "pccl", [{"op": "all_reduce", "bytes": big, "reps": 5}],
                  {}, "pccl", 300.0)]
    if "g" in args.scenarios:
        secret = {"PCCL_SECRET": secrets.token_hex(32)}
        plan = [{"op": "all_reduce", "bytes": big, "reps": args.loop}]
        pinned = {**secret, "PCCL_PACING": f"{rate:g}"}
        jobs += [("g", 2, fast, {}, "pccl", plan, {**secret, "PCCL_ENCRYPT": "0"},
                  "pccl, secret, plain", rate),
                 ("g", 2, fast, {}, "pccl", plan, secret, "pccl, secret, encrypted", rate),
                 # The same with the cap pinned at the link's rate: what encryption costs
                 # with the rate estimate taken out of the comparison.
                 ("g", 2, fast, {}, "pccl", plan, {**pinned, "PCCL_ENCRYPT": "0"},
                  "plain, PCCL_PACING=rate", rate),
                 ("g", 2, fast, {}, "pccl", plan, pinned, "encrypted, PCCL_PACING=rate", rate)]
    return jobs


def run_all(args) -> list[dict]:
    from harness.wanem import wan
    from tqdm import tqdm

    results = []
    for scenario, k, link, over, backend, plan, env, label, mbit in tqdm(
            jobs_for(args), desc="wan", unit="group"):
        with wan(k, link, overrides=over) as w:
            w.check_connectivity()
            before = w.stats()
            res = run_group(w, backend, plan, env, args.timeout)
            stats = w.stats()
        # The group's run only: the namespaces' setup is not what a row measures.
        cpu_s, wall_s = stats["cpu_s"] - before["cpu_s"], stats["wall_s"] - before["wall_s"]
        results.append({"scenario": scenario, "world": k, "label": label, "backend": backend,
                        "env": env, "bottleneck_mbit": mbit, "init_s": res["init_s"],
                        "rows": res["rows"], "forwarder_cpu_s": cpu_s,
                        "forwarder_wall_s": wall_s,
                        "forwarder_share": cpu_s / wall_s if wall_s > 0 else 0.0,
                        "forwarder_flag": forwarder_flag(cpu_s, wall_s),
                        "drops": sum(s["drop_queue"] for s in stats["links"].values()),
                        "link_drops": {f"{i}->{j}": {"queue": s["drop_queue"],
                                                     "loss": s["drop_loss"]}
                                       for (i, j), s in stats["links"].items()}})
    return results


def forwarder_flag(cpu_s: float, wall_s: float, limit: float = FORWARDER_LIMIT) -> str:
    """A warning when the emulator's forwarder used more than ``limit`` of one core (its CPU
    seconds ``cpu_s`` over the wall seconds ``wall_s`` of the group): then the instrument, not
    the link, may have set the row's rate; "" otherwise."""
    share = cpu_s / wall_s if wall_s > 0 else 0.0
    if share <= limit:
        return ""
    return (f"forwarder at {share:.0%} of a core (> {limit:.0%}): the emulator may have "
            "limited this row")


def args_loop(res: dict) -> int:
    """How many ops the first row of a group's result ran."""
    return len(res["rows"][0]["times"])


def util(nbytes: int, world: int, seconds: float, mbit: float) -> float:
    return sent_bytes(nbytes, world) / seconds / (mbit * 1e6 / 8)


def summarise(results: list[dict]) -> list[str]:
    """Prints the table; returns the goal lines."""
    print(f"\n{'sc':<3}{'group':<26}{'init s':>7}{'size':>8}  share of the link per op "
          "(seconds per op)")
    for res in results:
        for row in res["rows"]:
            if row["op"] == "optimize":
                print(f"{res['scenario']:<3}{res['label']:<26}{'':>7}{'':>8}  "
                      f"optimize_topology -> ring {row['order']} in {row['seconds']:.1f} s")
            elif row["op"] == "idle":
                print(f"{res['scenario']:<3}{res['label']:<26}{'':>7}{'':>8}  "
                      f"{row['seconds']:g} s without traffic")
            else:
                shares = " ".join(f"{util(row['bytes'], res['world'], s, res['bottleneck_mbit']):.0%}"
                                  for s in row["times"])
                times = " ".join(f"{s:.2f}" for s in row["times"])
                print(f"{res['scenario']:<3}{res['label']:<26}{res['init_s']:>7.1f}"
                      f"{row['bytes'] // MIB:>6}Mi  {shares}  ({times})")
    for res in results:
        drops = ", ".join(f"{pair} {d['queue']} queue / {d['loss']} loss"
                          for pair, d in res["link_drops"].items() if d["queue"] or d["loss"])
        print(f"{res['scenario']:<3}{res['label']:<26}forwarder {res['forwarder_share']:.0%} "
              f"of a core; drops {drops or 'none'}"
              + (f"  ** {res['forwarder_flag']}" if res["forwarder_flag"] else ""))
    goals = []

    def find(scenario, label):
        return next((r for r in results if r["scenario"] == scenario and r["label"] == label),
                    None)

    def verdict(ok):
        return "met" if ok else "NOT met"

    a = find("a", "pccl")
    if a:
        loop_row, after = a["rows"][0], a["rows"][-1]
        u = [util(loop_row["bytes"], 2, s, a["bottleneck_mbit"]) for s in loop_row["times"]]
        idle_u = util(after["bytes"], 2, after["times"][0], a["bottleneck_mbit"])
        goals += [f"(a) first op of a new group {u[0]:.0%} of the link (goal >= 70 %): "
                  f"{verdict(u[0] >= GOALS['a_first'])}",
                  f"(a) ops 2-{len(u)}, one at a time: lowest {min(u[1:]):.0%}, median "
                  f"{statistics.median(u[1:]):.0%} (goal: each >= 85 %): "
                  f"{verdict(min(u[1:]) >= GOALS['a_later'])}",
                  f"(a) first op after {a['rows'][1]['seconds']:g} s idle {idle_u:.0%} "
                  f"(goal >= 80 %): {verdict(idle_u >= GOALS['a_idle'])}"]
        q = find("a", "pccl int8")
        if q:
            ratio = statistics.median(loop_row["times"][1:]) / statistics.median(
                q["rows"][0]["times"][1:])
            goals.append(f"(a) int8 from its second op {ratio:.1f}x the float32 rate "
                         f"(goal >= 3x): {verdict(ratio >= GOALS['a_int8'])}")
        g = find("a", "gloo")
        if g:
            goals.append(f"(a) pccl ops 2-{len(u)} {statistics.median(g['rows'][0]['times']) / statistics.median(loop_row['times'][1:]):.1f}x gloo "
                         "(for comparison)")
    b = find("b", "pccl")
    if b:
        u = [util(b["rows"][0]["bytes"], 2, s, b["bottleneck_mbit"]) for s in b["rows"][0]["times"]]
        goals.append(f"(b) 0.01 % loss, median of ops 2-{len(u)} {statistics.median(u[1:]):.0%} "
                     f"(goal >= 70 %): {verdict(statistics.median(u[1:]) >= GOALS['b_util'])}")
    c = find("c", "pccl")
    if c:
        before = min(c["rows"][0]["times"])
        after = min(c["rows"][2]["times"])
        goals.append(f"(c) optimised ring {before / after:.1f}x rank order, pacing on "
                     f"(goal >= 5x): {verdict(before / after >= GOALS['c_gain'])}")
    d, d_off = find("d", "pccl"), find("d", "pccl, PCCL_PACING=off")
    if d and d_off:
        worst, slower = 1.0, []
        for row, off in zip(d["rows"], d_off["rows"]):
            u = util(row["bytes"], 2, min(row["times"]), d["bottleneck_mbit"])
            if row["bytes"] >= 64 * MIB:
                worst = min(worst, u)
            if min(row["times"]) > min(off["times"]) * 1.05:
                slower.append(f"{row['bytes'] // MIB} MiB")
        goals.append(f"(d) from 64 MiB at least {worst:.0%} (goal >= 85 %): "
                     f"{verdict(worst >= GOALS['d_util'])}; slower than pacing off (by > 5 %): "
                     f"{', '.join(slower) or 'none'}: {verdict(not slower)}")
    for sc, key, what in (("e", "e_util", "250 ms RTT"),
                          ("f", "f_util", "a 300 Mbit/s uplink in the ring")):
        r = find(sc, "pccl")
        if r:
            u = [util(r["rows"][0]["bytes"], r["world"], s, r["bottleneck_mbit"])
                 for s in r["rows"][0]["times"]]
            goals.append(f"({sc}) {what}: median of ops 2-{len(u)} {statistics.median(u[1:]):.0%} "
                         f"of the bottleneck (goal >= {GOALS[key]:.0%}): "
                         f"{verdict(statistics.median(u[1:]) >= GOALS[key])}")
    for plain_label, sealed_label, how in (
            ("pccl, secret, plain", "pccl, secret, encrypted", "pacing auto"),
            ("plain, PCCL_PACING=rate", "encrypted, PCCL_PACING=rate", "pacing pinned")):
        plain, sealed = find("g", plain_label), find("g", sealed_label)
        if plain and sealed:
            ratio = statistics.median(sealed["rows"][0]["times"][1:]) / statistics.median(
                plain["rows"][0]["times"][1:])
            goals.append(f"(g) encrypted 64 MiB all-reduce, {how}, median of ops "
                         f"2-{args_loop(sealed)}: {ratio:.3f}x the plain one (goal <= "
                         f"{GOALS['g_cost']:.2f}): {verdict(ratio <= GOALS['g_cost'])}")
    print()
    for line in goals:
        print(line)
    return goals


def plot(results: list[dict], path: str) -> None:
    """Share of the link per op: (a)'s loop and the op after idle, and (d)'s sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for res in results:
        if res["scenario"] in ("a", "b", "e", "f") and res["rows"][0]["op"] == "all_reduce":
            shares = [util(row["bytes"], res["world"], s, res["bottleneck_mbit"])
                      for row in res["rows"] if row["op"] == "all_reduce" for s in row["times"]]
            left.plot(range(1, len(shares) + 1), shares, marker="o",
                      label=f"({res['scenario']}) {res['label']}")
        if res["scenario"] == "d":
            sizes = [r["bytes"] / MIB for r in res["rows"]]
            shares = [util(r["bytes"], 2, min(r["times"]), res["bottleneck_mbit"])
                      for r in res["rows"]]
            right.plot(sizes, shares, marker="o", label=res["label"])
    left.set_xlabel("op of the group, in order (a: the last one after the idle period)")
    left.set_ylabel("share of the bottleneck link")
    left.axhline(0.85, color="grey", lw=0.8, ls="--")
    left.legend(fontsize=7)
    left.grid(True, alpha=0.3)
    right.set_xscale("log", base=2)
    right.set_xlabel("all_reduce size (MiB, float32)")
    right.axhline(0.85, color="grey", lw=0.8, ls="--")
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    fig.suptitle("pccl across emulated WAN links, defaults vs settings")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate (default 1000)")
    p.add_argument("--rtt-ms", type=float, default=100.0, help="RTT of (a, b, d, f) (default 100)")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--loop", type=int, default=8, help="ops of (a)'s loop (default 8)")
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
    started = time.monotonic()
    results = run_all(args)
    goals = summarise(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"},
                   "results": results, "goals": goals,
                   "seconds": time.monotonic() - started}, f, indent=1)
    plot(results, os.path.join(args.out, "wan.png"))
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
