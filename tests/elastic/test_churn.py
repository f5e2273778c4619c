"""Churn (issue 3): 20 rounds of SIGKILL at random points during all-reduce.

Three peers loop on a 1 MiB all-reduce; the test SIGKILLs a random one a
random 0-250 ms after every peer said its loop started (seeded: the seed is
in every failure message, env PCCL_CHURN_SEED replays a run). Every survivor
must raise a network PcclError within 2x the op timeout with its input
bit-identical to before the op, then finish that same all-reduce on the
world of two (alternately through update_topology + all_reduce and through
all_reduce_with_retry) with the right sum. A replacement joins (pccl://) and
is admitted by peers_pending + update_topology, so each round starts with 3.

Which errors count: PeerLostError (a ring neighbour's connection closed or
reset), RemoteError (another survivor's ABORT frame) and PcclSystemError (a
send on a reset socket). PcclTimeoutError does not: a SIGKILLed process's
sockets are closed by its kernel at once, so a survivor that waits for its
deadline missed both the EOF and the ABORT; that is a detection bug even if
it lands inside 2x the timeout.

Harness as tests/elastic/test_membership.py: master in a thread of this process with
short heartbeats, peers are tests/harness/churn_worker.py subprocesses over JSON
lines, every wait has a deadline, every process is SIGKILLed in a finally.
Replacements are started two rounds ahead and only register on "join", so
their torch import overlaps the previous rounds.
"""

import os
import random
import sys
import threading
import time

import pytest

from harness import HARNESS
from harness.worker_process import WorkerProcess
from harness.worker_process import call_all as _call_all
from harness.worker_process import wait_until
from torch_pccl.master import start_in_thread

pytestmark = [pytest.mark.timeout(300), pytest.mark.pccl_only]

T = 3.0                 # seconds: the op timeout (PCCL_TIMEOUT)
ROUNDS = 20
LIVE = 3
N = 262_144             # float32 elements: 1 MiB, several ms per all-reduce on loopback
MAX_KILL_DELAY_S = 0.25
AHEAD = 2               # replacements started ahead of the round that admits them
JOIN_TIMEOUT_S = 60.0   # how long a replacement may stay pending
START_S = 60.0          # a worker's start (imports torch) on a loaded machine
STEP_S = 2 * T + 20     # deadline of one collective command (update rounds, retries)
ROUND_S = 45.0          # no round may take longer than this
WORKER = os.path.join(HARNESS, "churn_worker.py")
PEER_DEATH = ("PeerLostError", "RemoteError", "PcclSystemError")


class Peer(WorkerProcess):
    """One worker process; starts as a standby, ``join`` registers it with the master."""

    def __init__(self, master_addr, tmp_path, index):
        name = f"p{index}"
        self.value = float(index + 1)
        env = dict(os.environ, PCCL_TIMEOUT=str(T), PCCL_PEER_ID=name)
        super().__init__(name, [sys.executable, WORKER, master_addr, str(JOIN_TIMEOUT_S),
                                str(self.value)], env, tmp_path / f"{name}.stderr")

    def join(self):
        self.recv(START_S, "started")
        self.send("join")


def call_all(peers, cmd, timeout_s=STEP_S, **kw):
    """Sends ``cmd`` to every peer first (a collective), then collects each answer."""
    return _call_all(peers, cmd, timeout_s, **kw)



def check_world(answers, peers, size):
    assert sorted(a["rank"] for a in answers) == list(range(size)), answers
    for a in answers:
        assert a["world_size"] == size and a["group_ranks"] == list(range(size)), a
    assert len({a["epoch"] for a in answers}) == 1, answers
    expected = sum(p.value for p in peers)
    for a in answers:
        assert a["uniform"] and a["residue"] == expected, (
            f"wrong SUM over {[p.name for p in peers]}: expected residue {expected}, got {a}")


def churn_round(r, rng, m, live, standby, stats):
    """Kills one of ``live`` mid all-reduce, checks the survivors, admits ``standby``."""
    round_deadline = time.monotonic() + ROUND_S
    for p in live:
        p.send("loop", n=N, max_s=ROUND_S)
    for p in live:
        p.recv(START_S, "looping")
    victim = rng.choice(live)
    delay = rng.uniform(0.0, MAX_KILL_DELAY_S)
    threading.Event().wait(delay)   # the random kill time is the point of the test
    killed_at = time.monotonic()
    victim.kill()
    survivors = [p for p in live if p is not victim]
    where = f"victim {victim.name} killed {delay * 1000:.0f} ms into the loop"

    # 1. every survivor fails promptly with a network error, its input untouched.
    for p in survivors:
        a = p.recv(2 * T + 5, "loop")
        late = time.monotonic() - killed_at
        err = a["error"]
        assert err is not None, f"{where}: {p.name}'s all_reduce loop never failed: {a}"
        assert set(PEER_DEATH) & set(err["mro"]), (
            f"{where}: {p.name} raised {err['type']}: {err['message']}")
        assert err["elapsed"] < 2 * T and late < 2 * T, (
            f"{where}: {p.name}'s {err['type']} took {err['elapsed']:.2f} s "
            f"({late:.2f} s after the kill), bound {2 * T} s")
        assert a["sha_after"] == a["sha_before"], (
            f"{where}: {p.name}'s failed all_reduce modified its input")
        assert a["world_size"] == LIVE, a
        stats["errors"][err["type"]] = stats["errors"].get(err["type"], 0) + 1
        stats["done"].append(a["done"])
        stats["latency"] = max(stats["latency"], late)

    # 2. the same all_reduce, retried on the world of two, sums the survivors' inputs.
    mode = "update" if r % 2 == 0 else "with_retry"
    answers = call_all(survivors, "retry", mode=mode)
    check_world(answers, survivors, LIVE - 1)
    for a in answers:
        assert a["changes"] == 1 and a["left"] == [[victim.name]] and a["joined"] == [[]], (
            f"{where}: {mode}: {a}")
        if mode == "update":
            sticky = a["sticky"]
            assert sticky is not None and sticky["elapsed"] < T, (
                f"{where}: the network error was not sticky until update_topology: {sticky}")

    # 3. the replacement registers, is seen pending by all, and is admitted.
    t0 = time.monotonic()
    standby.join()
    stats["standby_wait"] += time.monotonic() - t0
    wait_until(lambda: m.snapshot()["pending"] == 1, 30, f"{standby.name} pending")
    pending = call_all(survivors, "pending")
    assert all(a["pending"] is True for a in pending), pending
    grown = survivors + [standby]
    changes = call_all(survivors, "update")
    hello = standby.recv(STEP_S, "ready")
    for c in changes:
        assert c["joined"] == [standby.name] and c["left"] == [] and c["world_size"] == LIVE, c
    assert (hello["rank"], hello["world_size"]) == (LIVE - 1, LIVE), hello
    check_world(call_all(grown, "check"), grown, LIVE)
    assert time.monotonic() < round_deadline, f"round took longer than {ROUND_S} s"
    return grown


def test_twenty_rounds_of_sigkill_during_all_reduce(tmp_path):
    seed = int(os.environ.get("PCCL_CHURN_SEED", random.randrange(2**32)))
    print(f"churn seed {seed} (replay: PCCL_CHURN_SEED={seed})")
    rng = random.Random(seed)
    m = start_in_thread("127.0.0.1", 0, world_size=LIVE, heartbeat_interval_s=0.5,
                        heartbeat_timeout_s=2.0, round_timeout_s=15.0)
    procs = []

    def spawn():
        p = Peer(m.address, tmp_path, len(procs))
        procs.append(p)
        return p

    stats = {"errors": {}, "done": [], "latency": 0.0, "standby_wait": 0.0}
    started = time.monotonic()
    try:
        live = [spawn() for _ in range(LIVE)]
        for p in live:
            p.join()
        by_rank = {p.recv(START_S, "ready")["rank"]: p for p in live}
        live = [by_rank[i] for i in range(LIVE)]
        check_world(call_all(live, "check"), live, LIVE)
        # Replacements start AHEAD rounds early: importing torch (~1-2 s of CPU) then
        # overlaps the rounds before instead of adding to each.
        standbys = [spawn() for _ in range(min(AHEAD, ROUNDS))]
        for r in range(ROUNDS):
            try:
                live = churn_round(r, rng, m, live, standbys.pop(0), stats)
                if len(procs) < LIVE + ROUNDS:
                    standbys.append(spawn())
            except AssertionError as exc:
                raise AssertionError(f"round {r} of {ROUNDS} (PCCL_CHURN_SEED={seed}): "
                                     f"{exc}") from None
        for p in live:
            p.send("exit")
        for p in live:
            p.recv(30, "bye")
            assert p.proc.wait(30) == 0, f"{p.name} exit status (PCCL_CHURN_SEED={seed})"
    finally:
        for p in procs:
            p.close()
        m.stop()
    print(f"churn: {ROUNDS} rounds in {time.monotonic() - started:.1f} s; survivor errors "
          f"{stats['errors']}; ops completed before the kill {stats['done']}; "
          f"slowest failure {stats['latency']:.3f} s after the kill; "
          f"{stats['standby_wait']:.1f} s waiting for replacements to import torch")
