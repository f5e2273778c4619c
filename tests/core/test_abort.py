"""Aborting a communicator with a cause: ``Communicator.abort(lost=...)`` (pcclCommAbortWithError).

The control plane learns that a member is gone (the master dropped it) before the data plane
can: a stopped process keeps its sockets open, so its peers would wait for its bytes until the
op's deadline. Aborting with the cause must fail the op in flight at once, as a PeerLostError
that names the peer, leave the caller's tensor as it was, and stay sticky.
"""

import threading
import time

import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.pccl_only]


def _pair(lanes=1):
    """Two connected communicators of one process (rank 1 is left idle by the tests)."""
    from torch_pccl import Communicator

    comms = [Communicator(r, 2, 77, "127.0.0.1", 30.0) for r in range(2)]
    addrs = [f"127.0.0.1:{c.port}" for c in comms]
    threads = [threading.Thread(target=c.connect, args=(addrs,), kwargs={"lanes": lanes})
               for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return comms


def _blocked_all_reduce(comm, tensor):
    """Starts an all_reduce that cannot finish (the peer never calls); returns (thread, box)."""
    box = {}

    def run():
        try:
            comm.all_reduce(tensor)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e
        box["at"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_abort_with_lost_peer_fails_the_op_in_flight_as_peer_lost():
    import torch

    from torch_pccl.errors import PeerLostError

    comms = _pair(lanes=2)
    try:
        lane1 = comms[0].lanes[1]
        t0 = torch.arange(1 << 16, dtype=torch.float32)
        t1 = t0.clone()
        threads = [_blocked_all_reduce(comms[0], t0), _blocked_all_reduce(lane1, t1)]
        time.sleep(0.3)  # not synchronisation: the test only wants the ops to be blocked first
        assert all(t.is_alive() for t, _ in threads), "the ops finished without their peer"
        why = "peer p2 (rank 1) was dropped by the master: no message for 10.2 s"
        start = time.monotonic()
        comms[0].abort(lost=why)
        for t, box in threads:
            t.join(5)
            assert not t.is_alive(), "abort did not wake the op"
            assert isinstance(box["error"], PeerLostError), repr(box["error"])
            assert why in str(box["error"])
            assert box["at"] - start < 2.0
        expect = torch.arange(1 << 16, dtype=torch.float32)
        assert torch.equal(t0, expect) and torch.equal(t1, expect), "a failed op wrote the tensor"
        # Sticky, with the same cause, on every lane.
        for lane in comms[0].lanes:
            err = lane.errored()
            assert isinstance(err, PeerLostError) and why in str(err)
            with pytest.raises(PeerLostError, match="dropped by the master"):
                lane.all_reduce(t0)
        # A later abort does not replace the first cause.
        comms[0].abort(lost="something else")
        assert "dropped by the master" in str(comms[0].errored())
    finally:
        for c in comms:
            c.abort()
            c.close()


def test_plain_abort_still_reads_aborted():
    import torch

    from torch_pccl.errors import AbortedError

    comms = _pair()
    try:
        t, box = _blocked_all_reduce(comms[0], torch.ones(10))
        time.sleep(0.2)  # not synchronisation: only lets the op block first
        comms[0].abort()
        t.join(5)
        assert isinstance(box["error"], AbortedError), repr(box["error"])
        assert isinstance(comms[0].errored(), AbortedError)
    finally:
        for c in comms:
            c.close()


def test_abort_reason_is_bounded():
    from torch_pccl.core.native import lib
    from torch_pccl.errors import PeerLostError

    comms = _pair()
    try:
        comms[0].abort(lost="x" * 5000)
        err = comms[0].errored()
        assert isinstance(err, PeerLostError)
        assert "x" * lib.PCCL_MAX_ABORT_REASON in str(err)
        assert "x" * (lib.PCCL_MAX_ABORT_REASON + 1) not in str(err)
    finally:
        for c in comms:
            c.close()
