"""Every collective against a numpy-free torch reference, on world sizes 1-4.

Inputs are rebuilt in this process from (seed, rank) (tests/harness/data.py), so the
reference never depends on the backend under test. Each test asserts that
every rank's result bytes are identical and that they equal the reference
(exact for integers, MIN/MAX and data movement; float tolerance for reductions).
"""

import zlib

import pytest
import torch

from harness.data import (
    DTYPES,
    OPS,
    assert_equal,
    assert_identical_across_ranks,
    assert_reduced,
    make_input,
    unpack,
)
from conftest import WORLD_SIZES

pytestmark = pytest.mark.timeout(120)

SIZES = (0, 1, 7, 1031)
BIG = 1_000_003  # odd, not a multiple of any world size or chunk


def seed_of(*params):
    return zlib.crc32(repr(params).encode()) % 100_000


def skip_unsupported(backend, op=None, dtype=None):
    """gloo (the harness check) lacks AVG; pccl must support every combination."""
    if backend == "gloo" and op == "AVG":
        pytest.skip("gloo has no AVG")


def check_reduced(results, inputs, op, dtype, what):
    assert_identical_across_ranks(results, what)
    assert_reduced(unpack(results[0]), inputs, op, dtype, what)


# --- all_reduce ------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce(pools, backend, world_size, op, dtype, numel):
    skip_unsupported(backend, op, dtype)
    pool = pools.get(world_size)
    seed = seed_of("all_reduce", world_size, op, dtype, numel)
    results = pool.run("all_reduce", seed, numel, dtype, op, full=True)
    inputs = [make_input(seed, r, numel, dtype, op) for r in range(world_size)]
    check_reduced(results, inputs, op, dtype, f"all_reduce {op} {dtype} n={numel}")


LARGE_CASES = [(3, op, dtype) for op in OPS for dtype in DTYPES] + [
    (ws, "SUM", dtype) for ws in (2, 4) for dtype in DTYPES
] + [(4, "AVG", "bfloat16"), (4, "PRODUCT", "float16"), (1, "SUM", "float32")]


@pytest.mark.parametrize("world_size,op,dtype", LARGE_CASES)
def test_all_reduce_large(pools, backend, world_size, op, dtype):
    skip_unsupported(backend, op, dtype)
    pool = pools.get(world_size)
    seed = seed_of("all_reduce_large", world_size, op, dtype)
    # Only rank 0 sends its bytes; the others send a digest of theirs.
    results = pool.run("all_reduce", seed, BIG, dtype, op, full=False)
    inputs = [make_input(seed, r, BIG, dtype, op) for r in range(world_size)]
    check_reduced(results, inputs, op, dtype, f"all_reduce {op} {dtype} n={BIG}")


@pytest.mark.parametrize("world_size", (2, 3))
def test_all_reduce_on_view_leaves_rest_of_buffer(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("view", world_size)
    results = pool.run("all_reduce_on_view", seed, 33, "float32", "SUM")
    assert all(r["untouched"] for r in results), "all_reduce wrote outside the tensor's view"
    inputs = [make_input(seed, r, 33, "float32", "SUM") for r in range(world_size)]
    check_reduced([r["result"] for r in results], inputs, "SUM", "float32", "view")


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int64"))
@pytest.mark.parametrize("op", ("SUM", "MAX"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("api", ("all_reduce_coalesced", "all_reduce_coalescing_manager"))
def test_all_reduce_coalesced(pools, world_size, op, dtype, api):
    pool = pools.get(world_size)
    sizes = [5, 0, 1031, 1]
    seed = seed_of(api, world_size, op, dtype)
    results = pool.run(api, seed, sizes, dtype, op)
    for i, n in enumerate(sizes):
        inputs = [make_input(seed + i, r, n, dtype, op) for r in range(world_size)]
        check_reduced([res[i] for res in results], inputs, op, dtype, f"{api} tensor {i}")


# --- broadcast -------------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", (0, 1, 7, 1031))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast(pools, world_size, dtype, numel):
    pool = pools.get(world_size)
    seed = seed_of("broadcast", world_size, dtype, numel)
    for root in range(world_size):
        results = pool.run("broadcast", seed, numel, dtype, root, full=True)
        what = f"broadcast root={root} {dtype} n={numel}"
        assert_identical_across_ranks(results, what)
        assert_equal(unpack(results[0]), make_input(seed, root, numel, dtype), what)


@pytest.mark.parametrize("world_size", (2, 3))
def test_broadcast_large(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("broadcast_large", world_size)
    root = world_size - 1
    results = pool.run("broadcast", seed, BIG, "float16", root, full=False)
    assert_identical_across_ranks(results, "broadcast large")
    assert_equal(unpack(results[0]), make_input(seed, root, BIG, "float16"), "broadcast large")


# --- all_gather ------------------------------------------------------------------------------------


def expected_gather(seed, world_size, numel, dtype):
    return torch.cat([make_input(seed, r, numel, dtype) for r in range(world_size)])


@pytest.mark.parametrize("numel", (0, 1, 7, 1031))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("api", ("all_gather_list", "all_gather_into_tensor"))
def test_all_gather(pools, api, world_size, dtype, numel):
    pool = pools.get(world_size)
    seed = seed_of(api, world_size, dtype, numel)
    results = pool.run(api, seed, numel, dtype)
    what = f"{api} {dtype} n={numel}"
    assert_identical_across_ranks(results, what)
    assert_equal(unpack(results[0]), expected_gather(seed, world_size, numel, dtype), what)


@pytest.mark.parametrize("world_size", (2, 3))
def test_all_gather_into_tensor_2d_output(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("ag2d", world_size)
    results = pool.run("all_gather_into_tensor", seed, 9, "float64", shape2d=True)
    assert_identical_across_ranks(results, "all_gather 2d")
    assert_equal(unpack(results[0]), expected_gather(seed, world_size, 9, "float64"), "ag 2d")




AG_COALESCED_CASES = [
    ("all_gather_coalesced_manager", ws, dtype) for ws in WORLD_SIZES
    for dtype in ("float32", "float16", "uint8")
] + [("all_gather_coalesced_legacy", ws, "int64") for ws in WORLD_SIZES]


@pytest.mark.parametrize("api,world_size,dtype", AG_COALESCED_CASES)
def test_all_gather_coalesced(pools, backend, api, world_size, dtype):
    pool = pools.get(world_size)
    sizes = [3, 1031, 1] if api.endswith("legacy") else [3, 0, 1031, 1]
    seed = seed_of(api, world_size, dtype)
    results = pool.run(api, seed, sizes, dtype)
    for i, n in enumerate(sizes):
        what = f"{api} tensor {i} {dtype}"
        outs = [res[i] for res in results]
        assert_identical_across_ranks(outs, what)
        assert_equal(unpack(outs[0]), expected_gather(seed + i, world_size, n, dtype), what)


# --- reduce_scatter --------------------------------------------------------------------------------


def check_reduce_scatter(results, seed, world_size, op, dtype, numel, what):
    for r, rec in enumerate(results):
        # Rank r's output is op over ranks s of the r-th block of s's input.
        inputs = [make_input(seed + r, s, numel, dtype, op) for s in range(world_size)]
        assert_reduced(unpack(rec), inputs, op, dtype, f"{what} {op} {dtype} n={numel} rank {r}")


@pytest.mark.parametrize("numel", (7, 1031))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_tensor(pools, backend, world_size, op, dtype, numel):
    skip_unsupported(backend, op, dtype)
    pool = pools.get(world_size)
    seed = seed_of("reduce_scatter_tensor", world_size, op, dtype, numel)
    results = pool.run("reduce_scatter_tensor", seed, numel, dtype, op)
    check_reduce_scatter(results, seed, world_size, op, dtype, numel, "reduce_scatter_tensor")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_list(pools, backend, world_size, op, dtype):
    skip_unsupported(backend, op, dtype)
    pool = pools.get(world_size)
    seed = seed_of("reduce_scatter_list", world_size, op, dtype)
    results = pool.run("reduce_scatter_list", seed, 7, dtype, op)
    check_reduce_scatter(results, seed, world_size, op, dtype, 7, "reduce_scatter (list)")


@pytest.mark.parametrize("numel", (0, 1))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("api", ("reduce_scatter_list", "reduce_scatter_tensor"))
def test_reduce_scatter_tiny(pools, api, world_size, numel):
    pool = pools.get(world_size)
    seed = seed_of(api, "tiny", world_size, numel)
    results = pool.run(api, seed, numel, "float32", "SUM")
    check_reduce_scatter(results, seed, world_size, "SUM", "float32", numel, api)


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_reduce_scatter_coalesced(pools, world_size):
    pool = pools.get(world_size)
    sizes = [3, 1031, 1]
    seed = seed_of("rs_coalesced", world_size)
    results = pool.run("reduce_scatter_coalesced_manager", seed, sizes, "float32", "SUM")
    for i, n in enumerate(sizes):
        for r in range(world_size):
            inputs = [make_input(seed + 100 * i + r, s, n, "float32", "SUM") for s in range(world_size)]
            assert_reduced(unpack(results[r][i]), inputs, "SUM", "float32", f"rs coalesced {i} rank {r}")


# --- all_to_all ------------------------------------------------------------------------------------


def expected_all_to_all(seed, dtype, splits, me):
    ws = len(splits)
    parts = []
    for s in range(ws):
        data = make_input(seed, s, sum(splits[s]), dtype)
        start = sum(splits[s][:me])
        parts.append(data[start : start + splits[s][me]])
    return torch.cat(parts)


def uneven_splits(world_size, seed):
    g = torch.Generator().manual_seed(seed)
    splits = torch.randint(0, 6, (world_size, world_size), generator=g).tolist()
    if world_size > 1:
        splits[0][world_size - 1] = 0  # at least one empty pair
        splits[world_size - 1][0] = 11
    return splits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("even", (True, False), ids=("even", "uneven"))
def test_all_to_all_single(pools, world_size, dtype, even):
    pool = pools.get(world_size)
    seed = seed_of("a2a", world_size, dtype, even)
    if even:
        per_peer = 5
        results = pool.run("all_to_all_single_even", seed, dtype, per_peer)
        splits = [[per_peer] * world_size for _ in range(world_size)]
    else:
        splits = uneven_splits(world_size, seed)
        results = pool.run("all_to_all_single", seed, dtype, splits)
    for r, rec in enumerate(results):
        assert_equal(unpack(rec), expected_all_to_all(seed, dtype, splits, r),
                     f"all_to_all_single rank {r} splits {splits}")


@pytest.mark.parametrize("world_size", (1, 3, 4))
def test_all_to_all_list(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("a2a_list", world_size)
    results = pool.run("all_to_all_list", seed, "int32", 4)
    splits = [[4] * world_size for _ in range(world_size)]
    for r, rec in enumerate(results):
        assert_equal(unpack(rec), expected_all_to_all(seed, "int32", splits, r), f"all_to_all rank {r}")


# --- rooted collectives ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int8", "int64"))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce(pools, backend, world_size, op, dtype):
    skip_unsupported(backend, op, dtype)
    pool = pools.get(world_size)
    numel = 257
    for dst in range(world_size):
        seed = seed_of("reduce", world_size, op, dtype, dst)
        results = pool.run("reduce", seed, numel, dtype, op, dst)
        inputs = [make_input(seed, r, numel, dtype, op) for r in range(world_size)]
        assert_reduced(unpack(results[dst]["result"]), inputs, op, dtype, f"reduce dst={dst}")


@pytest.mark.parametrize("numel", (0, 7, 1031))
@pytest.mark.parametrize("dtype", ("float64", "float16", "uint8", "int32"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather(pools, world_size, dtype, numel):
    pool = pools.get(world_size)
    for dst in range(world_size):
        seed = seed_of("gather", world_size, dtype, numel, dst)
        results = pool.run("gather", seed, numel, dtype, dst)
        assert all(results[r] is None for r in range(world_size) if r != dst)
        assert_equal(unpack(results[dst]), expected_gather(seed, world_size, numel, dtype),
                     f"gather dst={dst}")


@pytest.mark.parametrize("numel", (0, 7, 1031))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int8", "int64"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_scatter(pools, world_size, dtype, numel):
    pool = pools.get(world_size)
    for src in range(world_size):
        seed = seed_of("scatter", world_size, dtype, numel, src)
        results = pool.run("scatter", seed, numel, dtype, src)
        for r, rec in enumerate(results):
            assert_equal(unpack(rec), make_input(seed + r, src, numel, dtype), f"scatter src={src} rank {r}")


# --- barrier ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier_waits_for_the_last_rank(pools, world_size, tmp_path):
    """Ranks 0..n-2 enter the barrier; the last rank is held back by the parent.

    None may return before the last rank writes its flag file (checked by each
    rank after the barrier), and none may return while the parent holds it.
    """
    pool = pools.get(world_size)
    last = world_size - 1
    for r in range(world_size):
        pool.send(r, "barrier_ordered", str(tmp_path))
    for r in range(world_size):
        tag, _ = pool.recv(r, 30, "barrier entry")
        assert tag == ("waiting" if r == last else "entering")
    # While the last rank is held, nobody may have returned from the barrier.
    for r in range(last):
        assert not pool.conns[r].poll(0.3), f"rank {r} returned from barrier before rank {last} entered"
    pool.conns[last].send("go")
    flags = sorted(f"rank{r}" for r in range(world_size))
    for r in range(world_size):
        assert pool.result(r, 30, "barrier") == flags


# --- large data movement (many pipeline chunks, odd sizes) -----------------------------------------


def test_all_gather_large(pools):
    pool = pools.get(3)
    n = 333_337
    seed = seed_of("ag_large")
    results = pool.run("all_gather_into_tensor", seed, n, "bfloat16")
    assert_identical_across_ranks(results, "all_gather large")
    assert_equal(unpack(results[0]), expected_gather(seed, 3, n, "bfloat16"), "all_gather large")


@pytest.mark.parametrize("op,dtype", [("SUM", "bfloat16"), ("MAX", "int32"), ("AVG", "float32")])
def test_reduce_scatter_large(pools, backend, op, dtype):
    skip_unsupported(backend, op, dtype)
    pool = pools.get(3)
    n = 333_337
    seed = seed_of("rs_large", op, dtype)
    results = pool.run("reduce_scatter_tensor", seed, n, dtype, op)
    check_reduce_scatter(results, seed, 3, op, dtype, n, "reduce_scatter large")


def test_all_to_all_large_uneven(pools):
    pool = pools.get(4)
    seed = seed_of("a2a_large")
    splits = [[(s * 4 + d) * 20_011 % 150_001 for d in range(4)] for s in range(4)]
    results = pool.run("all_to_all_single", seed, "float16", splits)
    for r, rec in enumerate(results):
        assert_equal(unpack(rec), expected_all_to_all(seed, "float16", splits, r), f"a2a large rank {r}")
