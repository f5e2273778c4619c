"""MasterClient outliving its master (elastic/master_client.py): a member reconnects with
backoff and re-registers; a request made while the master is away is sent again on the new
connection; a refused re-registration or a master that never comes back ends in a sticky
PeerLostError. Masters run in threads of this process; every wait is bounded."""

import logging
import threading

import pytest

from torch_pccl.elastic.master_client import MasterClient
from torch_pccl.errors import PeerLostError
from torch_pccl.master.server import start_in_thread

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
FAST = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, handshake_timeout_s=2.0,
            secret=b"")


def _member(master, peer_id="a", secret=b""):
    """A client admitted alone (epoch 1) that re-registers with what it was assigned."""
    c = MasterClient(master.address, "127.0.0.1:40000", peer_id=peer_id, timeout_s=WAIT_S,
                     secret=secret)
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


@pytest.mark.parametrize("secret", [b"", b"the run's secret, 16+ chars"], ids=["plain", "secret"])
def test_a_request_made_while_the_master_is_away_is_answered_by_the_next_one(secret):
    """With a secret, the reconnect proves it to the new master again."""
    first = start_in_thread("127.0.0.1", 0, world_size=0, **dict(FAST, secret=secret))
    port = first.port
    c, a = _member(first, secret=secret)
    second = None
    try:
        first.stop()
        _wait_for(lambda: c.away, "notice of the lost master")
        answer = {}
        asking = threading.Thread(target=lambda: answer.update(
            count=c.pending_count(WAIT_S, key=(a.epoch, 1, 0))))
        asking.start()                      # waits for the reconnect
        second = start_in_thread("127.0.0.1", port, world_size=0, **dict(FAST, secret=secret))
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


def test_a_late_answer_to_an_earlier_request_is_never_taken_for_a_newer_one():
    """A hand-driven master answers each pending query twice: first with the id of the
    query before it (what a late answer looks like), then with the right one."""
    from torch_pccl.control import protocol
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    answered = []

    def fake_master():
        conn, _ = server.accept()
        conn.settimeout(WAIT_S)
        decoder = protocol.Decoder(protocol.TO_MASTER)
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                for msg in decoder.feed(data):
                    if msg["type"] == "hello":
                        conn.sendall(protocol.encode({
                            "type": "welcome", "peer_id": msg["peer_id"], "state": "pending",
                            "epoch": 0, "heartbeat_interval_s": 5.0}))
                    elif msg["type"] == "pending":
                        rid = msg["id"]
                        answered.append(rid)
                        conn.sendall(protocol.encode({"type": "pending_count", "count": 99,
                                                      "id": rid - 1}) +
                                     protocol.encode({"type": "pending_count",
                                                      "count": rid, "id": rid}))

    thread = threading.Thread(target=fake_master, daemon=True)
    thread.start()
    c = MasterClient(f"127.0.0.1:{port}", "127.0.0.1:40000", peer_id="a", timeout_s=WAIT_S,
                     secret=b"")
    try:
        counts = [c.pending_count(WAIT_S) for _ in range(3)]
        assert counts == answered and 99 not in counts and len(set(counts)) == 3
    finally:
        c.close()
        server.close()
        thread.join(WAIT_S)


def test_a_master_that_stops_cleanly_is_waited_for_without_a_warning(caplog, monkeypatch):
    """The end of a torchrun job (rank 0 stops its master while the others finish) and an
    operator's quick restart print nothing above INFO; a master that stays away is warned
    about after config.STOPPED_MASTER_QUIET_S."""
    from torch_pccl import config

    monkeypatch.setattr(config, "STOPPED_MASTER_QUIET_S", 1.0)
    caplog.set_level(logging.DEBUG, logger="torch_pccl")
    first = start_in_thread("127.0.0.1", 0, world_size=0, **FAST)
    port = first.port
    c, a = _member(first)
    second = None
    try:
        first.stop()                        # says "stopping" before it closes
        _wait_for(lambda: c.away, "notice of the lost master")
        second = start_in_thread("127.0.0.1", port, world_size=0, **FAST)
        _wait_for(lambda: not c.away, "the re-registration")
        noisy = [r for r in caplog.records
                 if r.name == "torch_pccl" and r.levelno >= logging.WARNING]
        assert not noisy, [r.getMessage() for r in noisy]
        assert any("re-registered" in r.getMessage() and r.levelno == logging.INFO
                   for r in caplog.records)
        second.stop()
        _wait_for(lambda: any("is not back" in r.getMessage() and r.levelno == logging.WARNING
                              for r in caplog.records), "the warning of a master that stays away")
    finally:
        c.close()
        if second is not None:
            second.stop()


def test_a_ready_sent_ahead_to_a_master_that_died_is_sent_again_to_the_next_one():
    """``send_ready`` while the master is away is dropped, and the wait for that round
    sends it again once the member re-registered: a member alone closes its round."""
    first = start_in_thread("127.0.0.1", 0, world_size=0, **FAST)
    port = first.port
    c, a = _member(first)
    second = None
    try:
        first.stop()
        _wait_for(lambda: c.away, "notice of the lost master")
        c.send_ready(a.epoch, 3, 12, 0, 1, 0.0)     # dropped: nobody to send it to
        answer = {}
        waiting = threading.Thread(target=lambda: answer.update(
            msg=c.request_quorum(a.epoch, 3, 12, 0, 1, 0.0, WAIT_S)))
        waiting.start()
        second = start_in_thread("127.0.0.1", port, world_size=0, **FAST)
        waiting.join(WAIT_S)
        msg = answer.get("msg")
        assert msg is not None and (msg["round"], msg["peer_ids"], msg["tokens"]) == \
            (3, ["a"], [12]), answer
        assert second.snapshot()["quorum"]["closed"][-1]["round"] == 3
    finally:
        c.close()
        if second is not None:
            second.stop()
