"""DDP, FSDP2 and FSDP1 trained over the group under test against the same run over gloo.

Same model initialisation, same per-rank data. After training every rank must
hold bit-identical parameters (the backend returns identical bytes everywhere),
and the parameters must match gloo's run to float tolerance (summation order
may differ between the backends).
"""

import pytest
import torch

from harness.data import assert_identical_across_ranks, unpack

pytestmark = pytest.mark.timeout(180)

STEPS = 6


def check_parity(results, reference, what):
    world_size = len(results)
    n_params = len(results[0]["params"])
    assert n_params == 6
    for i in range(n_params):
        assert_identical_across_ranks([r["params"][i] for r in results], f"{what} param {i}")
        got = unpack(results[0]["params"][i])
        ref = unpack(reference[0]["params"][i])
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} param {i}: {m}")
    for r in range(world_size):
        torch.testing.assert_close(torch.tensor(results[r]["losses"]),
                                   torch.tensor(reference[r]["losses"]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("wrapper", ("train_ddp", "train_fsdp2", "train_fsdp1"))
def test_training_matches_gloo(pools, wrapper, world_size):
    pool = pools.get(world_size)
    seed = 11 + world_size
    ours = pool.run(wrapper, seed, STEPS, "default", deadline_s=120)
    reference = pool.run(wrapper, seed, STEPS, "gloo", deadline_s=120)
    check_parity(ours, reference, f"{wrapper} world size {world_size}")
    untrained = pool.run(wrapper, seed, 0, "gloo", deadline_s=120)
    moved = any(
        not torch.equal(unpack(untrained[0]["params"][i]), unpack(ours[0]["params"][i]))
        for i in range(len(ours[0]["params"]))
    )
    assert moved, "parameters did not change during training"
