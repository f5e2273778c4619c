"""DTensor, tensor parallel and FSDP2 over the group under test, each against one process.

Four of the pool's workers build ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))`` (and a 1-D
mesh of all four) on the default group, so every collective DTensor issues runs over the
backend under test; each worker also runs the one-process reference from the same seed
(tests/harness/dtensor_code.py) and sends back only the comparisons. Everything is float64.

- Placement changes move data without arithmetic, and the reductions sum integer-valued
  float64 (exact in any order): those results must be bit-identical.
- Tensor parallel splits a matmul's inner sum in two and adds the halves, and FSDP2 sums the
  dp halves' gradients, where the reference sums in one go: the results differ by float64
  rounding in summation order only, a few ulps of values of order 1 (measured: at most 9e-16,
  the same over pccl and gloo). The tolerance below, 1e-12 absolute after 3 AdamW steps, is a
  thousand times that; an error of 1e-9 in one element of one all-reduce fails every test.

Run with ``--backend gloo`` to check the tests themselves on torch's own backend.
"""

import pytest

pytestmark = pytest.mark.timeout(180)

SEED = 39
STEPS = 3
ATOL_SUMMATION_ORDER = 1e-12


def check_exact(results, what):
    for r, res in enumerate(results):
        for name, c in res["checks"].items():
            assert c["shape"] == c["want_shape"], f"rank {r} {what} {name}: shape {c['shape']} != {c['want_shape']}"
            assert c["exact"], f"rank {r} {what} {name}: max |diff| {c['max_abs']} (want bit-identical)"


def check_close(results, what, atol=ATOL_SUMMATION_ORDER):
    for r, res in enumerate(results):
        for name, c in res["checks"].items():
            assert c["shape"] == c["want_shape"], f"rank {r} {what} {name}: shape {c['shape']} != {c['want_shape']}"
            assert c["max_abs"] <= atol, f"rank {r} {what} {name}: max |diff| {c['max_abs']} > {atol}"
            assert c["scale"] > 0.01, f"rank {r} {what} {name}: reference is ~0, the comparison says nothing"


def test_distribute_and_redistribute(pools, backend):
    results = pools.get(4).run("dtensor_code.distribute_and_redistribute", SEED, deadline_s=90)
    for r, res in enumerate(results):
        assert res["backends_1d"] == {"world": backend}, f"rank {r}: {res['backends_1d']}"
        assert res["backends_2d"] == {"dp": backend, "tp": backend}, f"rank {r}: {res['backends_2d']}"
        assert len(res["checks"]) == 39, f"rank {r}: {len(res['checks'])} comparisons"
        # Ranks 0-2 hold 2 of x's 7 rows under Shard(0) over 4, rank 3 one: uneven layouts ran.
        assert res["checks"]["1d x Shard(dim=0) local"]["shape"] == [2 if r < 3 else 1, 10]
    check_exact(results, "distribute/redistribute")


def test_tensor_parallel_mlp(pools, backend):
    results = pools.get(4).run("dtensor_code.tensor_parallel_mlp", SEED, deadline_s=90)
    for r, res in enumerate(results):
        assert res["backends"] == {"dp": backend, "tp": backend}, f"rank {r}: {res['backends']}"
        # The module really is split over tp: colwise rows, rowwise columns, each half local.
        assert res["placements"] == {
            "w1.weight": (["Shard(dim=0)"], [8, 12], 1), "w1.bias": (["Shard(dim=0)"], [8], 1),
            "w2.weight": (["Shard(dim=1)"], [6, 8], 1), "w2.bias": (["Replicate()"], [6], 1),
        }, f"rank {r}: {res['placements']}"
        assert not res["output_is_dtensor"]
    # Parameters were only distributed and gathered: exact. Output and gradients: summation order.
    check_exact([{"checks": {n: c for n, c in res["checks"].items() if n.endswith(("weight", "bias"))}}
                 for res in results], "tensor parallel")
    check_close([{"checks": {n: c for n, c in res["checks"].items() if not n.endswith(("weight", "bias"))}}
                 for res in results], "tensor parallel")
    assert len(results[0]["checks"]) == 2 + 2 * 4


def test_fsdp_with_tensor_parallel(pools, backend):
    results = pools.get(4).run("dtensor_code.fsdp_tensor_parallel", SEED, STEPS, 0.02, deadline_s=120)
    for r, res in enumerate(results):
        assert res["backends"] == {"dp": backend, "tp": backend}, f"rank {r}: {res['backends']}"
        assert len(res["checks"]) == 8, f"rank {r}: {sorted(res['checks'])}"
        for name, (placements, _, mesh_dims) in res["placements"].items():
            # Sharded by FSDP over dp and by tensor parallel over tp: a 2-D DTensor.
            assert mesh_dims == 2 and "Shard" in placements[0], f"rank {r} {name}: {placements}"
        assert all(m > 1e-3 for m in res["moved"].values()), f"training did not move: {res['moved']}"
        assert len(res["losses"]) == STEPS
        for step, (got, want) in enumerate(zip(res["losses"], res["ref_losses"])):
            assert abs(got - want) <= ATOL_SUMMATION_ORDER, f"rank {r} step {step}: loss {got} != {want}"
    check_close(results, f"FSDP2 x TP after {STEPS} AdamW steps")
