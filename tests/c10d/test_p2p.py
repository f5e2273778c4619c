"""Point-to-point: blocking send/recv pairs, isend/irecv rings, batch_isend_irecv."""

import zlib

import pytest

from harness.data import DTYPES, assert_equal, make_input, unpack

pytestmark = pytest.mark.timeout(120)


def seed_of(*params):
    return zlib.crc32(repr(params).encode()) % 100_000


PAIR_CASES = [(d, n) for d in DTYPES for n in (0, 1, 1031)] + [
    ("float32", 300_007), ("bfloat16", 300_007)]


@pytest.mark.parametrize("dtype,numel", PAIR_CASES)
@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_send_recv_pairs(pools, world_size, dtype, numel):
    pool = pools.get(world_size)
    seed = seed_of("pairs", world_size, dtype, numel)
    results = pool.run("send_recv_pairs", seed, numel, dtype)
    for r, rec in enumerate(results):
        if r % 2 == 0:
            assert rec is None
            continue
        assert rec["src"] == r - 1
        assert_equal(unpack(rec["result"]), make_input(seed, r - 1, numel, dtype), f"recv on rank {r}")


@pytest.mark.parametrize("tagged", (False, True), ids=("tag0", "tag7"))
@pytest.mark.parametrize("dtype", ("float32", "float16", "int8", "int64"))
@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_isend_irecv_ring(pools, world_size, dtype, tagged):
    pool = pools.get(world_size)
    seed = seed_of("ring", world_size, dtype, tagged)
    results = pool.run("send_recv_ring", seed, 513, dtype, tagged=tagged)
    for r, rec in enumerate(results):
        left = (r - 1) % world_size
        assert_equal(unpack(rec), make_input(seed, left, 513, dtype), f"ring recv on rank {r}")


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_batch_isend_irecv(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("batch", world_size)
    results = pool.run("send_recv_batch", seed, 129, "float64")
    for r, rec in enumerate(results):
        left, right = (r - 1) % world_size, (r + 1) % world_size
        assert_equal(unpack(rec["left"]), make_input(seed, left, 129, "float64"), f"rank {r} left")
        assert_equal(unpack(rec["right"]), make_input(seed, right, 129, "float64"), f"rank {r} right")


@pytest.mark.pccl_only
@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_transfer_batch_lands_in_place(pools, world_size):
    pool = pools.get(world_size)
    seed = seed_of("transfer", world_size)
    results = pool.run("transfer_batch_all_pairs", seed, 100_003)
    for r, rec in enumerate(results):
        assert sorted(int(p) for p in rec) == [p for p in range(world_size) if p != r]
        for p, packed in rec.items():
            assert_equal(unpack(packed), make_input(seed, int(p), 100_003, "float32"),
                         f"rank {r} from {p}")
