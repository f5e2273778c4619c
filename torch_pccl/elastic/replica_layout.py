"""A sharded replica's layout: what every replica of a group must share
(docs/sharded-replicas.md). Pure: a model in, a digest and its description out."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

MAX_DESCRIPTION_CHARS = 200
"""The longest description (the master quotes it in a refusal; control.schemas bounds it)."""


class ReplicaLayout(NamedTuple):
    """How a replica holds its model.

    Attributes:
        digest: 32 lowercase hex characters (BLAKE2b, 16 bytes) of the trainable
            parameters' names, global shapes, dtypes and DTensor placements and mesh shape,
            in order; the same on every shard of a replica (no shard index or local
            shape enters it), different for another model or another sharding.
        description: at most ``MAX_DESCRIPTION_CHARS`` characters saying the same in
            words, e.g. ``"6 tensors, 1,234 elements, float32; (Shard(dim=0),) on mesh
            (2,)"``.
    """

    digest: str
    description: str


def _placement(p: torch.Tensor) -> str:
    """A parameter's sharding in words: DTensor placements and mesh shape, or ``local``."""
    placements = getattr(p, "placements", None)
    mesh = getattr(p, "device_mesh", None)
    if placements is None or mesh is None:
        return "local"
    return f"{tuple(placements)} on mesh {tuple(mesh.shape)}"


def replica_layout(model: torch.nn.Module) -> ReplicaLayout:
    """The layout of ``model``'s trainable parameters (``requires_grad``), as every shard of
    a replica computes it alike: name, global shape (a DTensor's ``shape``), dtype and
    placement of each, in ``named_parameters`` order.

    Raises:
        ValueError: the model has no trainable parameter.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter with requires_grad")
    canon = "\n".join(f"{n}|{tuple(p.shape)}|{p.dtype}|{_placement(p)}" for n, p in params)
    digest = hashlib.blake2b(canon.encode(), digest_size=16).hexdigest()
    elements = sum(p.numel() for _, p in params)
    dtypes = ",".join(sorted({str(p.dtype).replace("torch.", "") for _, p in params}))
    placements = sorted({_placement(p) for _, p in params})
    text = f"{len(params)} tensors, {elements:,} elements, {dtypes}; {'; '.join(placements)}"
    if len(text) > MAX_DESCRIPTION_CHARS:
        text = text[:MAX_DESCRIPTION_CHARS - 3] + "..."
    return ReplicaLayout(digest, text)


__all__ = ["MAX_DESCRIPTION_CHARS", "ReplicaLayout", "replica_layout"]
