"""Several hosts: each rank in its own network namespace (root only; skipped otherwise).

Rank r runs in a namespace whose only non-loopback address is 198.18.0.{r+1}, so
a rank that advertised 127.0.0.1 (or any address but its own) cannot be reached.
Rendezvous is ``init_method="tcp://198.18.0.1:PORT"``: rank 0's namespace hosts
the TCPStore, and MASTER_ADDR/PCCL_HOST are unset. See tests/harness/netns.py.
"""

import hashlib
import os
import signal
import sys
import time

import pytest
import torch

from harness import HARNESS, REPO
from harness.data import assert_reduced, make_input, pack

pytestmark = [pytest.mark.timeout(120), pytest.mark.pccl_only]

WORKER = os.path.join(HARNESS, "netns_worker.py")
STORE_PORT = 29500  # rank 0's namespace is fresh, so the port is always free there
START_DEADLINE_S = 60.0  # importing torch in 3 processes on 2 cores
T = 3.0  # the group timeout of the kill test
PEER_DEATH = ("PeerLostError", "RemoteError", "PcclSystemError")


def worker_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "PCCL_HOST", "PCCL_TIMEOUT", "RANK",
                        "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    return env


def start_ranks(hosts, mode, timeout_s, out_dir, seed=1):
    procs = []
    for r in range(hosts.k):
        argv = [sys.executable, WORKER, mode, str(r), str(hosts.k), hosts.addrs[0],
                str(STORE_PORT), str(timeout_s), str(out_dir), str(seed)]
        procs.append(hosts.popen(r, argv, env=worker_env(), label=f"rank {r} ({hosts.addrs[r]})"))
    for p in procs:
        started = p.next_event(START_DEADLINE_S, "started")
        # `ip netns exec` execs the command: the pid we signal is the worker's own.
        assert started["pid"] == p.pid, f"{p.label}: worker pid {started['pid']} != {p.pid}"
    return procs


def sha(t):
    return pack(t, raw=False)["digest"]


def links_between_namespaces(res, hosts):
    """For every pair of ranks, the established TCP connections that join their listeners."""
    found = {}
    for r, rec in enumerate(res):
        for state, local, remote in rec["sockets"]:
            if state != "ESTABLISHED":
                continue
            for q in range(hosts.k):
                if q != r and remote == [hosts.addrs[q], res[q]["listen_port"]]:
                    found.setdefault(frozenset((r, q)), []).append((r, local, remote))
    return found


@pytest.mark.parametrize("world_size", (2, 3))
def test_collectives_across_namespaces(netns_hosts, tmp_path, world_size):
    hosts = netns_hosts(world_size)
    hosts.check_connectivity()
    seed = 11 + world_size
    procs = start_ranks(hosts, "collectives", 10, tmp_path, seed)
    res = [p.finish(60.0) for p in procs]

    for r, rec in enumerate(res):
        assert rec["advertised"] == hosts.addrs[r], (
            f"rank {r} advertises {rec['advertised']}, its namespace address is {hosts.addrs[r]}")
        listening = [local for state, local, _ in rec["sockets"]
                     if state == "LISTEN" and local[1] == rec["listen_port"]]
        assert listening == [[hosts.addrs[r], rec["listen_port"]]], (
            f"rank {r}: pccl listener bound to {listening}, expected {hosts.addrs[r]}")
        loopback = [s for s in rec["sockets"] if s[1][0].startswith("127.") or s[1][0] == "::1"]
        assert not loopback, f"rank {r}: TCP sockets on loopback: {loopback}"
    links = links_between_namespaces(res, hosts)
    for r in range(world_size):
        for q in range(r + 1, world_size):
            assert frozenset((r, q)) in links, (
                f"no TCP link between rank {r} and rank {q}'s listener; seen {links}")

    for key in ("sum_float32", "sum_int64", "broadcast", "all_gather"):
        digests = [rec[key] for rec in res]
        assert len(set(digests)) == 1, f"{key}: ranks disagree on the result bytes: {digests}"

    floats = [make_input(seed, r, 1_000_003, "float32") for r in range(world_size)]
    raw = (tmp_path / "sum_float32.bin").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == res[0]["sum_float32"]
    got = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    assert_reduced(got, floats, "SUM", "float32", "all_reduce float32 across namespaces")

    ints = torch.stack([make_input(seed, r, 1_000_003, "int64") for r in range(world_size)])
    assert res[0]["sum_int64"] == sha(ints.sum(0)), "all_reduce int64: wrong sum"
    root = world_size - 1
    assert res[0]["broadcast"] == sha(make_input(seed, root, 100_003, "float32")), "broadcast"
    gathered = torch.cat([make_input(seed, r, 10_007, "int64") for r in range(world_size)])
    assert res[0]["all_gather"] == sha(gathered), "all_gather_into_tensor"


@pytest.mark.parametrize("world_size,victim", [(2, 0), (3, 1)])
def test_sigkilled_rank_in_its_namespace(netns_hosts, tmp_path, world_size, victim):
    """SIGKILL one rank mid-loop: the others raise a PcclError within 2*T instead of hanging.

    Victim 0 also takes the TCPStore down with it: collectives must not depend on it.
    """
    hosts = netns_hosts(world_size)
    procs = start_ranks(hosts, "kill_loop", T, tmp_path)
    for p in procs:
        p.next_event(START_DEADLINE_S, "looping")  # every rank is inside the loop
    procs[victim].kill(signal.SIGKILL)
    killed_at = time.monotonic()
    assert procs[victim].proc.wait(timeout=10) == -signal.SIGKILL

    for r in range(world_size):
        if r == victim:
            continue
        rec = procs[r].finish(2 * T + 10)
        assert rec["type"] is not None, f"rank {r}: the loop ended without an error: {rec}"
        assert "PcclError" in rec["mro"] and set(PEER_DEATH) & set(rec["mro"]), (
            f"rank {r}: raised {rec['type']} ({rec['mro']}), expected one of {PEER_DEATH}: "
            f"{rec['message']}\n{rec['traceback']}")
        # Same CLOCK_MONOTONIC in every process (namespaces do not change clocks).
        after_kill = rec["error_time"] - killed_at
        in_call = rec["error_time"] - rec["call_start"]
        assert after_kill < 2 * T, (
            f"rank {r}: error {after_kill:.2f}s after the kill (limit {2 * T}s)")
        assert in_call < 2 * T, f"rank {r}: the failing call took {in_call:.2f}s (limit {2 * T}s)"


def test_a_path_that_drops_everything_fails_the_op_at_the_link_timeout(netns_hosts, tmp_path):
    """Rank 0's host starts dropping every packet to rank 1 (a blackhole route) while both
    are alive: with an op deadline of 120 s, both must fail with PeerLostError about
    PCCL_LINK_TIMEOUT (3 s) later, because nothing they send is acknowledged any more."""
    link_s, op_s = 3.0, 120.0
    hosts = netns_hosts(2)
    env = dict(worker_env(), PCCL_LINK_TIMEOUT=str(link_s))
    procs = []
    for r in range(2):
        argv = [sys.executable, WORKER, "kill_loop", str(r), "2", hosts.addrs[0],
                str(STORE_PORT), str(op_s), str(tmp_path), "1"]
        procs.append(hosts.popen(r, argv, env=env, label=f"rank {r}"))
    for p in procs:
        p.next_event(START_DEADLINE_S, "started")
    for p in procs:
        p.next_event(START_DEADLINE_S, "looping")
    done = hosts.run(0, ["ip", "route", "add", "blackhole", f"{hosts.addrs[1]}/32"], 10)
    assert done.returncode == 0, done.stderr
    cut_at = time.monotonic()
    for r, p in enumerate(procs):
        rec = p.finish(link_s + 30)
        assert rec["type"] is not None and "PeerLostError" in rec["mro"], (
            f"rank {r}: {rec['type']}: {rec['message']}")
        after = rec["error_time"] - cut_at
        assert after < link_s + 10, f"rank {r} failed {after:.1f} s after the cut"
