"""Quiet epochs on the master (torch_pccl/master/quiet.py, state.py; issue 40).

A sync round every member votes in, electing with nobody pending, grants the epoch quiet (its
``sync_result`` says so): its members answer their pending queries alone, so a DiLoCo boundary
sends the master nothing. A pending peer ends the grant
with a ``wake``; every key a member answered alone must answer 0 for every member, and every
later key the count, whatever order the ``awake`` answers and the queries arrive in. Pure: the
members here are messages a test sends by hand.
"""

import pytest

from test_master_state import Harness

pytestmark = pytest.mark.timeout(30)


DIGEST = "a" * 32


def sync(h, pids):
    """Every member of ``pids`` votes the same state; the common sync_result."""
    for pid in pids:
        act = h.send(pid, "sync", epoch=h.s.epoch, revision=1, strategy="enforce_popular",
                     fresh=False, content=DIGEST)
    results = [m for _, m in act.sends if m["type"] == "sync_result"]
    assert len(results) == len(pids)
    return results[0]


def quiet_group(*pids):
    h = Harness(world_size=len(pids), quiet_epochs=True)
    act = h.group(*pids)
    assert not any(m.get("quiet") for m in h.assigns(act).values())   # not before a sync
    assert sync(h, pids)["quiet"]
    return h


def wakes(h, act):
    by_conn = {c: pid for pid, c in h.conn.items()}
    return sorted(by_conn[c] for c, m in act.sends if m["type"] == "wake")


def ask(h, pid, ops, index):
    """The replies to ``pid``'s keyed query (none while it is held)."""
    act = h.send(pid, "pending", epoch=h.s.epoch, ops=ops, index=index)
    return [m for _, m in act.sends]


def test_a_master_grants_no_quiet_epoch_unless_started_with_quiet_epochs():
    # Off by default (quiet.py's known gap): members then ask at every boundary.
    h = Harness(world_size=2)
    h.group("a", "b")
    assert "quiet" not in sync(h, ["a", "b"])
    assert ask(h, "a", 1, 0) == [{"type": "pending_count", "count": 0}]


def test_a_sync_with_a_peer_pending_or_a_member_missing_grants_nothing():
    h = Harness(world_size=2, quiet_epochs=True)
    h.group("a", "b")
    h.hello("c")                                 # pending: the sync does not grant
    assert "quiet" not in sync(h, ["a", "b"])
    assert wakes(h, h.hello("d")) == []          # nothing to wake
    h.update("a")
    h.update("b")                                # c and d admitted: nobody pending
    assert sync(h, ["a", "b", "c", "d"])["quiet"]
    # A round completed by a member's departure grants nothing either.
    for pid in ("a", "b", "c"):
        h.send(pid, "sync", epoch=h.s.epoch, revision=2, strategy="enforce_popular",
               fresh=False, content=DIGEST)
    act = h.send("d", "leave")
    results = [m for _, m in act.sends if m["type"] == "sync_result"]
    assert results and "quiet" not in results[0]


def test_a_pending_peer_wakes_every_member_once():
    h = quiet_group("a", "b", "c")
    assert wakes(h, h.hello("x")) == ["a", "b", "c"]
    assert wakes(h, h.hello("y")) == []          # already woken


def test_an_update_round_opened_in_a_quiet_epoch_is_announced_to_every_member():
    # Members past a boundary passed quiet train on: the wake's `update` makes them join
    # the round at their next inner step, even when a pending peer woke the epoch already.
    h = quiet_group("a", "b", "c")
    assert wakes(h, h.hello("x")) == ["a", "b", "c"]
    act = h.send("a", "update", epoch=h.s.epoch, admit=False, done=2)
    assert wakes(h, act) == ["a", "b", "c"]
    assert all(m["update"] for _, m in act.sends if m["type"] == "wake")
    # Not in an epoch that was never granted quiet: its members meet at every boundary.
    h = Harness(world_size=2, quiet_epochs=True)
    h.group("a", "b")
    assert wakes(h, h.send("a", "update", epoch=h.s.epoch, admit=False, done=0)) == []


def test_a_query_waits_for_every_awake_and_keys_answered_alone_stay_zero():
    h = quiet_group("a", "b")
    h.hello("x")
    # a is awake and asks the key b is about to answer alone: it must wait for b.
    h.send("a", "awake", epoch=1, ops=-1, index=-1)
    assert ask(h, "a", 5, 0) == []
    # b had answered (5, 0) alone before the wake reached it.
    act = h.send("b", "awake", epoch=1, ops=5, index=0)
    [reply] = [m for _, m in act.sends]
    assert reply["type"] == "pending_count" and reply["count"] == 0 and reply["quiet"]
    # The next key sees the pending peer, for both.
    assert ask(h, "b", 6, 0)[0]["count"] == 1
    assert ask(h, "a", 6, 0)[0]["count"] == 1


def test_a_key_after_the_last_answered_alone_sees_the_pending_peer():
    h = quiet_group("a", "b")
    h.hello("x")
    h.send("b", "awake", epoch=1, ops=4, index=0)
    assert ask(h, "a", 5, 0) == []               # a still owes its awake: held
    act = h.send("a", "awake", epoch=1, ops=4, index=0)
    [reply] = [m for _, m in act.sends]
    assert reply["count"] == 1 and "quiet" not in reply
    assert ask(h, "a", 4, 0)[0]["count"] == 0    # answered alone by both: quiet


def test_a_member_lost_while_waking_owes_no_awake():
    h = quiet_group("a", "b", "c")
    h.hello("x")
    h.send("a", "awake", epoch=1, ops=-1, index=-1)
    assert ask(h, "a", 3, 0) == []
    h.send("b", "awake", epoch=1, ops=-1, index=-1)
    act = h.send("c", "leave")                   # c never answers the wake
    replies = [m for c, m in act.sends if c == h.conn["a"] and m["type"] == "pending_count"]
    assert replies and replies[0]["count"] == 1


def test_a_query_held_when_a_new_epoch_forms_is_refused_as_stale():
    h = quiet_group("a", "b")
    h.hello("x")
    h.send("a", "awake", epoch=1, ops=-1, index=-1)
    assert ask(h, "a", 3, 0) == []
    h.update("a")
    act = h.update("b")                          # b never answered: the round forms anyway
    errors = [m for c, m in act.sends if c == h.conn["a"] and m["type"] == "error"]
    assert errors and not errors[0]["fatal"]


def test_an_awake_for_another_epoch_is_ignored():
    h = quiet_group("a", "b")
    h.hello("x")
    h.send("a", "awake", epoch=7, ops=9, index=9)    # not this epoch's: still owed
    h.send("b", "awake", epoch=1, ops=-1, index=-1)
    assert ask(h, "b", 2, 0) == []


def test_members_requests_are_counted_by_type_heartbeats_aside():
    h = quiet_group("a", "b")
    h.send("a", "heartbeat")
    h.send("a", "pending", epoch=1, ops=1, index=0)
    h.send("b", "pending", epoch=1, ops=1, index=0)
    assert h.s.counters.requests == {"sync": 2, "pending": 2}


def test_a_member_that_asks_before_any_wake_gets_what_the_others_answer_alone():
    # b re-registered on a new link (its grant holds only on the old one) and asks; a still
    # answers alone. Both must agree on every key, before and after a joiner arrives.
    h = quiet_group("a", "b")
    [reply] = ask(h, "b", 3, 0)
    assert reply["count"] == 0 and reply["quiet"]
    h.hello("x")
    h.send("a", "awake", epoch=1, ops=2, index=0)   # a answered up to (2, 0) alone
    h.send("b", "awake", epoch=1, ops=-1, index=-1)
    assert ask(h, "a", 3, 0)[0]["count"] == 0        # b's key: its answer stands
    assert ask(h, "a", 4, 0)[0]["count"] == 1
    assert ask(h, "b", 4, 0)[0]["count"] == 1
