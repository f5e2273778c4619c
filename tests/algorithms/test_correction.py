"""Async DiLoCo's staleness correction (torch_pccl.algorithms.diloco.correction,
``MomentumAligned``, after HeLoCo): the rule on hand-made blocks, and through
``AsyncDiLoCo(correction=...)`` on threads (bit-identical outer state, and a different
trajectory from the uncorrected one)."""

import math
import threading

import pytest
import torch

from harness.replicas import ThreadGroup
from torch_pccl.algorithms.diloco import AsyncDiLoCo, MomentumAligned


def cosine(a, b):
    return float(a @ b) / float(a.norm() * b.norm())


def test_an_aligned_block_is_kept_as_it_is():
    rule = MomentumAligned(keep=0.5)
    d = torch.tensor([1.0, 0.2], dtype=torch.float64)
    m = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert rule.correct(d, m) is d                  # cosine 0.98 >= 0.5


def test_an_anti_aligned_block_loses_part_of_its_component_against_the_momentum():
    rule = MomentumAligned(keep=0.5, shrink=1.0, max_shrink=1.0, kappa=1.0)
    d = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    m = torch.tensor([2.0, 0.0], dtype=torch.float64)
    out = rule.correct(d, m)
    dn, mn = math.sqrt(2.0), 2.0
    c = -1.0 / math.sqrt(2.0)
    beta = min(-c * dn / (dn + mn), 1.0)
    want = d - beta * c * dn * torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(out, want, rtol=0, atol=1e-12)
    assert out[1] == d[1]                           # the orthogonal part is untouched
    assert cosine(out, m) > cosine(d, m)
    capped = MomentumAligned(keep=0.5, shrink=10.0, max_shrink=0.25).correct(d, m)
    assert torch.allclose(capped, d - 0.25 * c * dn * torch.tensor([1.0, 0.0],
                                                                    dtype=torch.float64))


def test_a_weakly_aligned_block_turns_towards_the_momentum_and_keeps_its_norm():
    rule = MomentumAligned(keep=0.9, reorient=0.5, kappa=0.0)     # conf = 1 with kappa 0
    d = torch.tensor([1.0, 1.0], dtype=torch.float64)             # cosine 0.707
    m = torch.tensor([3.0, 0.0], dtype=torch.float64)
    out = rule.correct(d, m)
    assert math.isclose(float(out.norm()), float(d.norm()), rel_tol=1e-12)
    lam = 0.5 * (1.0 - 1.0 / math.sqrt(2.0))
    turned = (1 - lam) * d / d.norm() + lam * torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(out, turned * d.norm() / turned.norm(), rtol=0, atol=1e-12)
    assert cosine(out, m) > cosine(d, m)


def test_no_momentum_or_no_update_keeps_the_block_and_shapes_are_checked():
    rule = MomentumAligned()
    d = torch.randn(3, 4)
    assert rule.correct(d, torch.zeros(3, 4)) is d
    zero = torch.zeros(3, 4)
    assert rule.correct(zero, torch.ones(3, 4)) is zero
    assert rule.correct_all([d], [None])[0] is d
    out = rule.correct(-d, d)
    assert out.dtype == d.dtype and out.shape == d.shape
    with pytest.raises(ValueError):
        rule.correct(d, torch.ones(4, 3))
    for bad in ({"keep": 0.0}, {"keep": 1.5}, {"shrink": -1.0}, {"max_shrink": 2.0},
                {"reorient": float("nan")}, {"kappa": -0.1}):
        with pytest.raises(ValueError):
            MomentumAligned(**bad)
    with pytest.raises(ValueError):
        AsyncDiLoCo(torch.nn.Linear(2, 2), None, correction="heloco")


class Vec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))


@pytest.mark.usefixtures("in_process")
def test_async_diloco_with_the_correction_stays_bit_identical_and_takes_another_path():
    def run(correction):
        n, group = 3, ThreadGroup(3)
        finals = [None] * n
        # Targets that rotate from round to round, so the delayed averages disagree with
        # the momentum and the correction has blocks to work on.
        targets = [[torch.randn(16, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(7 * r + k))
                    for k in range(12)] for r in range(n)]

        def replica(r):
            model = Vec()
            inner = torch.optim.SGD(model.parameters(), lr=0.2)
            d = AsyncDiLoCo(model, inner, sync_every=2, group=group.peer(r),
                            correction=correction)
            for t in range(24):
                inner.zero_grad()
                (0.5 * ((model.w - targets[r][t // 2]) ** 2).sum()).backward()
                inner.step()
                d.step()
            d.finish()
            finals[r] = d.outer_parameters[0].clone()

        threads = [threading.Thread(target=replica, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert all(f is not None for f in finals)
        for r in range(1, n):
            assert torch.equal(finals[0], finals[r]), r
        return finals[0]

    plain = run(None)
    corrected = run(MomentumAligned(keep=1.0, reorient=1.0))
    assert not torch.equal(plain, corrected)
    assert torch.isfinite(corrected).all()
