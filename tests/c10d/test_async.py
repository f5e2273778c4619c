"""Async ops: Work.wait(), get_future() (what DDP uses), several ops in flight, abort."""

import zlib

import pytest
import torch

from harness.data import assert_equal, assert_identical_across_ranks, assert_reduced, make_input, unpack

pytestmark = pytest.mark.timeout(120)


def seed_of(*params):
    return zlib.crc32(repr(params).encode()) % 100_000


def check_reduced(results, inputs, op, dtype, what):
    assert_identical_across_ranks(results, what)
    assert_reduced(unpack(results[0]), inputs, op, dtype, what)


@pytest.mark.parametrize("world_size", (1, 2, 3))
def test_async_wait(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("async_wait", world_size)
    results = pool.run("all_reduce", seed, 1031, "float32", "SUM", full=True, async_op=True)
    inputs = [make_input(seed, r, 1031, "float32", "SUM") for r in range(world_size)]
    check_reduced(results, inputs, "SUM", "float32", "async all_reduce")
    results = pool.run("broadcast", seed, 77, "int64", world_size - 1, full=True, async_op=True)
    assert_identical_across_ranks(results, "async broadcast")
    assert_equal(unpack(results[0]), make_input(seed, world_size - 1, 77, "int64"), "async bcast")


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_async_get_future(pools, backend, world_size):
    pool = pools.get(world_size)
    seed = seed_of("future", world_size)
    results = pool.run("all_reduce_future", seed, 513, "float64", "MAX")
    inputs = [make_input(seed, r, 513, "float64", "MAX") for r in range(world_size)]
    for key in ("inplace", "future_value", "chained"):
        check_reduced([r[key] for r in results], inputs, "MAX", "float64", f"future {key}")
    assert all(r["future_done"] for r in results)
    if backend == "pccl":  # gloo may set the future before it marks the Work completed
        assert all(r["completed"] for r in results), "Work.is_completed() False after its future"


@pytest.mark.parametrize("world_size", (2, 3))
def test_many_async_in_flight(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("many_async", world_size)
    count = 6
    results = pool.run("many_async_all_reduces", seed, 301, count)
    for i in range(count):
        inputs = [make_input(seed + i, r, 301, "float32") for r in range(world_size)]
        check_reduced([res[i] for res in results], inputs, "SUM", "float32", f"async #{i}")


@pytest.mark.pccl_only
def test_a_tensor_dropped_or_resized_after_an_async_call_is_safe(pools):
    """The queued op holds its tensors from the call: a ``del`` by the caller changes
    nothing, and a tensor resized before the op's turn fails that op (InvalidUsageError on
    every rank alike, here) instead of touching freed memory; the group goes on."""
    world_size, numel = 2, 100_003
    pool = pools.get(world_size)
    seed = seed_of("lifetime", world_size)
    results = pool.run("async_tensor_lifetime", seed, numel)
    inputs = [make_input(seed, r, numel, "float32") for r in range(world_size)]
    check_reduced([r["dropped"] for r in results], inputs, "SUM", "float32", "dropped tensor")
    for r in results:
        assert r["resize_error"] is not None and "resized" in r["resize_error"], r["resize_error"]
        assert_equal(unpack(r["after"]), torch.full((numel,), float(world_size)), "after")


@pytest.mark.pccl_only
def test_a_storage_swapped_and_freed_while_the_op_runs_is_never_touched(pools):
    """The op holds the storage its tensor had at the call until it completes (issue 22):
    swapping it out and freeing it mid-op used to let the native op write freed memory
    (a segfault, or 'send() ... Bad address'). Now the op completes into the old storage,
    the swapped rank gets a clear InvalidUsageError, and new allocations are untouched."""
    numel = (32 << 20) // 4
    results = pools.get(2).run("storage_swapped_during_op", numel)
    swapped, other = results
    assert swapped["error"] is not None and "while the operation ran" in swapped["error"]
    assert swapped["fills_intact"], "the op wrote into memory freed and reused by the caller"
    assert other["error"] is None and other["value"] == 3.0 and other["uniform"], other
    assert swapped["after"] == other["after"] == 2.0


@pytest.mark.pccl_only
def test_abort_wakes_a_blocked_op(fresh_group):
    """Rank 1 never calls; rank 0's pending all_reduce fails with AbortedError once aborted."""
    timeout_s = 20.0
    pool = fresh_group(2, timeout_s)
    pool.send(1, "wait_for_parent")
    pool.send(0, "abort_blocked_all_reduce", 1000)
    assert pool.recv(1, 30) == ("waiting", 1)
    assert pool.recv(0, 30) == ("entering", 0)
    pool.conns[0].send("abort")
    res = pool.result(0, 15, "aborted all_reduce")
    rec = res["error"]
    assert rec is not None, "work.wait() returned after abort"
    assert "AbortedError" in rec["mro"], f"{rec['type']}: {rec['message']}"
    assert rec["elapsed"] < 2.0, f"abort took {rec['elapsed']:.2f}s to wake the op"
    assert res["unchanged"]
