"""benchmarks/_wan_report.py's goal lines on made-up group records (no emulator): each goal
says met or NOT met by the rule issue "The link filled by design" states, and the
forwarder's load flags a row."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import _wan_report as report  # noqa: E402

MIB = 1 << 20
LINK_S = 64 * MIB / (1000e6 / 8)     # a 64 MiB op at exactly the link's rate


def _group(shares, label="pccl", scenario="a", tags=(), init_s=2.0, warmup_mib=40.0,
           world=2, rows=None):
    times = [LINK_S / s for s in shares]
    return {"scenario": scenario, "world": world, "label": label, "backend": "pccl",
            "tags": list(tags), "bottleneck_mbit": 1000.0, "init_s": init_s,
            "warmup_mib": warmup_mib, "rows": rows or [
                {"op": "all_reduce", "bytes": 64 * MIB, "reps": len(times), "times": times}],
            "forwarder_share": 0.3, "forwarder_flag": "", "link_drops": {}}


def _line(goals, start):
    return next(g for g in goals if g.startswith(start))


def test_nine_good_groups_of_ten_meet_the_link_goal_eight_do_not():
    good = [_group([0.86, 0.85, 0.88, 0.87]) for _ in range(9)]
    bad = _group([0.70, 0.88, 0.88, 0.88])           # one op under 80 %
    assert _line(report.goals(good + [bad]), "(a) groups").endswith(": met")
    worse = good[:8] + [bad, bad]
    assert _line(report.goals(worse), "(a) groups").endswith("NOT met")


def test_the_default_is_compared_with_the_best_pinned_setting():
    default = [_group([0.85] * 4) for _ in range(3)]
    near = [_group([0.86] * 4, label="PCCL_STREAMS=6, PACING=rate", tags=("PINNED",))]
    far = [_group([0.95] * 4, label="PCCL_STREAMS=4, PACING=rate", tags=("PINNED",))]
    assert _line(report.goals(default + near), "(a) default").endswith(": met")
    line = _line(report.goals(default + near + far), "(a) default")
    assert "PCCL_STREAMS=4" in line and line.endswith("NOT met")


@pytest.mark.parametrize("init_s, warm, ok", [(2.9, 60.0, True), (3.1, 60.0, False),
                                              (2.0, 70.0, False)])
def test_forming_a_group_is_judged_by_its_slowest_rank_and_its_bytes(init_s, warm, ok):
    goals = report.goals([_group([0.85] * 4, init_s=init_s, warmup_mib=warm)])
    init_ok = _line(goals, "(a) init_process_group").endswith(": met")
    warm_ok = _line(goals, "(a) warm-up traffic").endswith(": met")
    assert (init_ok and warm_ok) == ok


def test_a_link_change_is_followed_within_three_ops():
    rows = [{"op": "all_reduce", "bytes": 64 * MIB, "reps": 2, "times": [LINK_S] * 2,
             "estimates_mbit": [900, 910]},
            {"op": "set_link", "rate_mbit": 500},
            {"op": "all_reduce", "bytes": 64 * MIB, "reps": 4, "times": [2 * LINK_S] * 4,
             "estimates_mbit": [900, 700, 490, 480]},
            {"op": "set_link", "rate_mbit": 1000},
            {"op": "all_reduce", "bytes": 64 * MIB, "reps": 4, "times": [LINK_S] * 4,
             "estimates_mbit": [500, 600, 700, 880]}]
    lines = report.follow_goals(_group([], scenario="h", rows=rows))
    assert lines[0].endswith(": met") and "after 3 op(s)" in lines[0]
    assert lines[1].endswith("NOT met") and "after 4 op(s)" in lines[1]


def test_a_busy_forwarder_flags_its_row():
    assert report.forwarder_flag(7.5, 10.0)
    assert report.forwarder_flag(6.9, 10.0) == ""
