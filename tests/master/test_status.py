"""The status document (master/status.py) and the heartbeat report it is built from: pure,
no sockets. What the page, /api/status and /metrics show comes from here."""

import pytest

from torch_pccl.control import protocol, schemas
from torch_pccl.master.state import MembershipState
from torch_pccl.master.status import StatusLog, build


def _hello(state, conn, pid, now):
    state.receive(conn, {"type": "hello", "magic": protocol.MAGIC, "version": protocol.VERSION,
                         "peer_id": pid, "data_addr": f"10.0.0.{conn}:29500", "meta": {}}, now)


def _group(n, interval=1.0):
    state = MembershipState(world_size=n, heartbeat_interval_s=interval,
                            heartbeat_timeout_s=5 * interval)
    conns = [state.connect(0.0, f"10.0.0.{i + 1}:4000") for i in range(n)]
    for i, c in enumerate(conns):
        _hello(state, c, f"peer{i}", 0.0)
    assert state.epoch == 1
    return state, conns


def _beat(state, conn, now, **report):
    msg = protocol.Decoder(protocol.TO_MASTER).feed(
        protocol.encode({"type": "heartbeat", "report": report}))[0]
    state.receive(conn, msg, now)


def test_members_by_rank_with_reports_and_staleness():
    state, conns = _group(3)
    _beat(state, conns[0], 1.0, step=7, sent=100, received=90, op="AllReduce", ring=[0, 2, 1])
    _beat(state, conns[1], 1.0, step=7, sent=50, received=60, op="idle")
    doc = build(state.snapshot(), now=2.5, log=StatusLog(), address="127.0.0.1:29600")
    assert [p["rank"] for p in doc["peers"]] == [0, 1, 2]
    first = doc["peers"][0]
    assert (first["step"], first["bytes_sent"], first["bytes_received"], first["op"]) == \
        (7, 100, 90, "AllReduce")
    assert doc["ring_order"] == [0, 2, 1]            # rank 0's report
    # Heartbeat ages: 1.5 s for the two that beat at 1.0, 2.5 s (> 2 intervals) for rank 2.
    assert [p["heartbeat_age_s"] for p in doc["peers"]] == [1.5, 1.5, 2.5]
    assert [p["stale"] for p in doc["peers"]] == [False, False, True]
    assert doc["peers"][2]["step"] is None
    assert doc["world_size"] == 3 and doc["epoch"] == 1 and doc["bandwidth"] is None
    assert doc["counters"]["joins"] == 3


def test_bad_ring_falls_back_to_rank_order_and_bandwidth_matrix():
    state, conns = _group(2)
    _beat(state, conns[0], 1.0, ring=[0, 0], links=[0.0, 2e6])
    _beat(state, conns[1], 1.0, links=[1e6, -1])
    doc = build(state.snapshot(), now=1.0, log=StatusLog(), address="m")
    assert doc["ring_order"] == [0, 1]
    assert doc["bandwidth"]["matrix"] == [[None, 2e6], [1e6, None]]
    assert doc["bandwidth"]["peer_ids"] == ["peer0", "peer1"]


def test_drops_are_counted_by_cause_and_logged_as_events():
    state, conns = _group(3)
    log = StatusLog()
    for line in state.receive(conns[2], {"type": "leave"}, 1.0).events:
        log.event(line, wall=100.0)
    for line in state.tick(10.0).events:        # the other two are silent past 5 s
        log.event(line, wall=101.0)
    drops = state.snapshot()["counters"]["drops"]
    assert drops == {"left": 1, "heartbeat": 2}
    doc = build(state.snapshot(), now=10.0, log=log, address="m")
    assert doc["peers"] == [] and doc["world_size"] == 0
    texts = [e["text"] for e in doc["events"]]
    assert any("peer2" in t and "left" in t for t in texts), texts
    assert sum("heartbeat timeout" in t for t in texts) == 2, texts


def test_history_rate_is_bytes_per_second_between_samples():
    state, conns = _group(2)
    log = StatusLog(sample_s=2.0)
    _beat(state, conns[0], 0.0, sent=0)
    _beat(state, conns[1], 0.0, sent=0)
    log.sample(state.snapshot, wall=10.0)
    _beat(state, conns[0], 1.0, sent=3000)
    _beat(state, conns[1], 1.0, sent=1000)
    log.sample(state.snapshot, wall=11.0)      # within sample_s: skipped
    log.sample(state.snapshot, wall=12.0)
    assert [(h["world_size"], h["bytes_per_s"]) for h in log.history] == [(2, 0.0), (2, 2000.0)]


@pytest.mark.parametrize("report,why", [
    ({"op": "x\x1b[31m"}, "control characters"),
    ({"op": "y" * 65}, "longer than"),
    ({"step": -2}, "outside"),
    ({"sent": True}, "integer"),
    ({"links": [float("inf")]}, "rate"),
    ({"ring": list(range(schemas.MAX_REPORT_RANKS + 1))}, "entries"),
    ("step 3", "object"),
])
def test_hostile_reports_are_refused(report, why):
    with pytest.raises(protocol.ProtocolError, match=why):
        schemas.validate({"type": "heartbeat", "report": report})


def test_unknown_report_fields_are_dropped():
    msg = {"type": "heartbeat", "report": {"step": 1, "password": "hunter2"}}
    assert protocol.Decoder(protocol.TO_MASTER).feed(protocol.encode(msg))[0]["report"] == \
        {"step": 1}


def test_quorum_rounds_are_in_the_document_and_on_the_server_rendered_page():
    from torch_pccl.master.http import render_page

    state, conns = _group(3)
    for conn, tokens in ((conns[0], 10), (conns[2], 30)):
        state.receive(conn, schemas.validate(
            {"type": "ready", "epoch": 1, "round": 4, "tokens": tokens, "min_peers": 2,
             "grace_s": 0.0}, protocol.TO_MASTER), 1.0)
    state.receive(conns[1], schemas.validate(
        {"type": "ready", "epoch": 1, "round": 5, "tokens": 20, "min_peers": 3,
         "grace_s": 2.0}, protocol.TO_MASTER), 1.5)
    doc = build(state.snapshot(), now=2.0, log=StatusLog(), address="127.0.0.1:29600")
    closed = doc["quorum"]["closed"]
    assert [(r["round"], r["peer_ids"], r["tokens"], r["late"]) for r in closed] == \
        [(4, ["peer0", "peer2"], [10, 30], ["peer1"])]
    assert doc["quorum"]["open"]["ready"] == ["peer1"]
    page = render_page(doc, "n0nce")
    assert 'data-round="4"' in page and "peer0 (10), peer2 (30)" in page
    assert '<td class="late">peer1</td>' in page
    assert "round 5 open: ready peer1; waiting for peer0, peer2" in page
    # No round yet: the section is hidden.
    fresh, _ = _group(2)
    page = render_page(build(fresh.snapshot(), 0.0, StatusLog(), "a:1"), "n")
    assert '<section id="quorum-section" hidden>' in page
