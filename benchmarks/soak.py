"""The churn soak for as long as you like: DiLoCo training while peers are killed, stopped and
added at random, with its goodput.

    python benchmarks/soak.py --minutes 60            # an hour (default)
    python benchmarks/soak.py --minutes 5 --seed 7    # a replay of seed 7, 5 minutes

The soak itself is tests/harness/soak.py (the suite runs it with 30 kills, 30 joins and 5 stops,
tests/elastic/test_soak.py): a ``pccl-master`` process, peers started ahead as standbys, one event
every 0.3-1.2 s (join, SIGKILL, SIGSTOP then SIGCONT once dropped, join and kill at once) keeping
2-5 peers. Here the event targets scale with the time: per minute 15 kills, 15 joins, 2 stops
and 1 join+kill, and the run lasts at least ``--minutes``. **Goodput** is the share of the inner
steps executed by all peers whose updates reached the outer parameters (a killed or stopped
peer loses the inner steps since its last outer step). Every check of the soak is reported
(parity after every outer step, no outer step longer than twice the op deadline, only stopped
peers fail, falling loss, the master's open files and memory).

Writes ``results.json`` and ``soak.png`` (world size and loss over the run) to ``--out`` and
shows a progress bar.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from _harness import REPO, machine, write_json

sys.path.insert(0, os.path.join(REPO, "tests"))
from harness import soak  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long at least (default 60)")
    p.add_argument("--seed", type=int, default=None, help="replay a schedule (default: random)")
    p.add_argument("--quiet-epochs", action="store_true",
                   help="the master grants quiet epochs (pccl-master --quiet-epochs)")
    p.add_argument("--out", default="runs/soak", help="where results.json and soak.png go")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    per_min = {"kills": 15, "joins": 15, "stops": 2, "join_kills": 1}
    targets = {k: max(1, int(v * args.minutes)) for k, v in per_min.items()}
    os.makedirs(args.out, exist_ok=True)
    from tqdm import tqdm

    bar = tqdm(total=int(args.minutes * 60), desc="soak", unit="s")

    def progress(res):
        bar.n = min(bar.total, int(res.seconds))
        bar.set_postfix(kills=res.kills, joins=res.joins, stops=res.stops,
                        outer=res.outer_steps, refresh=False)
        bar.refresh()

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pccl-soak-") as work:
        res = soak.run(seed, work, min_seconds=args.minutes * 60,
                       max_seconds=args.minutes * 60 + 600, progress=progress,
                       quiet_epochs=args.quiet_epochs, **targets)
    bar.close()
    print(f"seed {seed}: {res.kills} kills, {res.joins} joins, {res.stops} stops, "
          f"{res.join_kills} join+kill in {res.seconds:.0f} s; {res.outer_steps} outer steps")
    print(f"goodput {res.goodput:.4f} ({res.useful_inner} of {res.useful_inner + res.lost_inner} "
          f"inner steps reached the outer parameters); worst outer step {res.worst_outer_s:.1f} s; "
          f"master open files {res.master_fds[0]} -> {res.master_fds[1]}, "
          f"RSS {res.master_rss_kib[0]} -> {res.master_rss_kib[1]} KiB")
    for line in res.problems:
        print("PROBLEM:", line)
    print("all checks held" if not res.problems else f"{len(res.problems)} problem(s)")
    doc = {"machine": machine(), "seed": seed, "minutes": args.minutes, "targets": targets,
           "kills": res.kills, "joins": res.joins, "stops": res.stops,
           "join_kills": res.join_kills, "outer_steps": res.outer_steps,
           "seconds": res.seconds, "goodput": res.goodput, "useful_inner": res.useful_inner,
           "lost_inner": res.lost_inner, "worst_outer_s": res.worst_outer_s,
           "master_fds": res.master_fds, "master_rss_kib": res.master_rss_kib,
           "problems": res.problems, "wall_s": time.monotonic() - started}
    write_json(os.path.join(args.out, "results.json"), doc)
    plot(res, os.path.join(args.out, "soak.png"))
    print(f"wrote {args.out}/results.json and {args.out}/soak.png")
    return 0 if not res.problems else 1


def plot(res, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=False)
    if res.worlds:
        t, w = zip(*res.worlds)
        top.step(t, w, where="post")
    top.set_ylabel("world size")
    top.set_xlabel("seconds")
    top.set_title(f"churn soak, seed {res.seed}: {res.kills} kills, {res.joins} joins, "
                  f"{res.stops} stops; goodput {res.goodput:.3f}")
    if res.losses:
        s, loss = zip(*res.losses)
        bottom.plot(s, loss)
        bottom.set_yscale("log")
    bottom.set_xlabel("outer step")
    bottom.set_ylabel("training loss (mean over peers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
