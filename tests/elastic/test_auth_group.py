"""A run with a shared secret, end to end: peers with the secret (PCCL_SECRET) form a group
through a master that requires it and all-reduce as without one; a process without it, or
with a wrong one, is refused at the master with an AuthenticationError and learns nothing,
and the group carries on and still admits a peer that has it. Every process is killed in a
finally; every wait is bounded."""

import pytest

from harness.elastic_peer import START_S, assert_sum, start_peer
from harness.worker_process import call_all, wait_until
from torch_pccl.master import start_in_thread

pytestmark = [pytest.mark.timeout(120), pytest.mark.pccl_only]

SECRET = "the run's shared secret, 32 chars"
T = 5.0


def test_secret_run_refuses_strangers_and_carries_on(tmp_path):
    master = start_in_thread("127.0.0.1", 0, world_size=2, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=5.0, round_timeout_s=15.0,
                             secret=SECRET.encode())
    peers = []
    try:
        peers = [start_peer(master.address, tmp_path, f"peer{i}", T, PCCL_SECRET=SECRET)
                 for i in range(2)]
        for p in peers:
            p.recv(START_S, "ready")
        assert_sum(call_all(peers, "all_reduce", 30), 2)

        for name, secret in (("nosecret", None), ("wrongsecret", "a wrong secret, 16+ chars")):
            stranger = start_peer(master.address, tmp_path, name, T, PCCL_SECRET=secret)
            peers.append(stranger)
            assert stranger.proc.wait(START_S) != 0
            err = stranger.stderr()
            assert "AuthenticationError" in err, err
            assert ("requires the shared secret" in err if secret is None
                    else "the secrets differ" in err), err
            # Never registered: the master holds no state of it.
            assert name not in [p["peer_id"] for p in master.snapshot()["peers"]]

        assert_sum(call_all(peers[:2], "all_reduce", 30), 2)
        assert [a["pending"] for a in call_all(peers[:2], "pending", 30)] == [False, False]

        # A peer with the secret is still admitted, data links authenticated as before.
        late = start_peer(master.address, tmp_path, "late", T, PCCL_SECRET=SECRET)
        peers.append(late)
        wait_until(lambda: master.snapshot()["pending"] == 1, 30, "the late peer pending")
        call_all(peers[:2], "update", 30)
        late.recv(START_S, "ready")
        assert_sum(call_all([peers[0], peers[1], late], "all_reduce", 30), 3)
    finally:
        for p in peers:
            p.close()
        master.stop()
