"""Shared-state sync (issue 4) end to end: ``torch_pccl.sync_shared_state`` across processes.

Harness as tests/elastic/test_membership.py: a master in a thread of this process
(start_in_thread, short heartbeats), every peer a tests/harness/shared_state_worker.py
subprocess driven by JSON lines; every wait has a deadline and every process
is SIGKILLed in a finally. Workers start as standbys (importing torch) and
register with the master on "join", so a late joiner's start-up overlaps the
test.

Each worker reports sha256 digests of its entries, computed apart from the
code under test, next to ``torch_pccl.state_hashes``; "equal on every peer"
and "unchanged" are checked on both.
"""

import os
import signal
import time

import pytest

from harness import HARNESS
from harness.worker_process import StandbyPeer
from harness.worker_process import call_all as _call_all
from harness.worker_process import wait_until
from torch_pccl.master import start_in_thread

pytestmark = [pytest.mark.timeout(180), pytest.mark.pccl_only]

T = 5.0                 # seconds: the groups' op timeout (PCCL_TIMEOUT)
JOIN_TIMEOUT_S = 60.0   # seconds: how long a peer may stay pending
START_S = 60.0          # seconds: a worker's start (imports torch) on a loaded machine
STEP_S = 2 * T + 30     # seconds: deadline of one collective command
WORKER = os.path.join(HARNESS, "shared_state_worker.py")
MIB = 2**20


class Peer(StandbyPeer):
    """One worker process, a standby until ``join``."""

    def __init__(self, master_addr, tmp_path, name):
        super().__init__(WORKER, master_addr, tmp_path, name, T, JOIN_TIMEOUT_S, START_S, STEP_S)


def call_all(peers, cmd, timeout_s=STEP_S, **kw):
    """Sends ``cmd`` to every peer first (a collective), then collects each answer."""
    return _call_all(peers, cmd, timeout_s, **kw)


def sync_all(peers, revisions, timeout_s=STEP_S, **kw):
    """Every peer syncs (its own revision when ``revisions`` is a list); the answers."""
    if not isinstance(revisions, list):
        revisions = [revisions] * len(peers)
    for p, r in zip(peers, revisions):
        p.send("sync", revision=r, **kw.get(p.name, {}))
    return [p.recv(timeout_s, "sync") for p in peers]



@pytest.fixture
def cluster(tmp_path):
    """Factory: ``start(n_boot, n_standby, **master_kw)`` starts a master bootstrapping a
    world of ``n_boot`` and n_boot + n_standby workers (the first n_boot join); the
    bootstrap peers come back ordered by rank, then the standbys. All stopped after."""
    state = {"master": None, "peers": []}

    def start(n_boot, n_standby=0, **kw):
        kw = dict(dict(world_size=n_boot, heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0,
                       round_timeout_s=20.0), **kw)
        m = state["master"] = start_in_thread("127.0.0.1", 0, **kw)
        peers = [Peer(m.address, tmp_path, f"peer{i}") for i in range(n_boot + n_standby)]
        state["peers"].extend(peers)
        boot, standby = peers[:n_boot], peers[n_boot:]
        for p in boot:
            p.join()
        for p in boot:
            p.ready()
        boot.sort(key=lambda p: p.rank)
        assert [p.rank for p in boot] == list(range(n_boot))
        return m, boot, standby

    try:
        yield start
    finally:
        for p in state["peers"]:
            p.close()
        if state["master"] is not None:
            state["master"].stop()


# -- assertions ------------------------------------------------------------------


def ok(answers):
    """The sync results; fails with the peer's error if any sync raised."""
    for a in answers:
        assert a["error"] is None, (
            f"rank {a['rank']}: sync raised {a['error']['type']}: {a['error']['message']}\n"
            f"{a['error']['traceback']}")
    return [a["result"] for a in answers]


def assert_in_sync(answers):
    """Every peer holds the same bytes (independent sha256 and the library's hashes)
    and reports the same elected content, which is its own content digest."""
    first = answers[0]
    for a in answers:
        assert a["shas"] == first["shas"], f"rank {a['rank']} differs from rank {first['rank']}"
        assert a["hashes"] == first["hashes"], a["rank"]
        if a["result"] is not None:
            assert a["result"]["content"] == a["digest"], a["rank"]
    assert len({a["digest"] for a in answers}) == 1


def assert_quiet(results, revision):
    """A sync where nobody was outdated: no data-plane traffic, nothing changed."""
    for r in results:
        assert r["revision"] == revision
        assert (r["bytes_sent"], r["bytes_received"], r["changed"], r["retries"]) == (
            0, 0, [], 0), r


def failed(answers, exc_type):
    for a in answers:
        assert a["error"] is not None, f"rank {a['rank']}: the sync did not fail: {a['result']}"
        assert exc_type in a["error"]["mro"], (
            f"rank {a['rank']}: {a['error']['type']}, expected {exc_type}: "
            f"{a['error']['message']}\n{a['error']['traceback']}")
        assert a["unchanged"], f"rank {a['rank']}: the failed sync changed the state"
    return [a["error"]["message"] for a in answers]


def assert_healthy(peers):
    for a in call_all(peers, "all_reduce"):
        assert a["ok"] and a["world_size"] == len(peers), a


# -- 1. a joiner mid-training ------------------------------------------------------


def test_joiner_receives_the_trained_state_and_training_continues_in_parity(cluster):
    m, old, (joiner,) = cluster(3, 1)
    built = call_all(old, "build", kind="mlp", seed=1)
    state_bytes = built[0]["bytes"]
    assert state_bytes > 256 * 1024
    answers = sync_all(old, 0)
    assert_quiet(ok(answers), 0)
    assert_in_sync(answers)
    assert m.snapshot()["shared_state"]["revision"] == 0

    for step in (1, 2, 3):
        call_all(old, "outer_step")
        answers = sync_all(old, step)
        assert_quiet(ok(answers), step)
        assert_in_sync(answers)
    assert answers[0]["shas"] != built[0]["shas"], "training did not change the state"
    trained = answers[0]

    joiner.join()
    wait_until(lambda: m.snapshot()["pending"] == 1, 30, "the joiner pending")
    assert [a["pending"] for a in call_all(old, "pending")] == [True] * 3
    changes = call_all(old, "update")
    assert all(c["world_size"] == 4 and c["joined"] == ["peer3"] for c in changes)
    assert joiner.ready() == 3
    mine = joiner.call("build", kind="mlp", seed=2)       # another init
    differing = sorted(n for n in trained["shas"] if mine["shas"][n] != trained["shas"][n])
    assert len(differing) == len(trained["shas"])         # weights, momenta and step all differ

    everyone = old + [joiner]
    answers = sync_all(everyone, [3, 3, 3, 0])
    results = ok(answers)
    assert_in_sync(answers)
    assert answers[0]["shas"] == trained["shas"], "the incumbents' state was changed"
    j = results[3]
    assert j["revision"] == 3 and j["retries"] == 0
    assert sorted(j["changed"]) == differing
    assert j["bytes_received"] >= state_bytes
    assert j["bytes_sent"] < state_bytes / 4
    assert j["sources"] == [0, 1, 2]
    for r in results[:3]:
        assert r["changed"] == [] and r["sources"] == [0, 1, 2] and r["revision"] == 3
        assert r["bytes_received"] < state_bytes / 4, r
    # The load is shared: every incumbent served part of the joiner's download.
    assert all(r["bytes_sent"] > state_bytes / 6 for r in results[:3]), results
    assert sum(r["bytes_sent"] for r in results[:3]) >= state_bytes

    for step in (4, 5):          # the joiner's model (not just a copy) got the state
        call_all(everyone, "outer_step")
        answers = sync_all(everyone, step)
        assert_quiet(ok(answers), step)
        assert_in_sync(answers)
    assert m.snapshot()["shared_state"]["revision"] == 5


# -- 2 + 5. a drifted peer is repaired; the revision rule ----------------------------


def test_tampered_entry_is_repaired_alone_and_revisions_advance_by_one(cluster):
    m, peers, _ = cluster(3)
    built = call_all(peers, "build", kind="blob", seed=3, entries=8, entry_elems=65536)
    nbytes = built[0]["nbytes"]
    assert_quiet(ok(sync_all(peers, 0)), 0)
    assert_quiet(ok(sync_all(peers, 1)), 1)

    bad = peers[1]
    bad.call("tamper", name="blob5", delta=1.0)
    answers = sync_all(peers, 1)         # the same revision again is allowed
    results = ok(answers)
    assert_in_sync(answers)
    assert answers[0]["shas"] == built[0]["shas"]
    assert list(results[1]["changed"]) == ["blob5"]
    assert nbytes["blob5"] <= results[1]["bytes_received"] < nbytes["blob5"] + 64 * 1024
    assert results[1]["sources"] == [0, 2]
    for r in (results[0], results[2]):
        assert r["changed"] == [] and r["bytes_received"] < 64 * 1024, r
    assert results[0]["bytes_sent"] + results[2]["bytes_sent"] >= nbytes["blob5"]

    for rev in (2, 3, 4, 5):
        assert_quiet(ok(sync_all(peers, rev)), rev)
    assert m.snapshot()["shared_state"]["revision"] == 5

    # One incumbent skips a revision: refused on every peer, nothing changes.
    messages = failed(sync_all(peers, [6, 7, 6]), "InvalidUsageError")
    assert all("revision 7" in msg for msg in messages), messages
    # Backwards is refused too.
    failed(sync_all(peers, 4), "InvalidUsageError")
    assert m.snapshot()["shared_state"]["revision"] == 5
    assert_healthy(peers)
    answers = sync_all(peers, 6)
    assert_quiet(ok(answers), 6)
    assert_in_sync(answers)


# -- 3. a source dies mid-transfer ----------------------------------------------------


def test_source_killed_mid_transfer_the_sync_retries_on_the_survivors(cluster):
    m, old, (joiner,) = cluster(3, 1)
    entry_elems = 6 * MIB // 4                   # 6 entries of 6 MiB: 36 MiB
    built = call_all(old, "build", kind="blob", seed=1, entries=6, entry_elems=entry_elems)
    state_bytes = built[0]["bytes"]
    assert_quiet(ok(sync_all(old, 0)), 0)

    joiner.join()
    wait_until(lambda: m.snapshot()["pending"] == 1, 30, "the joiner pending")
    call_all(old, "update")
    assert joiner.ready() == 3
    joiner.call("build", kind="blob", seed=2, entries=6, entry_elems=entry_elems)

    victim, survivors = old[1], [old[0], old[2]]
    victim.call("arm_kill", fraction=0.5)
    started = time.monotonic()
    for p in old + [joiner]:
        p.send("sync", revision=0)
    killing = victim.recv(STEP_S, "killing")
    assert killing["ops"] >= 2 and killing["sends"] == killing["ops"], killing
    assert victim.proc.wait(30) == -signal.SIGKILL
    answers = [p.recv(4 * T + 40, "sync") for p in survivors + [joiner]]
    elapsed = time.monotonic() - started
    results = ok(answers)
    assert_in_sync(answers)
    assert answers[0]["shas"] == built[0]["shas"]
    j = results[2]
    assert j["retries"] >= 1
    assert sorted(j["changed"]) == sorted(built[0]["shas"])
    assert state_bytes <= j["bytes_received"] < 2 * state_bytes
    assert sorted(j["sources"]) == [0, 1]                   # the survivors, in a world of 3
    for r in results[:2]:
        assert r["retries"] >= 1 and r["changed"] == [], r
    assert all(a["world_size"] == 3 for a in answers)
    assert elapsed < 2 * T + 10, f"the sync took {elapsed:.1f} s"
    assert_healthy(survivors + [joiner])


def test_the_only_source_killed_mid_transfer_the_joiner_gets_the_state_of_who_is_left(cluster):
    """Nobody has synced yet, and every peer holds other bytes: the lowest rank's win, so it
    is the only source. It dies half-way through serving; the retried sync elects among the
    survivors, and the joiner ends with the survivor's state (nothing half-written)."""
    m, old, (joiner,) = cluster(2, 1)
    entry_elems = 6 * MIB // 4
    joiner.join()
    wait_until(lambda: m.snapshot()["pending"] == 1, 30, "the joiner pending")
    call_all(old, "all_reduce")      # a collective first: the next update is a real one
    call_all(old, "update")
    assert joiner.ready() == 2                   # its rank in the world of 3
    built = {}
    for seed, p in enumerate(old + [joiner], start=1):
        built[p.name] = p.call("build", kind="blob", seed=seed, entries=6,
                               entry_elems=entry_elems)
    ranks = {p.name: p.call("world")["rank"] for p in old + [joiner]}
    source = min(old, key=lambda p: ranks[p.name])
    left = [p for p in old if p is not source][0]
    source.call("arm_kill", fraction=0.5)
    for p in old + [joiner]:
        p.send("sync", revision=0)
    source.recv(STEP_S, "killing")
    assert source.proc.wait(30) == -signal.SIGKILL
    answers = [p.recv(4 * T + 40, "sync") for p in (left, joiner)]
    results = ok(answers)
    assert_in_sync(answers)
    assert answers[0]["shas"] == built[left.name]["shas"], "the survivor's state won"
    assert results[1]["retries"] >= 1
    assert all(a["world_size"] == 2 for a in answers)
    assert_healthy([left, joiner])


# -- 4. layouts differ ----------------------------------------------------------------


def test_layout_mismatch_raises_on_every_peer_and_changes_nothing(cluster):
    m, peers, _ = cluster(3)
    call_all(peers, "build", kind="blob", seed=4, entries=3, entry_elems=1000)
    assert_quiet(ok(sync_all(peers, 0)), 0)

    odd = peers[2]
    odd.call("add_entry", name="extra")
    messages = failed(sync_all(peers, 1), "MismatchError")
    assert all("extra" in msg for msg in messages), messages
    assert_healthy(peers)
    odd.call("remove_entry", name="extra")

    odd = peers[0]                   # the lowest rank: not the one that serves the manifest
    odd.call("reshape_entry", name="blob1")
    messages = failed(sync_all(peers, 1), "MismatchError")
    assert all("blob1" in msg for msg in messages), messages
    assert_healthy(peers)

    call_all(peers, "build", kind="blob", seed=4, entries=3, entry_elems=1000)
    peers[1].call("retype_entry", name="blob2")
    messages = failed(sync_all(peers, 1), "MismatchError")
    assert all("blob2" in msg for msg in messages), messages
    assert_healthy(peers)

    # Once the layouts agree again the group syncs normally.
    call_all(peers, "build", kind="blob", seed=4, entries=3, entry_elems=1000)
    answers = sync_all(peers, 1)
    assert_quiet(ok(answers), 1)
    assert_in_sync(answers)


# -- 6. strategies --------------------------------------------------------------------


def test_receive_only_is_repaired_never_serves_and_send_only_is_never_overwritten(cluster):
    m, peers, _ = cluster(3)
    built = call_all(peers, "build", kind="blob", seed=5, entries=4, entry_elems=4096)
    assert_quiet(ok(sync_all(peers, 0)), 0)

    # A receive_only peer with other content is repaired; it never serves.
    a, b, c = peers
    c.call("tamper", name="blob0")
    answers = sync_all(peers, 1, **{c.name: {"strategy": "receive_only"}})
    results = ok(answers)
    assert_in_sync(answers)
    assert list(results[2]["changed"]) == ["blob0"]
    assert all(r["sources"] == [0, 1] for r in results), results

    # Now c holds the elected content, but as receive_only it is still no source:
    # b drifts and is served by a alone.
    b.call("tamper", name="blob3")
    answers = sync_all(peers, 1, **{c.name: {"strategy": "receive_only"}})
    results = ok(answers)
    assert_in_sync(answers)
    assert list(results[1]["changed"]) == ["blob3"]
    assert results[0]["changed"] == results[2]["changed"] == []
    assert all(r["sources"] == [0] for r in results), results
    assert results[2]["bytes_sent"] < 8192, "the receive_only peer served data"

    # A send_only peer whose content lost the vote raises; the others finish.
    b.call("tamper", name="blob2")
    answers = sync_all(peers, 2, **{b.name: {"strategy": "send_only"}})
    failed([answers[1]], "MismatchError")
    assert "send_only" in answers[1]["error"]["message"]
    results = ok([answers[0], answers[2]])
    assert all(r["changed"] == [] and r["revision"] == 2 for r in results)
    assert answers[0]["shas"] == answers[2]["shas"] == built[0]["shas"]
    assert answers[1]["shas"]["blob2"] != built[0]["shas"]["blob2"]
    assert_healthy(peers)

    # Syncing as enforce_popular, b takes the elected blob2.
    answers = sync_all(peers, 2)
    results = ok(answers)
    assert_in_sync(answers)
    assert sorted(results[1]["changed"]) == ["blob2"]
    assert answers[0]["shas"] == built[0]["shas"]

    # A send_only peer in the majority serves as usual.
    a.call("tamper", name="blob1")
    answers = sync_all(peers, 3, **{b.name: {"strategy": "send_only"}})
    results = ok(answers)
    assert_in_sync(answers)
    assert sorted(results[0]["changed"]) == ["blob1"]
    assert results[1]["changed"] == results[2]["changed"] == []
    assert all(r["sources"] == [1, 2] for r in results), results
    assert answers[0]["shas"] == built[0]["shas"]


# -- 7. a joiner without the memory to stage ----------------------------------------


def test_peer_that_cannot_stage_fails_alone_with_out_of_memory(cluster):
    m, peers, _ = cluster(3)
    entry_elems = 16 * MIB // 4                  # 4 entries of 16 MiB: 64 MiB
    built = [p.call("build", kind="blob", seed=1 if p.rank < 2 else 2, entries=4,
                    entry_elems=entry_elems) for p in peers]
    assert built[2]["shas"] != built[0]["shas"]

    answers = sync_all(peers, 0, **{peers[2].name: {"as_headroom_mib": 16}})
    poor = answers[2]
    failed([poor], "OutOfMemoryError")
    assert poor["shas"] == built[2]["shas"]
    results = ok(answers[:2])
    assert all(r["changed"] == [] for r in results)
    assert answers[0]["shas"] == answers[1]["shas"] == built[0]["shas"]

    # With its memory back, the same peer is repaired by the next sync.
    answers = sync_all(peers, 0)
    results = ok(answers)
    assert_in_sync(answers)
    assert answers[0]["shas"] == built[0]["shas"]
    assert sorted(results[2]["changed"]) == sorted(built[0]["shas"])
