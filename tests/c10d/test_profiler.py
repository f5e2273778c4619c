"""Every collective and p2p op shows up in the profiler as gloo's do: "<backend>:<op>",
with the input shapes, marked async, for sync and async calls, under torch.autograd.profiler
and torch.profiler alike (torch's _DistTestBase.call_dist_op checks exactly these)."""

import pytest

pytestmark = pytest.mark.timeout(120)

# Ops gloo implements with another op, so its event is named after that one:
# reduce_scatter_tensor runs as an all_reduce of the whole input (same shapes) on gloo.
GLOO_NAMES = {"reduce_scatter_tensor": "all_reduce"}


@pytest.mark.parametrize("profiler", ("autograd", "torch"))
@pytest.mark.parametrize("async_op", (False, True))
@pytest.mark.parametrize("world_size", (2, 3))
def test_events_match_gloo(pools, world_size, async_op, profiler):
    pool = pools.get(world_size)
    ours = pool.run("fidelity.profiled_ops", "default", async_op, profiler, deadline_s=60)
    gloo = pool.run("fidelity.profiled_ops", "gloo", async_op, profiler, deadline_s=60)
    for rank in range(world_size):
        assert len(ours[rank]) == 14, f"rank {rank}: expected one event per op, got {ours[rank]}"
        assert all(is_async for _, is_async, _ in ours[rank]), ours[rank]
        # Async ops may start their events in any order: compare as multisets.
        mine = sorted((GLOO_NAMES.get(n, n), str(s)) for n, _, s in ours[rank])
        theirs = sorted((n, str(s)) for n, _, s in gloo[rank])
        assert mine == theirs, f"rank {rank}:\n pccl {ours[rank]}\n gloo {gloo[rank]}"
        assert {"send", "recv"} <= {n for n, _, _ in ours[rank]}

