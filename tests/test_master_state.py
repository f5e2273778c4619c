"""The master's membership state machine (torch_pccl/master/state.py).

Pure: the clock is a number these tests move by hand, so every deadline is
exercised exactly, without sockets or sleeps.
"""

import itertools
import json

import pytest

from torch_pccl.master import protocol
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
        return self.check(self.s.receive(self.conn[pid], dict(fields, type=kind), self.now))

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
