"""Where a loop may check for joiners: at the top of the step, at its end or both, with or
without a shared-state sync after the update, for members and joiners running the same program.

Two members train (tests/harness/loop_worker.py: one all-reduce per step); a third process
running the same program joins. Every rank must read the same world size from every step's
all-reduce (a joiner whose program position did not line up with the members' would make the
group mismatch or hang), the members must see exactly one change that admits it, and with a
shared state all three must end with identical bytes.
"""

import os
import sys

import pytest

from harness import HARNESS
from harness.worker_process import WorkerProcess
from torch_pccl.master import start_in_thread

pytestmark = [pytest.mark.timeout(180), pytest.mark.pccl_only]

WORKER = os.path.join(HARNESS, "loop_worker.py")
START_S = 60.0   # a worker's start (imports torch) on a loaded machine
RUN_S = 90.0     # the whole loop, join included


def _start(master, name, placement, sync, tmp_path):
    env = dict(os.environ, PCCL_PEER_ID=name, PCCL_TIMEOUT="30")
    return WorkerProcess(name, [sys.executable, WORKER, master.address, placement, sync, "3"],
                         env, tmp_path / f"{name}.stderr")


@pytest.mark.parametrize("sync", ["none", "after", "after-only"])
@pytest.mark.parametrize("placement", ["top", "end", "both"])
def test_a_joiner_lines_up_with_the_members_wherever_the_check_is(placement, sync, tmp_path):
    if sync == "after-only" and placement == "end":
        pytest.skip("a joiner whose first check comes after its first step cannot get the "
                    "state before that step: such a program syncs at its start (docs/membership.md)")
    master = start_in_thread("127.0.0.1", 0, world_size=2, heartbeat_interval_s=0.5,
                             heartbeat_timeout_s=5.0, round_timeout_s=30.0)
    procs = []
    try:
        members = [_start(master, f"m{i}", placement, sync, tmp_path) for i in range(2)]
        procs += members
        for p in members:
            p.recv(START_S, "started")
        joiner = _start(master, "j", placement, sync, tmp_path)
        procs.append(joiner)
        joiner.recv(START_S, "started")
        results = [p.recv(RUN_S, "done") for p in procs]
        for p in procs:
            assert p.proc.wait(30) == 0, p.stderr()
    finally:
        for p in procs:
            p.close()
        master.stop()
    for r in results:
        assert all(world == total for world, total in r["worlds"]), (
            f"a step's all-reduce disagreed with the world size: {r}")
    m0, m1, j = results
    assert j["joiner"] and not m0["joiner"] and not m1["joiner"]
    for m in (m0, m1):
        # A top check's first update is the bootstrap's own (epoch 1, returned at once).
        later = [c for c in m["changes"] if c["epoch"] > 1]
        assert [(c["world_size"], c["joined"]) for c in later] == [(3, ["j"])], m["changes"]
        assert m["worlds"][-1][0] == 3
    assert j["epoch"] == m0["epoch"] == m1["epoch"]
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    if sync != "none":
        assert m0["digest"] == m1["digest"] == j["digest"], "the shared state diverged"
