"""Sharded replicas over pccl, end to end (docs/sharded-replicas.md).

Each replica is 2 processes (tests/harness/replica_worker.py) with an inner gloo group, the
model cut between them so that no inner step runs without both; across replicas each
process joins its shard's ring through a master in this process (short heartbeats), and
DiLoCo exchanges every shard over its ring. The tests hold the replicas after an outer step
(the worker waits for a word on stdin), change the world there, and let them go on:

- two replicas form, a third joins and receives its shards bit-identically;
- a SIGKILLed shard process takes its whole replica out; the others train on;
- a SIGSTOPped one does the same within the heartbeat timeout;
- a replica of another layout is refused with both layouts named;
- the same with int8, TopK, a quorum, and FSDP2 (``fully_shard``: DTensor parameters);

and after every outer step each shard's DiLoCo state (outer parameters, outer-optimizer
state, step) has one digest across the replicas that report it. Every wait is bounded;
every process is killed in a finally.
"""

import signal
import time

import pytest

from harness.replica_process import ShardProcess
from harness.tcp_ranks import free_port
from harness.worker_process import wait_until
from torch_pccl.master import start_in_thread

pytestmark = pytest.mark.timeout(240)

WAIT_S = 90.0
HEARTBEAT_TIMEOUT_S = 4.0


class Run:
    """A master in this process and replicas of ``shards`` processes."""

    def __init__(self, tmp_path, extra=(), world_size=0):
        self.tmp_path = tmp_path
        self.extra = list(extra)
        # world_size: processes the first group waits for (whole replicas).
        self.master = start_in_thread("127.0.0.1", 0, world_size=world_size,
                                      heartbeat_interval_s=0.5,
                                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        self.replicas: dict[str, list[ShardProcess]] = {}

    def start(self, name, shards=2, extra=()):
        port = free_port()
        self.replicas[name] = [
            ShardProcess(self.tmp_path, "replica_worker.py", f"{name}{i}",
                         ["--master", self.master.address, "--replica", name, "--shard", str(i),
                          "--shards", str(shards), "--inner-port", str(port),
                          "--timeout", str(WAIT_S)] + self.extra + list(extra), WAIT_S)
            for i in range(shards)]
        return self.replicas[name]

    def all(self, names):
        return [s for n in names for s in self.replicas[n]]

    def pending(self):
        return self.master.snapshot()["pending"]

    def close(self):
        for shards in self.replicas.values():
            for s in shards:
                s.kill(signal.SIGCONT)
                s.kill()
        for shards in self.replicas.values():
            for s in shards:
                s.proc.wait(timeout=30)
        self.master.stop()


def outer_digests(shards):
    """(step, shard index) -> {replica: digest} over every outer event seen."""
    out = {}
    for s in shards:
        for e in s.events:
            if e["event"] == "outer":
                out.setdefault((e["step"], s.shard), {})[s.replica] = e["digest"]
    return out


def assert_bit_identical(shards, min_replicas=2):
    digests = outer_digests(shards)
    assert digests, "no outer step was reported"
    many = 0
    for (step, shard), by_replica in sorted(digests.items()):
        assert len(set(by_replica.values())) == 1, \
            f"outer step {step}, shard {shard}: the replicas differ: {by_replica}"
        many += len(by_replica) >= min_replicas
    assert many, f"no outer step was reported by {min_replicas} replicas"


@pytest.fixture
def run(tmp_path):
    runs = []

    def make(extra=(), world_size=0):
        r = Run(tmp_path, extra, world_size)
        runs.append(r)
        return r
    yield make
    for r in runs:
        r.close()


def form_two(run, extra, hold):
    """Replicas a and b, held after outer step ``hold`` (both in one group by then)."""
    r = run(extra + [f"--hold-at={h}" for h in hold], world_size=4)
    r.start("a")
    r.start("b")
    for s in r.all("ab"):
        s.next("admitted")
    for s in r.all("ab"):
        held = s.until("held")
        assert held["step"] == hold[0]
    return r


def go(shards):
    for s in shards:
        s.say("go")


@pytest.mark.parametrize("variant", [
    [],
    pytest.param(["--quantization", "int8", "--quorum", "1"], id="int8-quorum"),
    pytest.param(["--topk"], id="topk"),
    pytest.param(["--fsdp"], id="fsdp2"),
], ids=lambda v: "plain" if not v else None)
def test_a_replica_joins_and_a_killed_shard_takes_its_replica_out(run, variant):
    r = form_two(run, ["--outer-steps", "7"] + variant, hold=[2, 4])
    a, b = r.replicas["a"], r.replicas["b"]
    assert a[0].events[-2]["world"] == 2, a[0].events       # a and b share every ring
    # A third replica registers while the group is held; one of its processes alone is
    # not admitted (the master counts it once the replica is whole).
    c = r.start("c")
    wait_until(lambda: r.pending() == 2, WAIT_S, "replica c registered whole")
    go(a + b)
    for s in c:
        s.next("admitted")
    for s in a + b + c:
        assert s.until("held")["step"] == 4
    assert {e["world"] for e in c[0].events if e["event"] == "outer"} == {3}
    assert_bit_identical(a + b + c, min_replicas=3)
    # SIGKILL shard 1 of replica b while everyone is held: the master drops b whole.
    b[1].kill()
    wait_until(lambda: r.master.snapshot()["world_size"] == 4, WAIT_S, "replica b dropped")
    b[0].say("probe")
    probe = b[0].next("probe")
    assert probe["type"] == "ReplicaLostError", probe
    assert "replica 'b' lost its shard 1" in probe["message"]
    go(a + c)
    for s in a + c:
        assert s.until("done")
    tail = [e for e in a[0].events if e["event"] == "outer"][-1]
    assert tail["world"] == 2 and tail["step"] == 7
    assert_bit_identical(a + c)


def test_a_stopped_shard_takes_its_replica_out_within_the_heartbeat_timeout(run):
    r = form_two(run, ["--outer-steps", "4"], hold=[2])
    a, b = r.replicas["a"], r.replicas["b"]
    stopped = time.monotonic()
    b[1].kill(signal.SIGSTOP)
    wait_until(lambda: r.master.snapshot()["world_size"] == 2, WAIT_S, "replica b dropped")
    # Dropped after the heartbeat timeout: not at once, and not much later (a wide bound).
    took = time.monotonic() - stopped
    assert HEARTBEAT_TIMEOUT_S * 0.8 <= took <= HEARTBEAT_TIMEOUT_S + 6.0, took
    b[0].say("probe")
    probe = b[0].next("probe")
    assert probe["type"] == "ReplicaLostError" and "no message for" in probe["message"], probe
    go(a)
    for s in a:
        s.until("done")
    assert [e for e in a[0].events if e["event"] == "outer"][-1]["world"] == 1
    assert_bit_identical(a + b)


def test_a_replica_of_another_layout_is_refused_naming_both(run):
    r = run(["--outer-steps", "2", "--hold-at=1"])
    r.start("a")
    for s in r.replicas["a"]:
        s.next("admitted")
        s.until("held")
    odd = r.start("z", extra=["--dim-scale", "2"])
    for s in odd:
        err = s.next("error")
        assert err["type"] == "ReplicaLayoutError", err
        # Each process holds its slice: 24 of 48 elements here, 48 of 96 in replica z.
        assert "24 elements" in err["message"] and "48 elements" in err["message"], err
    go(r.replicas["a"])
    for s in r.replicas["a"]:
        s.until("done")
