"""The run outlives its master (issue 12): separate launches, `pccl-master` in its own
process. SIGKILL it mid-run: the members keep all-reducing, bit-identical; `peers_pending`
answers False while it is away. Restart it on the same address: the members re-register
with their epoch and ranks, the new master rebuilds the group from them, admits a new peer
at the members' next update, and the joiner receives the shared state. Every process is
killed in a finally; every wait is bounded."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from harness.elastic_peer import START_S, assert_sum, start_peer
from harness.worker_process import call_all, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.pccl_only]

T = 5.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _master(port, tmp_path, n):
    """`python -m torch_pccl.master` on 127.0.0.1:port; returns once it listens."""
    env = dict(os.environ, PCCL_HEARTBEAT_INTERVAL="0.5", PCCL_HEARTBEAT_TIMEOUT="5")
    log = open(tmp_path / f"master{n}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch_pccl.master", "--host", "127.0.0.1",
                             "--port", str(port), "--round-timeout", "15", "--world-size", "2"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = proc.stdout.readline()       # bounded by the test's timeout mark
    assert "listening on" in line, (tmp_path / f"master{n}.log").read_text()
    return proc


def test_members_outlive_a_killed_master_and_a_restarted_one_takes_the_group_back(tmp_path):
    port = _free_port()
    addr = f"127.0.0.1:{port}"
    masters, peers = [], []
    try:
        masters.append(_master(port, tmp_path, 0))
        peers = [start_peer(addr, tmp_path, f"peer{i}", T, PCCL_MASTER_RECONNECT="60") for i in range(2)]
        for p in peers:
            p.recv(START_S, "ready")
        assert_sum(call_all(peers, "all_reduce", 30), 2)
        assert [a["value"] for a in call_all(peers, "sync", 30, revision=1, fill=7)] == [7, 7]

        masters[0].send_signal(signal.SIGKILL)
        masters[0].wait(30)
        wait_until(lambda: all(a["away"] for a in call_all(peers, "master_away", 30)), 30,
                   "both members noticing the master is gone")
        for _ in range(3):          # training goes on without a master
            assert_sum(call_all(peers, "all_reduce", 30), 2)
        assert [a["pending"] for a in call_all(peers, "pending", 30)] == [False, False]

        masters.append(_master(port, tmp_path, 1))
        wait_until(lambda: not any(a["away"] for a in call_all(peers, "master_away", 30)), 30,
                   "both members re-registered with the restarted master")
        assert_sum(call_all(peers, "all_reduce", 30), 2)
        log = (tmp_path / "master1.log").read_text()
        assert "resumed epoch" in log and "re-registered as rank" in log, log

        joiner = start_peer(addr, tmp_path, "joiner", T)
        peers.append(joiner)
        wait_until(lambda: all(a["pending"] for a in call_all(peers[:2], "pending", 30)), 30,
                   "the members seeing the joiner")
        changes = call_all(peers[:2], "update", 30)
        assert all(c["joined"] == ["joiner"] and c["world_size"] == 3 for c in changes), changes
        assert joiner.recv(START_S, "ready")["world_size"] == 3
        for p, fill in zip(peers, (7, 7, 0)):      # the joiner starts with other bytes
            p.send("sync", revision=1, fill=fill)
        synced = [p.recv(30, "sync") for p in peers]
        assert [a["value"] for a in synced] == [7, 7, 7] and all(a["uniform"] for a in synced)
        assert_sum(call_all(peers, "all_reduce", 30), 3)
    finally:
        for p in peers:
            p.close()
        for m in masters:
            if m.poll() is None:
                m.kill()
            m.wait(30)
