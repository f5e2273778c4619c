"""Training across emulated WAN links, end to end: wall-clock time to a target eval loss for DDP
over gloo and over pccl and for every DiLoCo variant, with churn (root only).

    sudo python benchmarks/wan_training.py            # every row, about 30 minutes on 2 cores
    sudo python benchmarks/wan_training.py --quick    # fewer tokens, same rows and goals, ~10
    sudo python benchmarks/wan_training.py --rows ddp-pccl diloco --rate-mbit 50

Four peers (diloco-2 and diloco-sharded: two hosts), one per network namespace, joined by the
project's userspace WAN emulator (tests/harness/wanem.py: every directed pair has ``--rtt-ms`` / 2
of one-way delay, ``--rate-mbit`` of rate and a 50 ms tail-drop queue). Every row trains the main
job's model and data (examples/train_diloco.py: the 0.35 M-parameter character transformer on the
King James Bible, seed 0, 16 x 64 characters per peer per step, AdamW peak 3e-3 with warm-up and
cosine, DiLoCo H = 20 with Nesterov outer SGD lr 0.7 momentum 0.7) for the same token budget
(``--steps`` inner steps per peer), or until its wall-clock cap (``--cap-s``). The default link,
100 ms and 20 Mbit/s, makes one all-reduce of the model (1.42 MB, 4 peers) take about 10x one inner
step's compute here, as a 1B model's does over 1 Gbit/s (docs/wan-training.md has the arithmetic and
the figures). Rows (``--rows``; benchmarks/_wan_rows.py defines them):

  ddp-gloo      torch DDP over gloo (what a user has today), formed through a TCP store
  ddp-pccl      torch DDP over pccl
  diloco        DiLoCo, blocking exchange every H steps
  diloco-int8   ... pseudo-gradients exchanged as int8; diloco-int4: int4
  diloco-sparse ... as sparse top-k payloads with error feedback (torch_pccl.TopK(), all-gathered)
  streaming     Streaming DiLoCo, 3 fragments, alpha = 0.5, tau sized from the measured
                exchange time (the default); streaming-tau5: a fixed tau = 5 inner steps
  async         async DiLoCo (one-round-delayed outer update, eager)
  diloco-churn  DiLoCo while the peer of host 1 SIGKILLs itself at a third of the budget and a
                new peer joins on that host at half
  diloco-slow   DiLoCo with the peer of host 3 ``--slow-peer`` times slower (default 3): every
                exchange waits for it
  diloco-quorum ... with ``torch_pccl.Quorum(min_peers=3, grace=0.5)``: rounds close on the
                other three, the slow peer's work is merged when it comes
  diloco-quorum-even  the quorum with no slow peer (what the option costs)
  streaming-slow, async-slow  Streaming (tau measured) and async DiLoCo with the slow peer
  streaming-quorum, async-quorum  ... with the same quorum (Streaming: a round per fragment
                send)
  diloco-2      DiLoCo on 2 hosts (one peer each): what diloco-sharded is measured against
  diloco-sharded  2 hosts, each a replica of 2 processes with the model sharded by FSDP2 over
                an inner gloo group on the host's own loopback, each process half a peer's
                batch (equal tokens to diloco-2); DiLoCo across replicas on the shard rings of
                ``torch_pccl.init_replica_group``. Bytes per peer are then per replica.

The peers evaluate nothing while they train: every ``--eval-every`` steps they record a digest of
their outer parameters (DDP: the model) and the peer of host 0 saves them; after the row the
driver evaluates the saved parameters on ``--eval-batches`` held-out batches. The time to target
is the training wall-clock (from the first inner step, group formation excluded and reported
apart) of the first evaluation at or below ``--target-loss``; nothing is interpolated or
extrapolated. Bytes per peer are what the emulated links carried from each host while it trained
(IP bytes: payload, headers, the master's heartbeats). Compute utilisation is inner-step compute
over wall-clock, per peer; link utilisation is bytes sent over the seconds its exchanges were in
flight (blocking DiLoCo: the trainer's wait; DDP: from its first bucket's launch), over the rate
(none for rows whose exchange overlaps compute). Prints the table and every goal with
met / not met, and the emulator's forwarder's share of a core while each row trained (flagged
above 70 %, as benchmarks/wan.py does: then the instrument may have set the pace); writes
results.json, curves.png (eval loss against wall-clock and against tokens) and the peers'
records to ``--out`` (default runs/bench_wan_training).

``--loopback`` runs the same rows with every peer on 127.0.0.1 and no emulated link (no root
needed; the tests use it with a tiny budget).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))      # the WAN emulator, harness/wanem.py
sys.path.insert(0, os.path.join(REPO, "examples"))   # the main job's model, data, evaluation

from _wan_curve import Point, churn_schedule  # noqa: E402
from _wan_rows import ROWS  # noqa: E402
from _wan_training_report import goal_lines, plot, print_table, summarise_row  # noqa: E402

PEER = os.path.join(HERE, "_wan_peer.py")
# Ports in the namespaces: the master's and the gloo store's on host 0, and a sharded
# replica's inner group on its own host's loopback.
PORTS = {"master": 29680, "store": 29681, "inner": 29682}
# The defaults (main run) and --quick: tokens, cap and target. The targets are eval losses
# DDP over pccl reaches within its cap on this 2-core machine (docs/wan-training.md).
PRESETS = {"full": {"steps": 800, "cap_s": 300.0, "target_loss": 2.10},
           "quick": {"steps": 200, "cap_s": 75.0, "target_loss": 2.60}}


# -------------------------------------------------------------------------- the master


def master_process(cfg: dict) -> None:
    """``--master-process``: a torch_pccl master on (host, port) for ``world`` peers; prints
    ``{"event": "ready", "address"}`` and serves until its stdin closes, then writes the
    messages members sent it, by type (heartbeats aside), to ``cfg["out"]`` (JSON)."""
    import logging

    from torch_pccl.master import start_in_thread

    logging.basicConfig(level=logging.WARNING)
    # Quiet epochs (opt-in: their gap is a death inside an exchange, which no row has).
    master = start_in_thread(cfg["host"], cfg["port"], world_size=cfg["world"],
                             resume_grace_s=0.0, quiet_epochs=True)
    print(json.dumps({"event": "ready", "address": master.address}), flush=True)
    sys.stdin.read()        # the driver closes it (or dies): time to go
    requests = master.snapshot()["counters"]["requests"]
    master.stop()
    with open(cfg["out"], "w") as f:
        json.dump(requests, f)


# -------------------------------------------------------------------------- hosts


class LoopbackHosts:
    """Every peer on 127.0.0.1, no emulated link (``--loopback``)."""

    def __init__(self, k: int, workdir: str):
        self.workdir = workdir
        self.addrs = ["127.0.0.1"] * k
        self.procs = []

    def popen(self, i: int, argv: list[str], env: dict, label: str, stdin: bool = False):
        from harness.netns import NsProcess

        p = NsProcess(argv, env, os.path.join(self.workdir, f"{label}.stderr"), label, stdin)
        self.procs.append(p)
        return p

    def free_port(self, i: int, use: str) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def counters(self) -> dict | None:
        return None

    def close(self) -> None:
        for p in self.procs:
            p.close()


class WanHosts:
    """One network namespace per peer on the emulated links (harness/wanem.py)."""

    def __init__(self, stack: contextlib.ExitStack, k: int, rate_mbit: float, rtt_ms: float,
                 workdir: str):
        from harness.wanem import Link, wan

        self.k = k
        self.w = stack.enter_context(wan(k, Link(delay_ms=rtt_ms / 2, rate_mbit=rate_mbit),
                                         workdir=workdir))
        self.w.check_connectivity()
        self.addrs = self.w.addrs

    def popen(self, i: int, argv: list[str], env: dict, label: str, stdin: bool = False):
        return self.w.popen(i, argv, env=env, label=label, stdin=stdin)

    def free_port(self, i: int, use: str) -> int:
        return PORTS[use]           # every host is its own namespace

    def counters(self) -> dict:
        """The emulator's counters so far: IP bytes each host has sent onto the emulated
        links (``bytes``), the forwarder's CPU seconds (``cpu_s``) and its wall seconds."""
        stats = self.w.stats()
        return {"bytes": [sum(v["bytes_in"] for (src, _), v in stats["links"].items()
                              if src == i) for i in range(self.k)],
                "cpu_s": stats["cpu_s"], "wall_s": stats["wall_s"]}

    def close(self) -> None:
        pass            # the ExitStack tears the emulator down


# -------------------------------------------------------------------------- one row


def peer_config(args, row, host: int, rowdir: str, **extra) -> dict:
    return {"row": row.name, "host": host, "world": row.hosts, "stream": host,
            "steps": args.steps,
            "batch_size": 16, "block_size": 64, "dim": 96, "layers": 3, "heads": 4,
            "lr": 3e-3, "warmup": 50, "seed": args.seed, "sync_every": args.sync_every,
            "fragments": 3, "tau": 1, "alpha": 0.5, "outer_lr": 0.7, "outer_momentum": 0.7,
            "eval_every": args.eval_every, "progress_every": 10, "op_timeout": 60.0,
            "setup_timeout": args.setup_timeout,
            "record": os.path.join(rowdir, f"peer-{host}-{extra.get('stream', host)}.jsonl"),
            "snapshots": os.path.join(rowdir, "snapshots") if host == 0 else None,
            "gather": host == 0 and row.shards > 1, **extra}


def start_peers(args, row, hosts, rowdir: str, env: dict, extra: dict, churn: dict) -> list:
    """The row's processes, host by host: one peer, or a sharded replica's ``row.shards``
    processes (shard s of host i reads data stream i + s * hosts, so shard 0 reads what the
    unsharded peer of host i reads); host 0's first is the observer."""
    peers = []
    for i in range(row.hosts):
        kill = {"kill_step": churn["kill"]} if (row.churn and i == 1) else {}
        if row.slow and i == row.hosts - 1:
            kill["slow"] = args.slow_peer
        inner = f"127.0.0.1:{hosts.free_port(i, 'inner')}"
        for shard in range(row.shards):
            cfg = peer_config(args, row, i, rowdir, **extra, **kill)
            label = f"peer{i}"
            if row.shards > 1:
                cfg.update(shard=shard, inner=inner, stream=i + shard * row.hosts,
                           snapshots=cfg["snapshots"] if shard == 0 else None,
                           record=os.path.join(rowdir, f"peer-{i}-{i + shard * row.hosts}.jsonl"))
                label = f"peer{i}.{shard}"
            peers.append(hosts.popen(i, [sys.executable, PEER, json.dumps(cfg)],
                                     {**env, "GLOO_SOCKET_IFNAME": "lo"} if row.shards > 1
                                     else env, label))
    return peers


def run_row(args, row, progress) -> dict:
    """Trains one row (a fresh set of hosts); returns its raw result."""
    from _harness import child_env

    rowdir = os.path.join(args.out, row.name)
    shutil.rmtree(rowdir, ignore_errors=True)
    os.makedirs(os.path.join(rowdir, "snapshots"))
    env = {k: v for k, v in child_env().items() if not k.startswith("PCCL_")}
    if args.pacing is not None:
        env["PCCL_PACING"] = args.pacing
    if not args.loopback:
        env["GLOO_SOCKET_IFNAME"] = "wan0"   # gloo would take the hostname's 127.0.0.1
    kill_step, join_step = churn_schedule(args.steps) if row.churn else (None, None)
    result = {"name": row.name, "capped": False, "error": None, "joined_at": None}
    world = row.hosts
    with contextlib.ExitStack() as stack:
        hosts = (LoopbackHosts(world, rowdir) if args.loopback
                 else WanHosts(stack, world, args.rate_mbit, args.rtt_ms, rowdir))
        stack.callback(hosts.close)
        extra = {}
        if row.backend == "pccl":       # the master counts processes: every shard of every host
            m = hosts.popen(0, [sys.executable, os.path.abspath(__file__), "--master-process",
                                json.dumps({"host": hosts.addrs[0],
                                            "port": hosts.free_port(0, "master"),
                                            "world": world * row.shards,
                                            "out": os.path.join(rowdir, "master.json")})],
                            env, "master", stdin=True)
            extra["master"] = m.next_event(30, "ready")["address"]
        else:
            extra["store"] = f"{hosts.addrs[0]}:{hosts.free_port(0, 'store')}"
        peers = start_peers(args, row, hosts, rowdir, env, extra, {"kill": kill_step})
        observer = peers[0]
        started = time.monotonic()
        ev = observer.next_event(args.setup_timeout, "progress")   # the first inner step
        result["setup_s"] = time.monotonic() - started
        traffic0 = hosts.counters()
        train_start = time.monotonic()
        progress.reset(total=args.steps)
        progress.set_description(row.name)
        while not ev["done"]:
            left = train_start + args.cap_s - time.monotonic()
            try:
                ev = observer.next_event(max(0.1, left), "progress")
            except AssertionError:
                if observer.proc.poll() is not None:
                    raise
                result["capped"] = True            # past its cap: what it has is its result
                break
            progress.n = ev["step"]
            progress.refresh()
            if join_step is not None and ev["step"] >= join_step and result["joined_at"] is None:
                cfg = peer_config(args, row, 1, rowdir, **extra, stream=world)
                peers.append(hosts.popen(1, [sys.executable, PEER, json.dumps(cfg)], env,
                                         "joiner"))
                result["joined_at"] = ev["step"]
        result["train_s"] = time.monotonic() - train_start
        traffic1 = hosts.counters()
        if not result["capped"]:
            victim = peers[1] if row.churn else None
            joiner = peers[world] if len(peers) > world * row.shards else None
            for p in peers:
                if p is victim or (p is joiner and not started_training(rowdir, world)):
                    continue        # killed itself; or never admitted before the end
                p.finish(60)
    if traffic0 is not None:
        result["bytes_per_host"] = [b - a for a, b in zip(traffic0["bytes"], traffic1["bytes"])]
        # The emulator's own load while the row trained (its setup left out): above
        # FORWARDER_LIMIT of a core, the instrument may have set the row's pace.
        result["forwarder_cpu_s"] = traffic1["cpu_s"] - traffic0["cpu_s"]
        result["forwarder_wall_s"] = traffic1["wall_s"] - traffic0["wall_s"]
    result["records"] = read_records(rowdir)
    try:            # what the members asked the master (pccl rows; see master_process)
        with open(os.path.join(rowdir, "master.json")) as f:
            result["master_requests"] = json.load(f)
    except (OSError, ValueError):
        result["master_requests"] = None
    result["curve"] = evaluate(args, os.path.join(rowdir, "snapshots"),
                               result["records"].get("peer-0-0", []))
    shutil.rmtree(os.path.join(rowdir, "snapshots"), ignore_errors=True)
    return result


def started_training(rowdir: str, stream: int) -> bool:
    """Whether the peer of data stream ``stream`` got into the group (wrote ``start``)."""
    for name, record in read_records(rowdir).items():
        if name.endswith(f"-{stream}") and any(r["kind"] == "start" for r in record):
            return True
    return False


def read_records(rowdir: str) -> dict[str, list[dict]]:
    out = {}
    for name in sorted(os.listdir(rowdir)):
        if name.startswith("peer-") and name.endswith(".jsonl"):
            with open(os.path.join(rowdir, name)) as f:
                out[name[:-6]] = [json.loads(line) for line in f if line.strip()]
    return out


def evaluate(args, snapdir: str, record: list[dict]) -> list[Point]:
    """Eval loss of every snapshot the observing peer saved, in step order."""
    import torch

    from _data import build_corpus, load_kjv_text, validation_batches
    from _model import CharTransformer, evaluate_params

    torch.set_num_threads(2)
    corpus = build_corpus(load_kjv_text())
    model = CharTransformer(corpus.vocab_size, 64, 96, 3, 4)
    batches = validation_batches(corpus.val, 16, 64, args.eval_batches)
    snaps = {r["step"]: r for r in record if r["kind"] == "snap"}
    curve = []
    if snaps:           # step 0: the initial weights, the same for every row
        torch.manual_seed(args.seed)
        init = CharTransformer(corpus.vocab_size, 64, 96, 3, 4)
        curve.append(Point(0, 0.0, 0, evaluate_params(model, list(init.parameters()), batches)))
    for step in sorted(snaps):
        path = os.path.join(snapdir, f"{step}.pt")
        if os.path.exists(path):
            loss = evaluate_params(model, torch.load(path), batches)
            curve.append(Point(step, snaps[step]["seconds"], snaps[step]["tokens"], loss))
    return curve


# -------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--quick", action="store_true",
                   help=f"{PRESETS['quick']['steps']} steps, cap {PRESETS['quick']['cap_s']:g} s,"
                        f" target {PRESETS['quick']['target_loss']}")
    p.add_argument("--rate-mbit", type=float, default=20.0, help="link rate (default 20)")
    p.add_argument("--rtt-ms", type=float, default=100.0, help="round trip (default 100)")
    p.add_argument("--steps", type=int, help="inner steps per peer (the token budget; "
                   f"default {PRESETS['full']['steps']}, the main job's)")
    p.add_argument("--cap-s", type=float, help="training wall-clock cap per row "
                   f"(default {PRESETS['full']['cap_s']:g})")
    p.add_argument("--target-loss", type=float,
                   help=f"eval loss to reach (default {PRESETS['full']['target_loss']})")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H (default 20)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between snapshots")
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-peer", type=float, default=3.0,
                   help="how many times slower the slow rows' peer of the last host runs its "
                        "inner steps (default 3)")
    p.add_argument("--setup-timeout", type=float, default=240.0,
                   help="seconds a row may take to form its group")
    p.add_argument("--loopback", action="store_true",
                   help="every peer on 127.0.0.1, no emulated link (no root needed)")
    p.add_argument("--pacing", default=None,
                   help="PCCL_PACING for every peer (Mbit/s per peer, auto or off; default: "
                        "the library's, auto): the rows otherwise take no PCCL_ variable "
                        "from this shell")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench_wan_training"))
    p.add_argument("--master-process", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    preset = PRESETS["quick" if args.quick else "full"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 6 or args.sync_every < 1 or args.eval_every < 1:
        p.error("--steps >= 6, --sync-every >= 1 and --eval-every >= 1 are required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.master_process:
        master_process(json.loads(args.master_process))
        return 0
    if not args.loopback:
        from harness.wanem import unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"wan_training.py: the WAN emulator cannot run here: {reason} "
                  "(--loopback runs without it)", file=sys.stderr)
            return 2
    from tqdm import tqdm

    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    rows, failed = {}, []
    with tqdm(total=args.steps, unit="step", desc="wan_training") as progress:
        for name in args.rows:
            try:
                rows[name] = summarise_row(args, ROWS[name], run_row(args, ROWS[name], progress))
            except (AssertionError, RuntimeError, OSError, ValueError) as e:
                progress.write(f"{name}: failed: {e}")
                failed.append({"name": name, "error": str(e)[-3000:]})
                continue
            r = rows[name]
            # A row cut short before its first snapshot was evaluated has no loss to print.
            loss = "none" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}"
            progress.write(f"{name}: final eval loss {loss} at step "
                           f"{r['final_step']}, target "
                           + ("not reached" if r["time_to_target_s"] is None
                              else f"at {r['time_to_target_s']:.1f} s") + f", {r['train_s']:.0f} s")
    print_table(rows, args)
    goals = goal_lines(rows, args)
    print()
    for line in goals:
        print(line)
    for f in failed:
        print(f"row {f['name']} FAILED: {f['error'][-500:]}")
    doc = {"target_loss": args.target_loss,
           "link": {"rtt_ms": args.rtt_ms, "rate_mbit": args.rate_mbit,
                    "emulated": not args.loopback},
           "budget": {"steps": args.steps, "cap_s": args.cap_s,
                      "tokens_per_host": args.steps * 16 * 64,
                      "hosts": {name: ROWS[name].hosts for name in rows}},
           "rows": list(rows.values()), "failed": failed, "goals": goals,
           "seconds": round(time.monotonic() - started, 1)}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    if rows:
        plot(rows, args, os.path.join(args.out, "curves.png"))
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}/results.json and curves.png")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
