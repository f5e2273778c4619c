"""benchmarks/wan.py's report: the table, the goals with met / not met, the plot.

Pure functions of the results wan.py collects (a list of group records, see ``wan.py``):
no network, no processes, so they can be checked on recorded results.
"""

from __future__ import annotations

import statistics

MIB = 1 << 20
PAYLOAD = 1448 / 1500   # payload bytes per byte on the wire (IPv4 + TCP with timestamps)
FORWARDER_LIMIT = 0.70  # of one core: above it the emulator, not the link, may set the rate
GOALS = {"a_op": 0.80, "a_median": 0.85, "a_groups": 0.9, "a_idle": 0.80, "a_pinned": 0.97,
         "a_int8": 3.0, "init_100": 3.0, "init_250": 5.0, "warmup_mib": 64.0,
         "follow": 0.10, "follow_ops": 3, "b_util": 0.75, "c_gain": 5.0, "d_util": 0.85,
         "e_util": 0.80, "f_util": 0.85, "g_cost": 1.05}


def sent_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) / world * nbytes


def util(nbytes: int, world: int, seconds: float, mbit: float) -> float:
    """Share of a ``mbit`` Mbit/s link (IP bytes) that one op's bytes per rank filled."""
    return sent_bytes(nbytes, world) / seconds / (mbit * 1e6 / 8)


def forwarder_flag(cpu_s: float, wall_s: float, limit: float = FORWARDER_LIMIT) -> str:
    """A warning when the emulator's forwarder used more than ``limit`` of one core (its CPU
    seconds ``cpu_s`` over the wall seconds ``wall_s`` of the group): then the instrument, not
    the link, may have set the row's rate; "" otherwise."""
    share = cpu_s / wall_s if wall_s > 0 else 0.0
    if share <= limit:
        return ""
    return (f"forwarder at {share:.0%} of a core (> {limit:.0%}): the emulator may have "
            "limited this row")


def op_utils(res: dict) -> list[float]:
    """Every all-reduce's share of the bottleneck in a group, in order (idle steps skipped)."""
    return [util(row["bytes"], res["world"], s, res["bottleneck_mbit"])
            for row in res["rows"] if row["op"] in ("all_reduce", "int8") for s in row["times"]]


def groups(results: list[dict], scenario: str, label: str) -> list[dict]:
    return [r for r in results if r["scenario"] == scenario and r["label"] == label]


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def table(results: list[dict]) -> None:
    """Prints every group's ops, its stripe and estimate, and the forwarder's load."""
    print(f"\n{'sc':<3}{'group':<30}{'init s':>7}{'warm MiB':>9}{'stripe':>7}{'est Mbit':>9}"
          "  share of the link per op")
    for res in results:
        shares = " ".join(f"{u:.0%}" for u in op_utils(res))
        extra = "".join(f"; {row['op']} {row.get('seconds', '')}" for row in res["rows"]
                        if row["op"] in ("idle", "optimize", "set_link"))
        est = res.get("estimate_mbit")
        print(f"{res['scenario']:<3}{res['label'][:29]:<30}{res['init_s']:>7.1f}"
              f"{res.get('warmup_mib', 0):>9.1f}{res.get('stripe', 0):>7}"
              f"{(f'{est:.0f}' if est else '-'):>9}  {shares}{extra}")
    for res in results:
        drops = ", ".join(f"{pair} {d['queue']}q/{d['loss']}l"
                          for pair, d in res["link_drops"].items() if d["queue"] or d["loss"])
        flag = res.get("forwarder_flag", "")
        print(f"{res['scenario']:<3}{res['label'][:29]:<30}forwarder {res['forwarder_share']:.0%} "
              f"of a core; drops {drops or 'none'}" + (f"  ** {flag}" if flag else ""))


def goals(results: list[dict]) -> list[str]:
    """The goal lines of issue "The link filled by design", each with met / NOT met."""
    out = []
    a = groups(results, "a", "pccl")
    if a:
        per = [op_utils(r) for r in a]
        good = [min(u) >= GOALS["a_op"] and statistics.median(u) >= GOALS["a_median"]
                for u in per]
        medians = [statistics.median(u) for u in per]
        out.append(f"(a) groups with every op >= 80 % and the median >= 85 %, first op included: "
                   f"{sum(good)} of {len(a)} (worst ops {', '.join(f'{min(u):.0%}' for u in per)};"
                   f" medians {min(medians):.0%}-{max(medians):.0%}; goal >= 9 of 10): "
                   f"{verdict(sum(good) >= GOALS['a_groups'] * len(a))}")
        default = statistics.median(u for x in per for u in x)
        pinned = {r["label"]: [] for r in results if r["scenario"] == "a" and "PINNED" in r["tags"]}
        for r in results:
            if r["scenario"] == "a" and "PINNED" in r["tags"]:
                pinned[r["label"]] += op_utils(r)
        if pinned:
            best_label, best = max(((k, statistics.median(v)) for k, v in pinned.items()),
                                   key=lambda kv: kv[1])
            out.append(f"(a) default median {default:.0%} vs the best pinned setting of the run "
                       f"({best_label}: {best:.0%}): {default / best:.3f}x (goal >= "
                       f"{GOALS['a_pinned']}): {verdict(default >= GOALS['a_pinned'] * best)}")
        init = max(r["init_s"] for r in a)
        out.append(f"(a) init_process_group at 100 ms RTT: slowest of {len(a)} groups {init:.1f} s "
                   f"(goal <= {GOALS['init_100']:g} s; gloo ~1.1 s): "
                   f"{verdict(init <= GOALS['init_100'])}")
        warm = max(r.get("warmup_mib", 0) for r in a)
        out.append(f"(a) warm-up traffic per rank: at most {warm:.1f} MiB (goal <= "
                   f"{GOALS['warmup_mib']:g} MiB): {verdict(warm <= GOALS['warmup_mib'])}")
        flagged = [r for r in a if r.get("forwarder_flag")]
        if flagged:
            out.append(f"(a) ** {len(flagged)} group(s) flagged: the forwarder above "
                       f"{FORWARDER_LIMIT:.0%} of a core")
    idle = groups(results, "a", "pccl, idle")
    if idle:
        after = idle[0]["rows"][-1]
        u = util(after["bytes"], 2, after["times"][0], idle[0]["bottleneck_mbit"])
        out.append(f"(a) first op after {idle[0]['rows'][-2]['seconds']:g} s idle {u:.0%} "
                   f"(goal >= 80 %): {verdict(u >= GOALS['a_idle'])}")
    q, gl = groups(results, "a", "pccl int8"), groups(results, "a", "gloo")
    if a and q:
        ratio = statistics.median(op_utils(q[0])[1:]) / statistics.median(op_utils(a[0]))
        out.append(f"(a) int8 from its second op {ratio:.1f}x the float32 rate "
                   f"(goal >= 3x): {verdict(ratio >= GOALS['a_int8'])}")
    if a and gl:
        out.append(f"(a) pccl {statistics.median(op_utils(a[0])) / statistics.median(op_utils(gl[0])):.1f}x "
                   "gloo (for comparison)")
    h = groups(results, "h", "pccl")
    if h:
        out += follow_goals(h[0])
    for sc, key, what in (("b", "b_util", "0.01 % loss"), ("e", "e_util", "250 ms RTT"),
                          ("f", "f_util", "a 300 Mbit/s uplink in the ring")):
        rs = groups(results, sc, "pccl")
        if rs:
            med = statistics.median(u for r in rs for u in op_utils(r))
            out.append(f"({sc}) {what}: median op {med:.0%} of the bottleneck over {len(rs)} "
                       f"group(s) (goal >= {GOALS[key]:.0%}): {verdict(med >= GOALS[key])}")
    e = groups(results, "e", "pccl")
    if e:
        init = max(r["init_s"] for r in e)
        out.append(f"(e) init_process_group at 250 ms RTT: slowest {init:.1f} s (goal <= "
                   f"{GOALS['init_250']:g} s): {verdict(init <= GOALS['init_250'])}")
    c = groups(results, "c", "pccl")
    if c:
        before, after = min(c[0]["rows"][0]["times"]), min(c[0]["rows"][2]["times"])
        out.append(f"(c) optimised ring {before / after:.1f}x rank order (goal >= 5x): "
                   f"{verdict(before / after >= GOALS['c_gain'])}")
    d, d_off = groups(results, "d", "pccl"), groups(results, "d", "pccl, PCCL_PACING=off")
    if d and d_off:
        worst, slower = 1.0, []
        for row, off in zip(d[0]["rows"], d_off[0]["rows"]):
            u = util(row["bytes"], 2, min(row["times"]), d[0]["bottleneck_mbit"])
            if row["bytes"] >= 64 * MIB:
                worst = min(worst, u)
            if min(row["times"]) > min(off["times"]) * 1.05:
                slower.append(f"{row['bytes'] // MIB} MiB")
        out.append(f"(d) from 64 MiB at least {worst:.0%} (goal >= 85 %): "
                   f"{verdict(worst >= GOALS['d_util'])}; slower than pacing off (by > 5 %): "
                   f"{', '.join(slower) or 'none'}: {verdict(not slower)}")
    plain, sealed = groups(results, "g", "pccl, secret, plain"), groups(results, "g",
                                                                         "pccl, secret, encrypted")
    if plain and sealed:
        ratio = (statistics.median(1 / u for r in sealed for u in op_utils(r))
                 / statistics.median(1 / u for r in plain for u in op_utils(r)))
        out.append(f"(g) encrypted 64 MiB all-reduce with defaults: {ratio:.3f}x the plain one's "
                   f"time (goal <= {GOALS['g_cost']:.2f}): {verdict(ratio <= GOALS['g_cost'])}")
    return out


def follow_goals(res: dict) -> list[str]:
    """(h): after the link's rate changed, the ops until the estimate came within
    ``GOALS['follow']`` of the new rate (payload terms), per change."""
    out = []
    rate = res["bottleneck_mbit"]
    for row in res["rows"]:
        if row["op"] == "set_link":
            rate = row["rate_mbit"]
            continue
        if row["op"] != "all_reduce" or row is res["rows"][0]:
            continue
        want = rate * PAYLOAD
        ests = row.get("estimates_mbit") or []
        ops = next((i + 1 for i, e in enumerate(ests) if abs(e - want) <= GOALS["follow"] * want),
                   None)
        seen = ", ".join(f"{e:.0f}" for e in ests)
        out.append(f"(h) link at {rate:g} Mbit/s: estimate within 10 % of {want:.0f} Mbit/s of "
                   f"payload after {ops if ops else '-'} op(s) ({seen}; goal <= 3): "
                   f"{verdict(ops is not None and ops <= GOALS['follow_ops'])}")
    return out


def plot(results: list[dict], path: str) -> None:
    """Share of the link per op for every group of (a), (b), (e), (f), (g); (d)'s sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {}
    for res in results:
        if res["scenario"] in ("a", "b", "e", "f", "g") and res["backend"] == "pccl":
            shares = op_utils(res)
            key = (res["scenario"], res["label"])
            first = key not in colours
            line, = left.plot(range(1, len(shares) + 1), shares, marker="o", ms=3, lw=0.8,
                              color=colours.get(key),
                              label=f"({res['scenario']}) {res['label']}" if first else None)
            colours[key] = line.get_color()
        if res["scenario"] == "d":
            sizes = [r["bytes"] / MIB for r in res["rows"]]
            shares = [util(r["bytes"], 2, min(r["times"]), res["bottleneck_mbit"])
                      for r in res["rows"]]
            right.plot(sizes, shares, marker="o", label=res["label"])
    left.set_xlabel("op of the group, in order (every fresh group drawn)")
    left.set_ylabel("share of the bottleneck link")
    left.axhline(0.85, color="grey", lw=0.8, ls="--")
    left.legend(fontsize=6)
    left.grid(True, alpha=0.3)
    right.set_xscale("log", base=2)
    right.set_xlabel("all_reduce size (MiB, float32)")
    right.axhline(0.85, color="grey", lw=0.8, ls="--")
    right.legend(fontsize=7)
    right.grid(True, alpha=0.3)
    fig.suptitle("pccl across emulated WAN links: defaults, fresh groups, beside settings")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
