"""Sharded replicas: the local shards of a model's trainable parameters.

A *replica* of the model may be sharded inside itself over several processes
(FSDP2's ``fully_shard``, tensor parallel's ``parallelize_module``, any
``DTensor`` placement). Across replicas the DiLoCo wrappers exchange over a
group that joins the processes holding the same shard index in every replica,
so each process works on its *local* shards only: ``local`` gives the tensor
an in-place write must go to for the model's next forward to see it. The
layout every replica shares is ``torch_pccl.elastic.replica_layout``'s.
"""

from __future__ import annotations

import torch

from ...elastic.replica_layout import (
    ReplicaLayout,
    is_dtensor,
    replica_layout,
    reshard,
    trainable,
)

__all__ = ["ReplicaLayout", "is_dtensor", "local", "replica_layout", "reshard", "trainable",
           "wrap_like"]


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds of parameter ``p``: a DTensor's local shard
    (``to_local()`` under no_grad: the same tensor object, an alias, whose in-place
    writes the model's next forward sees, FSDP2's padded shards included:
    tests/algorithms/test_diloco_shards.py), else ``p`` itself.

    Resolved at every use rather than kept: FSDP2 may swap a parameter's local tensor
    (``reset_sharded_param`` after ``module.to`` or ``load_state_dict(assign=True)``).
    """
    if not is_dtensor(p):
        return p
    with torch.no_grad():
        return p.to_local()


def wrap_like(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (this process's part of a tensor shaped like ``local(p)``) as what
    ``p`` is: a DTensor on ``p``'s mesh with ``p``'s placements and global shape and
    stride (no communication), or ``shard`` itself when ``p`` is a plain tensor."""
    if not is_dtensor(p):
        return shard
    return type(p).from_local(shard, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())
