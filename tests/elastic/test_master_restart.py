"""The run outlives its master, and a restarted master never forks it (issues 12 and 21):
separate launches, `pccl-master` in its own process. SIGKILL it mid-run: the members keep
all-reducing, bit-identical; `peers_pending` answers False while it is away. Restart it on
the same address, with a new peer arriving before, during or after the members'
re-registrations, or retrying its join around a master in a crash loop: the joiner always
ends in the members' group (world 3, their shared state), never in a group of its own. With
a state file the restarted master knows the run before anyone re-registers. A member the
restarted master refuses for good raises GroupReplacedError at its next membership call.
Every process is killed in a finally; every wait is bounded."""

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from harness.elastic_peer import START_S, assert_sum, start_peer
from harness.worker_process import call_all, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.pccl_only]

T = 5.0
GRACE_S = 15.0          # the restarted masters' resume grace window (--resume-grace)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """Two members through `pccl-master` processes started one after the other on one
    port (`masters[n]` logs to master{n}.log), and the peers to clean up."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.port = _free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.masters, self.peers = [], []

    def master(self, *args):
        """`python -m torch_pccl.master` on the run's port; returns once it listens. The
        first forms the members' world of 2; a restarted one is the plain command (world
        size 0: a lone joiner could form a group of its own at once)."""
        n = len(self.masters)
        env = dict(os.environ, PCCL_HEARTBEAT_INTERVAL="0.5", PCCL_HEARTBEAT_TIMEOUT="5")
        with open(self.tmp_path / f"master{n}.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch_pccl.master", "--host", "127.0.0.1", "--port",
                 str(self.port), "--round-timeout", "15", "--world-size",
                 "2" if n == 0 else "0", *args],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.masters.append(proc)
        line = proc.stdout.readline()       # bounded by the test's timeout mark
        assert "listening on" in line, self.log(n)
        return proc

    def log(self, n=-1):
        return (self.tmp_path / f"master{n % len(self.masters)}.log").read_text()

    def wait_log(self, text, what, n=-1, timeout_s=30):
        wait_until(lambda: text in self.log(n), timeout_s, what)

    def start_members(self, *master_args):
        """The first master and two members that all-reduce and sync revision 1 (7s)."""
        self.master("--resume-grace", "0", *master_args)
        members = [start_peer(self.addr, self.tmp_path, f"peer{i}", T,
                              PCCL_MASTER_RECONNECT="60") for i in range(2)]
        self.peers += members
        for p in members:
            p.recv(START_S, "ready")
        assert_sum(call_all(members, "all_reduce", 30), 2)
        assert [a["value"] for a in call_all(members, "sync", 30, revision=1, fill=7)] == [7, 7]
        return members

    def kill_master(self, members):
        self.masters[-1].send_signal(signal.SIGKILL)
        self.masters[-1].wait(30)
        wait_until(lambda: all(a["away"] for a in call_all(members, "master_away", 30)), 30,
                   "the members noticing the master is gone")

    def close(self):
        for p in self.peers:
            p.close()
        for m in self.masters:
            if m.poll() is None:
                m.kill()
            m.wait(30)


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _admit_and_share(run, members, joiner):
    """The members see the joiner, admit it (world 3), it receives their state (7s)."""
    wait_until(lambda: all(a["pending"] for a in call_all(members, "pending", 30)), 30,
               "the members seeing the joiner")
    changes = call_all(members, "update", 30)
    assert all(c["joined"] == ["joiner"] and c["world_size"] == 3 for c in changes), changes
    ready = joiner.recv(START_S, "ready")
    assert ready["world_size"] == 3
    everyone = members + [joiner]
    for p, fill in zip(everyone, (7, 7, 0)):      # the joiner starts with other bytes
        p.send("sync", revision=1, fill=fill)
    synced = [p.recv(30, "sync") for p in everyone]
    assert [a["value"] for a in synced] == [7, 7, 7] and all(a["uniform"] for a in synced)
    assert_sum(call_all(everyone, "all_reduce", 30), 3)
    return ready


def _assert_no_group_without_the_members(run):
    """No master ever formed a group from joiners alone (the fork of issue 21)."""
    for n in range(len(run.masters)):
        log = run.log(n)
        assert "world size 1" not in log and "takes precedence" not in log, log


@pytest.mark.parametrize("order", ["before", "during", "after"])
def test_a_joiner_around_the_restart_joins_the_members_group(run, order):
    """Issue 21's sequence, each order of the joiner's hello against the members'
    re-registrations. Members are held back with SIGSTOP to fix the order."""
    members = run.start_members()
    joiner = start_peer(run.addr, run.tmp_path, "joiner", T, mode="standby")
    run.peers.append(joiner)
    run.kill_master(members)
    for _ in range(3):          # training goes on without a master
        assert_sum(call_all(members, "all_reduce", 30), 2)
    assert [a["pending"] for a in call_all(members, "pending", 30)] == [False, False]

    held = {"before": members, "during": members[1:], "after": []}[order]
    for p in held:
        p.kill(signal.SIGSTOP)
    run.master("--resume-grace", str(GRACE_S))
    if order == "during":
        run.wait_log("re-registered as rank 0", "peer0 re-registering")
    if order == "after":
        wait_until(lambda: not any(a["away"] for a in call_all(members, "master_away", 30)),
                   30, "both members re-registered with the restarted master")
    joiner.send("join")
    run.wait_log("peer joiner", "the joiner's hello")
    if order == "before":
        assert "held: resume grace window" in run.log(), run.log()
    for p in held:
        p.kill(signal.SIGCONT)
    wait_until(lambda: not any(a["away"] for a in call_all(members, "master_away", 30)), 30,
               "both members re-registered with the restarted master")
    assert "resumed epoch" in run.log() and "re-registered as rank 1" in run.log()
    _admit_and_share(run, members, joiner)
    _assert_no_group_without_the_members(run)


def test_a_joiner_retrying_around_a_master_in_a_crash_loop_never_forms_its_own_group(run):
    members = run.start_members()
    joiner = start_peer(run.addr, run.tmp_path, "joiner", T, mode="retry")
    run.peers.append(joiner)
    joiner.send("join")
    run.wait_log("peer joiner", "the joiner's first hello")
    rng = random.Random(int(os.environ.get("PCCL_CRASH_LOOP_SEED", "21")))
    pause = threading.Event()
    for _ in range(5):
        run.kill_master(members)
        assert_sum(call_all(members, "all_reduce", 30), 2)
        run.master("--resume-grace", str(GRACE_S))
        # Chaos, not synchronisation: the next kill comes before, while or after the
        # members and the joiner re-register.
        pause.wait(rng.uniform(0.0, 1.5))
    run.wait_log("peer joiner", "the joiner's hello to the last master")
    wait_until(lambda: not any(a["away"] for a in call_all(members, "master_away", 30)), 30,
               "both members re-registered with the last master")
    ready = _admit_and_share(run, members, joiner)
    assert ready["failures"] >= 1, "the joiner's join never failed: no crash hit it"
    _assert_no_group_without_the_members(run)


def test_a_master_restarted_with_its_state_file_knows_the_run_before_anyone_is_back(run):
    """No grace window at all (--resume-grace 0): without the file the joiner would form a
    group of its own at its hello; with it, it is a pending peer of the run's group."""
    state = str(run.tmp_path / "run.json")
    members = run.start_members("--state-file", state)
    joiner = start_peer(run.addr, run.tmp_path, "joiner", T, mode="standby")
    run.peers.append(joiner)
    run.kill_master(members)
    for p in members:
        p.kill(signal.SIGSTOP)
    run.master("--resume-grace", "0", "--state-file", state)
    assert "from the state file" in run.log(), run.log()
    joiner.send("join")
    run.wait_log("peer joiner", "the joiner's hello")
    assert "held" not in run.log() and "world size 1" not in run.log(), run.log()
    for p in members:
        p.kill(signal.SIGCONT)
    wait_until(lambda: not any(a["away"] for a in call_all(members, "master_away", 30)), 30,
               "both members re-registered with the restarted master")
    _admit_and_share(run, members, joiner)
    _assert_no_group_without_the_members(run)


def test_a_member_refused_for_good_raises_group_replaced_at_its_next_membership_call(run):
    members = run.start_members()
    run.kill_master(members)
    late = members[1]
    late.kill(signal.SIGSTOP)
    run.master("--resume-grace", str(GRACE_S))
    # peer0 takes the run back; peer1's placeholder is dropped at the heartbeat timeout.
    run.wait_log("peer peer1 (resuming) dropped", "peer1's placeholder dropped")
    late.kill(signal.SIGCONT)
    run.wait_log("cannot resume rank 1", "peer1's refused re-registration")
    for cmd in ("pending", "update"):
        asked = time.monotonic()
        late.send(cmd)
        answer = late.lines.get(timeout=30)
        assert time.monotonic() - asked < 5, "the refused member did not fail promptly"
        assert answer["event"] == cmd and "exception" in answer, answer
        error = answer["exception"]
        assert error["type"] == "GroupReplacedError" and "PeerLostError" in error["mro"]
        assert "cannot resume rank 1" in error["message"], error
    # Logged (at ERROR; Python's last-resort handler prints the message alone) when it
    # happened, not only when asked.
    stderr = late.stderr()
    assert "refused this peer's re-registration: cannot resume rank 1" in stderr, stderr
