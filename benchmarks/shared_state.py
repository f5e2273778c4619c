"""Shared-state sync: a joiner receiving the group's state from 1 vs 3 up-to-date peers.

    python benchmarks/shared_state.py        # 256 MiB, 3 reps, both modes, about a minute
    python benchmarks/shared_state.py [--size-mib 256] [--reps 3] [--modes loopback netns]
                                      [--rate-mbit 800] [--sources 1 3]

For each mode, rate limit and source count S in ``--sources`` (default 1 and 3), the script
starts a master with ``--world-size S`` and S *source* processes that join it with
``init_process_group(backend="pccl", init_method="pccl://...")``. Every source holds the same
state of ``--size-mib`` MiB (``--entries`` float32 tensors, default 8 of 32 MiB, filled from a
fixed seed); the sources first sync among themselves (revision 0: all agree, no data moves).
Then a *joiner* whose state is all zeros registers; the sources see it with
``torch_pccl.peers_pending()`` and admit it with ``torch_pccl.update_topology()``, and all of
them call ``torch_pccl.sync_shared_state(state, revision=1)``. The joiner is outvoted, so it
receives every entry, striped over the S sources. Its ``SyncResult`` is recorded (seconds,
bytes_received, changed) and its receive rate is ``state bytes / seconds`` in GB/s (1e9 B/s).
For each further repeat (``--reps``, default 3, the first being the join itself) the joiner
changes every entry again (``add_(1)``, outside the timed region) and all sync with the same
revision 1; a one-element all-reduce lines the peers up before every sync. After every sync
each peer checks that its ``content_digest`` equals the elected one, and the joiner that every
entry changed. The table gives the median and the range of the joiner's seconds.

``seconds`` covers the whole call on the joiner: hashing its own state, the master's vote, the
transfer, hashing every received entry again to verify it, and the copy into its tensors. For
reference the script also times ``torch_pccl.state_hashes`` on one state of the same size in
this process, alone on the machine.

Modes:
  loopback  master in a thread of this process (``start_in_thread``), peers on 127.0.0.1.
  netns     every process on its own "host": one network namespace each (tests/harness/netns.py),
            joined by a bridge; host 0 runs ``python -m torch_pccl.master``, hosts 1..S the
            sources, host S+1 the joiner. Root only: skipped, with the reason, otherwise.
            With ``--rate-mbit R`` (R > 0) every host's ``eth0`` gets a token bucket
            (``tc qdisc ... tbf rate Rmbit``) on egress: a per-host uplink cap, so S sources
            can feed the joiner with up to S x R while one source gives at most R. 0 means no
            limit; the default runs 0 and 800 (256 MiB at 800 Mbit/s is about 2.7 s).

Every process is a subprocess of this script (``--worker``), with one torch thread; every wait
has a deadline; every process is killed and the namespaces deleted in ``finally``.

Prints a table and writes ``results.json`` to ``--out`` (default runs/bench_shared_state), every
child's stderr to ``--out``/logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time

from _harness import MIB, child_env, machine, netns_module, print_header, set_rate, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SEED = 4
LOOPBACK = "127.0.0.1"
MASTER_PORT = 29650           # netns: host 0 is a fresh namespace, the port is free there
JOIN_REVISION = 1             # the sources start at revision 0; every later sync uses 1
POLL_S = 0.02                 # period of the sources' peers_pending() poll (bounded by a deadline)

log = logging.getLogger("bench_shared_state")

if REPO not in sys.path:
    # torch imports torch_pccl at start-up (its backend entry point): run from a checkout
    # whether or not the package is installed.
    sys.path.insert(0, REPO)


# --------------------------------------------------------------------------- one peer (--worker)


def _emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def _build_state(cfg: dict, joiner: bool) -> dict:
    import torch

    numel = cfg["size_bytes"] // cfg["entries"] // 4
    gen = torch.Generator().manual_seed(SEED)
    state = {}
    for i in range(cfg["entries"]):
        if joiner:
            state[f"entry{i:02d}"] = torch.zeros(numel, dtype=torch.float32)
        else:
            state[f"entry{i:02d}"] = torch.rand(numel, dtype=torch.float32, generator=gen)
    return state


def _result_fields(res) -> dict:
    return {"seconds": res.seconds, "bytes_sent": res.bytes_sent,
            "bytes_received": res.bytes_received, "changed": list(res.changed),
            "sources": list(res.sources), "retries": res.retries, "revision": res.revision,
            "content": res.content}


def worker_main(cfg: dict) -> int:
    """One peer: a source (``role == "source"``) or the joiner; JSON lines on stdout."""
    import datetime

    import torch
    import torch.distributed as dist

    import torch_pccl
    from torch_pccl.elastic.shared_state import content_digest  # not re-exported by the package

    torch.set_num_threads(1)  # up to 4 peers share the 2 cores
    joiner = cfg["role"] == "joiner"
    state = _build_state(cfg, joiner)
    _emit("started", pid=os.getpid())
    # The parent says "go" to the sources once the master listens (a refused connection is
    # not retried) and to the joiner once the sources' world exists (so that it is not counted
    # into the first world); its deadline kills us if "go" never comes.
    if sys.stdin.readline().strip() != "go":
        return 1
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    dist.init_process_group(backend="pccl", init_method=f"pccl://{cfg['master']}",
                            timeout=timeout)
    try:
        if not joiner:
            res = torch_pccl.sync_shared_state(state, revision=0, timeout=cfg["timeout"])
            if res.bytes_received or res.changed:
                raise RuntimeError(f"identical sources moved data at revision 0: {res}")
            _emit("ready", rank=dist.get_rank(), world_size=dist.get_world_size(),
                  result=_result_fields(res))
            deadline = time.monotonic() + cfg["timeout"]
            while not torch_pccl.peers_pending():  # the same answer on every source
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the joiner never registered within {cfg['timeout']} s")
                time.sleep(POLL_S)
            change = torch_pccl.update_topology(timeout=cfg["timeout"])
            if len(change.joined) != 1 or change.world_size != cfg["sources"] + 1:
                raise RuntimeError(f"unexpected topology change: {change}")
        _emit("joined", rank=dist.get_rank(), world_size=dist.get_world_size())
        names = sorted(state)
        line_up = torch.zeros(1)
        for rep in range(cfg["reps"]):
            if joiner and rep > 0:
                for t in state.values():
                    t.add_(1)  # differ from the sources in every entry again
            dist.all_reduce(line_up)
            res = torch_pccl.sync_shared_state(state, revision=JOIN_REVISION,
                                               timeout=cfg["timeout"])
            digest = content_digest(state)
            if digest != res.content:
                raise RuntimeError(f"rep {rep}: content {digest} after the sync, elected "
                                   f"{res.content}")
            if joiner and (list(res.changed) != names or res.bytes_received < cfg["size_bytes"]):
                raise RuntimeError(f"rep {rep}: the joiner did not receive the whole state: "
                                   f"changed {res.changed}, {res.bytes_received} bytes")
            if not joiner and res.changed:
                raise RuntimeError(f"rep {rep}: a source was overwritten: {res.changed}")
            _emit("sync", rep=rep, rank=dist.get_rank(), result=_result_fields(res))
        dist.all_reduce(line_up)  # nobody leaves while another still syncs
    finally:
        dist.destroy_process_group()
    _emit("done")
    return 0


# --------------------------------------------------------------------------- the parent's children


class Child:
    """A subprocess (in a namespace when ``netns`` is given) whose stdout lines a thread queues."""

    def __init__(self, argv: list[str], env: dict, label: str, logdir: str,
                 netns: str | None = None, stdin: bool = False):
        self.label = label
        self.stderr_path = os.path.join(logdir, f"{label}.stderr")
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]  # execs argv: the pid is the command's
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else
                                         subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         env=env, text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def stderr_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError as e:
            return f"<stderr unreadable: {e}>"

    def line(self, deadline: float, what: str) -> str:
        try:
            text = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{self.label}: no {what} before the deadline\n"
                               f"{self.stderr_tail()}") from None
        if text is None:
            code = self.proc.wait(timeout=10)
            raise RuntimeError(f"{self.label} exited ({code}) before {what}:\n"
                               f"{self.stderr_tail()}")
        return text

    def event(self, deadline: float, name: str) -> dict:
        while True:
            text = self.line(deadline, repr(name))
            if text.startswith("{"):
                rec = json.loads(text)
                if rec.get("event") == name:
                    return rec

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def _child_env(**extra) -> dict:
    """``child_env`` less this shell's rendezvous and pccl settings, unbuffered, plus ``extra``."""
    return child_env(drop=("MASTER_ADDR", "MASTER_PORT", "PCCL_HOST", "PCCL_TIMEOUT",
                           "PCCL_PEER_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
                     PYTHONUNBUFFERED="1", **extra)


def _op_timeout(cfg: dict, rate_mbit: float) -> float:
    """Per-op deadline (PCCL_TIMEOUT): generous next to one source's transfer at the cap."""
    if rate_mbit <= 0:
        return 60.0
    return max(60.0, 4 * cfg["size_bytes"] * 8 / (rate_mbit * 1e6))


def run_one(cfg: dict, sources: int, logdir: str, hosts=None, port: int = MASTER_PORT,
            rate_mbit: float = 0.0) -> dict:
    """Master + ``sources`` sources + a joiner; returns every peer's sync results."""
    tag = f"{'netns' if hosts else 'loopback'}-{rate_mbit:g}mbit-{sources}src"
    children: list[Child] = []
    master_thread = None
    deadline = time.monotonic() + cfg["timeout"]
    op_timeout = _op_timeout(cfg, rate_mbit)
    try:
        if hosts is None:
            from torch_pccl.master import start_in_thread

            master_thread = start_in_thread(LOOPBACK, 0, world_size=sources,
                                            heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0,
                                            round_timeout_s=cfg["timeout"])
            master = master_thread.address
        else:
            master = f"{hosts.addrs[0]}:{port}"
            children.append(Child(
                [sys.executable, "-m", "torch_pccl.master", "--host", hosts.addrs[0],
                 "--port", str(port), "--world-size", str(sources), "--heartbeat-interval", "1",
                 "--heartbeat-timeout", "30", "--round-timeout", str(cfg["timeout"]),
                 "--log-level", "WARNING", "--resume-grace", "0"],
                _child_env(), f"{tag}-master", logdir, netns=hosts.names[0]))
        peers = []
        for i in range(sources + 1):
            role = "joiner" if i == sources else "source"
            spec = dict(cfg, role=role, master=master, sources=sources)
            label = f"{tag}-{role}{i if role == 'source' else ''}"
            peers.append(Child([sys.executable, os.path.abspath(__file__), "--worker",
                                json.dumps(spec)],
                               _child_env(PCCL_TIMEOUT=str(op_timeout), PCCL_PEER_ID=label),
                               label, logdir, netns=hosts.names[i + 1] if hosts else None,
                               stdin=True))
        children.extend(peers)
        srcs, joiner = peers[:-1], peers[-1]
        if hosts is not None:
            listening = children[0].line(deadline, "the master's 'listening on' line")
            if listening != f"pccl-master listening on {master}":
                raise RuntimeError(f"unexpected master output: {listening!r}")
        for p in peers:
            p.event(deadline, "started")
        for p in srcs:
            p.send("go")
        ready = [p.event(deadline, "ready") for p in srcs]  # the world of S exists
        joiner.send("go")
        joined = {p.label: p.event(deadline, "joined") for p in peers}
        syncs = {p.label: [p.event(deadline, "sync") for _ in range(cfg["reps"])] for p in peers}
        for p in peers:
            p.event(deadline, "done")
            code = p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{p.label} exited with {code}:\n{p.stderr_tail()}")
    finally:
        for c in reversed(children):  # the peers, then the master
            c.kill()
        if master_thread is not None:
            master_thread.stop()
    jl = joiner.label
    rows = [s["result"] for s in syncs[jl]]
    seconds = [r["seconds"] for r in rows]
    return {
        "sources": sources, "rate_mbit": rate_mbit, "op_timeout_s": op_timeout,
        "joiner_rank": joined[jl]["rank"],
        "joiner": rows,
        "source_syncs": {p.label: [s["result"] for s in syncs[p.label]] for p in srcs},
        "revision0": [r["result"] for r in ready],
        "seconds": seconds,
        "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
        "GBps": [cfg["size_bytes"] / s / 1e9 for s in seconds],
        "median_GBps": cfg["size_bytes"] / statistics.median(seconds) / 1e9,
    }


# --------------------------------------------------------------------------- namespaces


def run_netns(cfg: dict, logdir: str, runs: dict) -> str | None:
    """Every (rate, S) in namespaces; returns why the mode was skipped, or None."""
    try:
        netns = netns_module()
    except ImportError as e:
        return f"tests/harness/netns.py cannot be imported: {e}"
    reason = netns.unavailable_reason()
    if reason is None and subprocess.run(["sh", "-c", "command -v tc"],
                                         capture_output=True).returncode != 0 \
            and any(r > 0 for r in cfg["rates"]):
        reason = "the 'tc' command (iproute2) is not installed"
    if reason:
        return reason
    try:
        with netns.hosts(max(cfg["sources"]) + 2, logdir) as hosts:
            hosts.check_connectivity()
            port = MASTER_PORT
            for rate in cfg["rates"]:
                set_rate(hosts, rate)
                for s in cfg["sources"]:
                    key = f"netns/{rate:g}/{s}"
                    log.info("%s: master, %d sources and a joiner in namespaces", key, s)
                    runs[key] = dict(run_one(cfg, s, logdir, hosts, port, rate), mode="netns")
                    port += 1  # a fresh port: the last master's socket may linger
    except netns.NetnsUnavailable as e:
        return str(e)
    return None


# --------------------------------------------------------------------------- report


def time_hashes(cfg: dict) -> dict:
    """``state_hashes`` on one state of the benchmark's size, in this process, median of 3."""
    import torch

    import torch_pccl

    torch.set_num_threads(1)
    state = _build_state(cfg, joiner=False)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        torch_pccl.state_hashes(state)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {"seconds": seconds, "median_s": median, "GBps": cfg["size_bytes"] / median / 1e9}


def print_table(runs: dict, cfg: dict, hashing: dict, skipped: dict) -> None:
    size = cfg["size_bytes"]
    print(f"joiner receiving a {size // MIB} MiB state ({cfg['entries']} float32 entries) "
          f"with sync_shared_state; {cfg['reps']} syncs per row (the first is the join)\n"
          f"GB/s = {size} B / the joiner's SyncResult.seconds / 1e9; 'vs 1 src' = GB/s over "
          f"that with 1 source; 'cap' = sources x the per-host uplink limit")
    header = (f"{'mode':<9} {'rate limit':>12} {'sources':>7} {'median s':>9} "
              f"{'min .. max s':>15} {'GB/s':>6} {'cap GB/s':>8} {'vs 1 src':>8}")
    print_header(header)
    for key, r in runs.items():
        mode, rate, s = key.split("/")
        limited = float(rate) > 0
        limit = f"{rate} Mbit/s" if limited else "none"
        # With a per-host uplink cap, S sources can deliver at most S x the cap.
        cap = f"{int(s) * float(rate) / 8e3:.2f}" if limited else ""
        one = runs.get(f"{mode}/{rate}/1")
        ratio = (f"{r['median_GBps'] / one['median_GBps']:.2f}x"
                 if one is not None and int(s) > 1 else "")
        print(f"{mode:<9} {limit:>12} {s:>7} {r['median_s']:>9.3f} "
              f"{r['min_s']:>6.3f} .. {r['max_s']:<6.3f} {r['median_GBps']:>6.2f} {cap:>8} "
              f"{ratio:>8}")
    print(f"state_hashes() on {size // MIB} MiB, this process alone: "
          f"{hashing['median_s']:.3f} s ({hashing['GBps']:.2f} GB/s); a sync hashes the "
          f"joiner's state once before the vote and the received bytes once more")
    for mode, why in skipped.items():
        print(f"{mode}: skipped: {why}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=256, help="state size in MiB (default 256)")
    p.add_argument("--entries", type=int, default=8,
                   help="float32 tensors the state is split into (default 8)")
    p.add_argument("--reps", type=int, default=3,
                   help="syncs timed per row, the join included (default 3)")
    p.add_argument("--sources", type=int, nargs="+", default=[1, 3],
                   help="up-to-date peers serving the joiner (default 1 3)")
    p.add_argument("--modes", nargs="+", choices=("loopback", "netns"),
                   default=["loopback", "netns"], help="default both")
    p.add_argument("--rate-mbit", type=float, nargs="+", default=[0, 800],
                   help="netns only: per-host egress caps in Mbit/s to run, 0 = none "
                        "(default 0 800)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds allowed per row (start-up included)")
    p.add_argument("--out", default="runs/bench_shared_state", help="folder for results.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one peer
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.reps < 1 or args.entries < 1 or min(args.sources) < 1:
        p.error("--size-mib, --entries, --reps and --sources must be at least 1")
    if (args.size_mib * MIB) % (4 * args.entries):
        p.error("--size-mib must split into --entries float32 tensors")
    if min(args.rate_mbit) < 0:
        p.error("--rate-mbit must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)  # this script's progress; the master thread's only from WARNING
    cfg = {"size_bytes": args.size_mib * MIB, "entries": args.entries, "reps": args.reps,
           "sources": sorted(set(args.sources)), "rates": list(dict.fromkeys(args.rate_mbit)),
           "modes": args.modes, "timeout": args.timeout}
    started = time.perf_counter()
    hashing = time_hashes(cfg)
    runs: dict = {}
    skipped: dict = {}
    logdir = os.path.join(args.out, "logs")  # every child's stderr, kept for a post-mortem
    os.makedirs(logdir, exist_ok=True)
    if "loopback" in args.modes:
        for s in cfg["sources"]:
            key = f"loopback/0/{s}"
            log.info("%s: master thread, %d sources and a joiner on %s", key, s, LOOPBACK)
            runs[key] = dict(run_one(cfg, s, logdir), mode="loopback")
    if "netns" in args.modes:
        why = run_netns(cfg, logdir, runs)
        if why:
            log.warning("netns mode skipped: %s", why)
            skipped["netns"] = why
    seconds = time.perf_counter() - started
    print_table(runs, cfg, hashing, skipped)
    doc = {
        "measure": "seconds of torch_pccl.sync_shared_state on a joiner whose state differs in "
                   "every entry from that of S up-to-date sources (SyncResult.seconds); GB/s = "
                   "state bytes / seconds / 1e9; per row the join and reps-1 repeats",
        "config": cfg,
        "state_hashes": hashing,
        "skipped": skipped,
        "machine": machine(),
        "seconds": round(seconds, 1),
        "runs": runs,
    }
    write_results(args.out, doc, seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
