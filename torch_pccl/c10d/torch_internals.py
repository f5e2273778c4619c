"""The one module that touches torch.distributed's private state.

c10d has no public way to ask for the default group object, for the backend
behind a group, for the backend string a group is being created with, or to
tell it that the default group's world changed size; nor has the profiler a
public way to record an op that ends on another thread with its input
shapes. torch_pccl needs all of these. Keeping every
such access here means a torch upgrade that moves them breaks one file, which
tests/c10d exercise on every run. Pinned to the torch version in pyproject.toml.
"""

from __future__ import annotations

import sys

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


def requested_backends() -> dict[str, str] | None:
    """Device type -> backend name of the ``init_process_group``/``new_group`` call now
    creating a group (``{"cpu": "pccl", "cuda": "nccl"}`` for ``"cpu:pccl,cuda:nccl"``).

    c10d calls a backend's creator without the backend string; it lives only as
    ``backend_config`` in the frame of ``_new_process_group_helper`` that
    calls the creator. None when called outside that (a creator called
    directly, or a torch that renamed the helper).
    """
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code.co_name == "_new_process_group_helper":
            config = frame.f_locals.get("backend_config")
            if config is None:
                return None
            return {str(d): str(b) for d, b in config.get_device_backend_map().items()}
        frame = frame.f_back
    return None


# The profiler's record functions, as c10d's own backends record their ops:
# "<backend>:<op>" with the input tensors' shapes, begun on the calling thread
# and ended on the thread that completes the op (the profiler marks such an
# event async, as it does gloo's). Cost with no profiler running: one call.
profiler_enabled = torch._C._autograd._profiler_enabled


def record_begin(name: str, inputs) -> object:
    """Begins the profiler event ``name`` with ``inputs``' shapes; returns its handle."""
    return torch._C._autograd._record_function_with_args_enter(name, *inputs)


def record_end(handle: object) -> None:
    """Ends an event begun by ``record_begin``, on any thread."""
    torch._C._autograd._record_function_with_args_exit(handle)


def detach_ddp_reducer(ddp) -> None:
    """Removes the autograd hooks of ``ddp``'s reducer (``DistributedDataParallel
    ._remove_autograd_hooks``), so that a DDP instance being replaced cannot take part in
    another backward while something still holds it."""
    ddp._remove_autograd_hooks()
