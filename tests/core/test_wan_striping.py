"""Striping where it matters: a pccl all_reduce over an emulated long link (100 ms RTT)
through the project's WAN emulator, with one TCP stream and with four; and pacing of the
four at the link's rate (native/src/pacing.hpp) on a link with a short queue.

A stream's send buffer is capped (128 KiB in the namespaces), so one stream is window-bound
at about 128 KiB per round trip, as a default stream is at 1 Gbit/s; four streams carry
four windows. Only the relative gain is asserted (>= 2x); absolute figures belong to
benchmarks/wan.py. Root and /dev/net/tun only (skipped with the reason otherwise).
"""

import os
import sys

import pytest

from harness import HARNESS, REPO
from harness.wanem import Link

pytestmark = pytest.mark.timeout(180)

WORKER = os.path.join(HARNESS, "wan_allreduce_worker.py")
NBYTES = 2 << 20            # per all_reduce; ~1.6 s on one window-bound stream
STORE_PORT = 29680


def _run_pair(w, nbytes, reps, port, **settings):
    """Both ranks' results of ``reps`` pccl all-reduces of ``nbytes`` with env ``settings``."""
    env = dict(os.environ, PCCL_MASTER="0", OMP_NUM_THREADS="1", **settings,
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    label = ", ".join(f"{k}={v}" for k, v in settings.items())
    procs = [w.popen(r, [sys.executable, WORKER, str(r), "2", f"{w.addrs[0]}:{port}", "pccl",
                         str(nbytes), str(reps)], env=env, label=f"rank {r}, {label}")
             for r in range(2)]
    try:
        results = [p.finish(120) for p in procs]
    finally:
        for p in procs:
            p.close()
    assert all(res["ok"] for res in results), results
    return results


def _time_all_reduce(w, streams):
    # Pacing (and its warm-up) off: this compares streams alone.
    results = _run_pair(w, NBYTES, 2, STORE_PORT, PCCL_STREAMS=str(streams), PCCL_PACING="off")
    return min(min(res["seconds"]) for res in results)


def test_four_streams_at_least_twice_one_on_a_long_link(wan_hosts):
    w = wan_hosts(2, Link(delay_ms=50, rate_mbit=200), tcp_wmem_max=128 << 10)
    one = _time_all_reduce(w, 1)
    four = _time_all_reduce(w, 4)
    assert one >= 2 * four, f"1 stream {one:.2f} s, 4 streams {four:.2f} s"


def _paced_run(w, pacing):
    """(rank 0's [estimate, cap] for rank 1, tail drops) of 4 all-reduces of 8 MiB on 4
    streams with ``PCCL_PACING=pacing``, the group's forming included."""
    before = sum(s["drop_queue"] for s in w.stats()["links"].values())
    results = _run_pair(w, 8 << 20, 4, STORE_PORT + 1, PCCL_STREAMS="4", PCCL_LANES="1",
                        PCCL_PACING=pacing)
    drops = sum(s["drop_queue"] for s in w.stats()["links"].values()) - before
    return results[0]["pacing"]["1"], drops


def test_pacing_at_the_link_rate_stops_the_queue_overflowing(wan_hosts):
    """On a 200 Mbit/s, 40 ms link with a 20 ms queue, four unpaced streams overrun the
    queue together; capped together at the link's rate, the same ops overflow it far less.
    (What the measured default finds: test_wan_pacing.py.)"""
    w = wan_hosts(2, Link(delay_ms=20, rate_mbit=200, queue_ms=20))
    (estimate, cap), paced_drops = _paced_run(w, "200")
    assert (estimate, cap) == (0.0, 200e6 / 8)
    (off_estimate, off_cap), free_drops = _paced_run(w, "off")
    assert (off_estimate, off_cap) == (0.0, 0.0)
    assert free_drops >= 10 and paced_drops * 2 <= free_drops, (
        f"tail drops: {paced_drops} paced, {free_drops} unpaced")
