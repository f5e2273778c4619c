"""monitored_barrier names the ranks that did not arrive, in gloo's words: rank 0 says
"Rank 1 failed to pass monitoredBarrier" (all of them with wait_all_ranks) and the others
"successfully reached monitoredBarrier, but received errors ... from rank 0".

On gloo the worker calls dist.monitored_barrier; on pccl (where torch refuses it for any
backend but gloo) torch_pccl.monitored_barrier, or the group's own method."""

import pytest

pytestmark = pytest.mark.timeout(120)

T = 1.5  # seconds: the monitored barrier's timeout


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("subgroup", (False, True))
def test_everyone_arrives(fresh_group, world_size, subgroup):
    pool = fresh_group(world_size, 10.0)
    for wait_all in (False, True):
        recs = pool.run("fidelity.monitored_barrier", T, wait_all, subgroup, deadline_s=30)
        assert recs == [None] * world_size, recs
    # The group still works afterwards.
    pool.run("all_reduce", 1, 100, "float32", "SUM", deadline_s=30)


@pytest.mark.parametrize("wait_all_ranks", (False, True))
def test_missing_ranks_are_named(fresh_group, wait_all_ranks):
    """World of 4, ranks 1 and 3 never call it."""
    pool = fresh_group(4, 10.0)
    recs = pool.run("fidelity.monitored_barrier", T, wait_all_ranks, ranks=[0, 2], deadline_s=30)
    zero, two = recs
    assert zero is not None and two is not None, recs
    named = "Ranks 1, 3" if wait_all_ranks else "Rank 1"
    assert f"{named} failed to pass monitoredBarrier" in zero["message"], zero["message"]
    assert "RuntimeError" in zero["mro"]
    # Rank 0 waits out the timeout, counted from the first of the two to enter: on pccl,
    # rank 2's own timeout aborts the group and ends rank 0's wait with it. Rank 0 can
    # enter ~0.1 s after rank 2 (its first import of harness.fidelity ran a full garbage
    # collection: its process also holds the fixed world's master).
    first = min(zero["started"], two["started"])
    assert zero["started"] + zero["elapsed"] >= first + T - 0.1, (zero, two)
    assert zero["elapsed"] < T + 5, zero["elapsed"]
    assert ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting "
            "for send/recv from rank 0") in two["message"], two["message"]
    assert two["elapsed"] < T + 5, two["elapsed"]


@pytest.mark.pccl_only
def test_group_method_and_zero_timeout(fresh_group):
    """torch's tests call group.monitored_barrier(timeout) directly; a zero timeout fails
    at once on rank 0 ("Rank 0 timed out in monitoredBarrier")."""
    pool = fresh_group(2, 10.0)
    assert pool.run("fidelity.monitored_barrier_method", T, deadline_s=30) == [None, None]
    rec = pool.run("fidelity.monitored_barrier_method", 0.0, ranks=[0], deadline_s=30)[0]
    assert rec is not None and "Rank 0 timed out in monitoredBarrier" in rec["message"], rec
    assert rec["elapsed"] < 1.0
