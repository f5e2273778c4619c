"""``ReplicaDataParallel`` end to end: per-step data parallelism across sharded replicas
(docs/sharded-replicas.md, "Per-step data parallelism across replicas").

Each replica is 2 processes (tests/harness/replica_ddp_worker.py) with an inner gloo group
and an FSDP2 model (DTensor parameters, AdamW with DTensor moments, a LambdaLR schedule);
across replicas each process joins its shard's ring through a master in this process, and
every step averages the local gradient shards over the ring. The test holds the replicas
between a backward and its ``step()`` (the worker waits for a word on stdin), changes the
world there and lets them go on:

- two replicas form and train; a third registers while they are held, is admitted at
  the next boundary and receives its shards (parameters, optimizer state, schedule, step);
- a SIGKILLed shard process takes its whole replica out; the survivors' next ``step()``
  fails on every ring, recovers on the smaller world and is applied;

and after every step each shard's digest (local parameters, local optimizer state,
learning rate, step, taken by the worker from the model and the optimizer) is one across
the replicas that report it. The replicas train on different batches, so without the
per-step exchange (or without the joiner's sync) the digests differ. Every wait is
bounded; every process is killed in a finally.
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

import pytest

from harness import HARNESS, REPO
from harness.worker_process import wait_until
from torch_pccl.master import start_in_thread

pytestmark = pytest.mark.timeout(180)

WAIT_S = 60.0
HEARTBEAT_TIMEOUT_S = 4.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Shard:
    """One replica_ddp_worker process and its JSON events."""

    def __init__(self, tmp_path, master, replica, shard, inner_port, extra):
        self.name, self.replica, self.shard = f"{replica}{shard}", replica, shard
        self.err_path = tmp_path / f"{self.name}.err"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HARNESS]))
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(HARNESS, "replica_ddp_worker.py"),
                 "--master", master, "--replica", replica, "--shard", str(shard),
                 "--shards", "2", "--inner-port", str(inner_port),
                 "--timeout", str(WAIT_S)] + extra,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.events = []
        self._q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._q.put(json.loads(line))
        self._q.put(None)

    def until(self, kind):
        """Events up to and including the next ``kind`` (bounded wait); only ``admitted``
        and ``step`` events may come before it."""
        while True:
            try:
                msg = self._q.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"{self.name}: no {kind!r} within {WAIT_S} s\n"
                                     f"{self.err_path.read_text()[-3000:]}") from None
            assert msg is not None, f"{self.name} exited before {kind!r}:\n" \
                                    f"{self.err_path.read_text()[-3000:]}"
            self.events.append(msg)
            if msg["event"] == kind:
                return msg
            assert msg["event"] in ("admitted", "step"), \
                f"{self.name}: expected {kind}, got {msg}"

    def say(self, word):
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def steps(self):
        return {e["step"]: e for e in self.events if e["event"] == "step"}


@pytest.fixture
def run(tmp_path):
    master = start_in_thread("127.0.0.1", 0, world_size=4, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    replicas = {}

    def start(name):
        port = free_port()
        replicas[name] = [Shard(tmp_path, master.address, name, i, port,
                                ["--steps", "6", "--hold-at=2", "--hold-at=4"])
                          for i in range(2)]
        return replicas[name]
    try:
        yield master, start
    finally:
        for shards in replicas.values():
            for s in shards:
                s.kill()
        for shards in replicas.values():
            for s in shards:
                s.proc.wait(timeout=30)
        master.stop()


def assert_bit_identical(shards):
    """Per (step, shard index): one digest across the replicas; returns how many
    replicas reported each step."""
    by_key = {}
    for s in shards:
        for step, e in s.steps().items():
            by_key.setdefault((step, s.shard), {})[s.replica] = e["digest"]
    assert by_key, "no step was reported"
    for (step, shard), digests in sorted(by_key.items()):
        assert len(set(digests.values())) == 1, \
            f"step {step}, shard {shard}: the replicas differ: {digests}"
    return {step: len(d) for (step, shard), d in by_key.items()}


def go(shards):
    for s in shards:
        s.say("go")


def test_replicas_average_every_step_through_a_join_and_a_death(run):
    master, start = run
    a, b = start("a"), start("b")
    for s in a + b:
        s.until("admitted")
        assert s.until("held")["step"] == 2
    assert a[0].steps()[2]["world"] == 2
    # A third replica registers while a and b are held between a backward and its step;
    # it is admitted at their next boundary, with the run's state.
    c = start("c")
    wait_until(lambda: master.snapshot()["pending"] == 2, WAIT_S, "replica c registered")
    go(a + b)
    for s in a + b + c:
        assert s.until("held")["step"] == 4
    first = c[0].steps()
    assert min(first) == 3 and first[3]["world"] == 3, first     # joined after step 3
    for i in range(2):                  # each ring gained c's shard of its index
        joined = a[i].steps()[3]["joined"]
        assert len(joined) == 1 and joined[0].startswith(f"c/{i}-"), joined
    assert assert_bit_identical(a + b + c)[3] == 3      # c received the run's shards
    # SIGKILL shard 1 of replica b while everyone is held: the master drops b whole; a's
    # and c's next step fails on both rings, recovers without b, and is applied.
    b[1].kill()
    wait_until(lambda: master.snapshot()["world_size"] == 4, WAIT_S, "replica b dropped")
    b[0].say("probe")
    probe = b[0].until("probe")
    assert probe["type"] == "ReplicaLostError", probe
    go(a + c)
    for s in a + c:
        s.until("done")
        assert s.steps()[5]["recoveries"] >= 1 and s.steps()[5]["world"] == 2, s.steps()[5]
        assert s.steps()[6]["world"] == 2
    counts = assert_bit_identical(a + b + c)
    assert counts[3] == 3 and counts[4] == 3 and counts[6] == 2, counts
