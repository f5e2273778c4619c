"""benchmarks/wan_training.py's report: every row's summary as results.json lists it, the goals
of the issues with met / NOT met, the table and the plot.

Pure functions of what a row recorded (``run_row``'s raw result, the rows' summaries and the
command line's settings): no process, no network, so they can be checked on recorded results.
"""

from __future__ import annotations

import statistics

from _wan_curve import crossing, equal_time_losses, link_utilisation, parity, speedup, utilisation
from _wan_report import FORWARDER_LIMIT, forwarder_flag

GOALS = {"vs_gloo": 5.0, "vs_ddp_pccl": 3.0, "streaming_util": 0.95, "streaming_loss": 0.02,
         "async_loss": 0.05,
         "churn_time": 0.20, "quorum_speedup": 1.5, "quorum_cost": 0.02}


def summarise_row(args, row, raw: dict) -> dict:
    """The row as results.json lists it."""
    curve = raw["curve"]
    hit = crossing(curve, args.target_loss)
    ends = [r[-1] for r in raw["records"].values() if r and r[-1]["kind"] == "end"]
    last_snaps = [next(x for x in reversed(r) if x["kind"] == "snap")
                  for r in raw["records"].values() if any(x["kind"] == "snap" for x in r)]
    per_peer = ends if ends else last_snaps
    utils = [utilisation(p["compute"], p["seconds"]) for p in per_peer if p["seconds"] > 0]
    par = shard_parity(raw["records"])
    bytes_per_host = raw.get("bytes_per_host")
    link = None
    if bytes_per_host and not row.overlapped:
        shares = []
        for name, r in raw["records"].items():
            host = int(name.split("-")[1])
            last = [x for x in r if x["kind"] in ("snap", "end")]
            # The peers that trained from start to end or cap (not a victim, not a joiner);
            # of a sharded replica, shard 0 (its host's bytes are its shards' together).
            if last and name.endswith(f"-{host}") and (last[-1]["kind"] == "end"
                                                       or raw["capped"]):
                share = link_utilisation(bytes_per_host[host], last[-1]["wire"],
                                         args.rate_mbit)
                if share is not None:
                    shares.append(share)
        link = statistics.mean(shares) if shares else None
    fwd_cpu, fwd_wall = raw.get("forwarder_cpu_s"), raw.get("forwarder_wall_s")
    # pccl's own count of what each host's processes sent (a replica: its shards together).
    ring_sent: dict[int, int] = {}
    for name, r in raw["records"].items():
        if r and r[-1]["kind"] == "end" and r[-1].get("pccl_bytes"):
            host = int(name.split("-")[1])
            ring_sent[host] = ring_sent.get(host, 0) + r[-1]["pccl_bytes"][0]
    return {
        "name": row.name, "label": row.label, "backend": row.backend,
        "hosts": row.hosts, "shards": row.shards,
        "time_to_target_s": None if hit is None else round(hit.seconds, 2),
        "tokens_to_target": None if hit is None else hit.tokens,
        "steps_to_target": None if hit is None else hit.step,
        "final_eval_loss": curve[-1].loss if curve else None,
        "final_step": curve[-1].step if curve else 0,
        "capped": raw["capped"],
        "train_s": round(raw["train_s"], 1), "setup_s": round(raw["setup_s"], 1),
        "bytes_per_peer": (round(statistics.mean(bytes_per_host)) if bytes_per_host else None),
        "pccl_sent_per_host": (round(statistics.mean(ring_sent.values())) if ring_sent
                               else None),
        "compute_utilisation": round(statistics.mean(utils), 3) if utils else None,
        "compute_utilisation_per_peer": [round(u, 3) for u in utils],
        "link_utilisation": None if link is None else round(link, 3),
        "bit_identical": None if par is None else par[0],
        "bit_identical_checked": None if par is None else {"step": par[1], "peers": par[2]},
        "joined_at_step": raw["joined_at"],
        "master_requests": raw.get("master_requests"),
        "forwarder_share": (None if fwd_cpu is None or fwd_wall <= 0
                            else round(fwd_cpu / fwd_wall, 3)),
        "forwarder_flag": None if fwd_cpu is None else forwarder_flag(fwd_cpu, fwd_wall),
        "curve": [vars(p) for p in curve],
    }


def shard_parity(records: dict[str, list[dict]]) -> tuple[bool, int, int] | None:
    """``parity`` of the peers' digests, shard index by shard index (a sharded replica's
    processes digest their own shards, which compare only with the same shard of the other
    replicas): (every shard identical across its peers, the step, peers compared in all)."""
    by_shard: dict[int, dict] = {}
    for name, r in records.items():
        shard = next((x.get("shard", 0) for x in r if x["kind"] == "start"), 0)
        by_shard.setdefault(shard, {})[name] = {x["step"]: x["digest"] for x in r
                                                if x["kind"] == "snap"}
    verdicts = [v for v in map(parity, by_shard.values()) if v is not None]
    if not verdicts:
        return None
    return (all(v[0] for v in verdicts), min(v[1] for v in verdicts),
            sum(v[2] for v in verdicts))


def sharded_lines(rows: dict, args) -> list[str]:
    """diloco-sharded beside diloco-2 (the same hosts, tokens and H): the ratios
    sharded / unsharded of time to target, bytes per replica, compute utilisation and eval
    loss at the end."""
    if "diloco-sharded" not in rows or "diloco-2" not in rows:
        return []
    s, u = rows["diloco-sharded"], rows["diloco-2"]

    def ratio(key, spec):
        a, b = s[key], u[key]
        if a is None or b is None or b == 0:
            return f"{key}: {a} vs {b} (no ratio)"
        return f"{format(a, spec)} vs {format(b, spec)}: {a / b:.2f}x"

    out = [f"sharded (2 replicas x {s['shards']} FSDP2 shards) / unsharded (2 peers), "
           f"{args.steps} steps of the same tokens:"]
    if s["time_to_target_s"] is None:
        out.append(f"  time to {args.target_loss}: sharded not reached"
                   + ("" if u["time_to_target_s"] is None
                      else f", unsharded {u['time_to_target_s']:.1f} s"))
    else:
        out.append(f"  time to {args.target_loss}: {ratio('time_to_target_s', '.1f')}")
    if s["bytes_per_peer"] is not None and u["bytes_per_peer"] is not None:
        out.append(f"  MB per replica (its host's link bytes): "
                   f"{s['bytes_per_peer'] / 1e6:.2f} vs {u['bytes_per_peer'] / 1e6:.2f}: "
                   f"{s['bytes_per_peer'] / u['bytes_per_peer']:.2f}x")
    if s["pccl_sent_per_host"] and u["pccl_sent_per_host"]:
        out.append(f"  MB per replica by pccl's count (payload and frame headers, since the "
                   f"rings formed: their warm-up included): "
                   f"{s['pccl_sent_per_host'] / 1e6:.2f} vs {u['pccl_sent_per_host'] / 1e6:.2f}"
                   f": {s['pccl_sent_per_host'] / u['pccl_sent_per_host']:.2f}x")
    out.append(f"  compute utilisation: {ratio('compute_utilisation', '.3f')}")
    same = s["final_step"] == u["final_step"]
    out.append(f"  eval loss at the end (step {s['final_step']}"
               + ("" if same else f" vs {u['final_step']}: not equal tokens")
               + f"): {ratio('final_eval_loss', '.4f')}")
    out.append(f"  training wall-clock: {ratio('train_s', '.1f')}")
    return out


def goal_lines(rows: dict, args) -> list[str]:
    """Every goal of the issue the rows at hand can check, with met / NOT met."""
    out = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def t(name):
        return rows[name]["time_to_target_s"]

    def cap(name):
        return rows[name]["train_s"] if not rows[name]["capped"] else args.cap_s

    if "diloco" in rows:
        for other, key in (("ddp-gloo", "vs_gloo"), ("ddp-pccl", "vs_ddp_pccl")):
            if other in rows:
                s = speedup(t("diloco"), t(other), cap(other))
                if s is None:
                    out.append(f"DiLoCo vs {other}: DiLoCo did not reach {args.target_loss} "
                               f"(goal >= {GOALS[key]:g}x sooner): NOT met")
                    continue
                bound = "" if s[1] else f" at least ({other} did not reach it within its cap)"
                out.append(f"DiLoCo reached {args.target_loss} {s[0]:.1f}x sooner than {other}"
                           f"{bound} (goal >= {GOALS[key]:g}x): {verdict(s[0] >= GOALS[key])}")
    if "streaming" in rows and rows["streaming"]["compute_utilisation"] is not None:
        u = rows["streaming"]["compute_utilisation"]
        out.append(f"Streaming DiLoCo compute utilisation {u:.1%} (goal >= 95 %): "
                   f"{verdict(u >= GOALS['streaming_util'])}")
    for name in ("streaming", "streaming-tau5"):
        if name in rows and "diloco" in rows:
            s, d = rows[name], rows["diloco"]
            if s["final_eval_loss"] and d["final_eval_loss"] and \
                    s["final_step"] == d["final_step"]:
                gap = s["final_eval_loss"] / d["final_eval_loss"] - 1
                out.append(f"{name} eval loss {gap:+.1%} vs DiLoCo at equal tokens (goal within "
                           f"2 %): {verdict(gap <= GOALS['streaming_loss'])}")
    if "diloco" in rows and rows["diloco"]["compute_utilisation"] is not None:
        out.append(f"DiLoCo (blocking exchange) compute utilisation "
                   f"{rows['diloco']['compute_utilisation']:.1%} (its own figure)")
    if "diloco" in rows and rows["diloco"].get("master_requests") is not None:
        d = rows["diloco"]
        asked = d["master_requests"]
        peers = d["hosts"] * d["shards"]
        # Each constructor votes once in the sync that starts the run; the outer steps of
        # an epoch nobody joins or leaves send nothing (a quiet epoch).
        extra = {k: n for k, n in asked.items() if not (k == "sync" and n <= peers)}
        out.append(f"DiLoCo's {d['final_step'] // args.sync_every} outer steps sent the master "
                   f"{sum(extra.values())} messages ({asked or 'none'}; the constructors' "
                   f"{peers} sync votes aside; goal 0): {verdict(not extra)}")
    if "async" in rows and "diloco" in rows:
        a, d = rows["async"], rows["diloco"]
        if a["final_eval_loss"] and d["final_eval_loss"] and a["final_step"] == d["final_step"]:
            gap = a["final_eval_loss"] / d["final_eval_loss"] - 1
            shorter = a["train_s"] < d["train_s"]
            out.append(f"async DiLoCo eval loss {gap:+.1%} vs DiLoCo at equal tokens (goal "
                       f"within 5 %): {verdict(abs(gap) <= GOALS['async_loss'])}; wall-clock "
                       f"{a['train_s']:.0f} s vs {d['train_s']:.0f} s (goal shorter): "
                       f"{verdict(shorter)}")
        else:
            out.append("async DiLoCo vs DiLoCo at equal tokens: not comparable (a row did not "
                       "finish its budget): NOT met")
    if "diloco-churn" in rows and "diloco" in rows:
        c, d = t("diloco-churn"), t("diloco")
        if c is None or d is None:
            out.append("diloco-churn vs diloco: a row did not reach the target: NOT met")
        else:
            out.append(f"diloco-churn reached the target in {c:.0f} s, diloco in {d:.0f} s "
                       f"({c / d - 1:+.0%}; goal within +20 %): "
                       f"{verdict(c <= d * (1 + GOALS['churn_time']))}")
    if "diloco-sparse" in rows and "diloco-int4" in rows:
        sp, q4 = t("diloco-sparse"), t("diloco-int4")
        if sp is None:
            out.append("diloco-sparse did not reach the target (goal: no later than "
                       "diloco-int4): NOT met")
        elif q4 is None:
            out.append(f"diloco-sparse reached the target in {sp:.0f} s, diloco-int4 not "
                       f"within its cap (goal: no later than diloco-int4): met")
        else:
            out.append(f"diloco-sparse reached the target in {sp:.0f} s, diloco-int4 in "
                       f"{q4:.0f} s (goal: no later): {verdict(sp <= q4)}")
    for base in ("diloco", "streaming", "async"):
        quick, slow = f"{base}-quorum", f"{base}-slow"
        if quick not in rows or slow not in rows:
            continue
        s = speedup(t(quick), t(slow), cap(slow))
        if s is None:
            out.append(f"{quick} did not reach {args.target_loss} (goal >= "
                       f"{GOALS['quorum_speedup']:g}x sooner than {slow}): NOT met")
        else:
            bound = "" if s[1] else f" at least ({slow} did not reach it within its cap)"
            out.append(f"{quick} reached {args.target_loss} {s[0]:.2f}x sooner than "
                       f"{slow}{bound} (goal >= {GOALS['quorum_speedup']:g}x): "
                       f"{verdict(s[0] >= GOALS['quorum_speedup'])}")
        at = equal_time_losses(rows[quick]["curve"], rows[slow]["curve"])
        if at is None:
            out.append(f"{quick} vs {slow} eval loss at equal wall-clock: no common time: "
                       "NOT met")
        else:
            secs, q, s_ = at
            out.append(f"eval loss at {secs:.0f} s ({slow}'s last evaluation): {quick} "
                       f"{q:.4f}, {slow} {s_:.4f} (goal: no worse): {verdict(q <= s_)}")
    if "diloco-quorum-even" in rows and "diloco" in rows:
        q, d = rows["diloco-quorum-even"], rows["diloco"]
        if q["capped"] or d["capped"]:
            out.append("diloco-quorum-even vs diloco wall-clock: a row was capped: NOT met")
        else:
            cost = q["train_s"] / d["train_s"] - 1
            out.append(f"the quorum with no slow peer: {q['train_s']:.1f} s vs DiLoCo "
                       f"{d['train_s']:.1f} s for the same budget ({cost:+.1%}; goal <= "
                       f"+{GOALS['quorum_cost']:.0%}): {verdict(cost <= GOALS['quorum_cost'])}")
    out += sharded_lines(rows, args)
    for r in rows.values():
        if r.get("forwarder_flag"):
            out.append(f"** {r['name']}: {r['forwarder_flag']}")
    pccl = [r for r in rows.values() if r["backend"] == "pccl"]
    if pccl:
        bad = [r["name"] for r in pccl if r["bit_identical"] is not True]
        out.append(f"every pccl row bit-identical on every peer at the end: "
                   f"{'yes' if not bad else 'no: ' + ', '.join(bad)}: {verdict(not bad)}")
    return out


def print_table(rows: dict, args) -> None:
    head = (f"{'row':<20}{'to target s':>12}{'tokens':>10}{'final loss':>11}{'setup s':>8}"
            f"{'train s':>8}{'MB/host':>9}{'compute':>8}{'link':>6}{'parity':>7}{'fwd':>6}")
    print(f"\nlink: {args.rtt_ms:g} ms RTT, {args.rate_mbit:g} Mbit/s"
          f"{' (loopback: no link)' if args.loopback else ''}; target eval loss "
          f"{args.target_loss}; {args.steps} steps per peer, cap {args.cap_s:g} s"
          f"{'' if getattr(args, 'pacing', None) is None else '; PCCL_PACING=' + args.pacing}\n")
    print(head)
    print("-" * len(head))
    for r in rows.values():
        def f(v, spec, none="-"):
            return none if v is None else format(v, spec)
        reached = f(r["time_to_target_s"], ".1f", "not reached")
        print(f"{r['name']:<20}{reached:>12}{f(r['tokens_to_target'], ',d'):>10}"
              f"{f(r['final_eval_loss'], '.4f'):>11}{r['setup_s']:>8.1f}{r['train_s']:>8.1f}"
              f"{f(None if r['bytes_per_peer'] is None else r['bytes_per_peer'] / 1e6, '.1f'):>9}"
              f"{f(r['compute_utilisation'], '.0%'):>8}{f(r['link_utilisation'], '.0%'):>6}"
              f"{ {True: 'yes', False: 'NO', None: '-'}[r['bit_identical']]:>7}"
              f"{f(r.get('forwarder_share'), '.0%'):>6}"
              + ("  (capped)" if r["capped"] else "")
              + ("  **" if r.get("forwarder_flag") else ""))
    print(f"(MB/host: per peer, or per replica of a sharded row; fwd: the WAN emulator's "
          f"forwarder, share of one core; ** above {FORWARDER_LIMIT:.0%})")


def plot(rows: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for r in rows.values():
        pts = r["curve"]
        left.plot([p["seconds"] for p in pts], [p["loss"] for p in pts], marker=".",
                  label=r["label"])
        right.plot([p["tokens"] / 1e6 for p in pts], [p["loss"] for p in pts], marker=".",
                   label=r["label"])
    for ax, xlabel in ((left, "training wall-clock (s)"), (right, "tokens (millions, all peers)")):
        ax.axhline(args.target_loss, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss of the outer parameters (nats / char)")
        ax.set_ylim(1.3, 3.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"peers one per host, {args.rtt_ms:g} ms RTT, {args.rate_mbit:g} Mbit/s "
                 f"(emulated); dashed: target {args.target_loss}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
