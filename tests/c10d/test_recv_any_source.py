"""dist.recv / dist.irecv with no src: the first sender wins, the sender is reported, one
peer's messages keep their order, tags select, and nobody sending is a prompt timeout."""

import re

import pytest

pytestmark = pytest.mark.timeout(120)

# What torch's own tests accept as a timeout's message (distributed_test.py).
TORCH_TIMEOUT = re.compile(" (Timed out|closed|timeout) ")


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_every_rank_receives_from_any_source(pools, world_size):
    res = pools.get(world_size).run("fidelity.recv_any_source", 10, deadline_s=60)
    for rank, r in enumerate(res):
        assert r["faithful"], f"rank {rank}: a received tensor does not hold its sender's rank"
        others = [p for p in range(world_size) if p != rank]
        assert sorted(r["senders"]) == sorted(others * 2), (rank, r["senders"])


def test_one_peers_messages_arrive_in_order(pools):
    got = pools.get(2).run("fidelity.recv_any_source_order", 20, deadline_s=60)[0]
    assert got == [(1, float(i)) for i in range(20)]


def test_tag_selects_the_sender(pools):
    """Rank 1's message (tag 9) reaches rank 0 first; a receive of tag 4 from any source
    passes it over and takes rank 2's; rank 1's is then received by src and tag."""
    got = pools.get(3).run("fidelity.recv_any_source_tag", deadline_s=60)[0]
    assert got == [(2, 2.0), (1, 1.0)]


@pytest.mark.pccl_only
def test_nobody_sends_times_out_in_torchs_words(fresh_group):
    timeout_s = 2.0
    pool = fresh_group(2, timeout_s)
    rec = pool.run("fidelity.recv_any_source_expecting_timeout", ranks=[0], deadline_s=30)[0]
    assert rec is not None, "recv from any source returned although nobody sent"
    assert "PcclTimeoutError" in rec["mro"], rec
    assert TORCH_TIMEOUT.search(rec["message"]), rec["message"]
    assert f"Timed out waiting {int(timeout_s * 1000)}ms" in rec["message"], rec["message"]
    assert timeout_s - 0.1 <= rec["elapsed"] < timeout_s + 5, rec["elapsed"]
    assert rec["unchanged"], "the failed receive wrote the tensor"
