"""The one module that touches torch.distributed's private state.

c10d has no public way to ask for the default group object, for the backend
behind a group, or to tell it that the default group's world changed size;
torch_pccl needs all three. Keeping every
such access here means a torch upgrade that moves them breaks one file, which
tests/c10d exercise on every run. Pinned to the torch version in pyproject.toml.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


def default_group():
    """The default process group (``dist.group.WORLD``'s object), or None before init."""
    if not dist.is_initialized():
        return None
    return distributed_c10d._get_default_group()


def cpu_backend(group):
    """The backend c10d registered for the CPU in ``group``, or None if it has none."""
    try:
        return group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError):
        return None


def refresh_default_group_ranks(pg, world_size: int) -> None:
    """Tells c10d that the default group ``pg`` now has ``world_size`` ranks.

    c10d records the default group's rank map once, at ``init_process_group``;
    after ``update_topology`` changes the world this keeps
    ``get_process_group_ranks`` / ``get_global_rank`` in step with it. Other
    groups are left alone (their maps stay frozen).
    """
    world = distributed_c10d._world
    if pg is distributed_c10d.GroupMember.WORLD and pg in world.pg_group_ranks:
        world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
