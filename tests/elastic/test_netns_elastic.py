"""Elastic membership across hosts: master and peers each in their own network namespace.

Root only (skipped otherwise, see tests/harness/netns.py). Host 0 (198.18.0.1) runs
``python -m torch_pccl.master``; hosts 1..3 each run one elastic peer
(tests/harness/netns_elastic_worker.py) with ``init_method="pccl://198.18.0.1:PORT"``
and PCCL_HOST unset, so every peer must find and advertise its own namespace
address: 127.0.0.1 in one namespace is not 127.0.0.1 in another, so a peer
that advertised loopback could not be reached. Peers are driven by JSON lines
on stdin/stdout; every wait has a deadline, every process is SIGKILLed in a
finally (and the namespaces' leftovers by the fixture).
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from harness import HARNESS, REPO
from harness.data import make_input, pack

pytestmark = [pytest.mark.timeout(120), pytest.mark.pccl_only]

WORKER = os.path.join(HARNESS, "netns_elastic_worker.py")
MASTER_PORT = 29600     # host 0's namespace is fresh: the port is free there
T = 3.0                 # seconds: the groups' op timeout (PCCL_TIMEOUT)
START_S = 45.0          # seconds: a process's start (imports torch) on a loaded 2-core box
JOIN_TIMEOUT_S = 40.0   # seconds: how long a peer may stay pending
CALL_S = 2 * T + 15     # seconds: one command's answer
SEED = 29
PEER_DEATH = ("PeerLostError", "RemoteError", "PcclSystemError", "PcclTimeoutError")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "PCCL_HOST", "PCCL_TIMEOUT", "PCCL_PEER_ID",
                        "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p), **extra)
    return env


class NsChild:
    """``ip netns exec NS argv`` with stdin/stdout pipes; stdout lines read by a thread."""

    def __init__(self, hosts, i, argv, env, name, tmp_path):
        self.name = f"{name} ({hosts.addrs[i]})"
        self.peer_id = name
        self.addr = hosts.addrs[i]
        self.stderr_path = tmp_path / f"{name}.stderr"
        with open(self.stderr_path, "w") as err:
            # `ip netns exec` execs argv: the pid is the command's own.
            self.proc = subprocess.Popen(["ip", "netns", "exec", hosts.names[i], *argv],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=env, start_new_session=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def stderr(self):
        try:
            return self.stderr_path.read_text()[-4000:]
        except OSError as e:
            return f"<stderr unreadable: {e}>"

    def line(self, timeout_s, what):
        try:
            text = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no {what} within {timeout_s} s\n"
                                 f"{self.stderr()}") from None
        assert text is not None, (f"{self.name} exited ({self.proc.poll()}) before {what}:\n"
                                  f"{self.stderr()}")
        return text

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class Peer(NsChild):
    def recv(self, timeout_s, event):
        msg = json.loads(self.line(timeout_s, repr(event)))
        assert msg["event"] == event, f"{self.name}: expected {event!r}, got {msg}"
        assert "exception" not in msg, (f"{self.name}: {event} raised {msg['exception']['type']}"
                                        f": {msg['exception']['traceback']}")
        return msg

    def idle(self):
        return self.lines.empty() and self.proc.poll() is None

    def send(self, cmd, **kw):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()


def call_all(peers, cmd, timeout_s=CALL_S, **kw):
    for p in peers:
        p.send(cmd, **kw)
    return [p.recv(timeout_s, cmd) for p in peers]


def sha(t):
    return pack(t, raw=False)["digest"]


def expected_sums(input_ranks):
    """Digests of the exact int64 SUM over ``input_ranks``' inputs."""
    ints = torch.stack([make_input(SEED, r, 100_003, "int64") for r in input_ranks]).sum(0)
    return sha(ints)


def assert_reduced(answers, world_size, input_ranks):
    for a in answers:
        assert a["error"] is None, f"all_reduce failed: {a['error']}"
        assert a["world_size"] == world_size, a
        assert a["group_ranks"] == list(range(world_size)), a
    floats = {a["float32"] for a in answers}
    assert len(floats) == 1, f"float32 SUM: ranks disagree on the result bytes: {floats}"
    want = expected_sums(input_ranks)
    assert all(a["int64"] == want for a in answers), f"int64 SUM is wrong: {answers}"


def assert_listener(peer):
    """The data-plane listener is bound to the peer's own namespace address, not loopback."""
    peer.send("listener")
    info = peer.recv(CALL_S, "listener")
    addr = peer.addr
    assert info["host"] == addr and info["address"] == f"{addr}:{info['port']}", (
        f"{peer.name}: data-plane listener on {info['address']}, expected {addr}")
    assert info["listening"] == [[addr, info["port"]]], (
        f"{peer.name}: sockets listening on port {info['port']}: {info['listening']}")
    assert not info["loopback"], f"{peer.name}: TCP sockets on loopback: {info['loopback']}"


def test_elastic_peers_in_separate_namespaces(netns_hosts, tmp_path):
    hosts = netns_hosts(4)
    hosts.check_connectivity()
    master_addr = f"{hosts.addrs[0]}:{MASTER_PORT}"
    children = []
    try:
        master = NsChild(hosts, 0, [sys.executable, "-m", "torch_pccl.master",
                                    "--host", hosts.addrs[0], "--port", str(MASTER_PORT),
                                    "--world-size", "2", "--heartbeat-interval", "0.5",
                                    "--heartbeat-timeout", "2", "--round-timeout", "15",
                                    "--log-level", "WARNING"],
                         clean_env(), "master", tmp_path)
        children.append(master)
        # All three peers import torch while the master starts; none registers before "join".
        peers = []
        for i in (1, 2, 3):
            env = clean_env(PCCL_TIMEOUT=str(T), PCCL_PEER_ID=f"peer{i}")
            peers.append(Peer(hosts, i, [sys.executable, WORKER, master_addr, str(JOIN_TIMEOUT_S)],
                              env, f"peer{i}", tmp_path))
            children.append(peers[-1])
        listening = master.line(START_S, "the master's 'listening on' line")
        assert listening == f"pccl-master listening on {master_addr}", listening
        for p in peers:
            assert p.recv(START_S, "started")["pid"] == p.proc.pid

        # Two peers bootstrap the world of 2.
        first, late = peers[:2], peers[2]
        hello = call_all(first, "join", JOIN_TIMEOUT_S)
        assert sorted(h["rank"] for h in hello) == [0, 1], hello
        assert all((h["world_size"], h["epoch"]) == (2, 1) for h in hello), hello
        first = [p for _, p in sorted(zip([h["rank"] for h in hello], first))]
        for p in first:
            assert_listener(p)
        assert_reduced(call_all(first, "all_reduce", seed=SEED), 2, [0, 1])

        # The third peer stays pending until the two call update_topology.
        late.send("join")
        deadline = time.monotonic() + 20
        while not all(a["pending"] for a in call_all(first, "pending")):
            assert time.monotonic() < deadline, "the master never reported the third peer pending"
            assert late.idle(), f"{late.name} answered before update_topology: {late.stderr()}"
            time.sleep(0.1)
        assert_reduced(call_all(first, "all_reduce", seed=SEED), 2, [0, 1])
        assert late.idle(), f"{late.name} was admitted before update_topology"
        changes = call_all(first, "update")
        joined = late.recv(JOIN_TIMEOUT_S, "join")
        for c in changes:
            assert (c["change_world_size"], c["world_size"], c["epoch"]) == (3, 3, 2), c
            assert (c["joined"], c["left"]) == (["peer3"], []), c
        assert [c["rank"] for c in changes] == [0, 1], changes
        assert (joined["rank"], joined["world_size"], joined["epoch"]) == (2, 3, 2), joined
        assert_listener(late)
        everyone = [*first, late]
        assert_reduced(call_all(everyone, "all_reduce", seed=SEED), 3, [0, 1, 2])

        # SIGKILL the middle rank during an all_reduce loop.
        for p in everyone:
            p.send("loop_all_reduce")
        for p in everyone:
            p.recv(CALL_S, "looping")
        victim, survivors = everyone[1], [everyone[0], everyone[2]]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert victim.proc.wait(timeout=10) == -signal.SIGKILL
        for p in survivors:
            res = p.recv(2 * T + 10, "loop_all_reduce")
            err = res["error"]
            assert err is not None, f"{p.name}: the loop ended without an error: {res}"
            assert "PcclError" in err["mro"] and set(PEER_DEATH) & set(err["mro"]), (
                f"{p.name}: raised {err['type']} ({err['mro']}): {err['message']}")
            # Same CLOCK_MONOTONIC in every process (namespaces do not change clocks).
            after_kill, in_call = err["error_time"] - killed_at, err["elapsed"]
            assert after_kill < 2 * T, f"{p.name}: error {after_kill:.2f} s after the kill"
            assert in_call < 2 * T, f"{p.name}: the failing call took {in_call:.2f} s"

        # all_reduce_with_retry shrinks to the two survivors (old ranks 0 and 2) and retries.
        answers = call_all(survivors, "retry_all_reduce", 2 * T + 25, seed=SEED)
        for a in answers:
            assert a["changes"] == [[3, 2, [victim.peer_id], []]], a
            assert a["group_ranks"] == [0, 1] and a["epoch"] == 3, a
        assert sorted((a["input_rank"], a["rank"]) for a in answers) == [(0, 0), (2, 1)], answers
        answers = [{"error": None, **a} for a in answers]
        assert_reduced(answers, 2, [0, 2])
        assert master.proc.poll() is None, f"the master exited: {master.stderr()}"
    finally:
        for c in children:
            c.kill()
