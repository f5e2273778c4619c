"""Registration of the "pccl" backend with torch.distributed (once, idempotent).

After ``register()``, ``dist.init_process_group(backend="pccl")`` and
``dist.new_group(backend="pccl")`` build a ``ProcessGroupPCCL``,
``dist.Backend.PCCL == "pccl"``, and ``init_method="pccl://host:port"``
rendezvous through a membership master (``torch_pccl.elastic.rendezvous``).

torch runs ``register()`` while it is itself being imported (the
``torch.backends`` entry point), so this module imports only
``torch.distributed`` at the top; the modules that load the native extension
are imported when a group or a rendezvous is created, and a missing build
fails there, not at ``import torch``.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from .. import config

BACKEND_NAME = "pccl"
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
    """The ``pccl://host:port`` rendezvous handler (``elastic.rendezvous.rendezvous_handler``)."""
    from ..elastic.rendezvous import rendezvous_handler  # loads the native extension

    return rendezvous_handler(url, **kwargs)


def _create(dist_opts, backend_options):
    """c10d's creator (extended API): bootstraps a Communicator and wraps it in a group.

    ``dist_opts.store`` is a PrefixStore private to this group, so store keys
    of different groups do not collide; ``dist_opts.timeout`` (timedelta)
    becomes the group's default deadline unless ``PCCL_TIMEOUT`` overrides it,
    ``PCCL_LANES`` its lane count and ``PCCL_STREAMS`` its streams per peer
    (``torch_pccl.config``).
    ``backend_options`` is unused. A group whose store came from the
    ``pccl://`` rendezvous is built from the master's assignment instead.

    Raises:
        ValueError: a malformed ``PCCL_TIMEOUT``, ``PCCL_LANES``, ``PCCL_STREAMS`` or
            ``PCCL_MASTER``.
        PcclError subclasses from connecting the group.
    """
    # Loads the native extension: deferred to the first group (see the module docstring).
    from ..core.communicator import Communicator
    from ..core.native import MAX_LANES, MAX_STREAMS
    from ..elastic.rendezvous import auto_master_membership, create_group, take_membership
    from .process_group import ProcessGroupPCCL

    timeout_s = config.timeout_s(config.as_seconds(dist_opts.timeout))
    lanes = config.lanes(MAX_LANES)
    streams = config.streams(MAX_STREAMS)
    membership = take_membership(dist_opts.store)
    # The default group of a fixed world (torchrun, env://, tcp://) gets a
    # master started for the job, so update_topology and heartbeats work there
    # too; subgroups (new_group) keep the plain store bootstrap.
    if membership is None and not dist.is_initialized() and config.master_enabled():
        membership = auto_master_membership(dist_opts.store, dist_opts.group_rank,
                                            dist_opts.group_size, timeout_s)
    if membership is not None:
        return create_group(membership, dist_opts.group_rank, dist_opts.group_size, timeout_s,
                            lanes=lanes, streams=streams)
    comm = Communicator.bootstrap(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                  timeout_s, prefix="pccl", lanes=lanes, streams=streams)
    try:
        return ProcessGroupPCCL(comm, timeout_s)
    except BaseException:
        comm.close()
        raise
