"""``MomentumAligned``: a staleness correction for delayed pseudo-gradients, after HeLoCo
(Al Asif, Diem, Muñoz, Wolf, Jannesari, Mazaheri, "HeLoCo: Efficient asynchronous
low-communication training under data and device heterogeneity", arXiv 2606.00271).

A delayed pseudo-gradient was computed from an older model than the one it is applied to,
so parts of it may point against where the outer optimizer is now heading. HeLoCo takes
the outer momentum ``m`` as the reference for that heading and corrects the incoming
pseudo-gradient ``d`` block by block (a block here: one parameter tensor), from the
cosine ``c = <d, m> / (|d| |m|)`` and a confidence ``conf = |d| / (|d| + kappa |m| + eps)``:

- ``c >= keep``: the block is kept as it is (aligned enough);
- ``c < 0``: its component against the momentum is shrunk,
  ``d - beta c |d| m / |m|`` with ``beta = min(shrink * (-c) * conf, max_shrink)``;
- ``0 <= c < keep``: it is turned part of the way towards the momentum, keeping its norm,
  ``|d| u' / |u'|`` with ``u' = (1 - lam) d / |d| + lam m / |m|`` and
  ``lam = min(reorient * (1 - c) * conf, 1)``.

A block whose momentum (or itself) is zero is kept. The equations follow the paper's
method as restated in the zij optimizer catalogue (docs/math/heloco.md of
github.com/junaidaliop/zij); the paper's own constants were not available here, so the
defaults below are this project's, chosen on benchmarks/diloco_quality.py (docs/diloco.md,
"Async DiLoCo's staleness correction"). Every input is shared state or the group's average,
so the corrected update is the same bytes on every peer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MomentumAligned"]


@dataclass(frozen=True)
class MomentumAligned:
    """The correction's constants (see the module docstring for the rule).

    Args:
        keep: cosine at or above which a block is kept, in (0, 1].
        shrink: strength of the shrinking of an anti-aligned block (>= 0).
        max_shrink: cap of that shrinking, in [0, 1].
        reorient: strength of the turn of a weakly aligned block (>= 0).
        kappa: weight of the momentum's norm in the confidence (>= 0).

    Raises:
        ValueError: a constant out of its range or not finite.
    """

    keep: float = 0.5
    shrink: float = 1.0
    max_shrink: float = 1.0
    reorient: float = 0.5
    kappa: float = 1.0

    def __post_init__(self):
        checks = {"keep": 0.0 < self.keep <= 1.0, "shrink": self.shrink >= 0.0,
                  "max_shrink": 0.0 <= self.max_shrink <= 1.0,
                  "reorient": self.reorient >= 0.0, "kappa": self.kappa >= 0.0}
        for name, ok in checks.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not ok:
                raise ValueError(f"{name} out of range: {value!r}")

    def correct(self, delta: torch.Tensor, momentum: torch.Tensor) -> torch.Tensor:
        """One block: ``delta`` (a pseudo-gradient's tensor) corrected against
        ``momentum`` (the outer optimizer's buffer of the same shape); a new tensor of
        ``delta``'s dtype, or ``delta`` itself when it is kept.

        Raises:
            ValueError: the shapes differ.
        """
        if delta.shape != momentum.shape:
            raise ValueError(f"shapes differ: {tuple(delta.shape)} and {tuple(momentum.shape)}")
        eps = torch.finfo(delta.dtype).tiny
        d, m = delta.double().reshape(-1), momentum.double().reshape(-1)
        dn, mn = float(d.norm()), float(m.norm())
        if dn <= eps or mn <= eps:
            return delta
        v = m / mn
        c = float(d @ v) / dn
        conf = dn / (dn + self.kappa * mn + eps)
        if c >= self.keep:
            return delta
        if c < 0.0:
            beta = min(self.shrink * -c * conf, self.max_shrink)
            out = d - (beta * c * dn) * v
        else:
            lam = min(self.reorient * (1.0 - c) * conf, 1.0)
            turned = (1.0 - lam) * (d / dn) + lam * v
            out = turned * (dn / max(float(turned.norm()), eps))
        return out.to(delta.dtype).view(delta.shape)

    def correct_all(self, deltas: Sequence[torch.Tensor],
                    momenta: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """``correct`` block by block; a block without a momentum (None) is kept."""
        return [d if m is None else self.correct(d, m) for d, m in zip(deltas, momenta)]
