"""Registration of the "pccl" backend with torch.distributed (once, idempotent).

After ``register()``, ``dist.init_process_group(backend="pccl")`` and
``dist.new_group(backend="pccl")`` build a ``ProcessGroupPCCL``, and
``dist.Backend.PCCL == "pccl"``, and ``init_method="pccl://host:port"``
rendezvous through a membership master (torch_pccl/elastic.py). The native
extension is imported only when a group is created, so registering works
before it is built.
"""

from __future__ import annotations

import os
import threading

import torch.distributed as dist

BACKEND_NAME = "pccl"
_TIMEOUT_ENV = "PCCL_TIMEOUT"
_MASTER_ENV = "PCCL_MASTER"  # "0": no master for fixed worlds (plain store bootstrap)
_LANES_ENV = "PCCL_LANES"
DEFAULT_LANES = 4
_lock = threading.Lock()


def register() -> None:
    """Registers the "pccl" c10d backend (cpu and cuda) and the ``pccl://`` rendezvous.

    Later calls do nothing.
    """
    with _lock:
        if BACKEND_NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        try:
            dist.register_rendezvous_handler(BACKEND_NAME, _rendezvous)
        except RuntimeError:
            pass  # registered already (a reloaded module)


def _rendezvous(url: str, **kwargs):
    """The ``pccl://host:port`` rendezvous handler (see ``torch_pccl.elastic.rendezvous_handler``)."""
    from .elastic import rendezvous_handler

    return rendezvous_handler(url, **kwargs)


def group_timeout_s(default_s: float) -> float:
    """The group's default per-op deadline: env ``PCCL_TIMEOUT`` (seconds, float) if set, else ``default_s``.

    Raises:
        ValueError: ``PCCL_TIMEOUT`` is not a positive number.
    """
    value = os.environ.get(_TIMEOUT_ENV)
    if not value:
        return default_s
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{_TIMEOUT_ENV}={value!r} must be a positive number of seconds")
    return seconds


def group_lanes() -> int:
    """The lanes of a new group: env ``PCCL_LANES`` (an int, 1 .. 64) if set, else ``DEFAULT_LANES`` (4).

    K lanes are K TCP connections to every peer, each its own communicator,
    so up to K collectives of the group are in flight at once; 1 runs every
    op of the group one after the other. Every rank must use the same value.

    Raises:
        ValueError: ``PCCL_LANES`` is not an int in 1 .. 64.
    """
    value = os.environ.get(_LANES_ENV)
    if not value:
        return DEFAULT_LANES
    try:
        lanes = int(value)
    except ValueError:
        lanes = 0
    if not 1 <= lanes <= 64:
        raise ValueError(f"{_LANES_ENV}={value!r} must be an int in 1 .. 64")
    return lanes


def _create(dist_opts, backend_options):
    """c10d's creator (extended API): bootstraps a Communicator and wraps it in a group.

    ``dist_opts.store`` is a PrefixStore private to this group, so store keys
    of different groups do not collide; ``dist_opts.timeout`` (timedelta)
    becomes the group's default deadline unless ``PCCL_TIMEOUT`` overrides it,
    and ``PCCL_LANES`` its lane count (``group_lanes``).
    ``backend_options`` is unused. A group whose store came from the
    ``pccl://`` rendezvous is built from the master's assignment instead.
    """
    from .communicator import Communicator
    from .elastic import auto_master_membership, create_group, take_membership
    from .process_group import ProcessGroupPCCL

    timeout_s = group_timeout_s(dist_opts.timeout.total_seconds())
    lanes = group_lanes()
    membership = take_membership(dist_opts.store)
    # The default group of a fixed world (torchrun, env://, tcp://) gets a
    # master started for the job, so update_topology and heartbeats work there
    # too; subgroups (new_group) keep the plain store bootstrap.
    if membership is None and not dist.is_initialized() and os.environ.get(_MASTER_ENV, "1") != "0":
        membership = auto_master_membership(dist_opts.store, dist_opts.group_rank,
                                            dist_opts.group_size, timeout_s)
    if membership is not None:
        return create_group(membership, dist_opts.group_rank, dist_opts.group_size, timeout_s,
                            lanes=lanes)
    comm = Communicator.bootstrap(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                  timeout_s, prefix="pccl", lanes=lanes)
    try:
        return ProcessGroupPCCL(comm, timeout_s)
    except BaseException:
        comm.close()
        raise
