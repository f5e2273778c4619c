"""MasterClient outliving its master (elastic/master_client.py): a member reconnects with
backoff and re-registers; a request made while the master is away is sent again on the new
connection; a refused re-registration or a master that never comes back ends in a sticky
PeerLostError. Masters run in threads of this process; every wait is bounded."""

import threading

import pytest

from torch_pccl.elastic.master_client import MasterClient
from torch_pccl.errors import PeerLostError
from torch_pccl.master.server import start_in_thread

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, handshake_timeout_s=2.0,
            secret=b"")


def _member(master, peer_id="a"):
    """A client admitted alone (epoch 1) that re-registers with what it was assigned."""
    c = MasterClient(master.address, "127.0.0.1:40000", peer_id=peer_id, timeout_s=WAIT_S,
                     secret=b"")
    a = c.wait_assignment(WAIT_S)
    c.set_resume_source(lambda: {"epoch": a.epoch, "comm_id": a.comm_id, "rank": a.rank,
                                 "peer_ids": list(a.peer_ids), "addrs": list(a.addrs),
                                 "revision": -1, "last_key": [-1, -1]})
    return c, a


def _wait_for(predicate, what):
    cond = threading.Event()
    for _ in range(int(WAIT_S / 0.05)):
        if predicate():
            return
        cond.wait(0.05)         # a poll period, not a guess at how long anything takes
    raise AssertionError(f"no {what} within {WAIT_S} s")


def test_a_request_made_while_the_master_is_away_is_answered_by_the_next_one():
    first = start_in_thread("127.0.0.1", 0, world_size=0, **FAST)
    port = first.port
    c, a = _member(first)
    second = None
    try:
        first.stop()
        _wait_for(lambda: c.away, "notice of the lost master")
        answer = {}
        asking = threading.Thread(target=lambda: answer.update(
            count=c.pending_count(WAIT_S, key=(a.epoch, 1, 0))))
        asking.start()                      # waits for the reconnect
        second = start_in_thread("127.0.0.1", port, world_size=0, **FAST)
        asking.join(WAIT_S)
        assert answer == {"count": 0} and not c.away and c.failure is None
        snap = second.snapshot()
        assert (snap["epoch"], snap["comm_id"]) == (a.epoch, a.comm_id)
        assert [(p["peer_id"], p["state"]) for p in snap["peers"]] == [("a", "accepted")]
        # And it is a member there: its update round completes (alone) into epoch 2.
        assert c.request_update(a.epoch, WAIT_S).epoch == a.epoch + 1
    finally:
        c.close()
        if second is not None:
            second.stop()


def test_a_refused_re_registration_is_sticky():
    first = start_in_thread("127.0.0.1", 0, world_size=0, **FAST)
    port = first.port
    c, _ = _member(first)
    other = None
    try:
        first.stop()
        _wait_for(lambda: c.away, "notice of the lost master")
        # Another run's master on that address: it has a group of its own at epoch 1
        # with another comm_id, so the re-registration does not match it.
        other = start_in_thread("127.0.0.1", port, world_size=0, **FAST)
        stranger = MasterClient(other.address, "127.0.0.1:40001", peer_id="b",
                                timeout_s=WAIT_S, secret=b"")
        stranger.wait_assignment(WAIT_S)
        _wait_for(lambda: c.failure is not None, "the refusal")
        with pytest.raises(PeerLostError, match="refused this peer's re-registration"):
            c.pending_count(WAIT_S)
        stranger.close()
    finally:
        c.close()
        if other is not None:
            other.stop()


def test_a_master_that_never_comes_back_ends_in_peer_lost(monkeypatch):
    monkeypatch.setenv("PCCL_MASTER_RECONNECT", "1")
    master = start_in_thread("127.0.0.1", 0, world_size=0, **FAST)
    c, a = _member(master)
    try:
        master.stop()
        with pytest.raises(PeerLostError, match="no master answered there within 1 s"):
            c.request_update(a.epoch, WAIT_S)
    finally:
        c.close()
