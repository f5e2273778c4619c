"""A sharded replica's layout: what every replica of a group must share
(docs/sharded-replicas.md), and the DTensor/FSDP2 lookups it needs. Pure: a model in, a
digest and its description out (no communication).

``replica_layout`` describes what every shard of a replica holds in common (names, global
shapes, dtypes, placements, mesh shapes, the shard count), so that replicas built
differently are told apart at admission (``init_replica_group``), before they exchange.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from typing import NamedTuple

import torch

__all__ = ["ReplicaLayout", "is_dtensor", "replica_layout", "reshard", "trainable"]

_DESCRIPTION_CHARS = 200


def _loaded(module: str, name: str):
    """``module.name`` if ``module`` is imported, else None.

    A DTensor or an FSDP2 module cannot exist before its module was imported, and
    importing ``torch.distributed.tensor`` costs 0.75 to 0.92 s (measured with torch
    2.13 on a shared 2-core machine), which a model without it should not pay.
    """
    mod = sys.modules.get(module)
    return None if mod is None else getattr(mod, name, None)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    cls = _loaded("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(t, cls)


def reshard(model: torch.nn.Module) -> None:
    """Reshards every FSDP2 module of ``model`` (``FSDPModule.reshard``; a no-op for
    those already sharded and for a model without FSDP2).

    After a forward without its backward, FSDP2 leaves the root module's parameters
    unsharded (plain tensors gathered from the shards) and its next forward reuses
    them: a write to a shard would not reach it. Resharded, the registered
    parameters are the sharded DTensors again and the next forward gathers them.
    """
    cls = _loaded("torch.distributed.fsdp", "FSDPModule")
    if cls is None:
        return
    for module in model.modules():
        if isinstance(module, cls):
            module.reshard()


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every parameter of ``model`` with ``requires_grad``, in
    ``named_parameters`` order, after ``reshard(model)`` (an FSDP2 module's are then
    its sharded DTensors)."""
    reshard(model)
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class ReplicaLayout(NamedTuple):
    """A replica's layout (``replica_layout``).

    Attributes:
        digest: 32 lowercase hex characters (BLAKE2b, 16 bytes) of the canonical
            description: equal for every shard of equal replicas, different when the
            shard count, a name, a global shape, a dtype, a placement or a mesh shape
            differs.
        description: at most 200 characters for a person, e.g. ``"2 shards; 4 tensors,
            92 elements, float64; placements Shard(dim=0) on mesh (2,)"``.
    """

    digest: str
    description: str


def replica_layout(model: torch.nn.Module, shards: int) -> ReplicaLayout:
    """The layout of a replica of ``model`` sharded over ``shards`` processes.

    Computed from the trainable parameters (``requires_grad``), in order: name,
    *global* shape, dtype, and for a DTensor its placements and mesh shape. The
    local shapes and the shard index do not enter it, so every shard of a replica
    computes the same layout; a pure function (no communication; FSDP2 modules are
    resharded first, ``reshard``).

    Args:
        model: the replica's module (plain, FSDP2 or tensor parallel).
        shards: processes that one replica spans (>= 1; 1 for an unsharded model).

    Returns:
        ``ReplicaLayout(digest, description)``.

    Raises:
        ValueError: ``shards`` is not an int >= 1, a DTensor's mesh spans more than
            ``shards`` processes, or the model has no trainable parameter.
    """
    if type(shards) is not int or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    named = trainable(model)
    if not named:
        raise ValueError("the model has no parameter with requires_grad")
    entries = []
    for name, p in named:
        entry = {"name": name, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix(
            "torch.")}
        if is_dtensor(p):
            if p.device_mesh.size() > shards:
                raise ValueError(f"parameter {name!r} is sharded over a mesh of "
                                 f"{p.device_mesh.size()} processes, more than shards={shards}")
            entry["placements"] = [repr(pl) for pl in p.placements]
            entry["mesh"] = list(p.device_mesh.shape)
        entries.append(entry)
    canonical = json.dumps({"shards": shards, "tensors": entries}, sort_keys=True,
                           separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
    return ReplicaLayout(digest, _describe(shards, entries))


def _describe(shards: int, entries: list[dict]) -> str:
    """The short text of ``ReplicaLayout.description`` (at most 200 characters)."""
    elements = sum(math.prod(e["shape"]) for e in entries)
    dtypes = "+".join(dict.fromkeys(e["dtype"] for e in entries))
    placed = dict.fromkeys(" ".join(e["placements"]) + " on mesh " + str(tuple(e["mesh"]))
                           for e in entries if "placements" in e)
    plain = sum(1 for e in entries if "placements" not in e)
    parts = [f"{shards} shard{'s' if shards != 1 else ''}",
             f"{len(entries)} tensors, {elements:,} elements, {dtypes}"]
    if placed:
        parts.append("placements " + ", ".join(placed)
                     + (f" ({plain} plain)" if plain else ""))
    text = "; ".join(parts)
    if len(text) > _DESCRIPTION_CHARS:
        text = text[:_DESCRIPTION_CHARS - 3] + "..."
    return text
