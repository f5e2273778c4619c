"""Failures: a SIGKILLed peer, a silent peer, mismatched calls. Each test owns its processes.

Every group here is created with a short timeout T (init_process_group(timeout=T)).
The assertions: the survivors get a PcclError subclass (the specific one where
the design names it) within 2*T, measured inside the worker around the call;
the error is sticky; the caller's tensor is left as it was; nobody hangs.
"""

import signal

import pytest

pytestmark = [pytest.mark.timeout(90), pytest.mark.pccl_only]

T = 3.0  # seconds: the groups' timeout
# A dead peer is seen as a closed or reset connection (or reported by the rank that saw
# it), not by waiting out the deadline.
PEER_DEATH = ("PeerLostError", "RemoteError", "PcclSystemError")


def assert_pccl_error(rec, what, within=2 * T, classes=("PcclError",)):
    assert rec is not None, f"{what}: returned without an error"
    assert set(classes) & set(rec["mro"]), (
        f"{what}: raised {rec['type']} ({' < '.join(rec['mro'])}), expected one of {classes}: "
        f"{rec['message']}\n{rec['traceback']}"
    )
    assert rec["elapsed"] < within, f"{what}: {rec['type']} after {rec['elapsed']:.2f}s (limit {within}s)"


def wait_tags(pool, ranks, tag):
    for r in ranks:
        got, _ = pool.recv(r, 30, f"{tag!r} message")
        assert got == tag, f"rank {r}: expected {tag!r}, got {got!r}"


@pytest.mark.parametrize(
    "world_size,victim,mode",
    [(2, 1, "sync"), (3, 1, "sync"), (4, 2, "sync"), (2, 0, "wait"), (3, 2, "future")],
)
def test_sigkilled_peer_mid_collective(fresh_group, world_size, victim, mode):
    pool = fresh_group(world_size, T)
    survivors = [r for r in range(world_size) if r != victim]
    pool.run("all_reduce", 1, 1000, "float32", "SUM", deadline_s=30)  # links are up and working
    pool.send(victim, "wait_for_parent")
    for r in survivors:
        pool.send(r, "report_and_all_reduce", 200_000, mode)
    wait_tags(pool, [victim], "waiting")
    wait_tags(pool, survivors, "entering")
    pool.kill(victim, signal.SIGKILL)
    for r in survivors:
        res = pool.result(r, 2 * T + 10, "the failed all_reduce")
        # Every survivor, neighbour of the victim or not, names the cause: a lost peer
        # (non-neighbours learn it from an ABORT frame that carries the origin's code).
        if mode == "future":
            # A torch future fails with a C++ error (what DDP's reducer needs): RuntimeError
            # naming the class, as gloo's futures raise.
            assert_pccl_error(res["error"], f"rank {r} (future) after rank {victim} was killed",
                              classes=("RuntimeError",))
            assert "PeerLostError: peer lost" in res["error"]["message"], res["error"]
        else:
            assert_pccl_error(res["error"], f"rank {r} ({mode}) after rank {victim} was killed",
                              classes=("PeerLostError",))
        assert res["unchanged"], f"rank {r}: the failed all_reduce modified the tensor"
    # Sticky: every later call fails again, at once, without waiting for a timeout.
    results = pool.run("all_reduce_expecting_error", 10, ranks=survivors, deadline_s=2 * T + 10)
    for r, rec in zip(survivors, results):
        assert_pccl_error(rec, f"rank {r}: second all_reduce (sticky)", within=1.0)


def test_ddp_backward_with_a_sigkilled_peer_raises(fresh_group):
    """A peer dies in the middle of DDP's backward: the survivors' ``loss.backward()``
    raises promptly, naming the lost peer, and their processes live on. (A future failed
    with a Python exception object crashed DDP's reducer: a segfault.)"""
    pool = fresh_group(3, T)
    for r in range(3):
        pool.send(r, "ddp_backward_expecting_error", 1)
    wait_tags(pool, [0, 1, 2], "entering")
    for r in (0, 2):
        res = pool.result(r, 2 * T + 20, "the backward")
        assert_pccl_error(res["error"], f"rank {r}: DDP backward after rank 1 was killed",
                          classes=("RuntimeError",))
        assert any(name in res["error"]["message"] for name in PEER_DEATH), res["error"]
        assert res["alive"]


def test_sigkilled_peer_while_idle(fresh_group):
    """The peer dies between collectives; the next collective fails promptly on the others."""
    pool = fresh_group(3, T)
    pool.run("all_reduce", 1, 1000, "float32", "SUM", deadline_s=30)
    pool.kill(1, signal.SIGKILL)
    results = pool.run("all_reduce_expecting_error", 1000, ranks=[0, 2], deadline_s=2 * T + 10)
    for r, rec in zip([0, 2], results):
        assert_pccl_error(rec, f"rank {r} after rank 1 died idle", classes=PEER_DEATH)


@pytest.mark.parametrize("world_size", (2, 3))
def test_silent_peer_times_out(fresh_group, world_size):
    """The last rank stays alive but never calls the collective: a timeout, not a hang."""
    pool = fresh_group(world_size, T)
    silent = world_size - 1
    waiting = list(range(silent))
    pool.run("all_reduce", 1, 1000, "float32", "SUM", deadline_s=30)
    pool.send(silent, "wait_for_parent")
    for r in waiting:
        pool.send(r, "report_and_all_reduce", 1000, "sync")
    wait_tags(pool, [silent], "waiting")
    wait_tags(pool, waiting, "entering")
    timed_out = 0
    for r in waiting:
        res = pool.result(r, 2 * T + 10, "the timed-out all_reduce")
        rec = res["error"]
        # The silent rank's ring neighbour times out; another rank may instead be told
        # by that neighbour's ABORT frame (RemoteError), possibly sooner.
        assert_pccl_error(rec, f"rank {r}", classes=("PcclTimeoutError", "RemoteError"))
        if "PcclTimeoutError" in rec["mro"]:
            timed_out += 1
            assert "TimeoutError" in rec["mro"], "PcclTimeoutError must also be a TimeoutError"
            assert rec["elapsed"] > 0.5 * T, f"rank {r}: timed out after {rec['elapsed']:.2f}s < T/2"
        assert res["unchanged"], f"rank {r}: the timed-out all_reduce modified the tensor"
    assert timed_out >= 1, "no rank reported PcclTimeoutError"
    pool.conns[silent].send("go")
    assert pool.result(silent, 10, "release") == "go"


MISMATCHES = {
    # kind: whether the frame header lets the ranks name it a mismatch
    "size": True,
    "dtype": True,
    "op": True,
    "collective": True,
    "broadcast_root": False,
    "all_gather_size": False,
}


@pytest.mark.parametrize(
    "world_size,kind", [(2, k) for k in MISMATCHES] + [(3, "size"), (3, "collective")]
)
def test_mismatched_calls_fail_on_every_rank(fresh_group, world_size, kind):
    pool = fresh_group(world_size, T)
    pool.run("all_reduce", 1, 100, "float32", "SUM", deadline_s=30)
    records = pool.run("mismatched_call", kind, deadline_s=2 * T + 10)
    if kind == "broadcast_root" and any(rec is None for rec in records):
        # Every rank thinks it is the root, so every rank only sends: the call itself
        # may succeed. The stray frames must then fail the next collective on that
        # lane, on every rank, instead of being taken as its data.
        records = pool.run("same_lane_expecting_error", 8, deadline_s=2 * T + 10)
    for r, rec in enumerate(records):
        assert_pccl_error(rec, f"rank {r}, mismatched {kind}")
    if MISMATCHES[kind]:
        names = [rec["type"] for rec in records]
        assert "MismatchError" in names, f"mismatched {kind}: no rank said MismatchError: {names}"
        for rec in records:
            assert rec["type"] in ("MismatchError", "RemoteError"), (
                f"mismatched {kind}: {rec['type']}: {rec['message']}"
            )


def test_survivors_rebuild_a_working_group(fresh_group):
    pool = fresh_group(3, T)
    pool.run("all_reduce", 1, 1000, "float32", "SUM", deadline_s=30)
    pool.kill(2, signal.SIGKILL)
    results = pool.run("all_reduce_expecting_error", 1000, ranks=[0, 1], deadline_s=2 * T + 10)
    for r, rec in zip([0, 1], results):
        assert_pccl_error(rec, f"rank {r} after rank 2 died")
    store = pool.new_store()
    results = pool.run("rebuild_and_all_reduce", ranks=[0, 1], deadline_s=60,
                       per_rank_args={0: (0, 2, store.port, T, 1.0), 1: (1, 2, store.port, T, 2.0)})
    assert results == [[3.0] * 5, [3.0] * 5]
