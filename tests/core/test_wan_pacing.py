"""Pacing as a user gets it, with no setting: every striped group between hosts finds its
path's rate by itself (native/src/pacing.hpp, torch_pccl/core/warmup.py), through the
project's WAN emulator (root and /dev/net/tun only; skipped with the reason otherwise).

- a new group's estimate, right after ``init_process_group`` (its warm-up), is the path's
  rate and not some other (a NIC's, loopback's, nothing): within 0.5 .. 1.35x the emulated
  link's rate, at 100 Mbit/s and at 1 Gbit/s; and 60 s without traffic do not lose it: after
  them and one op it is still in that range and at least 0.75x what it was. The estimator's
  spread on a fresh group is wide: 16 groups at 100 Mbit/s, 20 ms read 68-109 Mbit/s on
  their 32 ranks here, one CI run read 59, and +-15 % checks failed in about 1 run in 8
  (docs/performance.md); at 1 Gbit/s fresh-clone runs read 1.195x and 1.27x the link (the
  first measuring op's burst goes into the link's 50 ms queue as well as onto the wire). Probing right after a first estimate narrowed it (84-108) but made
  the link-halved check below undershoot (60-73 Mbit/s on 100) in 1 of 5 runs under load,
  so it was not kept;
- when the link's rate halves under a running group, the estimate comes within 15 % of
  it within 5 ops; when it doubles again, the estimate grows by >= 20 % within 16 ops
  (the probes of pacing.hpp: in most runs it reaches the new rate in 8-9 ops, but a lane
  whose streams' BBR state is still at the old rate holds a probe back);
- ``PCCL_PACING=off`` and ``PCCL_PACING=<Mbit/s>`` win over the estimate;
- the streams a group stripes over follow the bandwidth-delay product: the fewest
  (``config.DEFAULT_STREAMS``) at 1 Gbit/s and 40 ms RTT, more at 100 ms.
A group on one host is never paced: tests/core/test_pacing.py. Only estimates are asserted
here; how fast the ops run is benchmarks/wan.py's.
"""

import json
import os
import sys

import pytest

from harness import HARNESS, REPO
from harness.wanem import Link

from torch_pccl import config

pytestmark = pytest.mark.timeout(300)

WORKER = os.path.join(HARNESS, "wan_pacing_worker.py")
STORE_PORT = 29690
TOLERANCE = 0.15
FRESH_RANGE = (0.5, 1.35)   # a new group's estimate over the link's rate (see above)
MBIT = 1e6 / 8  # bytes/s


def _start(w, plan, port, **settings):
    """Both ranks' worker processes running ``plan`` with env ``settings`` (no PCCL_* else)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PCCL_")}
    env.update(PCCL_MASTER="0", OMP_NUM_THREADS="1", **settings,
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return [w.popen(r, [sys.executable, WORKER, str(r), "2", f"{w.addrs[0]}:{port}",
                        json.dumps(plan)], env=env, label=f"rank {r}", stdin=True)
            for r in range(2)]


def _events(procs, event):
    """Each worker's first ``event``, after they all finished; closes them."""
    try:
        seen = [p.next_event(120, event) for p in procs]
        for p in procs:
            p.finish(60)
    finally:
        _close(procs)
    return seen


def _close(procs):
    for p in procs:
        p.close()


def _near(rate_bytes, mbit):
    return abs(rate_bytes - mbit * MBIT) <= TOLERANCE * mbit * MBIT


def _of_path(rate_bytes, mbit):
    """The estimate is the path's rate, within the fresh estimator's spread."""
    return FRESH_RANGE[0] * mbit * MBIT <= rate_bytes <= FRESH_RANGE[1] * mbit * MBIT


def _mbit(rate_bytes):
    return f"{rate_bytes / MBIT:.0f} Mbit/s"


@pytest.mark.parametrize("mbit", [100, 1000])
def test_a_new_group_finds_the_link_rate_and_keeps_it_after_60_s_idle(wan_hosts, mbit):
    w = wan_hosts(2, Link(delay_ms=20, rate_mbit=mbit))
    op_bytes = int(mbit * MBIT * 0.5) // (1 << 20) * (1 << 20)  # ~0.5 s on the link
    procs = _start(w, [{"op": "idle", "seconds": 60},
                       {"op": "all_reduce", "bytes": op_bytes, "reps": 1}], STORE_PORT)
    try:
        formed = [p.next_event(120, "formed") for p in procs]
        after = [p.next_event(120, "ops") for p in procs]
        for p in procs:
            p.finish(60)
    finally:
        _close(procs)
    for r in range(2):
        estimate, cap, _ = formed[r]["pacing"]
        assert _of_path(estimate, mbit), f"rank {r} fresh: {_mbit(estimate)} on {mbit} Mbit/s"
        assert cap > estimate                       # measured pacing caps near the estimate
        assert formed[r]["stripe"] == config.DEFAULT_STREAMS   # 40 ms: a short path
        fresh, estimate = estimate, after[r]["pacing"][-1][0]
        assert _of_path(estimate, mbit) and estimate >= 0.75 * fresh, \
            f"rank {r} after idle: {_mbit(estimate)} (fresh {_mbit(fresh)})"


def test_a_longer_path_is_striped_over_more_streams(wan_hosts):
    w = wan_hosts(2, Link(delay_ms=50, rate_mbit=1000))       # 12.5 MB in flight
    formed = _events(_start(w, [], STORE_PORT + 3), "formed")
    stripes = [f["stripe"] for f in formed]
    assert stripes[0] == stripes[1] > config.DEFAULT_STREAMS, \
        (stripes, [_mbit(f["pacing"][0]) for f in formed])


def test_the_estimate_follows_the_link_down_and_up(wan_hosts):
    fast, slow = 200, 100
    w = wan_hosts(2, Link(delay_ms=20, rate_mbit=fast))
    down_ops = {"op": "all_reduce", "bytes": 8 << 20, "reps": 5}   # ~0.3-0.7 s each
    up_ops = {**down_ops, "reps": 16}
    procs = _start(w, [{"op": "wait"}, down_ops, {"op": "wait"}, up_ops], STORE_PORT + 1)

    def at_rate(mbit):
        """Both ranks' ops after the link changed to ``mbit`` while they waited."""
        for p in procs:
            p.next_event(30, "waiting")
        for i, j in ((0, 1), (1, 0)):
            w.set_link(i, j, Link(delay_ms=20, rate_mbit=mbit))
        for p in procs:
            p.send("go")
        return [p.next_event(120, "ops") for p in procs]

    try:
        formed = [p.next_event(120, "formed") for p in procs]
        down = at_rate(slow)
        up = at_rate(fast)
        for p in procs:
            p.finish(60)
    finally:
        _close(procs)
    for r in range(2):
        assert formed[r]["pacing"][0] > 0       # a fresh estimate (its precision: above)
        # Halved: a cap above the path loses segments, and each such op lowers it.
        seen = [_mbit(x[0]) for x in down[r]["pacing"]]
        assert any(_near(x[0], slow) for x in down[r]["pacing"]), f"rank {r}: {seen}"
        # Doubled: every third op probes above the estimate, and a probe the path let
        # through raises it and probes again higher (x1.1, 1.21, 1.33, ...).
        seen = [_mbit(x[0]) for x in up[r]["pacing"]]
        assert up[r]["pacing"][-1][0] >= 1.2 * down[r]["pacing"][-1][0], f"rank {r}: {seen}"


@pytest.mark.parametrize("setting", ["off", "50"])
def test_a_pacing_setting_wins_over_the_estimate(wan_hosts, setting):
    w = wan_hosts(2, Link(delay_ms=20, rate_mbit=100))
    ops = _events(_start(w, [{"op": "all_reduce", "bytes": 4 << 20, "reps": 2}],
                         STORE_PORT + 2, PCCL_PACING=setting), "ops")
    for r in range(2):
        estimate, cap, last_rate = ops[r]["pacing"][-1]
        assert estimate == 0.0                      # nothing measured into a cap
        if setting == "off":
            assert (cap, last_rate) == (0.0, 0.0)   # not even measured
        else:
            assert cap == 50 * MBIT                 # pinned, as given
            assert 0 < last_rate <= 1.15 * cap      # the streams did run under it
