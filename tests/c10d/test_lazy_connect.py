"""A subgroup connects in the background (torch_pccl/c10d/pending_connect.py,
``PCCL_LAZY_CONNECT``): ``new_group`` returns once the rank has published its address, and
the group's first op waits for the connect.

- ``PendingConnect`` on its own (in this process, no sockets): its lanes once connected;
  a failed connect raised by every waiter as a fresh exception of its class (a store's
  timeout as ``PcclTimeoutError``); an abort ending every wait at once, and lanes that a
  connect brings after it aborted and closed; a wait bounded by its deadline.
- Two ranks of a ``tcp://`` world: rank 1 calls ``new_group`` only after rank 0's has
  returned (a store key rank 0 sets then), and both reduce over the subgroup. With
  ``PCCL_LAZY_CONNECT=0`` rank 0's ``new_group`` waits for rank 1's address, which never
  comes: both give up at the store's deadline (the test of the feature).
- A subgroup whose peer never calls ``new_group``: its creation returns, its first op and
  the next raise ``PcclTimeoutError`` at the store's deadline, and the world then shuts down
  at once.
- ``detached_read``: the wait for the peers' addresses runs on a clone of the store, and
  a ``set`` on the caller's own client meanwhile returns at once (a TCPStore client serves
  one request at a time: the wait there held it until the peer came, who waited for it).
- Lanes on demand: a subgroup of 3 lanes runs its first op with lane 0 and its thread alone,
  opens the others (connections and threads) with the first op that runs on one, and a
  group that ran one op is destroyed without opening them. A lane thread that cannot start
  fails its op with ``PcclSystemError`` before the op takes a lane.
"""

import threading

import pytest

from harness.tcp_ranks import run_tcp_ranks

from torch_pccl.c10d.pending_connect import PendingConnect, detached_read
from torch_pccl.errors import AbortedError, PcclError, PcclTimeoutError, PeerLostError


class FakeLanes:
    def __init__(self):
        self.aborted = False
        self.closed = threading.Event()

    def abort(self):
        self.aborted = True

    def close(self):
        self.closed.set()


def test_the_lanes_once_connected():
    lanes = FakeLanes()
    pending = PendingConnect(lambda: lanes, 30.0)
    assert pending.wait() is lanes
    assert pending.done and pending.lanes is lanes and pending.error is None


def test_a_failed_connect_is_raised_by_every_waiter_as_its_own_exception():
    def fail():
        e = PeerLostError("peer lost: rank 1 did not come", 4, "detail")
        e.unreached_ranks = (1,)
        raise e

    pending = PendingConnect(fail, 30.0)
    raised = []
    for _ in range(2):
        with pytest.raises(PeerLostError) as info:
            pending.wait()
        raised.append(info.value)
        assert info.value.unreached_ranks == (1,) and info.value.detail == "detail"
        assert "rank 1 did not come" in str(info.value)
    assert raised[0] is not raised[1]
    assert pending.lanes is None


def test_a_store_timeout_is_a_timeout_and_anything_else_a_pccl_error():
    import torch.distributed as dist

    def store_timeout():
        raise dist.DistStoreError("wait timeout after 3000ms, keys: /pccl/1/addr/1")

    with pytest.raises(PcclTimeoutError, match="could not connect: DistStoreError"):
        PendingConnect(store_timeout, 30.0).wait()

    def broken():
        raise OSError("no route")

    with pytest.raises(PcclError, match="could not connect: OSError: no route"):
        PendingConnect(broken, 30.0).wait()


def test_an_abort_ends_every_wait_and_lanes_that_come_later_are_closed():
    release, lanes = threading.Event(), FakeLanes()

    def slow():
        assert release.wait(30)
        return lanes

    pending = PendingConnect(slow, 30.0)
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(_raised(pending.wait)))
    waiter.start()
    pending.abort()
    waiter.join(30)
    assert not waiter.is_alive()
    assert isinstance(errors[0], AbortedError)
    release.set()
    # The connect's thread ends on its own: the lanes it brings are aborted and closed.
    assert lanes.closed.wait(30)
    assert lanes.aborted
    assert pending.lanes is None


def test_a_wait_is_bounded_by_its_deadline():
    release = threading.Event()
    pending = PendingConnect(lambda: release.wait(30) and FakeLanes(), 0.05)
    with pytest.raises(PcclTimeoutError, match="did not end within 0.05 s"):
        pending.wait()
    release.set()


class Probe:
    """A store's check/multi_get/clone; a clone's multi_get tells ``waiting`` it started."""

    def __init__(self, store, waiting):
        self.store, self.waiting = store, waiting

    def check(self, keys):
        return self.store.check(keys)

    def multi_get(self, keys):
        return self.store.multi_get(keys)

    def clone(self):
        probe = Probe(self.store.clone(), self.waiting)
        probe.multi_get = lambda keys: (self.waiting.set(), probe.store.multi_get(keys))[1]
        return probe


def test_the_wait_for_the_peers_holds_no_other_store_call():
    import time
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=20))
    waiting, got = threading.Event(), []
    read = detached_read(Probe(store, waiting))
    reader = threading.Thread(target=lambda: got.append(read(["a", "b"])))
    store.set("a", "1")
    reader.start()
    assert waiting.wait(20), "the read did not wait on a clone"
    started = time.monotonic()
    store.set("unrelated", "x")     # the caller's own client, while the clone waits
    assert time.monotonic() - started < 5.0
    store.set("b", "2")
    reader.join(20)
    assert got == [[b"1", b"2"]]
    assert detached_read(store)(["a", "b"]) == [b"1", b"2"]   # all there: no clone needed


def test_a_lane_thread_that_cannot_start_fails_its_op_before_the_op_takes_a_lane(monkeypatch):
    from torch_pccl.c10d.scheduler import LaneScheduler
    from torch_pccl.core.lanes import LaneSet
    from torch_pccl.errors import PcclSystemError

    lane0 = LaneSet(["lane 0"])
    scheduler = LaneScheduler(lane0, "t", PendingConnect(lambda: lane0, 30.0), count=3)
    assert len(scheduler.executors) == 1 and scheduler.lane_count == 3
    ran = []
    scheduler.collective(ran.append, [], inline=True).wait()
    assert ran == ["lane 0"]

    def no_thread(lane):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(scheduler, "_executor", no_thread)
    with pytest.raises(PcclSystemError, match="could not start a lane's thread"):
        scheduler.collective(ran.append, [], inline=True)
    assert scheduler.issued == 1 and len(scheduler.executors) == 1   # the op took no lane
    scheduler.close(drain=True)


def _raised(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None



ORDERED = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch_pccl
rank, world, port = map(int, sys.argv[1:4])
dist.init_process_group("pccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=4))
store = dist.distributed_c10d._get_default_store()
out = {"rank": rank}
try:
    if rank == 1:
        store.wait(["rank0-formed"], timedelta(seconds=8))
    group = dist.new_group([0, 1])
    if rank == 0:
        store.set("rank0-formed", "1")
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x, group=group)
    out["sum"] = x.tolist()
except Exception as e:
    out["error"] = type(e).__name__
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_subgroup_is_formed_before_its_peers_arrive(monkeypatch):
    monkeypatch.setenv("PCCL_MASTER", "0")
    monkeypatch.delenv("PCCL_LAZY_CONNECT", raising=False)
    results = run_tcp_ranks(ORDERED, 2, timeout_s=90)
    assert [r.get("sum") for r in results] == [[3.0, 3.0, 3.0]] * 2, results


@pytest.mark.timeout(120)
def test_connecting_at_creation_waits_for_the_peers(monkeypatch):
    monkeypatch.setenv("PCCL_MASTER", "0")
    monkeypatch.setenv("PCCL_LAZY_CONNECT", "0")
    results = run_tcp_ranks(ORDERED, 2, timeout_s=90)
    # Rank 0 waits in new_group for rank 1's address, rank 1 for rank 0's key.
    assert all("error" in r for r in results), results


ABSENT = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch_pccl
rank, world, port = map(int, sys.argv[1:4])
dist.init_process_group("pccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=3))
store = dist.distributed_c10d._get_default_store()
out = {"rank": rank}
if rank == 0:
    started = time.monotonic()
    group = dist.new_group([0, 1])
    out["created_s"] = time.monotonic() - started
    out["errors"] = []
    for _ in range(2):
        try:
            dist.all_reduce(torch.ones(2), group=group)
        except Exception as e:
            out["errors"].append(type(e).__name__)
    store.set("rank0-done", "1")
    started = time.monotonic()
    dist.destroy_process_group()
    out["destroy_s"] = time.monotonic() - started
else:
    store.wait(["rank0-done"], timedelta(seconds=60))
    dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_subgroup_whose_peer_never_comes_fails_its_ops_not_its_creation(monkeypatch):
    monkeypatch.setenv("PCCL_MASTER", "0")
    monkeypatch.delenv("PCCL_LAZY_CONNECT", raising=False)
    first, _ = run_tcp_ranks(ABSENT, 2, timeout_s=90)
    assert first["created_s"] < 2.0, first        # not the store's 3 s deadline
    assert first["errors"] == ["PcclTimeoutError"] * 2, first
    assert first["destroy_s"] < 2.0, first


DEFERRED = r"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import torch_pccl
rank, world, port = map(int, sys.argv[1:4])
dist.init_process_group("pccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=20))
out = {"rank": rank}
group = dist.new_group(list(range(world)))
pg = group._get_backend(torch.device("cpu"))
x = torch.full((3,), float(rank + 1))
dist.all_reduce(x, group=group)
out["after_one"] = [len(pg.scheduler.lanes), len(pg.scheduler.executors), pg.num_lanes]
bufs = [torch.full((1000,), float(rank + k)) for k in range(7)]
works = [dist.all_reduce(b, group=group, async_op=True) for b in bufs]
for w in works:
    w.wait()
out["after_many"] = [len(pg.scheduler.lanes), len(pg.scheduler.executors)]
out["sums"] = [x[0].item()] + [b[0].item() for b in bufs]
# A group that ran one op is destroyed without opening its other lanes.
once = dist.new_group(list(range(world)))
dist.all_reduce(torch.ones(1), group=once)
once_pg = once._get_backend(torch.device("cpu"))
dist.destroy_process_group(once)
out["once"] = len(once_pg.scheduler.lanes)
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_subgroup_opens_its_other_lanes_with_the_op_that_first_needs_one(monkeypatch):
    monkeypatch.setenv("PCCL_MASTER", "0")
    monkeypatch.setenv("PCCL_LANES", "3")
    monkeypatch.delenv("PCCL_LAZY_CONNECT", raising=False)
    results = run_tcp_ranks(DEFERRED, 3, timeout_s=90)
    for r in results:
        assert r["after_one"] == [1, 1, 3], r       # lane 0 and its thread alone
        assert r["after_many"] == [3, 3], r
        assert r["sums"] == [6.0] + [float(3 * k + 3) for k in range(7)], r
        assert r["once"] == 1, r
