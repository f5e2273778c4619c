"""The restart rules of the master (MembershipState.start / _resume / _adoptable, and the
state file of master/run_file.py): a restarted master never forms a second group beside the
run's. Pure: the clock is a number moved by hand; the state file lives in tmp_path."""

import json
import os
import stat

import pytest

from test_master_state import Harness, _resume_hello
from test_master_state import _old_group as _group_of
from torch_pccl.control import protocol, schemas
from torch_pccl.master import run_file
from torch_pccl.master.state import ACCEPTED, PENDING
from torch_pccl.master.status import StatusLog, build

pytestmark = pytest.mark.timeout(30)

GRACE = 6.0


def _fresh(**kw):
    """A master that just (re)started without a record, its grace window open."""
    h = Harness(resume_grace_s=GRACE, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, **kw)
    act = h.check(h.s.start(h.now))
    assert any("resume grace window" in e for e in act.events)
    return h


def _old_group(n):
    """The assigns of a group formed by an earlier incarnation of the master (its comm_id
    drawn elsewhere: not one this incarnation will draw)."""
    return {pid: dict(a, comm_id=0x5eed0000 + a["comm_id"])
            for pid, a in _group_of(n).items()}


def _fatal(act, conn):
    errs = [m for c, m in act.sends if c == conn and m["type"] == "error"]
    assert errs and errs[-1]["fatal"], act.sends
    return errs[-1]


def test_a_master_without_a_record_holds_joiners_until_its_grace_window_ends():
    h = _fresh()
    h.now = 0.5
    act = h.hello("c")
    assert not h.assigns(act) and h.state_of("c") == PENDING
    assert any("held: resume grace window" in e for e in act.events)
    assert h.s.snapshot()["restart"]["held"] == ["c"]
    h.beat_until(GRACE - 0.1, ["c"], step=0.5)
    assert h.state_of("c") == PENDING and h.s.epoch == 0
    h.now = GRACE
    act = h.tick()
    assert h.assigns(act)["c"]["world_size"] == 1 and h.s.epoch == 1
    assert any("grace window over" in e for e in act.events)
    assert h.s.snapshot()["restart"] == {"source": None, "grace_until": None, "held": [],
                                         "resuming": [], "resumed": []}


@pytest.mark.parametrize("order", ["before", "during", "after"])
def test_a_joiner_around_the_members_re_registration_joins_their_group(order):
    """The issue's sequence, whatever the order of the joiner's hello and the members'
    re-registrations: one group, the joiner admitted at the members' next round."""
    assigns = _old_group(2)
    h = _fresh()
    steps = {"before": ["c", "p0", "p1"], "during": ["p0", "c", "p1"],
             "after": ["p0", "p1", "c"]}[order]
    for pid in steps:
        h.now += 0.2
        act = h.hello(pid) if pid == "c" else _resume_hello(h, pid, assigns[pid])
        assert not h.assigns(act), f"{pid}'s arrival formed a group"
    assert (h.s.epoch, h.s.comm_id) == (assigns["p0"]["epoch"], assigns["p0"]["comm_id"])
    assert h.state_of("c") == PENDING and h.s.snapshot()["restart"]["grace_until"] is None
    h.beat_until(GRACE + 1, ["c", "p0", "p1"])          # the window's end changes nothing
    assert h.state_of("c") == PENDING
    epoch = h.s.epoch
    count = h.send("p0", "pending", epoch=epoch, ops=1, index=0)
    assert count.to(h.conn["p0"], "pending_count")[0]["count"] == 1
    h.update("p0")
    act = h.update("p1")
    a = h.assigns(act)
    assert a["c"]["world_size"] == 3 and a["c"]["rank"] == 2 and a["c"]["joined"] == ["c"]
    assert a["p0"]["epoch"] == epoch + 1
    assert h.s.snapshot()["restart"]["resumed"] == ["p0", "p1"] or order != "after"


def test_a_master_in_a_crash_loop_never_forms_a_group_from_a_retrying_joiner():
    """Each incarnation holds the joiner; the members come back within the window every
    time and the joiner ends in their group, never in one of its own."""
    assigns = _old_group(2)
    for _ in range(5):
        h = _fresh()
        for t in (0.1, 0.4, 0.9):           # the joiner retries its hello
            h.now = t
            conn = h.conn.pop("c", None)
            if conn is not None and conn in h.s.peers:
                h.check(h.s.disconnect(conn, h.now))
            assert not h.assigns(h.hello("c"))
        h.now = 1.0
        for pid in ("p0", "p1"):
            assert not h.assigns(_resume_hello(h, pid, assigns[pid]))
        h.beat_until(GRACE + 2, ["c", "p0", "p1"])
        assert h.s.epoch == assigns["p0"]["epoch"] and h.state_of("c") == PENDING
        assert h.s.counters.joins == 0


def test_a_group_of_joiners_gives_way_to_a_resumed_group_with_more_history():
    assigns = _old_group(2)                       # revision 3 in _resume_hello
    h = _fresh()
    h.hello("c")
    h.beat_until(GRACE, ["c"])
    assert h.s.epoch == 1 and h.state_of("c") == ACCEPTED
    h.now += 1
    act = _resume_hello(h, "p0", assigns["p0"])
    err = _fatal(act, h.conn["c"])
    assert err["replaced"] and "takes precedence" in err["message"]
    assert h.conn["c"] in act.closes and h.state_of("c") == "gone"
    assert act.to(h.conn["p0"], "welcome")[0]["state"] == ACCEPTED
    assert (h.s.epoch, h.s.comm_id) == (assigns["p0"]["epoch"], assigns["p0"]["comm_id"])
    assert h.s.counters.drops == {"replaced": 1}
    assert not [m for _, m in act.sends if m["type"] == "member_lost"]
    # The evicted joiner re-joins as a new peer: pending in the resumed group.
    h.hello("c")
    _resume_hello(h, "p1", assigns["p1"])
    assert h.state_of("c") == PENDING
    h.update("p0")
    assert h.assigns(h.update("p1"))["c"]["world_size"] == 3


def test_a_group_of_joiners_keeps_the_run_against_a_resume_with_less_history():
    assigns = _old_group(2)
    h = Harness()                          # no window: "c" forms a group at once
    h.check(h.s.start(h.now))
    h.hello("c")
    for revision in (1, 2, 3, 4):
        h.send("c", "sync", epoch=h.s.epoch, revision=revision, strategy="enforce_popular",
               fresh=revision == 1, content=f"{revision:032x}")
    assert h.s.shared_revision == 4
    act = _resume_hello(h, "p0", assigns["p0"])            # revision 3 < 4
    err = _fatal(act, h.conn["p0"])
    assert err["replaced"] and "cannot resume" in err["message"]
    assert h.state_of("c") == ACCEPTED and h.s.epoch == 1


def test_a_re_registration_from_the_masters_own_history_is_refused_for_good():
    h = Harness(world_size=2)
    h.hello("a")
    first = h.assigns(h.hello("b"))
    h.update("a")
    h.update("b")                                  # epoch 2: "a"'s epoch-1 record is stale
    act = _resume_hello(h, "a", first["a"])
    err = _fatal(act, h.conn["a"])
    assert err["replaced"] and h.s.epoch == 2


def test_a_state_file_lets_a_restarted_master_know_the_run_at_once(tmp_path):
    path = str(tmp_path / "run.json")
    old = Harness(world_size=2)
    old.hello("p0")
    act = old.hello("p1")
    assert act.persist
    assigns = old.assigns(act)
    act = old.send("p0", "sync", epoch=old.s.epoch, revision=1, strategy="enforce_popular",
                   fresh=True, content="ab" * 16)
    act = old.send("p1", "sync", epoch=old.s.epoch, revision=1, strategy="enforce_popular",
                   fresh=True, content="ab" * 16)
    assert act.persist
    run_file.save(path, old.s.run_record())
    saved = run_file.load(path)
    assert saved == {"epoch": 1, "comm_id": assigns["p0"]["comm_id"],
                     "peer_ids": ["p0", "p1"], "addrs": assigns["p0"]["addrs"],
                     "revision": 1, "content": "ab" * 16}

    h = Harness(resume_grace_s=GRACE, heartbeat_timeout_s=5.0)
    act = h.check(h.s.start(h.now, saved))
    assert act.persist and any("from the state file" in e for e in act.events)
    restart = h.s.snapshot()["restart"]
    assert restart["source"] == "state file" and restart["grace_until"] is None
    assert restart["resuming"] == ["p0", "p1"]
    act = h.hello("c")                     # no window: a pending peer of the run's group
    assert "held" not in " ".join(act.events) and h.state_of("c") == PENDING
    _resume_hello(h, "p0", assigns["p0"], revision=1)
    _resume_hello(h, "p1", assigns["p1"], revision=1)
    h.update("p0")
    a = h.assigns(h.update("p1"))
    assert a["c"]["world_size"] == 3 and a["c"]["epoch"] == 2
    assert h.s.snapshot()["shared_state"] == {"revision": 1, "content": "ab" * 16}


def test_without_its_members_the_state_files_group_ends_at_the_heartbeat_timeout():
    assigns = _old_group(2)
    record = {"epoch": assigns["p0"]["epoch"], "comm_id": assigns["p0"]["comm_id"],
              "peer_ids": ["p0", "p1"], "addrs": assigns["p0"]["addrs"], "revision": 2,
              "content": ""}
    h = Harness(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    h.check(h.s.start(h.now, record))
    h.hello("c")
    h.beat_until(4.0, ["c"])
    assert h.state_of("c") == PENDING
    acts = h.beat_until(6.0, ["c"])
    a = [h.assigns(act) for act in acts if h.assigns(act)]
    assert a and a[-1]["c"]["world_size"] == 1


@pytest.mark.parametrize("delta", [1, -1])
def test_a_state_file_an_epoch_off_is_corrected_by_the_first_member_back(delta):
    """The master may die between writing the file and sending the assigns (file ahead),
    or after a sync's assigns and before the write: the members are the truth."""
    assigns = _old_group(2)
    record = {"epoch": assigns["p0"]["epoch"] + delta, "comm_id": 0xdead,
              "peer_ids": ["p0", "p1"], "addrs": assigns["p0"]["addrs"], "revision": 1,
              "content": ""}
    h = Harness()
    h.check(h.s.start(h.now, record))
    act = _resume_hello(h, "p0", assigns["p0"])
    assert act.to(h.conn["p0"], "welcome")[0]["state"] == ACCEPTED
    assert h.s.epoch == assigns["p0"]["epoch"] and h.s.comm_id == assigns["p0"]["comm_id"]
    assert [p["state"] for p in h.s.snapshot()["peers"]] == [ACCEPTED, "resuming"]
    assert not [m for _, m in act.sends if m["type"] == "error"]


def test_a_refused_re_registration_and_an_eviction_are_marked_replaced_on_the_wire():
    msg = schemas.validate({"type": "error", "fatal": True, "replaced": True,
                             "message": "x"}, protocol.TO_PEER)
    assert msg["replaced"] is True
    assert schemas.validate({"type": "error", "fatal": True, "message": "x"},
                             protocol.TO_PEER)["replaced"] is False


def test_the_status_document_shows_the_window_the_held_joiners_and_the_resumed_members():
    assigns = _old_group(2)
    h = _fresh()
    h.now = 1.0
    h.hello("c")
    doc = build(h.s.snapshot(), h.now, StatusLog(), "127.0.0.1:1")
    assert doc["restart"]["grace_left_s"] == GRACE - 1.0 and doc["restart"]["held"] == ["c"]
    assert "grace window: 5 s left; holding 1 joiner" in doc["restart"]["summary"]
    _resume_hello(h, "p1", assigns["p1"])
    doc = build(h.s.snapshot(), h.now, StatusLog(), "127.0.0.1:1")
    assert doc["restart"]["grace_left_s"] is None and doc["restart"]["held"] == []
    assert doc["restart"]["resuming"] == ["p0"] and doc["restart"]["resumed"] == ["p1"]
    assert doc["restart"]["summary"] == ("run taken back from the re-registration: 1 "
                                         "member(s) re-registered, 1 not yet")


# -- the state file itself ----------------------------------------------------------------

RECORD = {"epoch": 4, "comm_id": 2**64 - 1, "peer_ids": ["a", "b"],
          "addrs": ["10.0.0.1:1", "[::1]:2"], "revision": 7, "content": "0f" * 16}


def test_the_state_file_is_written_atomically_and_readable_by_its_owner_only(tmp_path):
    path = str(tmp_path / "run.json")
    assert run_file.load(path) is None                 # no file: a new run
    run_file.save(path, RECORD)
    run_file.save(path, dict(RECORD, epoch=5))
    assert run_file.load(path) == dict(RECORD, epoch=5)
    assert os.listdir(tmp_path) == ["run.json"]        # no temporary file left
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("content, why", [
    (b"x" * (run_file.MAX_BYTES + 1), "larger than"),
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (json.dumps({**RECORD, "format": "other", "version": 1}).encode(), "not a pccl-master"),
    (json.dumps({**RECORD, "format": "pccl-master-state", "version": 2}).encode(), "version"),
    (json.dumps({**RECORD, "format": "pccl-master-state", "version": 1,
                 "content": "XY"}).encode(), "content"),
    (json.dumps({**RECORD, "format": "pccl-master-state", "version": 1,
                 "epoch": 0}).encode(), "epoch"),
    (json.dumps({**RECORD, "format": "pccl-master-state", "version": 1,
                 "addrs": ["10.0.0.1:1"]}).encode(), "disagree"),
    (json.dumps({k: v for k, v in RECORD.items() if k != "comm_id"}
                | {"format": "pccl-master-state", "version": 1}).encode(), "comm_id"),
    (b"[]", "not a pccl-master"),
])
def test_a_damaged_state_file_is_refused_with_the_reason(tmp_path, content, why):
    path = tmp_path / "run.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why):
        run_file.load(str(path))
