"""The harness itself: deadlines are enforced and references are not trivially satisfied."""

import pytest
import torch

from harness.data import assert_reduced, make_input
from harness.pool import PoolError

pytestmark = pytest.mark.timeout(60)


def test_pool_deadline_is_enforced(fresh_group):
    """The harness itself: a worker that does not answer fails the test instead of hanging."""
    pool = fresh_group(2, 5.0)
    pool.send(0, "wait_for_parent")
    assert pool.recv(0, 30) == ("waiting", 0)
    with pytest.raises(PoolError, match="no reply within"):
        pool.result(0, 0.5)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int8"))
def test_reference_check_rejects_a_wrong_result(dtype):
    inputs = [make_input(3, r, 64, dtype, "SUM") for r in range(3)]
    right = sum(t.to(torch.float64) for t in inputs).to(inputs[0].dtype)
    assert_reduced(right, inputs, "SUM", dtype)
    wrong = right.clone()
    wrong[17] += 1
    with pytest.raises(AssertionError):
        assert_reduced(wrong, inputs, "SUM", dtype)
    with pytest.raises(AssertionError):  # a two-rank sum is not a three-rank sum
        assert_reduced(inputs[0] + inputs[1], inputs, "SUM", dtype)


def test_inputs_differ_between_ranks_and_are_reproducible():
    a0, a1 = make_input(5, 0, 100, "float32"), make_input(5, 1, 100, "float32")
    assert not torch.equal(a0, a1)
    assert torch.equal(a0, make_input(5, 0, 100, "float32"))
    big = make_input(5, 0, 1000, "int64", "MIN")
    assert big.min() < -(2**40) and big.max() > 2**40
