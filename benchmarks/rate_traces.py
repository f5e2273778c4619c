"""Records the rate controller's windows through the WAN emulator, for the deterministic
replay tests (native/tests/test_rate.cpp; root only).

Two ranks in two namespaces joined by the emulator's forwarder (tests/harness/wanem.py),
each with ``PCCL_RATE_TRACE`` set, run one plan per scenario; rank 0's trace (every window
of every op to its peer: what the streams delivered and sent, what was retransmitted, the
cap that followed; the CSV that native/src/pacing.cpp writes) is copied to
``native/tests/traces/<scenario>.csv``:

  fresh    1 Gbit/s, 100 ms RTT: a new group, then 8 all-reduces of 64 MiB
  loss     as fresh, with 0.01 % random loss on the link
  halved   as fresh for 6 ops, then the link at 500 Mbit/s for 6 ops
  doubled  the link at 500 Mbit/s for 6 ops, then at 1 Gbit/s for 6 ops
  stall    as fresh; in the 4th op the forwarder is stopped (SIGSTOP) for 0.3 s, as a
           busy host or a stalled middlebox holds packets, then resumed

    sudo python benchmarks/rate_traces.py                 # every scenario, ~3 minutes
    sudo python benchmarks/rate_traces.py --scenarios loss --out /tmp/traces
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import HARNESS  # noqa: E402
from harness.wanem import Link, wan  # noqa: E402

WORKER = os.path.join(HARNESS, "wan_pacing_worker.py")
STORE_PORT = 29791
MIB = 1 << 20
SCENARIOS = ("fresh", "loss", "halved", "doubled", "stall")


def plan_for(scenario: str, mib: int) -> tuple[Link, list[dict]]:
    """The first link and the workers' plan; a ``wait`` step's ``link`` is set meanwhile."""
    ops = {"op": "all_reduce", "bytes": mib * MIB, "reps": 8}
    six = {**ops, "reps": 6}
    fast, slow = Link(delay_ms=50, rate_mbit=1000), Link(delay_ms=50, rate_mbit=500)
    if scenario == "fresh":
        return fast, [ops]
    if scenario == "loss":
        return Link(delay_ms=50, rate_mbit=1000, loss=1e-4), [ops]
    if scenario == "halved":
        return fast, [six, {"op": "wait", "link": slow}, six]
    if scenario == "doubled":
        return slow, [six, {"op": "wait", "link": fast}, six]
    if scenario == "stall":
        return fast, [{**ops, "reps": 3}, {"op": "wait", "stall_s": 0.3}, {**ops, "reps": 5}]
    raise ValueError(scenario)


def record(scenario: str, out_dir: str, mib: int) -> dict:
    """Runs one scenario; copies rank 0's trace to ``out_dir``; returns a summary."""
    link, plan = plan_for(scenario, mib)
    # The workers only see the step kinds they know.
    worker_plan = [{k: v for k, v in s.items() if k in ("op", "bytes", "reps")} for s in plan]
    with tempfile.TemporaryDirectory(prefix="pccl-traces-") as tmp, wan(2, link) as w:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_")}
        env.update(PCCL_MASTER="0", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        procs = []
        for r in range(2):
            procs.append(w.popen(r, [sys.executable, WORKER, str(r), "2",
                                     f"{w.addrs[0]}:{STORE_PORT}", json.dumps(worker_plan)],
                                 env={**env, "PCCL_RATE_TRACE": os.path.join(tmp, f"r{r}.csv")},
                                 label=f"rank {r}", stdin=True))
        try:
            formed = [p.next_event(240, "formed") for p in procs]
            seconds = []
            for step in plan:
                if step["op"] == "all_reduce":
                    seconds += [p.next_event(600, "ops")["seconds"] for p in procs][0]
                elif step["op"] == "wait":
                    for p in procs:
                        p.next_event(60, "waiting")
                    if "link" in step:
                        for i, j in ((0, 1), (1, 0)):
                            w.set_link(i, j, step["link"])
                    for p in procs:
                        p.send("go")
                    if "stall_s" in step:
                        # Fault injection, not synchronisation: the op is under way by then.
                        time.sleep(0.4)
                        os.kill(w.forwarder_pid(), signal.SIGSTOP)
                        time.sleep(step["stall_s"])
                        os.kill(w.forwarder_pid(), signal.SIGCONT)
            for p in procs:
                p.finish(60)
        finally:
            for p in procs:
                p.close()
        stats = w.stats()
        os.makedirs(out_dir, exist_ok=True)
        shutil.copy(os.path.join(tmp, "r0.csv"), os.path.join(out_dir, f"{scenario}.csv"))
    return {"scenario": scenario, "init_s": [f["init_s"] for f in formed],
            "utilisation": [round(mib * MIB * 8 / s / (link.rate_mbit * 1e6), 3) for s in seconds],
            "forwarder_cpu_share": round(stats["cpu_s"] / max(stats["wall_s"], 1e-9), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--out", default=os.path.join(REPO, "native", "tests", "traces"))
    p.add_argument("--mib", type=int, default=64, help="all-reduce size (default 64)")
    args = p.parse_args(argv)
    for s in args.scenarios:
        print(json.dumps(record(s, args.out, args.mib)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
