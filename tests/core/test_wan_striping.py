"""Striping where it matters: a pccl all_reduce over an emulated long link (100 ms RTT)
through the project's WAN emulator, with one TCP stream and with four.

A stream's send buffer is capped (128 KiB in the namespaces), so one stream is window-bound
at about 128 KiB per round trip, as a default stream is at 1 Gbit/s; four streams carry
four windows. Only the relative gain is asserted (>= 2x); absolute figures belong to
benchmarks/wan.py. Root and /dev/net/tun only (skipped with the reason otherwise).
"""

import os
import sys

import pytest

from harness import HARNESS, REPO
from harness.wanem import Link, wan_hosts  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(180)

WORKER = os.path.join(HARNESS, "wan_allreduce_worker.py")
NBYTES = 2 << 20            # per all_reduce; ~1.6 s on one window-bound stream
STORE_PORT = 29680


def _time_all_reduce(w, streams):
    env = dict(os.environ, PCCL_STREAMS=str(streams), PCCL_MASTER="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    procs = [w.popen(r, [sys.executable, WORKER, str(r), "2", f"{w.addrs[0]}:{STORE_PORT}",
                         "pccl", str(NBYTES), "2"], env=env, label=f"rank {r}, {streams} streams")
             for r in range(2)]
    try:
        results = [p.finish(120) for p in procs]
    finally:
        for p in procs:
            p.close()
    assert all(res["ok"] for res in results), results
    return min(min(res["seconds"]) for res in results)


def test_four_streams_at_least_twice_one_on_a_long_link(wan_hosts):
    w = wan_hosts(2, Link(delay_ms=50, rate_mbit=200), tcp_wmem_max=128 << 10)
    one = _time_all_reduce(w, 1)
    four = _time_all_reduce(w, 4)
    assert one >= 2 * four, f"1 stream {one:.2f} s, 4 streams {four:.2f} s"
