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

import pytest

from harness.replica_process import ShardProcess
from harness.tcp_ranks import free_port
from harness.worker_process import wait_until
from torch_pccl.master import start_in_thread

pytestmark = pytest.mark.timeout(180)

WAIT_S = 60.0
HEARTBEAT_TIMEOUT_S = 4.0
PASSING = ("admitted", "step")      # the events a wait for another one may pass


def steps(shard):
    """Step -> its ``step`` event, of one shard process."""
    return {e["step"]: e for e in shard.events if e["event"] == "step"}


@pytest.fixture
def run(tmp_path):
    master = start_in_thread("127.0.0.1", 0, world_size=4, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    replicas = {}

    def start(name):
        port = free_port()
        replicas[name] = [
            ShardProcess(tmp_path, "replica_ddp_worker.py", f"{name}{i}",
                         ["--master", master.address, "--replica", name, "--shard", str(i),
                          "--shards", "2", "--inner-port", str(port), "--timeout", str(WAIT_S),
                          "--steps", "6", "--hold-at=2", "--hold-at=4"], WAIT_S)
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
        for step, e in steps(s).items():
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
        s.until("admitted", PASSING)
        assert s.until("held", PASSING)["step"] == 2
    assert steps(a[0])[2]["world"] == 2
    # A third replica registers while a and b are held between a backward and its step;
    # it is admitted at their next boundary, with the run's state.
    c = start("c")
    wait_until(lambda: master.snapshot()["pending"] == 2, WAIT_S, "replica c registered")
    go(a + b)
    for s in a + b + c:
        assert s.until("held", PASSING)["step"] == 4
    first = steps(c[0])
    assert min(first) == 3 and first[3]["world"] == 3, first     # joined after step 3
    for i in range(2):                  # each ring gained c's shard of its index
        joined = steps(a[i])[3]["joined"]
        assert len(joined) == 1 and joined[0].startswith(f"c/{i}-"), joined
    assert assert_bit_identical(a + b + c)[3] == 3      # c received the run's shards
    # SIGKILL shard 1 of replica b while everyone is held: the master drops b whole; a's
    # and c's next step fails on both rings, recovers without b, and is applied.
    b[1].kill()
    wait_until(lambda: master.snapshot()["world_size"] == 4, WAIT_S, "replica b dropped")
    b[0].say("probe")
    probe = b[0].until("probe", PASSING)
    assert probe["type"] == "ReplicaLostError", probe
    go(a + c)
    for s in a + c:
        s.until("done", PASSING)
        assert steps(s)[5]["recoveries"] >= 1 and steps(s)[5]["world"] == 2, steps(s)[5]
        assert steps(s)[6]["world"] == 2
    counts = assert_bit_identical(a + b + c)
    assert counts[3] == 3 and counts[4] == 3 and counts[6] == 2, counts
