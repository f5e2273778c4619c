"""The master's quorum rounds (torch_pccl/master/quorum.py) on the state machine alone.

The clock is a number moved by hand (tests/master/test_master_state.py's ``Harness``):
all members ready; a quorum, then the grace window; a member lost while the others wait;
a joiner arriving mid-round; a late ``ready``; members out of step.
"""

import pytest

from test_master_state import Harness

pytestmark = pytest.mark.timeout(30)


def formed(*pids, world_size=None):
    h = Harness(world_size=world_size or len(pids))
    h.group(*pids)
    assert h.s.epoch == 1
    return h


def ready(h, pid, round_=0, tokens=100, stale=0, min_peers=2, grace_s=5.0):
    return h.send(pid, "ready", epoch=h.s.epoch, round=round_, tokens=tokens, stale=stale,
                  min_peers=min_peers, grace_s=grace_s, id=7)


def announced(h, act):
    """peer_id -> quorum announcement in ``act``."""
    by_conn = {c: pid for pid, c in h.conn.items()}
    return {by_conn[c]: m for c, m in act.sends if m["type"] == "quorum"}


def test_the_round_closes_when_every_member_is_ready():
    h = formed("a", "b", "c")
    assert announced(h, ready(h, "a", tokens=10)) == {}
    assert announced(h, ready(h, "c", tokens=30, stale=2)) == {}   # quorum: grace runs
    got = announced(h, ready(h, "b", tokens=20))
    assert sorted(got) == ["a", "b", "c"]
    for m in got.values():
        assert m["round"] == 0 and m["pending"] == 0
        assert m["peer_ids"] == ["a", "b", "c"] and m["tokens"] == [10, 20, 30]
        assert m["stale"] == [0, 0, 2]
        assert m["id"] == 7                # each answers its member's request
    assert h.s.quorum.open is None
    assert h.s.snapshot()["quorum"]["closed"][-1]["late"] == []


def test_a_quorum_closes_after_the_grace_window_and_tells_the_late_member():
    h = formed("a", "b", "c")
    ready(h, "a", min_peers=2, grace_s=5.0)
    h.now = 1.0
    ready(h, "b")                            # the quorum, at t = 1: grace until 6
    snap = h.s.snapshot()["quorum"]["open"]
    assert snap["ready"] == ["a", "b"] and snap["waiting"] == ["c"]
    h.now = 5.9
    assert announced(h, h.tick()) == {}
    h.now = 6.0
    got = announced(h, h.tick())
    assert sorted(got) == ["a", "b", "c"]    # c too: it joins the exchange with zeros
    assert got["c"]["peer_ids"] == ["a", "b"]
    assert "id" not in got["c"] and got["a"]["id"] == 7
    assert h.s.snapshot()["quorum"]["closed"][-1]["late"] == ["c"]
    # c comes after the close: it gets the same announcement (it is not a participant),
    # and its next round is round 1.
    late = announced(h, ready(h, "c"))
    assert late["c"]["peer_ids"] == ["a", "b"] and late["c"]["round"] == 0
    assert h.s.quorum.open is None
    got = announced(h, ready(h, "c", round_=1, stale=1))
    assert got == {} and h.s.quorum.open.number == 1


def test_grace_zero_closes_at_the_quorum():
    h = formed("a", "b", "c")
    ready(h, "a", grace_s=0.0)
    assert sorted(announced(h, ready(h, "b", grace_s=0.0))) == ["a", "b", "c"]


def test_a_member_lost_while_the_others_wait_closes_the_round_without_it():
    h = formed("a", "b", "c")
    ready(h, "a", min_peers=3)
    ready(h, "b", min_peers=3)
    # c dies: the others' round closes at once (every live member is ready).
    act = h.s.disconnect(h.conn["c"], h.now)
    got = announced(h, h.check(act))
    assert sorted(got) == ["a", "b"] and got["a"]["peer_ids"] == ["a", "b"]
    assert any(m["type"] == "member_lost" for _, m in act.sends)


def test_a_ready_member_lost_no_longer_counts_for_the_quorum():
    h = formed("a", "b", "c")
    ready(h, "a", min_peers=2, grace_s=5.0)
    ready(h, "b")                            # quorum at t = 0
    h.check(h.s.disconnect(h.conn["b"], h.now))
    assert h.s.quorum.open.quorum_at is None   # one ready of two live: no quorum now
    h.now = 8.0
    assert announced(h, h.tick()) == {}
    got = announced(h, ready(h, "c"))          # everyone live is ready
    assert got["a"]["peer_ids"] == ["a", "c"]


def test_a_joiner_arriving_mid_round_is_not_waited_for():
    h = formed("a", "b")
    ready(h, "a", min_peers=2)
    h.hello("d")                              # pending: not a member of the round
    got = announced(h, ready(h, "b", min_peers=2))
    assert sorted(got) == ["a", "b"] and got["a"]["peer_ids"] == ["a", "b"]
    assert h.state_of("d") == "pending"
    # The announcement tells every member that a peer waits: their boundary admits it.
    assert got["a"]["pending"] == got["b"]["pending"] == 1


def test_a_world_smaller_than_min_peers_waits_for_everyone():
    h = formed("a", "b")
    ready(h, "a", min_peers=4, grace_s=0.0)
    for _ in h.beat_until(30.0, ["a", "b"]):
        assert h.s.quorum.open is not None
    assert h.s.quorum.open.quorum_at is None
    assert sorted(announced(h, ready(h, "b", min_peers=4, grace_s=0.0))) == ["a", "b"]


def test_members_out_of_step_are_refused():
    h = formed("a", "b", "c")
    ready(h, "a", round_=3)
    act = ready(h, "b", round_=4)
    errs = [m for _, m in act.sends if m["type"] == "error"]
    assert errs and not errs[0]["fatal"] and "round 3 is open" in errs[0]["message"]
    act = h.send("b", "ready", epoch=h.s.epoch + 1, round=3, tokens=1, min_peers=2,
                 grace_s=0.0)
    assert [m for _, m in act.sends if m["type"] == "error"]
    # Older than the newest closed round (and no longer kept): refused.
    ready(h, "b", round_=3, grace_s=0.0)       # closes round 3
    act = ready(h, "c", round_=2)
    assert [m for _, m in act.sends if m["type"] == "error"]


def test_a_hostile_ready_is_rejected_by_the_schema():
    from torch_pccl.control import protocol, schemas
    for bad in ({"tokens": -1}, {"min_peers": 0}, {"grace_s": -1.0},
                {"grace_s": float("inf")}, {"round": "x"}):
        msg = dict({"type": "ready", "epoch": 1, "round": 0, "tokens": 1, "min_peers": 1,
                    "grace_s": 0.0}, **bad)
        with pytest.raises(protocol.ProtocolError):
            schemas.validate(msg, protocol.TO_MASTER)
