"""The one module that touches torch.distributed's private state.

c10d has no public way to ask for the default group object, for the backend
behind a group, for the backend string a group is being created with, or to
tell it that the default group's world changed size; nor has the profiler a
public way to record an op that ends on another thread with its input
shapes; nor has a group built in Python a way to show its ops to the
TorchDispatchModes that see a C++ group's. torch_pccl needs all of these. Keeping every
such access here means a torch upgrade that moves them breaks one file, which
tests/c10d exercise on every run. Pinned to the torch version in pyproject.toml.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode


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


def register_outside_group(pg, rank: int) -> None:
    """Lists ``pg``, a group c10d did not create (a sharded replica's shard ring, formed
    beside the replica's own default group), in c10d's group maps, with this process's
    rank in it, ``rank``.

    The ``torch.distributed`` functions that look a group up (``get_backend``,
    ``get_rank(group)``) then accept it; so does c10d's logger, which calls both when a
    collective raises, and otherwise turned a ring's ``PeerLostError`` into ``ValueError:
    ... is not initialized in the world group map`` (so DiLoCo could not retry on the
    smaller world). The rank map holds this process only (its default-group rank -> its
    rank in ``pg``): the other members' default groups are other worlds. Nothing is
    listed before a default group exists. ``refresh_group_ranks`` keeps it current;
    ``forget_outside_group`` removes it.
    """
    world = distributed_c10d._world
    if not dist.is_initialized() or pg in world.pg_map:
        return
    world.pg_map[pg] = ("pccl", None)
    world.pg_group_ranks[pg] = {dist.get_rank(): rank}


def forget_outside_group(pg) -> None:
    """Removes ``pg`` from the maps ``register_outside_group`` put it in (no-op otherwise)."""
    world = distributed_c10d._world
    if pg in world.pg_map and pg not in world.pg_names:
        del world.pg_map[pg]
        world.pg_group_ranks.pop(pg, None)


def refresh_group_ranks(pg, rank: int, world_size: int) -> None:
    """Tells c10d that ``pg`` now has ``world_size`` ranks, this process being ``rank``:
    the default group's rank map (``refresh_default_group_ranks``), or an outside group's
    (``register_outside_group``). Other groups are left alone (their maps stay frozen)."""
    world = distributed_c10d._world
    if pg is distributed_c10d.GroupMember.WORLD:
        refresh_default_group_ranks(pg, world_size)
    elif pg in world.pg_map and pg not in world.pg_names and dist.is_initialized():
        world.pg_group_ranks[pg] = {dist.get_rank(): rank}


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


# -- c10d ops seen by TorchDispatchModes ------------------------------------
# A C++ group's collectives reach the dispatcher: each ProcessGroup method
# (ProcessGroup.hpp) calls the op "c10d::<name>_", whose kernel (Ops.cpp) runs
# the group's C++ Backend, so an active TorchDispatchMode (CommDebugMode,
# torch's LocalTensorMode, a user's logging mode) sees the op. c10d calls a
# Python group's methods directly, and the ops' kernels cannot run one: they
# call the group's C++ Backend, which a Python group cannot register (Backend
# has no Python constructor). So while a mode is active, a pccl op is called
# as that c10d op with a mode of the group's own at the bottom of the mode
# stack that runs it (as torch's LocalTensorMode implements c10d ops in a mode):
# the modes above see what they see for gloo. None of this runs with no mode
# active: ``dispatch_mode_count()`` (0 then) is one call.
dispatch_mode_count = torch._C._len_torch_dispatch_stack
_INFRA_KEYS = tuple(torch._C._TorchDispatchModeKey.__members__.values())
_reduce_op_boxes: dict = {}


def c10d_op(name: str):
    """The dispatcher op ``c10d::name`` (``torch.ops.c10d.<name>.default``)."""
    return getattr(torch.ops.c10d, name).default


def boxed_reduce_op(op) -> object:
    """``op`` (``dist.ReduceOp``, or ``dist.ReduceOp.MAX``...) as the ScriptObject c10d ops take.

    Python can build that ScriptObject only for SUM (``torch.classes.c10d.ReduceOp()``);
    a C++ ProcessGroup's ``allreduce`` builds it for any op, so this asks an empty one
    (no backend) for it, under a mode that takes the argument and stops the call.
    Cached per reduction.
    """
    key = int(getattr(op, "op", op))    # a ReduceOp, or its RedOpType
    box = _reduce_op_boxes.get(key)
    if box is None:
        class _Take(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.c10d.allreduce_.default:
                    _reduce_op_boxes[key] = args[2]
                    return args[0], dist.Work().boxed()
                return func(*args, **(kwargs or {}))

        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        with torch.utils._python_dispatch._disable_current_modes():  # hidden from the modes
            tensor = torch.empty(0)
            with _Take():
                dist.ProcessGroup(0, 1).allreduce([tensor], opts)
        box = _reduce_op_boxes[key]
    return box


class _RunsOp(TorchDispatchMode):
    """The bottom of the user modes while a pccl op is called as ``op``: runs ``body()``."""

    def __init__(self, op, body):
        super().__init__()
        self.op, self.body, self.work = op, body, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not self.op or self.work is not None:
            return func(*args, **(kwargs or {}))
        # Held here: the boxed Work keeps the C++ object alive, not the Python one (a
        # Work that completed inline has no other owner), and its unboxed copy would
        # lose the Python methods (wait() would block in C++).
        self.work = self.body()
        boxed = self.work.boxed()
        # What the op returns: its Work, after its first argument when it has two
        # results (as torch's meta kernels for c10d ops return).
        return boxed if len(func._schema.returns) == 1 else (args[0], boxed)


def call_as_c10d_op(op, args: tuple, body):
    """``body()``'s Work, ``body`` run as the c10d op ``op(*args)`` under the active modes.

    ``body`` ignores the arguments the modes pass down (it runs the op as the group was
    asked to); a mode that does not run the op but returns a result of its own makes
    this return that result's Work, as a C++ group's method does. With only infra modes
    active (FakeTensorMode, tracing), ``body()`` runs directly, as before.
    """
    infra = sum(torch._C._get_dispatch_mode(k) is not None for k in _INFRA_KEYS)
    users = torch._C._len_torch_dispatch_stack() - infra
    if users <= 0:
        return body()
    # The user modes sit above the infra ones; ours goes between.
    above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(users)]
    runs = _RunsOp(op, body)
    torch._C._push_on_torch_dispatch_stack(runs)
    for mode in reversed(above):
        torch._C._push_on_torch_dispatch_stack(mode)
    try:
        out = op(*args)
    finally:
        above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(users)]
        torch._C._pop_torch_dispatch_stack(None)
        for mode in reversed(above):
            torch._C._push_on_torch_dispatch_stack(mode)
    # The group's own Work object while ``runs`` holds it (unbox finds it by address).
    return dist.Work.unbox(out if len(op._schema.returns) == 1 else out[1])
