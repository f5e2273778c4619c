"""Bad input is refused with TypeError/ValueError before any byte is sent.

Only rank 0 makes the bad call; the other ranks do nothing. Then every rank
runs a good all_reduce: had rank 0 sent anything for the bad call, its peers
would see a mismatched frame and the good all_reduce would fail or differ.
"""

import zlib

import pytest

from harness.data import assert_identical_across_ranks, assert_reduced, make_input, unpack

pytestmark = [pytest.mark.timeout(120), pytest.mark.pccl_only]

CASES = {
    "dtype_int16": TypeError,
    "dtype_bool": TypeError,
    "dtype_uint16_all_gather": TypeError,
    "dtype_mixed_all_gather": (TypeError, ValueError),
    "non_contiguous_all_reduce": ValueError,
    "non_contiguous_broadcast": ValueError,
    "non_contiguous_all_gather": ValueError,
    "op_band": ValueError,
    "op_bxor": ValueError,
    "op_band_reduce_scatter": ValueError,
    "size_all_gather_into_tensor": ValueError,
    "size_reduce_scatter_tensor": ValueError,
    "size_all_gather_list_len": ValueError,
    "size_all_gather_list_elem": ValueError,
    "size_reduce_scatter_list": ValueError,
    "size_all_to_all_splits": ValueError,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world_size", (1, 3))
def test_bad_input_is_refused_locally(pools, world_size, case):
    pool = pools.get(world_size)
    expected = CASES[case]
    names = {c.__name__ for c in (expected if isinstance(expected, tuple) else (expected,))}
    records = pool.run("bad_call", case, [0], deadline_s=30)
    rec = records[0]
    assert all(r is None for r in records[1:])
    assert rec is not None, f"{case}: the bad call returned without an error"
    assert names & set(rec["mro"]), (
        f"{case}: raised {rec['type']} ({rec['mro']}), expected one of {sorted(names)}: "
        f"{rec['message']}\n{rec['traceback']}"
    )
    # A caller mistake is raised at once, not after a network round trip or timeout.
    assert rec["elapsed"] < 5.0, f"{case}: took {rec['elapsed']:.1f}s to raise"
    # The group is still usable and no stray bytes were sent.
    seed = zlib.crc32(case.encode()) % 1000
    results = pool.run("all_reduce", seed, 37, "float32", "SUM", full=True, deadline_s=30)
    assert_identical_across_ranks(results, f"after {case}")
    inputs = [make_input(seed, r, 37, "float32", "SUM") for r in range(world_size)]
    assert_reduced(unpack(results[0]), inputs, "SUM", "float32", f"all_reduce after {case}")


def test_error_classes_are_exported():
    import torch_pccl as tp

    assert issubclass(tp.PcclError, RuntimeError)
    for name in ("InvalidArgumentError", "InvalidUsageError", "PcclSystemError", "PeerLostError",
                 "PcclTimeoutError", "AbortedError", "ProtocolError", "MismatchError",
                 "OutOfMemoryError", "RemoteError"):
        cls = getattr(tp, name)
        assert issubclass(cls, tp.PcclError), name
    assert issubclass(tp.InvalidArgumentError, ValueError)
    assert issubclass(tp.PcclTimeoutError, TimeoutError)
    # Distinct classes, so a test (or a user) can tell the failures apart.
    names = [tp.PeerLostError, tp.PcclTimeoutError, tp.MismatchError, tp.RemoteError, tp.AbortedError]
    assert len(set(names)) == len(names)
