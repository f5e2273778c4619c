"""The churn soak in the suite: DiLoCo training survives 30 SIGKILLs, 30 joins and 5 SIGSTOPs
(tests/harness/soak.py has the schedule and the checks; benchmarks/soak.py runs it for an hour).

The seed is printed; ``PCCL_SOAK_SEED=N`` replays a run.
"""

import os
import random

import pytest

from harness import soak

pytestmark = [pytest.mark.timeout(900), pytest.mark.pccl_only]


def test_diloco_survives_random_kills_stops_and_joins(tmp_path):
    seed = int(os.environ.get("PCCL_SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    res = soak.run(seed, str(tmp_path), kills=30, joins=30, stops=5, join_kills=2,
                   max_seconds=480.0)
    summary = (f"seed {seed}: {res.kills} kills, {res.joins} joins, {res.stops} stops, "
               f"{res.join_kills} join+kill, {res.outer_steps} outer steps in "
               f"{res.seconds:.0f} s, goodput {res.goodput:.3f}, worst outer step "
               f"{res.worst_outer_s:.1f} s, master fds {res.master_fds}, "
               f"rss {res.master_rss_kib} KiB")
    print(summary)
    assert not res.problems, summary + "\n" + "\n".join(res.problems[:20])
    assert res.kills >= 30 and res.joins >= 30 and res.stops >= 5 and res.join_kills >= 2, summary


def test_diloco_with_a_quorum_survives_random_kills_stops_and_joins(tmp_path):
    """The same soak, shorter, with ``quorum=Quorum(min_peers=2, grace=0.5)``: rounds close
    without stopped or slow peers, peers die while the others wait for a quorum, and every
    live peer's outer parameters stay bit-identical after every outer step."""
    seed = int(os.environ.get("PCCL_SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    res = soak.run(seed, str(tmp_path), kills=10, joins=10, stops=2, join_kills=1,
                   max_seconds=300.0, quorum=(2, 0.5))
    summary = (f"seed {seed} (quorum 2, grace 0.5 s): {res.kills} kills, {res.joins} joins, "
               f"{res.stops} stops, {res.join_kills} join+kill, {res.outer_steps} outer "
               f"steps in {res.seconds:.0f} s, goodput {res.goodput:.3f}, worst outer step "
               f"{res.worst_outer_s:.1f} s")
    print(summary)
    assert not res.problems, summary + "\n" + "\n".join(res.problems[:20])
    assert res.kills >= 10 and res.joins >= 10 and res.stops >= 2 and res.join_kills >= 1, \
        summary
