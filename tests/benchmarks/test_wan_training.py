"""benchmarks/wan_training.py's parts: the arithmetic alone, a tiny run on loopback (targets,
utilisation, parity and the churn schedule as a run records them), and a short two-row run
through the WAN emulator (root and /dev/net/tun only; skipped with the reason otherwise)."""

import json
import os
import subprocess
import sys

import pytest

from harness import REPO

BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)

from _wan_curve import (Point, churn_schedule, crossing, equal_time_losses,  # noqa: E402
                        link_utilisation, parity, speedup, utilisation)
from _wan_rows import ROWS, Row  # noqa: E402
from _wan_training_report import shard_parity, sharded_lines  # noqa: E402


def _curve(losses, dt=2.0, tokens=4096):
    return [Point(step=10 * i, seconds=dt * i, tokens=tokens * i, loss=v)
            for i, v in enumerate(losses)]


def test_the_first_evaluation_at_or_below_the_target_is_the_crossing():
    curve = _curve([4.3, 3.1, 2.6, 2.7, 2.4])
    assert crossing(curve, 2.6) == curve[2]          # at the target counts
    assert crossing(curve, 2.65) == curve[2]         # not the later dip
    assert crossing(reversed(curve), 2.5) == curve[4]   # step order, whatever the input order
    assert crossing(curve, 2.0) is None              # never: nothing extrapolated


def test_speedup_is_a_lower_bound_when_the_slow_row_never_arrived():
    assert speedup(10.0, 55.0, 300.0) == (5.5, True)
    assert speedup(10.0, None, 300.0) == (30.0, False)
    assert speedup(None, 55.0, 300.0) is None


def test_utilisation_counts_compute_over_wall_clock_and_rejects_a_clock_mixup():
    assert utilisation(9.5, 10.0) == pytest.approx(0.95)
    assert utilisation(10.05, 10.0) == 1.0           # rounding of two clocks, capped
    with pytest.raises(ValueError):
        utilisation(12.0, 10.0)
    with pytest.raises(ValueError):
        utilisation(1.0, 0.0)
    # 2.5 MB in 1 s of waiting on a 20 Mbit/s link: the whole link.
    assert link_utilisation(2_500_000, 1.0, 20.0) == pytest.approx(1.0)
    assert link_utilisation(2_500_000, 0.0, 20.0) is None


def test_churn_kills_at_a_third_and_adds_at_half():
    assert churn_schedule(800) == (266, 400)
    assert churn_schedule(6) == (2, 3)
    with pytest.raises(ValueError):
        churn_schedule(5)


def test_parity_compares_the_peers_present_at_the_end():
    same = {"a": {20: "x", 40: "y"}, "b": {20: "x", 40: "y"},
            "victim": {20: "x"}, "joiner": {40: "y"}}
    assert parity(same) == (True, 40, 3)
    assert parity({**same, "b": {20: "x", 40: "z"}}) == (False, 40, 3)
    assert parity({"a": {20: "x"}}) is None


def test_equal_time_losses_compare_the_rows_at_the_slower_one_s_horizon():
    fast = [{"seconds": 5.0, "loss": 3.0}, {"seconds": 20.0, "loss": 2.2},
            {"seconds": 40.0, "loss": 2.0}]
    slow = [{"seconds": 10.0, "loss": 3.1}, {"seconds": 30.0, "loss": 2.5},
            {"seconds": 75.0, "loss": 2.1}]
    # The fast row ended at 40 s: both at 40 s, each its latest evaluation by then.
    assert equal_time_losses(fast, slow) == (40.0, 2.0, 2.5)
    assert equal_time_losses(slow, fast) == (40.0, 2.5, 2.0)
    assert equal_time_losses([{"seconds": 50.0, "loss": 2.0}], [{"seconds": 10.0, "loss": 3.0}]) \
        is None
    assert equal_time_losses([], slow) is None


def _records(shard_digests):
    """Records of a sharded row: (host, shard) -> its digest at step 20."""
    return {f"peer-{h}-{h + 2 * s}": [{"kind": "start", "shard": s},
                                      {"kind": "snap", "step": 20, "digest": d}]
            for (h, s), d in shard_digests.items()}


def test_a_sharded_row_s_parity_compares_each_shard_with_the_same_shard_elsewhere():
    # Shards hold different slices: equal within a shard index is parity.
    assert shard_parity(_records({(0, 0): "a", (1, 0): "a", (0, 1): "b", (1, 1): "b"})) \
        == (True, 20, 4)
    assert shard_parity(_records({(0, 0): "a", (1, 0): "a", (0, 1): "b", (1, 1): "c"})) \
        == (False, 20, 4)
    # Unsharded records (no shard in start) compare as before.
    assert shard_parity({"peer-0-0": [{"kind": "snap", "step": 20, "digest": "x"}],
                         "peer-1-1": [{"kind": "snap", "step": 20, "digest": "x"}]}) \
        == (True, 20, 2)


def test_the_sharded_row_is_compared_with_two_unsharded_peers_at_equal_tokens():
    s, u = ROWS["diloco-sharded"], ROWS["diloco-2"]
    assert (s.hosts, s.shards, u.hosts, u.shards) == (2, 2, 2, 1)
    assert s.algo == u.algo == "diloco" and s.backend == u.backend == "pccl"
    with pytest.raises(ValueError):
        Row("x", "x", "pccl", "diloco", churn=True, shards=2)

    def row(t, mb, util, loss):
        return {"time_to_target_s": t, "bytes_per_peer": mb * 1e6, "pccl_sent_per_host": None,
                "compute_utilisation": util, "final_eval_loss": loss, "final_step": 200,
                "train_s": 50.0, "shards": 2}

    class Args:
        steps, target_loss = 200, 2.6
    lines = sharded_lines({"diloco-sharded": row(12.0, 11.0, 0.5, 2.2),
                           "diloco-2": row(6.0, 10.0, 0.8, 2.0)}, Args)
    text = "\n".join(lines)
    assert "12.0 vs 6.0: 2.00x" in text and "11.00 vs 10.00: 1.10x" in text
    assert "0.500 vs 0.800: 0.62x" in text and "2.2000 vs 2.0000: 1.10x" in text
    lines = sharded_lines({"diloco-sharded": row(None, 11.0, 0.5, 2.7),
                           "diloco-2": row(6.0, 10.0, 0.8, 2.0)}, Args)
    assert "sharded not reached, unsharded 6.0 s" in "\n".join(lines)
    assert sharded_lines({"diloco-2": row(6.0, 10.0, 0.8, 2.0)}, Args) == []


def _run(out, *argv, deadline):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "wan_training.py"),
                           "--out", str(out), *argv], capture_output=True, text=True,
                          timeout=deadline)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        return {r["name"]: r for r in json.load(f)["rows"]}, proc.stdout


@pytest.mark.timeout(420)
def test_a_tiny_loopback_run_records_targets_utilisation_parity_and_churn(tmp_path):
    steps, h = 150, 10
    rows, text = _run(tmp_path, "--loopback", "--rows", "diloco", "diloco-churn",
                      "--steps", str(steps), "--sync-every", str(h), "--eval-every", str(h),
                      "--eval-batches", "4", "--target-loss", "3.0", "--cap-s", "200",
                      deadline=400)
    assert "met" in text and (tmp_path / "curves.png").stat().st_size > 10_000
    d = rows["diloco"]
    assert d["time_to_target_s"] is not None and not d["capped"]
    first = next(p for p in d["curve"] if p["loss"] <= 3.0)
    assert d["steps_to_target"] == first["step"]
    assert d["tokens_to_target"] == first["step"] * 4 * 16 * 64   # 4 peers all the way
    assert 0 < d["time_to_target_s"] < d["train_s"]
    assert d["bit_identical"] is True and d["bit_identical_checked"]["peers"] == 4
    assert len(d["compute_utilisation_per_peer"]) == 4
    assert all(0.3 < u <= 1.0 for u in d["compute_utilisation_per_peer"])
    kill, join = churn_schedule(steps)
    c = rows["diloco-churn"]
    assert c["joined_at_step"] is not None and c["joined_at_step"] >= join
    worlds = {p["step"]: p["tokens"] for p in c["curve"]}
    # Tokens grow by 4 peers' steps before the kill, 3 after it, 4 again once the joiner is in.
    per_step = [(worlds[b] - worlds[a]) // ((b - a) * 16 * 64)
                for a, b in zip(sorted(worlds), sorted(worlds)[1:])]
    assert per_step[0] == 4 and 3 in per_step and per_step[-1] == 4
    assert per_step.index(3) >= kill // h - 1
    assert c["bit_identical"] is True and c["bit_identical_checked"]["peers"] == 4


@pytest.mark.timeout(600)
def test_diloco_reaches_a_modest_target_sooner_than_ddp_across_an_emulated_link(tmp_path):
    from harness.wanem import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"WAN emulator unavailable: {reason}")
    rows, _ = _run(tmp_path, "--rows", "ddp-pccl", "diloco", "--steps", "60", "--rate-mbit", "50",
                   "--rtt-ms", "100", "--sync-every", "10", "--eval-every", "10",
                   "--eval-batches", "4", "--target-loss", "3.0", "--cap-s", "90", deadline=580)
    ddp, diloco = rows["ddp-pccl"], rows["diloco"]
    assert diloco["time_to_target_s"] is not None
    assert ddp["time_to_target_s"] is None or diloco["time_to_target_s"] < ddp["time_to_target_s"]
    assert diloco["bit_identical"] is True and ddp["bit_identical"] is True
    assert diloco["bytes_per_peer"] < ddp["bytes_per_peer"]
