"""all_reduce of sparse COO tensors, as gloo does it: the sum of every rank's entries,
coalesced, written into the caller's tensor, bit-identical on every rank."""

import pytest
import torch

from harness.data import assert_identical_across_ranks, unpack

pytestmark = pytest.mark.timeout(120)

CASES = [  # shape, sparse dims, nnz of rank 0 (rank r holds r more), dtype
    ((6, 5), 2, 7, "float32"),
    ((6, 5), 1, 3, "float64"),  # one dense dimension in the values
    ((4, 3, 2), 2, 5, "int64"),
    ((5,), 1, 0, "float32"),    # rank 0 contributes nothing
]


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}-{len(c[0])}d-sd{c[1]}-nnz{c[2]}")
def test_sparse_sum_matches_gloo(pools, world_size, case):
    shape, sparse_dim, nnz, dtype = case
    pool = pools.get(world_size)
    ours = pool.run("fidelity.sparse_all_reduce", 5, shape, sparse_dim, nnz, dtype, "default")
    gloo = pool.run("fidelity.sparse_all_reduce", 5, shape, sparse_dim, nnz, dtype, "gloo")
    for key in ("indices", "values", "dense"):
        assert_identical_across_ranks([r[key] for r in ours], f"sparse {key}")
    assert torch.equal(unpack(ours[0]["indices"]), unpack(gloo[0]["indices"]))
    # Both sum duplicates in coalesce; the order of the additions may differ.
    torch.testing.assert_close(unpack(ours[0]["values"]), unpack(gloo[0]["values"]))
    dense = unpack(ours[0]["dense"])
    assert dense.shape == shape and dense.abs().sum() > 0


@pytest.mark.pccl_only
@pytest.mark.parametrize("case,error", [("op", "InvalidArgumentError"), ("shape", "MismatchError")])
def test_sparse_refused(fresh_group, case, error):
    pool = fresh_group(2, 10.0)
    recs = pool.run("fidelity.sparse_all_reduce_expecting_error", case, deadline_s=30)
    for rank, rec in enumerate(recs):
        assert rec is not None and error in rec["mro"], (rank, rec)
