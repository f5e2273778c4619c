"""Sharded replicas at the master (torch_pccl/master/replicas.py, state.py): admitted whole,
dropped whole, refused for another layout, shared state and quorum per shard/replica.

Pure: the state machine is driven by hand with a hand-moved clock, as test_master_state.py.
"""

import itertools

import pytest

from torch_pccl.control import protocol, schemas
from torch_pccl.errors import ProtocolError
from torch_pccl.master.state import ACCEPTED, PENDING, MembershipState

pytestmark = pytest.mark.timeout(30)

LAYOUT = "ab" * 16
OTHER = "cd" * 16
DIGEST = {"a": "11" * 16, "b": "22" * 16, "c": "33" * 16}


class Master:
    """A MembershipState whose peers are processes of replicas, named ``<replica><shard>``."""

    def __init__(self, **kwargs):
        ids = itertools.count(0x1000)
        self.s = MembershipState(new_comm_id=lambda: next(ids), **kwargs)
        self.now = 0.0
        self.conn = {}
        self.port = itertools.count(41000)

    def receive(self, pid, kind, **fields):
        msg = schemas.validate(dict(fields, type=kind), protocol.TO_MASTER)
        act = self.s.receive(self.conn[pid], msg, self.now)
        for _, m in act.sends:
            protocol.encode(m)          # everything sent passes the wire schema
        return act

    def hello(self, pid, shards=2, layout=LAYOUT, description="", replica=True, as_=None):
        self.conn[pid] = self.s.connect(self.now, f"10.0.0.9:{next(self.port)}")
        fields = dict(magic=protocol.MAGIC, version=protocol.VERSION, peer_id=pid,
                      data_addr=f"10.0.1.{len(self.conn)}:{next(self.port)}")
        if replica:
            name = as_ or pid
            fields["replica"] = {"id": name[:-1], "shard": int(name[-1]), "shards": shards,
                                 "layout": layout, "description": description}
        return self.receive(pid, "hello", **fields)

    def replica(self, name, shards=2, **kw):
        act = None
        for i in range(shards):
            act = self.hello(f"{name}{i}", shards=shards, **kw)
        return act

    def state(self, pid):
        p = self.s.peers.get(self.conn[pid])
        return p.state if p else "gone"

    def assigns(self, act):
        by_conn = {c: pid for pid, c in self.conn.items()}
        return {by_conn[c]: m for c, m in act.sends if m["type"] == "assign"}

    def errors(self, act):
        by_conn = {c: pid for pid, c in self.conn.items()}
        return {by_conn[c]: m for c, m in act.sends if m["type"] == "error"}

    def update_all(self, admit=True):
        act = None
        for pid in [p for p in self.conn if self.state(p) == ACCEPTED]:
            act = self.receive(pid, "update", epoch=self.s.epoch, admit=admit)
        return act


def test_a_replica_is_admitted_only_with_all_its_shards():
    m = Master()
    assert not m.assigns(m.hello("a0"))
    assert m.state("a0") == PENDING and m.s.pending_count() == 0   # half a replica: nobody
    act = m.hello("a1")
    got = m.assigns(act)
    assert sorted(got) == ["a0", "a1"]
    assert got["a0"]["replicas"] == ["a", "a"] and got["a0"]["shards"] == [0, 1]
    # A second replica waits, half of it first, then whole, for the members' update.
    m.hello("b1")
    assert m.s.pending_count() == 0
    m.hello("b0")
    assert m.s.pending_count() == 2
    got = m.assigns(m.update_all())
    assert got["b0"]["peer_ids"] == ["a0", "a1", "b0", "b1"]
    assert got["b0"]["shards"] == [0, 1, 0, 1] and got["b0"]["replicas"] == ["a", "a", "b", "b"]
    assert got["b0"]["joined"] == ["b0", "b1"]


def test_an_update_round_admits_no_half_replica():
    m = Master()
    m.replica("a")
    m.hello("b0")
    got = m.assigns(m.update_all())
    assert sorted(got) == ["a0", "a1"] and got["a0"]["world_size"] == 2
    assert m.state("b0") == PENDING


def test_a_fixed_bootstrap_takes_whole_replicas():
    m = Master(world_size=4)
    m.replica("a")
    m.hello("b0")
    assert not m.assigns(m.hello("c0")) and m.s.epoch == 0
    got = m.assigns(m.hello("b1"))
    assert got["a0"]["peer_ids"] == ["a0", "a1", "b0", "b1"]
    assert m.state("c0") == PENDING


@pytest.mark.parametrize("how", ["disconnect", "heartbeat", "leave"])
def test_losing_one_process_drops_its_whole_replica(how):
    m = Master(heartbeat_timeout_s=5.0, heartbeat_interval_s=1.0)
    m.replica("a")
    m.replica("b")
    m.update_all()
    assert m.s.epoch == 2
    if how == "disconnect":
        act = m.s.disconnect(m.conn["b1"], m.now)
    elif how == "leave":
        act = m.receive("b1", "leave")
    else:
        m.now = 3.0
        for pid in ("a0", "a1", "b0"):
            m.receive(pid, "heartbeat")
        m.now = 6.0
        act = m.s.tick(m.now)
    assert m.state("b0") == "gone" and m.state("b1") == "gone"
    err = m.errors(act)["b0"]
    assert err["fatal"] and err["replica"]
    assert "replica 'b' lost its shard 1 (peer b1)" in err["message"]
    # The other replica is told of both, and goes on: its update forms an epoch of it alone.
    lost = sorted(msg["peer_id"] for c, msg in act.sends if msg["type"] == "member_lost"
                  and c == m.conn["a0"])
    assert lost == (["b0"] if how == "leave" else ["b0", "b1"])
    got = m.assigns(m.update_all(admit=False))
    assert got["a0"]["peer_ids"] == ["a0", "a1"] and sorted(got["a0"]["left"]) == ["b0", "b1"]


def test_a_replica_lost_during_an_update_round_never_enters_the_next_epoch():
    m = Master()
    m.replica("a")
    m.replica("b")
    m.update_all()
    for pid in ("a0", "a1", "b0"):
        m.receive(pid, "update", epoch=m.s.epoch)
    # b1 dies instead of joining: the round completes without b0 too.
    act = m.s.disconnect(m.conn["b1"], m.now)
    got = m.assigns(act)
    assert got["a0"]["peer_ids"] == ["a0", "a1"]
    assert "b0" not in got


def test_a_pending_replica_that_loses_a_process_is_dropped_whole():
    m = Master()
    m.replica("a")
    m.replica("b")
    act = m.s.disconnect(m.conn["b0"], m.now)
    assert m.state("b1") == "gone" and m.errors(act)["b1"]["replica"]
    assert m.s.pending_count() == 0


def test_a_replica_of_another_layout_is_refused_naming_both():
    m = Master()
    m.replica("a", description="4 tensors, 1,000 elements, float32")
    act = m.hello("b0", layout=OTHER, description="4 tensors, 2,000 elements, float32")
    err = m.errors(act)["b0"]
    assert err["fatal"] and err["layout"]
    assert "2,000 elements" in err["message"] and "1,000 elements" in err["message"]
    act = m.hello("c0", shards=3)
    assert "3 shard(s)" in m.errors(act)["c0"]["message"]
    assert "2 shard(s)" in m.errors(act)["c0"]["message"]
    # The same shard index twice in one replica, and plain peers, are refused too.
    assert "already registered" in m.errors(m.hello("x1", as_="a1"))["x1"]["message"]
    assert m.errors(m.hello("p9", replica=False))["p9"]["fatal"]
    assert m.state("a0") == ACCEPTED and m.state("a1") == ACCEPTED


def test_shared_state_is_elected_per_shard_index():
    m = Master()
    m.replica("a")
    m.replica("b")
    m.update_all()
    votes = {"a0": DIGEST["a"], "b0": DIGEST["a"], "a1": DIGEST["b"], "b1": DIGEST["c"]}
    results = {}
    for pid, content in votes.items():
        act = m.receive(pid, "sync", epoch=m.s.epoch, revision=1, strategy="enforce_popular",
                        fresh=pid.startswith("b"), content=content)
        results.update({p: msg for p, msg in m.assigns(act).items()})
        by_conn = {c: p for p, c in m.conn.items()}
        results.update({by_conn[c]: msg for c, msg in act.sends if msg["type"] == "sync_result"})
    # Shard 0: both hold a; shard 1: the incumbent a1's content wins over the fresh b1.
    assert results["a0"]["content"] == results["b0"]["content"] == DIGEST["a"]
    assert results["a1"]["content"] == results["b1"]["content"] == DIGEST["b"]
    ranks = {pid: i for i, pid in enumerate(["a0", "a1", "b0", "b1"])}
    assert results["b1"]["outdated"] == [ranks["b1"]]
    assert results["b1"]["sources"] == [ranks["a1"]]
    assert results["b0"]["outdated"] == []


def test_a_quorum_counts_whole_replicas():
    m = Master()
    m.replica("a")
    m.replica("b")
    m.update_all()
    by_conn = {c: p for p, c in m.conn.items()}

    def ready(pid):
        act = m.receive(pid, "ready", epoch=m.s.epoch, round=1, tokens=10, min_peers=1,
                        grace_s=5.0)
        return {by_conn[c]: msg for c, msg in act.sends if msg["type"] == "quorum"}

    assert not ready("a0")
    assert not ready("b0")            # a0 and b0 are ready, but no replica is whole yet
    got = ready("a1")                 # replica a is: the grace window starts
    assert not got
    m.now = 6.0
    act = m.s.tick(m.now)
    got = {by_conn[c]: msg for c, msg in act.sends if msg["type"] == "quorum"}
    assert set(got) == {"a0", "a1", "b0", "b1"}
    assert got["b0"]["peer_ids"] == ["a0", "a1"]   # b0 was ready, but its replica was not


def test_replica_fields_are_bounded():
    base = dict(type="hello", magic=protocol.MAGIC, version=protocol.VERSION, peer_id="x",
                data_addr="10.0.0.1:1")
    for bad in [{"id": "a", "shard": 2, "shards": 2}, {"id": "", "shard": 0, "shards": 1},
                {"id": "a", "shard": 0, "shards": 0},
                {"id": "a", "shard": 0, "shards": 1, "description": "x" * 201},
                {"id": "a", "shard": 0, "shards": 1, "layout": "zz"}, "a"]:
        with pytest.raises(ProtocolError):
            schemas.validate(dict(base, replica=bad), protocol.TO_MASTER)
    with pytest.raises(ProtocolError):
        schemas.validate({"type": "assign", "epoch": 1, "comm_id": 1, "rank": 0,
                          "world_size": 2, "addrs": ["a:1", "b:2"], "peer_ids": ["a", "b"],
                          "joined": [], "left": [], "replicas": ["r"], "shards": [0]},
                         protocol.TO_PEER)
