"""The master's membership state machine (torch_pccl/master/state.py).

Pure: the clock is a number these tests move by hand, so every deadline is
exercised exactly, without sockets or sleeps.
"""

import itertools
import json

import pytest

from torch_pccl.control import protocol, schemas
from torch_pccl.master.state import ACCEPTED, PENDING, MembershipState

pytestmark = pytest.mark.timeout(30)


class Harness:
    """A MembershipState, a hand-driven clock and peers by name."""

    def __init__(self, **kwargs):
        ids = itertools.count(0x1000)
        self.s = MembershipState(new_comm_id=lambda: next(ids), **kwargs)
        self.now = 0.0
        self.conn = {}      # peer_id -> conn
        self.port = itertools.count(41000)

    def check(self, act):
        # Everything the machine sends must pass the wire schema.
        for _, msg in act.sends:
            protocol.encode(msg)
        return act

    def hello(self, pid, **extra):
        c = self.s.connect(self.now, f"10.0.0.9:{next(self.port)}")
        self.conn[pid] = c
        msg = {"type": "hello", "magic": protocol.MAGIC, "version": 1, "peer_id": pid,
               "data_addr": f"10.0.0.{len(self.conn)}:{next(self.port)}", "meta": {}}
        msg.update(extra)
        return self.check(self.s.receive(c, msg, self.now))

    def send(self, pid, kind, **fields):
        # The server hands the machine validated messages only (defaults filled in).
        msg = schemas.validate(dict(fields, type=kind), protocol.TO_MASTER)
        return self.check(self.s.receive(self.conn[pid], msg, self.now))

    def update(self, pid):
        return self.send(pid, "update", epoch=self.s.epoch)

    def tick(self):
        return self.check(self.s.tick(self.now))

    def beat_until(self, t, alive, step=1.0):
        """Moves the clock to t; the peers in `alive` heartbeat every `step` s."""
        acts = []
        while self.now < t:
            self.now = min(t, self.now + step)
            for pid in alive:
                if self.conn[pid] in self.s.peers:
                    self.send(pid, "heartbeat")
            acts.append(self.tick())
        return acts

    def assigns(self, act):
        """peer_id -> assign message in `act`."""
        by_conn = {c: pid for pid, c in self.conn.items()}
        return {by_conn[c]: m for c, m in act.sends if m["type"] == "assign"}

    def state_of(self, pid):
        p = self.s.peers.get(self.conn[pid])
        return p.state if p else "gone"

    def group(self, *pids):
        """Says hello for each of `pids`; returns the last step's actions."""
        for pid in pids:
            act = self.hello(pid)
        return act


def assert_group(h, act, order, joined=(), left=()):
    a = h.assigns(act)
    assert sorted(a) == sorted(order)
    epoch = h.s.epoch
    comm_ids = {m["comm_id"] for m in a.values()}
    assert len(comm_ids) == 1
    for rank, pid in enumerate(order):
        m = a[pid]
        assert m["rank"] == rank
        assert m["epoch"] == epoch
        assert m["world_size"] == len(order)
        assert m["peer_ids"] == list(order)
        assert m["addrs"] == [h.s.peers[h.conn[p]].data_addr for p in order]
        assert m["joined"] == list(joined)
        assert m["left"] == list(left)
        assert h.state_of(pid) == ACCEPTED


def test_bootstrap_without_world_size_forms_a_group_of_one_at_once():
    h = Harness()
    act = h.hello("a")
    [welcome] = act.to(h.conn["a"], "welcome")
    assert welcome == {"type": "welcome", "peer_id": "a", "state": "accepted", "epoch": 1,
                       "heartbeat_interval_s": 1.0}
    # welcome comes before the assign
    assert [m["type"] for _, m in act.sends] == ["welcome", "assign"]
    assert_group(h, act, ["a"], joined=["a"])
    assert h.s.epoch == 1

    act = h.hello("b")
    assert [m for _, m in act.sends] == [{"type": "welcome", "peer_id": "b", "state": "pending",
                                          "epoch": 1, "heartbeat_interval_s": 1.0}]
    assert h.state_of("b") == PENDING


def test_bootstrap_with_world_size_admits_all_at_once():
    h = Harness(world_size=3)
    for pid in ("a", "b"):
        act = h.hello(pid)
        assert h.assigns(act) == {}
        assert act.to(h.conn[pid], "welcome")[0]["state"] == "pending"
        assert h.s.epoch == 0
    act = h.hello("c")
    assert_group(h, act, ["a", "b", "c"], joined=["a", "b", "c"])
    assert h.s.epoch == 1
    assert act.to(h.conn["c"], "welcome")[0]["state"] == "accepted"


def test_bootstrap_orders_a_fixed_world_by_rank_hints():
    """torchrun's ranks survive: peers that arrive out of order but give a rank hint
    get exactly that rank; peers without a hint follow in arrival order."""
    h = Harness(world_size=4)
    h.hello("r2", meta={"rank": 2})
    h.hello("anon")
    h.hello("r0", meta={"rank": 0})
    act = h.hello("r1", meta={"rank": 1})
    assert_group(h, act, ["r0", "r1", "r2", "anon"], joined=["r0", "r1", "r2", "anon"])


def test_pending_peer_leaving_before_bootstrap_is_not_counted():
    h = Harness(world_size=2)
    h.hello("a")
    act = h.send("a", "leave")
    assert act.closes == [h.conn["a"]]
    assert h.assigns(h.hello("b")) == {}
    assert_group(h, h.hello("c"), ["b", "c"], joined=["b", "c"])


def test_third_and_fourth_peer_admitted_only_at_an_update_round():
    h = Harness(world_size=2)
    h.group("a", "b")
    assert h.assigns(h.hello("c")) == {}
    assert h.assigns(h.hello("d")) == {}
    assert h.state_of("c") == h.state_of("d") == PENDING
    act = h.send("a", "pending")
    assert act.sends == [(h.conn["a"], {"type": "pending_count", "count": 2})]
    # Heartbeats and queries do not admit anyone.
    h.beat_until(3.0, ["a", "b", "c", "d"])
    assert h.s.epoch == 1 and h.state_of("c") == PENDING
    # The round is a collective: the first member's update gets no reply.
    assert h.update("a").sends == []
    assert h.s.round is not None
    act = h.update("b")
    assert_group(h, act, ["a", "b", "c", "d"], joined=["c", "d"])
    assert h.s.epoch == 2 and h.s.round is None
    assert h.send("d", "pending").sends[0][1]["count"] == 0


def test_round_without_changes_still_completes_with_a_new_epoch_and_comm_id():
    h = Harness(world_size=2)
    first = h.assigns(h.group("a", "b"))["a"]["comm_id"]
    h.update("b")
    h.update("b")     # a repeated update is harmless
    act = h.update("a")
    assert_group(h, act, ["a", "b"])
    assert h.assigns(act)["a"]["comm_id"] != first


def test_member_that_never_sends_update_is_dropped_at_the_deadline():
    h = Harness(world_size=3, round_timeout_s=30.0)
    h.group("a", "b", "c")
    h.beat_until(10.0, ["a", "b", "c"])
    h.update("a")
    h.update("c")
    # b keeps heartbeating (alive, but stuck outside the round): only the
    # round deadline can catch it.
    acts = h.beat_until(39.5, ["a", "b", "c"], step=0.5)
    assert all(not a.sends for a in acts), "nothing before the deadline"
    h.now = 40.0
    act = h.tick()
    assert act.to(h.conn["b"], "error")[0]["fatal"] is True
    assert "round timeout" in act.to(h.conn["b"], "error")[0]["message"]
    assert h.conn["b"] in act.closes
    assert_group(h, act, ["a", "c"], left=["b"])
    assert h.state_of("b") == "gone"


def test_heartbeat_timeout_drops_a_silent_peer():
    h = Harness(world_size=2, heartbeat_timeout_s=5.0)
    h.group("a", "b")
    h.hello("p")            # a pending peer that goes silent too
    h.beat_until(5.0, ["a"])
    assert h.state_of("b") == ACCEPTED and h.state_of("p") == PENDING  # exactly 5 s: kept
    h.now = 5.01
    h.send("a", "heartbeat")
    act = h.tick()
    for pid in ("b", "p"):
        [err] = act.to(h.conn[pid], "error")
        assert err["fatal"] and "heartbeat timeout" in err["message"]
        assert h.conn[pid] in act.closes
        assert h.state_of(pid) == "gone"
    assert h.state_of("a") == ACCEPTED
    # No round was running, so nobody gets an assign until the survivors update.
    assert h.assigns(act) == {}
    assert_group(h, h.update("a"), ["a"], left=["b"])


@pytest.mark.parametrize("how", ["heartbeat", "disconnect", "round"])
def test_every_live_member_is_told_at_once_when_a_member_is_dropped(how):
    h = Harness(world_size=3, heartbeat_timeout_s=5.0, round_timeout_s=8.0)
    h.group("a", "b", "c")
    h.hello("p")                      # pending: not a member, told nothing
    if how == "heartbeat":
        h.beat_until(5.0, ["a", "c", "p"])
        h.now = 5.01
        act = h.tick()
        cause = "heartbeat timeout"
    elif how == "disconnect":
        act = h.check(h.s.disconnect(h.conn["b"], h.now, "connection reset"))
        cause = "connection reset"
    else:
        h.update("a")
        h.update("c")
        h.beat_until(7.0, ["a", "b", "c", "p"])
        h.now = 8.01
        act = h.tick()
        cause = "round timeout"
    for pid in ("a", "c"):
        [lost] = act.to(h.conn[pid], "member_lost")
        assert (lost["epoch"], lost["peer_id"], lost["rank"]) == (1, "b", 1)
        assert cause in lost["reason"]
    assert act.to(h.conn["b"], "member_lost") == []
    assert act.to(h.conn["p"], "member_lost") == []
    if how == "round":
        # The notice names the epoch the member was lost from, and precedes the new epoch.
        kinds = [m["type"] for c, m in act.sends if c == h.conn["a"]]
        assert kinds.index("member_lost") < kinds.index("assign")


def test_a_keyed_pending_query_gets_the_answer_fixed_at_its_first_ask():
    h = Harness(world_size=2)
    h.group("a", "b")

    def ask(pid, ops, index, epoch=None):
        act = h.send(pid, "pending", epoch=h.s.epoch if epoch is None else epoch, ops=ops,
                     index=index)
        [reply] = act.sends
        return reply[1]

    assert ask("a", 1, 0)["count"] == 0
    h.hello("late")                                  # arrives between a's and b's query
    assert ask("b", 1, 0)["count"] == 0              # same key: same answer as a's
    assert h.send("b", "pending").sends[0][1]["count"] == 1   # unkeyed: the count now
    assert ask("b", 1, 1)["count"] == 1              # a new key sees the pending peer
    assert ask("a", 1, 1)["count"] == 1
    assert ask("a", 2, 0)["count"] == 1
    # Another epoch's key, or a pending peer's query, is refused (not fatal).
    for pid, epoch in (("a", 7), ("late", 1)):
        reply = ask(pid, 1, 0, epoch=epoch)
        assert reply["type"] == "error" and not reply["fatal"]
    # A new epoch starts with no answers.
    h.update("a")
    h.update("b")
    assert h.s.epoch == 2
    assert ask("a", 1, 0)["count"] == 0


def test_keyed_pending_answers_are_bounded_per_epoch(monkeypatch):
    from torch_pccl.master import answers

    monkeypatch.setattr(answers, "MAX_ANSWERS_PER_EPOCH", 3)
    h = Harness(world_size=1)
    h.group("a")
    for ops in range(3):
        h.send("a", "pending", epoch=1, ops=ops, index=0)
    [(_, reply)] = h.send("a", "pending", epoch=1, ops=3, index=0).sends
    assert reply["type"] == "error" and "more than 3" in reply["message"]
    [(_, reply)] = h.send("a", "pending", epoch=1, ops=0, index=0).sends
    assert reply["type"] == "pending_count"          # known keys are still answered


def test_a_recovery_round_leaves_pending_peers_pending():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    h.hello("j")
    h.send("c", "leave")
    h.send("a", "update", epoch=1, admit=False)      # one member recovering is enough
    act = h.update("b")
    assert_group(h, act, ["a", "b"], left=["c"])
    assert h.state_of("j") == PENDING
    # The next ordinary round admits it.
    h.update("a")
    assert_group(h, h.update("b"), ["a", "b", "j"], joined=["j"])


def test_unreached_report_drops_the_epochs_joiners_only():
    h = Harness(world_size=2)
    h.group("a", "b")
    h.hello("j")
    h.hello("k")
    h.update("a")
    act = h.update("b")
    assert h.s.epoch == 2 and sorted(h.assigns(act)) == ["a", "b", "j", "k"]
    ranks = {pid: h.s.peers[h.conn[pid]].rank for pid in ("a", "b", "j", "k")}
    # A joiner names an incumbent: nothing happens (members are never evicted this way).
    assert h.send("j", "unreached", epoch=2, ranks=[ranks["a"]]).sends == []
    # Out-of-range ranks and the reporter itself are ignored; a stale epoch is refused.
    assert h.send("a", "unreached", epoch=2, ranks=[99, ranks["a"]]).sends == []
    [(_, refused)] = h.send("a", "unreached", epoch=1, ranks=[ranks["j"]]).sends
    assert refused["type"] == "error" and not refused["fatal"]
    # An incumbent names joiner j: j is dropped with its address, the others are told.
    act = h.send("a", "unreached", epoch=2, ranks=[ranks["j"]])
    [err] = act.to(h.conn["j"], "error")
    assert err["fatal"] and h.s.peers.get(h.conn["j"]) is None
    data_addr = "10.0.0.3"
    assert data_addr in err["message"] and "reported by a" in err["message"]
    for pid in ("a", "b", "k"):
        [lost] = act.to(h.conn[pid], "member_lost")
        assert lost["peer_id"] == "j"
    assert h.state_of("k") == ACCEPTED
    # The members run a round of that epoch and carry on without j.
    for pid in ("a", "b", "k"):
        act = h.update(pid)
    assert sorted(h.assigns(act)) == ["a", "b", "k"] and h.s.epoch == 3


def test_stalled_member_during_a_round_is_dropped_by_heartbeat_before_the_round_deadline():
    h = Harness(world_size=3, heartbeat_timeout_s=5.0, round_timeout_s=30.0)
    h.group("a", "b", "c")
    h.update("a")
    h.update("b")
    acts = h.beat_until(6.0, ["a", "b"])
    [act] = [a for a in acts if a.sends]
    assert_group(h, act, ["a", "b"], left=["c"])
    assert h.now < 30.0


def test_leave_is_clean():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    act = h.send("b", "leave")
    assert act.sends == []                       # no error for a clean departure
    assert act.closes == [h.conn["b"]]
    assert any("left" in e for e in act.events)
    assert h.state_of("b") == "gone"
    h.update("a")
    assert_group(h, h.update("c"), ["a", "c"], left=["b"])


def test_members_gone_during_a_round_are_not_waited_for():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    h.hello("d")
    h.update("a")
    h.send("b", "leave")
    assert h.s.round is not None                 # c still owes its update
    act = h.check(h.s.disconnect(h.conn["c"], h.now))
    assert act.closes == []                      # the server closed it already
    assert_group(h, act, ["a", "d"], joined=["d"], left=["b", "c"])


def test_member_that_updated_then_died_is_left_out():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    h.update("b")
    h.check(h.s.disconnect(h.conn["b"], h.now))
    h.update("a")
    assert_group(h, h.update("c"), ["a", "c"], left=["b"])


def test_shrink_to_one_and_grow_again():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    h.send("a", "leave")
    h.check(h.s.disconnect(h.conn["c"], h.now))
    assert_group(h, h.update("b"), ["b"], left=["a", "c"])
    assert h.s.epoch == 2
    h.hello("d")
    h.hello("e")
    assert_group(h, h.update("b"), ["b", "d", "e"], joined=["d", "e"])
    assert h.s.epoch == 3
    # An id that has gone can come back as a new peer.
    h.hello("a")
    h.update("b")
    h.update("d")
    assert_group(h, h.update("e"), ["b", "d", "e", "a"], joined=["a"])


def test_whole_group_gone_reforms_from_pending_peers():
    h = Harness()
    h.hello("a")
    h.hello("b")
    act = h.send("a", "leave")
    assert_group(h, act, ["b"], joined=["b"], left=["a"])
    assert h.s.epoch == 2


def test_round_abandoned_when_every_responder_is_gone():
    h = Harness(world_size=2)
    h.group("a", "b")
    h.hello("p")
    h.update("a")
    act = h.send("b", "leave")   # nobody left to wait for: the round completes
    assert_group(h, act, ["a", "p"], joined=["p"], left=["b"])
    h2 = Harness(world_size=2)
    h2.group("a", "b")
    h2.update("a")
    h2.send("a", "leave")    # the only responder leaves; b is still waited for
    act = h2.send("b", "leave")
    assert h2.s.round is None and h2.assigns(act) == {}
    assert any("abandoned" in e for e in act.events)


def test_stale_and_future_epochs_are_rejected_without_starting_a_round():
    h = Harness(world_size=2)
    h.group("a", "b")
    for epoch in (0, 2):
        act = h.send("a", "update", epoch=epoch)
        [err] = act.to(h.conn["a"], "error")
        assert err["fatal"] is False and "current epoch is 1" in err["message"]
        assert act.closes == []
        assert h.s.round is None
    h.hello("p")
    [err] = h.send("p", "update", epoch=1).to(h.conn["p"], "error")
    assert err["fatal"] is False and h.state_of("p") == PENDING
    assert h.s.round is None


def test_duplicate_peer_id_is_fatal_for_the_newcomer_only():
    h = Harness()
    h.hello("a")
    first = h.conn["a"]
    act = h.hello("a")
    newcomer = h.conn["a"]
    assert newcomer != first
    [err] = act.to(newcomer, "error")
    assert err["fatal"] and "already connected" in err["message"]
    assert act.closes == [newcomer]
    assert h.s.peers[first].state == ACCEPTED


def test_first_message_must_be_hello_and_only_once():
    h = Harness()
    c = h.s.connect(0.0, "x:1")
    act = h.check(h.s.receive(c, {"type": "heartbeat"}, 0.0))
    assert act.to(c, "error")[0]["fatal"] and act.closes == [c]
    h.hello("a")
    act = h.check(h.s.receive(h.conn["a"], {
        "type": "hello", "magic": protocol.MAGIC, "version": 1, "peer_id": "a",
        "data_addr": "1.2.3.4:5", "meta": {}}, 0.0))
    assert act.to(h.conn["a"], "error")[0]["fatal"] and act.closes == [h.conn["a"]]


def test_handshake_deadline_closes_a_silent_connection():
    h = Harness(handshake_timeout_s=5.0)
    c = h.s.connect(0.0, "x:1")
    h.now = 5.0
    assert h.tick().closes == []
    h.now = 5.5
    act = h.tick()
    assert act.closes == [c]
    assert "no hello" in act.to(c, "error")[0]["message"]
    assert c not in h.s.peers


def test_messages_from_unknown_connections_are_ignored():
    h = Harness()
    act = h.s.receive(999, {"type": "heartbeat"}, 0.0)
    assert act.sends == act.closes == []
    assert h.s.disconnect(999, 0.0).sends == []


def test_snapshot_is_json():
    h = Harness(world_size=2)
    h.group("a", "b")
    h.hello("c")
    h.update("a")
    snap = json.loads(json.dumps(h.s.snapshot()))
    assert snap["epoch"] == 1 and snap["world_size"] == 2 and snap["pending"] == 1
    assert snap["round"]["responded"] == ["a"] and snap["round"]["waiting"] == ["b"]
    states = {p["peer_id"]: (p["state"], p["rank"]) for p in snap["peers"]}
    assert states == {"a": ("accepted", 0), "b": ("accepted", 1), "c": ("pending", -1)}


@pytest.mark.parametrize("kwargs", [
    {"world_size": -1},
    {"heartbeat_interval_s": 0},
    {"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 5.0},
    {"round_timeout_s": -1},
])
def test_bad_options(kwargs):
    with pytest.raises(ValueError):
        MembershipState(**kwargs)


# -- shared-state sync rounds --------------------------------------------------

A, B, C = "a" * 32, "b" * 32, "c" * 32     # content digests


def vote(h, pid, revision, content, strategy="enforce_popular", fresh=False, epoch=None):
    return h.send(pid, "sync", epoch=h.s.epoch if epoch is None else epoch,
                  revision=revision, strategy=strategy, fresh=fresh, content=content)


def sync_all(h, votes):
    """Each (pid, revision, content, extra) votes in order; returns the common sync_result.

    Only the last vote may complete the round, and every voter gets the same result.
    """
    for i, (pid, revision, content, *extra) in enumerate(votes):
        act = vote(h, pid, revision, content, **(extra[0] if extra else {}))
        if i < len(votes) - 1:
            assert act.sends == [], "the round completed before the last vote"
    results = [act.to(h.conn[pid], "sync_result") for pid, *_ in votes]
    assert all(len(r) == 1 for r in results), act.sends
    assert all(r == results[0] for r in results)
    assert h.s.sync_round is None
    # Whether the round granted a quiet epoch is test_master_quiet.py's concern.
    return {k: v for k, v in results[0][0].items() if k != "quiet"}


def ok(revision, content, sources, outdated, epoch=1):
    return {"type": "sync_result", "epoch": epoch, "revision": revision, "content": content,
            "sources": sources, "outdated": outdated, "error": ""}


def test_sync_majority_wins_and_names_sources_and_outdated():
    h = Harness(world_size=4)
    h.group("a", "b", "c", "d")
    assert h.s.shared_revision is None
    got = sync_all(h, [("b", 1, B), ("a", 1, A), ("d", 1, C),
                       ("c", 1, A, {"strategy": "send_only"})])
    assert got == ok(1, A, sources=[0, 2], outdated=[1, 3])
    assert (h.s.shared_revision, h.s.shared_content) == (1, A)


@pytest.mark.parametrize("votes,winner", [
    ([(1, A), (2, B)], (2, B)),                      # tie: the higher revision
    ([(2, B), (1, A)], (2, B)),
    ([(1, B), (1, A), (1, A), (1, B)], (1, B)),      # tie, same revision: lowest rank's content
    ([(1, A), (1, A), (2, B)], (1, A)),              # the count comes before the revision
    ([(3, A), (1, A), (3, A)], (3, A)),              # (revision, content) pairs are counted
])
def test_sync_tie_breaks(votes, winner):
    pids = [f"p{i}" for i in range(len(votes))]
    h = Harness(world_size=len(votes))
    h.group(*pids)
    # Votes arrive in reverse rank order: arrival must not matter.
    got = sync_all(h, [(pid, rev, content)
                       for pid, (rev, content) in reversed(list(zip(pids, votes)))])
    assert (got["revision"], got["content"]) == winner
    assert got["sources"] == [r for r, v in enumerate(votes) if v[1] == winner[1]]


def test_sync_incumbents_outvote_fresh_peers():
    h = Harness()
    h.group("a")
    assert sync_all(h, [("a", 1, A, {"fresh": True})]) == ok(1, A, [0], [])
    h.hello("b")
    h.hello("c")
    h.update("a")
    assert h.s.epoch == 2
    # Two fresh joiners agree on other content (and a newer revision): the incumbent wins.
    got = sync_all(h, [("b", 7, B, {"fresh": True}), ("a", 2, A),
                       ("c", 7, B, {"fresh": True})])
    assert got == ok(2, A, sources=[0], outdated=[1, 2], epoch=2)
    # A fresh peer holding the winner is a source too.
    got = sync_all(h, [("a", 2, A), ("b", 9, A, {"fresh": True}), ("c", 2, B)])
    assert got == ok(2, A, sources=[0, 1], outdated=[2], epoch=2)


def test_sync_without_incumbents_elects_among_fresh_peers():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    got = sync_all(h, [("a", 4, A, {"fresh": True}), ("b", 4, B, {"fresh": True}),
                       ("c", 4, B, {"fresh": True})])
    assert got == ok(4, B, sources=[1, 2], outdated=[0])


def test_receive_only_votes_never_count_and_never_serve():
    h = Harness(world_size=4)
    h.group("a", "b", "c", "d")
    ro = {"strategy": "receive_only"}
    # Three receive_only peers agree on B; the one peer that offers its state wins.
    got = sync_all(h, [("a", 1, B, ro), ("b", 1, B, ro), ("c", 1, A, ro), ("d", 1, A)])
    assert got == ok(1, A, sources=[3], outdated=[0, 1])


def test_all_receive_only_is_an_error():
    h = Harness(world_size=2)
    h.group("a", "b")
    ro = {"strategy": "receive_only"}
    got = sync_all(h, [("a", 1, A, ro), ("b", 1, A, ro)])
    assert got["error"] == "no member offers its state: every member syncs with receive_only"
    assert (got["content"], got["sources"], got["outdated"]) == ("", [], [])
    assert h.s.shared_revision is None and h.s.shared_content is None


def test_revision_rule():
    h = Harness(world_size=2)
    h.group("a", "b")
    assert sync_all(h, [("a", 5, A), ("b", 5, A)]) == ok(5, A, [0, 1], [])
    assert sync_all(h, [("a", 5, A), ("b", 5, A)]) == ok(5, A, [0, 1], [])     # R again
    assert sync_all(h, [("a", 6, B), ("b", 6, B)]) == ok(6, B, [0, 1], [])     # R + 1
    for bad in (8, 5):                                                          # R + 2, R - 1
        got = sync_all(h, [("a", 7, B), ("b", bad, B)])
        assert got["error"] == (
            f"peer b (rank 1) syncs revision {bad}, but the shared state is at revision 6: "
            f"a revision must equal the previous one or advance by exactly one")
        assert (got["revision"], got["content"], got["sources"], got["outdated"]) == (6, "", [], [])
        assert (h.s.shared_revision, h.s.shared_content) == (6, B)
    # The first offender by rank is named, whatever the arrival order.
    got = sync_all(h, [("b", 0, B), ("a", 9, B)])
    assert got["error"].startswith("peer a (rank 0) syncs revision 9")
    # A fresh peer and a receive_only peer are exempt.
    assert sync_all(h, [("a", 99, A, {"fresh": True}), ("b", 7, B)]) == ok(7, B, [1], [0])
    got = sync_all(h, [("a", 0, A, {"strategy": "receive_only"}), ("b", 8, B)])
    assert got == ok(8, B, [1], [0])


def test_sync_refused_from_a_pending_peer_or_for_another_epoch():
    h = Harness(world_size=2)
    h.group("a", "b")
    h.hello("p")
    for pid, epoch, why in (("a", 0, "sync for epoch 0, but the current epoch is 1"),
                            ("a", 2, "sync for epoch 2, but the current epoch is 1"),
                            ("p", 1, "sync from a pending peer: wait for your assign")):
        act = vote(h, pid, 1, A, epoch=epoch)
        assert act.sends == [(h.conn[pid], {"type": "error", "fatal": False, "message": why})]
        assert act.closes == []
        assert h.s.sync_round is None
    assert h.state_of("p") == PENDING


def test_a_repeated_vote_replaces_the_earlier_one():
    h = Harness(world_size=2)
    h.group("a", "b")
    assert vote(h, "a", 1, B).sends == []
    assert sync_all(h, [("a", 1, A), ("b", 1, A)]) == ok(1, A, [0, 1], [])


def test_sync_deadline_drops_the_members_that_did_not_vote():
    h = Harness(world_size=3, round_timeout_s=30.0)
    h.group("a", "b", "c")
    h.beat_until(10.0, ["a", "b", "c"])
    vote(h, "a", 1, A)
    vote(h, "c", 1, B)
    # b heartbeats but never votes: only the round deadline catches it.
    acts = h.beat_until(39.5, ["a", "b", "c"], step=0.5)
    assert all(not a.sends for a in acts), "nothing before the deadline"
    h.now = 40.0
    act = h.tick()
    [err] = act.to(h.conn["b"], "error")
    assert err == {"type": "error", "fatal": True,
                   "message": "no sync for epoch 1 within 30 s (round timeout)"}
    assert act.closes == [h.conn["b"]] and h.state_of("b") == "gone"
    assert act.to(h.conn["b"], "sync_result") == []
    for pid in ("a", "c"):
        assert act.to(h.conn[pid], "sync_result") == [ok(1, A, sources=[0], outdated=[2])]
    assert h.s.sync_round is None and h.s.epoch == 1      # a sync never changes the epoch


def test_member_gone_during_a_sync_round_is_not_waited_for_and_loses_its_vote():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    vote(h, "a", 1, B)                            # a votes, then dies: its vote is void
    h.check(h.s.disconnect(h.conn["a"], h.now))
    vote(h, "b", 1, A)
    act = h.check(h.s.disconnect(h.conn["c"], h.now))   # c never voted
    assert act.to(h.conn["b"], "sync_result") == [ok(1, A, sources=[1], outdated=[])]
    assert h.s.sync_round is None


def test_sync_round_abandoned_silently_when_every_voter_is_gone():
    h = Harness(world_size=2)
    h.group("a", "b")
    vote(h, "a", 1, A)
    h.send("a", "leave")
    act = h.send("b", "leave")
    assert act.sends == [] and h.s.sync_round is None
    assert any("sync for epoch 1 abandoned" in e for e in act.events)


def test_an_update_round_abandons_the_open_sync_round_and_refuses_votes_while_it_runs():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    vote(h, "a", 1, A)          # a and b wait in the sync round ...
    vote(h, "b", 1, A)
    act = h.update("c")         # ... c, recovering from a loss, opens an update round
    for pid in ("a", "b"):
        [err] = act.to(h.conn[pid], "error")
        assert not err["fatal"] and err["update"] and "abandoned" in err["message"]
    assert act.to(h.conn["c"], "error") == [] and h.s.sync_round is None
    [(_, refused)] = h.send("a", "sync", epoch=1, revision=1, strategy="enforce_popular",
                            fresh=True, content=A).sends
    assert refused["type"] == "error" and refused["update"] and not refused["fatal"]
    h.update("a")
    assert_group(h, h.update("b"), ["a", "b", "c"])
    assert sync_all(h, [("a", 1, A), ("b", 1, A), ("c", 1, A)]) == ok(1, A, [0, 1, 2], [],
                                                                       epoch=2)


def test_the_initiator_who_gave_up_its_sync_gets_no_error():
    h = Harness(world_size=2)
    h.group("a", "b")
    vote(h, "a", 1, A)          # a votes, gives up on the sync and joins an update round
    act = h.update("a")
    assert act.to(h.conn["a"], "error") == [] and h.s.sync_round is None
    assert_group(h, h.update("b"), ["a", "b"])


def test_recovery_counts_come_back_in_the_assign():
    h = Harness(world_size=3)
    h.group("a", "b", "c")
    h.send("a", "update", epoch=1, admit=False, done=4, busy=True)
    h.send("b", "update", epoch=1, admit=False, done=3)
    act = h.send("c", "leave")
    a = h.assigns(act)
    assert sorted(a) == ["a", "b"]
    ranks = {pid: m["rank"] for pid, m in a.items()}
    assert a["a"]["done"][ranks["a"]] == 4 and a["a"]["done"][ranks["b"]] == 3
    # Whether each came from inside its next exchange (ExchangeLedger.passed), aligned.
    assert a["a"]["busy"][ranks["a"]] is True and a["a"]["busy"][ranks["b"]] is False
    assert a["a"]["done"] == a["b"]["done"] and a["a"]["busy"] == a["b"]["busy"]
    # A round without counts sends none.
    h.update("a")
    a = h.assigns(h.update("b"))["a"]
    assert a["done"] == [] and a["busy"] == []


def test_a_minority_sync_round_fails_for_its_voter_and_drops_nobody():
    h = Harness(world_size=3, round_timeout_s=30.0)
    h.group("x", "y", "v")
    vote(h, "v", 1, A)                            # the sync round's deadline is 30
    h.beat_until(29.5, ["x", "y", "v"], step=0.5)
    h.now = 30.0
    act = h.tick()
    [err] = act.to(h.conn["v"], "error")
    assert not err["fatal"] and "abandoned" in err["message"] and "1 of 3" in err["message"]
    assert act.closes == [] and h.s.sync_round is None
    assert all(h.state_of(pid) == ACCEPTED for pid in ("x", "y", "v"))


def test_a_majority_update_round_drops_the_member_out_of_step():
    h = Harness(world_size=3, round_timeout_s=30.0)
    h.group("x", "y", "v")
    h.update("v")
    h.update("y")
    h.beat_until(29.5, ["x", "y", "v"], step=0.5)
    h.now = 30.0
    act = h.tick()
    assert act.to(h.conn["x"], "error")[0]["fatal"] is True
    assert_group(h, act, ["y", "v"], left=["x"])


@pytest.mark.parametrize("members", [2, 3, 4])
def test_a_lone_update_caller_does_not_evict_the_others(members):
    pids = [f"p{i}" for i in range(members)]
    h = Harness(world_size=members, round_timeout_s=30.0)
    h.group(*pids)
    h.update(pids[0])
    h.beat_until(29.5, pids, step=0.5)
    h.now = 30.0
    act = h.tick()
    [err] = act.to(h.conn[pids[0]], "error")
    assert not err["fatal"] and f"only 1 of {members}" in err["message"]
    assert act.closes == [] and h.assigns(act) == {} and h.s.round is None
    assert h.s.epoch == 1 and all(h.state_of(pid) == ACCEPTED for pid in pids)
    # The group still works: a round that every member joins completes.
    for pid in pids:
        act = h.update(pid)
    assert sorted(h.assigns(act)) == sorted(pids) and h.s.epoch == 2


def test_snapshot_shows_the_sync_round_and_the_shared_state():
    h = Harness(world_size=2)
    h.group("a", "b")
    snap = json.loads(json.dumps(h.s.snapshot()))
    assert snap["shared_state"] == {"revision": None, "content": None}
    assert snap["sync_round"] is None
    h.now = 3.0
    vote(h, "b", 4, A)
    snap = json.loads(json.dumps(h.s.snapshot()))
    assert snap["sync_round"] == {"epoch": 1, "started_at": 3.0, "deadline": 33.0,
                                  "voted": ["b"], "waiting": ["a"]}
    vote(h, "a", 4, A)
    snap = json.loads(json.dumps(h.s.snapshot()))
    assert snap["shared_state"] == {"revision": 4, "content": A}
    assert snap["sync_round"] is None


def test_elect_is_pure_and_deterministic():
    from torch_pccl.master.state import Vote, elect
    votes = [Vote(rank=r, peer_id=f"p{r}", revision=1, strategy="enforce_popular",
                  fresh=False, content=c) for r, c in enumerate((B, A, B, A))]
    first = elect(votes, None)
    assert first == {"revision": 1, "content": B, "sources": [0, 2], "outdated": [1, 3],
                     "error": ""}
    assert elect(list(reversed(votes)), None) == first
    assert elect(votes, 1) == first and elect(votes, 0) == first
    assert elect(votes, 2)["error"].startswith("peer p0 (rank 0) syncs revision 1")


# -- a master that comes back: members re-register (MembershipState._resume) -----------------


def _resume_hello(h, pid, assign, **extra):
    """`pid` re-registers with a new master holding the `assign` it got from the old one."""
    resume = {"epoch": assign["epoch"], "comm_id": assign["comm_id"], "rank": assign["rank"],
              "peer_ids": assign["peer_ids"], "addrs": assign["addrs"], "revision": 3,
              "last_key": [-1, -1]}
    resume.update(extra)
    c = h.s.connect(h.now, "10.0.0.9:1")
    h.conn[pid] = c
    msg = schemas.validate({"type": "hello", "magic": protocol.MAGIC, "version": 1,
                             "peer_id": pid, "data_addr": assign["addrs"][assign["rank"]],
                             "resume": resume}, protocol.TO_MASTER)
    return h.check(h.s.receive(c, msg, h.now))


def _old_group(n=3):
    old = Harness(world_size=n)
    act = None
    for i in range(n):
        act = old.hello(f"p{i}")
    return old.assigns(act)


def test_a_new_master_adopts_the_epoch_of_re_registering_members():
    assigns = _old_group()
    h = Harness(heartbeat_timeout_s=10.0)
    act = _resume_hello(h, "p1", assigns["p1"])
    assert act.to(h.conn["p1"], "welcome")[0]["state"] == ACCEPTED
    assert not act.to(h.conn["p1"], "assign")              # nothing changes for the member
    assert (h.s.epoch, h.s.comm_id) == (assigns["p1"]["epoch"], assigns["p1"]["comm_id"])
    snap = h.s.snapshot()
    assert sorted((p["peer_id"], p["state"], p["rank"]) for p in snap["peers"]) == [
        ("p0", "resuming", 0), ("p1", ACCEPTED, 1), ("p2", "resuming", 2)]
    assert snap["shared_state"]["revision"] == 3
    _resume_hello(h, "p0", assigns["p0"])
    _resume_hello(h, "p2", assigns["p2"])
    assert [p["state"] for p in h.s.snapshot()["peers"]] == [ACCEPTED] * 3
    # The group goes on as before: a joiner is admitted at the members' next round.
    h.hello("new")
    assert h.s.pending_count() == 1
    for pid in ("p0", "p1", "p2"):
        act = h.update(pid)
    assigned = h.assigns(act)
    assert assigned["new"]["world_size"] == 4 and assigned["new"]["rank"] == 3
    assert assigned["p0"]["epoch"] == assigns["p0"]["epoch"] + 1


def test_a_member_that_never_comes_back_is_dropped_and_announced():
    assigns = _old_group()
    h = Harness(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    _resume_hello(h, "p0", assigns["p0"])
    _resume_hello(h, "p1", assigns["p1"])
    acts = h.beat_until(6.0, ["p0", "p1"])
    lost = [m for act in acts for c, m in act.sends if m["type"] == "member_lost"]
    assert {(m["peer_id"], m["rank"]) for m in lost} == {("p2", 2)}
    assert {c for act in acts for c, m in act.sends if m["type"] == "member_lost"} == {
        h.conn["p0"], h.conn["p1"]}
    assert sorted(p["peer_id"] for p in h.s.snapshot()["peers"]) == ["p0", "p1"]
    for pid in ("p0", "p1"):
        act = h.update(pid)
    assert h.assigns(act)["p0"]["left"] == ["p2"] and h.assigns(act)["p0"]["world_size"] == 2


def test_pending_answers_stay_zero_until_every_member_is_back_and_for_keys_answered_alone():
    assigns = _old_group(2)
    h = Harness(heartbeat_timeout_s=10.0)
    epoch = assigns["p0"]["epoch"]
    _resume_hello(h, "p0", assigns["p0"], last_key=[5, 0])
    h.hello("joiner")
    ask = lambda pid, ops, index: h.send(pid, "pending", epoch=epoch, ops=ops, index=index)
    # p1 is not back yet: a new key answers 0, and stays 0 once fixed.
    assert ask("p0", 7, 0).to(h.conn["p0"], "pending_count")[0]["count"] == 0
    _resume_hello(h, "p1", assigns["p1"], last_key=[6, 1])
    # p1 answered (6, 1) and everything before it alone; (7, 0) was fixed at 0.
    for key in ((5, 0), (6, 1), (7, 0)):
        assert ask("p1", *key).to(h.conn["p1"], "pending_count")[0]["count"] == 0
    # A key nobody answered yet, with every member back: the real count.
    assert ask("p1", 8, 0).to(h.conn["p1"], "pending_count")[0]["count"] == 1
    assert ask("p0", 8, 0).to(h.conn["p0"], "pending_count")[0]["count"] == 1


@pytest.mark.parametrize("change", [dict(epoch=99), dict(comm_id=1), dict(rank=0)])
def test_a_re_registration_that_does_not_match_the_group_is_refused(change):
    assigns = _old_group()
    h = Harness()
    _resume_hello(h, "p1", assigns["p1"])
    act = _resume_hello(h, "p2", assigns["p2"], **change)
    err = act.to(h.conn["p2"], "error")
    assert err and err[0]["fatal"] and "cannot resume" in err[0]["message"]
    assert h.conn["p2"] in act.closes


def test_a_member_reconnecting_to_a_live_master_takes_over_its_old_connection():
    h = Harness(world_size=2)
    h.hello("a")
    act = h.hello("b")
    assigns = h.assigns(act)
    old = h.conn["a"]
    act = _resume_hello(h, "a", assigns["a"])
    assert old in act.closes and old not in h.s.peers
    assert h.s.members[0] == h.conn["a"] and h.state_of("a") == ACCEPTED
    assert not [m for _, m in act.sends if m["type"] == "member_lost"]


def test_every_answer_echoes_the_id_of_the_request_it_answers():
    h = Harness(world_size=2)
    h.hello("a")
    h.hello("b")
    epoch = h.s.epoch
    act = h.send("a", "pending", epoch=epoch, ops=1, index=0, id=11)
    assert act.to(h.conn["a"], "pending_count")[0]["id"] == 11
    act = h.send("a", "update", epoch=epoch + 5, id=12)           # refused: a stale epoch
    assert act.to(h.conn["a"], "error")[0]["id"] == 12
    h.send("a", "update", epoch=epoch, id=13)
    act = h.send("b", "update", epoch=epoch, id=21)
    assert act.to(h.conn["a"], "assign")[0]["id"] == 13
    assert act.to(h.conn["b"], "assign")[0]["id"] == 21
    vote = dict(revision=1, strategy="enforce_popular", fresh=True, content="a" * 32)
    h.send("a", "sync", epoch=h.s.epoch, id=14, **vote)
    act = h.send("b", "sync", epoch=h.s.epoch, id=22, **vote)
    assert act.to(h.conn["a"], "sync_result")[0]["id"] == 14
    assert act.to(h.conn["b"], "sync_result")[0]["id"] == 22
    # Without an id (an older peer), answers carry none.
    act = h.send("a", "pending")
    assert "id" not in act.to(h.conn["a"], "pending_count")[0]
