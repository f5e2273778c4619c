"""The pure functions of the DiLoCo family: the pseudo-gradient and Streaming
DiLoCo's fragments and schedule (unit-tested on their own, no group needed)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

__all__ = ["cycle_order", "first_send", "fragment_offsets", "fragments_due",
           "pseudo_gradient", "send_spacing", "strided_fragments"]


def pseudo_gradient(outer: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """DiLoCo's outer gradient ``outer - local``, in ``outer``'s dtype, on ``outer``'s device.

    Positive where the inner steps decreased a parameter, so that an SGD outer
    step with lr 1 and no momentum lands on the (averaged) local parameters.
    """
    return outer - local.detach().to(outer.device, outer.dtype)


_BLOCK = re.compile(r"^((?:[^.]+\.)*?\d+)\.")


def strided_fragments(names: Sequence[str], num_fragments: int,
                      numels: Sequence[int] | None = None) -> list[list[int]]:
    """Splits parameters into ``num_fragments`` fragments by strided block assignment.

    A *block* is the set of parameters whose name starts with the same
    ``<prefix>.<int>.`` (the first integer component: ``blocks.3.attn.w`` is in
    block ``blocks.3``, ``0.weight`` of an ``nn.Sequential`` in block ``0``),
    blocks numbered in order of first appearance; block j goes to fragment
    ``j % num_fragments`` (Streaming DiLoCo's default, arXiv 2501.18512). The
    parameters in no block (embeddings, final norm, head) go, together, to the
    fragment with the fewest elements (ties: the lowest index).

    Args:
        names: parameter names, in model order.
        num_fragments: P >= 1.
        numels: element count of each parameter (default: 1 each).

    Returns:
        P lists of indices into ``names``, each ascending and non-empty.

    Raises:
        ValueError: P < 1, or fewer blocks than fragments (a fragment would be empty).
    """
    if not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}")
    numels = [1] * len(names) if numels is None else list(numels)
    blocks: dict[str, list[int]] = {}
    rest: list[int] = []
    for i, name in enumerate(names):
        m = _BLOCK.match(name)
        if m:
            blocks.setdefault(m.group(1), []).append(i)
        else:
            rest.append(i)
    if num_fragments == 1:
        return [list(range(len(names)))] if names else [[]]
    if len(blocks) < num_fragments:
        raise ValueError(f"{len(blocks)} blocks (parameter names '<prefix>.<int>.') for "
                         f"{num_fragments} fragments: pass fragments= or fewer fragments")
    fragments: list[list[int]] = [[] for _ in range(num_fragments)]
    for j, members in enumerate(blocks.values()):
        fragments[j % num_fragments].extend(members)
    if rest:
        sizes = [sum(numels[i] for i in f) for f in fragments]
        fragments[sizes.index(min(sizes))].extend(rest)
    return [sorted(f) for f in fragments]


def fragment_offsets(sync_every: int, num_fragments: int) -> list[int]:
    """Default schedule offsets ``t_p = p * H // P``: the fragments spread evenly over H steps."""
    return [p * sync_every // num_fragments for p in range(num_fragments)]


def fragments_due(t: int, sync_every: int, offsets: Sequence[int]) -> list[int]:
    """The fragments p that send at inner step ``t`` (>= 1): ``(t - t_p) % H == 0``."""
    if t < 1:
        return []
    return [p for p, off in enumerate(offsets) if (t - off) % sync_every == 0]


def send_spacing(sync_every: int, offsets: Sequence[int]) -> int:
    """The fewest inner steps between two consecutive fragment sends (cyclic over H), in
    1 .. H - 1: ``H // P`` or one more for the default offsets (20 steps, 3 fragments:
    offsets 0, 6, 13, spacing 6). Streaming DiLoCo's schedule puts one fragment on the wire
    at a time while each exchange is shorter than this (arXiv 2501.18512)."""
    points = sorted(set(offsets))
    if len(points) < 2:
        return max(1, sync_every - 1)
    gaps = [b - a for a, b in zip(points, points[1:])] + [sync_every - points[-1] + points[0]]
    return max(1, min(min(gaps), sync_every - 1))


def first_send(sync_every: int, offset: int) -> int:
    """The first inner step (>= 1) at which a fragment of offset ``t_p`` sends: ``t_p``,
    or H for ``t_p = 0`` (``fragments_due`` never fires at step 0)."""
    return offset if offset > 0 else sync_every


def cycle_order(sync_every: int, offsets: Sequence[int]) -> list[int]:
    """The fragments in the order they send within one outer step: by ``first_send``,
    ties by index. With a quorum (``StreamingDiLoCo(quorum=...)``) the group's rounds
    follow this order, one per fragment, and the outer step's boundary comes after the
    last one (the fragment of offset 0 with the default offsets, as without a quorum)."""
    return sorted(range(len(offsets)), key=lambda p: (first_send(sync_every, offsets[p]), p))
