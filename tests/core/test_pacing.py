"""Pacing of striped streams (native/src/pacing.hpp): what the S streams to one peer send
together is capped, measured by default, pinned or off on request.

- a group on one host is never paced, even striped (loopback has no path queue);
- a pinned cap holds a striped all-reduce to its rate (a 4 MiB op at 10 MB/s takes
  >= 0.25 s where loopback needs milliseconds), and turning pacing off lifts it again
  from the same connections;
- one stream is never capped;
- measured pacing learns nothing from ops that never back the streams up (small ones);
- the option's bounds.
Ranks run on threads in this process, over loopback. What measured pacing learns on a
long link with a queue is checked through the WAN emulator in test_wan_striping.py.
"""

import contextlib
import time

import pytest
import torch
from harness.threads import on_threads

from torch_pccl import Communicator
from torch_pccl.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

W = 2


@contextlib.contextmanager
def _pair(streams, comm_id):
    """Two connected Communicators over loopback, closed on exit."""
    comms = [Communicator(r, W, comm_id, "127.0.0.1", 20.0) for r in range(W)]
    try:
        addrs = [f"127.0.0.1:{c.port}" for c in comms]
        on_threads(lambda r: comms[r].connect(addrs, streams=streams), W)
        yield comms
    finally:
        for c in comms:
            c.close()


def _timed_all_reduce(comms, numel):
    """Seconds of one all-reduce of ``numel`` float32 ones (the slower rank); checks it."""
    outs = [torch.ones(numel) for _ in comms]

    def run(r):
        start = time.monotonic()
        comms[r].all_reduce(outs[r])
        return time.monotonic() - start

    seconds = max(on_threads(run, W))
    for out in outs:
        assert torch.equal(out, torch.full_like(out, float(W)))
    return seconds


def test_a_pinned_cap_holds_a_striped_op_to_its_rate_and_off_lifts_it():
    with _pair(streams=2, comm_id=71) as comms:
        rate = 10_000_000  # bytes/s per peer, both streams together
        for c in comms:
            c.set_option("pacing", rate)
        assert comms[0].pacing(1) == (0.0, float(rate))
        # Each rank sends the whole 4 MiB once (ring of two): >= 0.42 s at the cap.
        paced = _timed_all_reduce(comms, 1 << 20)
        for c in comms:
            c.set_option("pacing", 0)
        assert comms[0].pacing(1) == (0.0, 0.0)
        free = _timed_all_reduce(comms, 1 << 20)
        assert paced >= 0.25, f"capped at 10 MB/s, 4 MiB took only {paced:.3f} s"
        assert free * 3 < paced, f"pacing off: {free:.3f} s vs {paced:.3f} s capped"


def test_a_one_host_group_is_never_paced(monkeypatch):
    """Measured pacing is the default (PCCL_PACING unset), but not on one host: a striped
    loopback group neither warms up nor measures nor caps."""
    monkeypatch.delenv("PCCL_PACING", raising=False)
    with _pair(streams=2, comm_id=75) as comms:
        assert [c.lanes[0].last_rate(1 - r) for r, c in enumerate(comms)] == [0.0] * W
        _timed_all_reduce(comms, 4 << 20)
        assert [c.pacing(1 - r) for r, c in enumerate(comms)] == [(0.0, 0.0)] * W
        assert [c.last_rate(1 - r) for r, c in enumerate(comms)] == [0.0] * W


def test_one_stream_is_never_capped():
    with _pair(streams=1, comm_id=72) as comms:
        for c in comms:
            c.set_option("pacing", 1_000_000)
        assert comms[0].pacing(1)[1] == 0.0
        seconds = _timed_all_reduce(comms, 1 << 20)
        assert seconds < 2.0, f"one stream was paced: 4 MiB took {seconds:.3f} s at 1 MB/s"


def test_measured_pacing_learns_nothing_from_small_ops():
    """Ops that never back the streams up (each fits the socket buffers at once) are not
    measurements of the path: a cap from them would hold later ops at their pace (the
    failure pacing.hpp guards against: a few small ops, then a 64 MiB op at 9 % of a link)."""
    with _pair(streams=2, comm_id=73) as comms:
        for c in comms:
            c.set_option("pacing", -1)
        for numel in (1, 1024, 16 << 10, 64 << 10, 1024, 64 << 10):
            _timed_all_reduce(comms, numel)
        assert [c.pacing(1 - r) for r, c in enumerate(comms)] == [(0.0, 0.0)] * W


@pytest.mark.parametrize("value", [-2, 1 << 41])
def test_pacing_option_bounds(value):
    comm = Communicator(0, 1, 74, "127.0.0.1", 5.0)
    try:
        with pytest.raises(InvalidArgumentError, match="pacing"):
            comm.set_option("pacing", value)
        with pytest.raises(InvalidArgumentError, match="peer"):
            comm.pacing(1)
    finally:
        comm.close()
