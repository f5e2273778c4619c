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
from .torch_internals import requested_backends

BACKEND_NAME = config.BACKEND_NAME
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


def check_backend_string(devices: dict[str, str] | None) -> None:
    """Refuses a backend string that gives other devices to other backends.

    A ``ProcessGroupPCCL`` is a Python ``ProcessGroup``, which c10d takes as
    the whole group: in ``"cpu:pccl,cuda:nccl"`` it would silently replace (or
    leak) the nccl backend and carry the CUDA tensors too. ``"cuda:pccl"`` and
    ``"cpu:pccl"`` alone are accepted (the group serves both devices).

    Args:
        devices: device type -> backend name (``torch_internals.requested_backends``),
            or None when unknown.

    Raises:
        InvalidArgumentError: the string names another backend too, with what to
            do instead.
    """
    if not devices:
        return
    others = {d: b for d, b in devices.items() if b.lower() != BACKEND_NAME}
    if not others:
        return
    from ..errors import InvalidArgumentError

    spec = ",".join(f"{d}:{b}" for d, b in devices.items())
    fast = ", ".join(sorted(set(others.values())))
    raise InvalidArgumentError(
        f"backend {spec!r} mixes pccl with {fast}: a pccl group serves every device of its "
        f"group (cpu and cuda), so it cannot share one with another backend. Create the "
        f"default group with init_process_group(backend={next(iter(others.values()))!r}) "
        f"and the slow (outer, cross-site) group with new_group(backend='pccl'), or use "
        f"backend='pccl' alone")


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
        InvalidArgumentError: a backend string that mixes pccl with another backend
            (``check_backend_string``).
        ValueError: a malformed ``PCCL_TIMEOUT``, ``PCCL_LANES``, ``PCCL_STREAMS`` or
            ``PCCL_MASTER``.
        PcclError subclasses from connecting the group.
    """
    # Loads the native extension: deferred to the first group (see the module docstring).
    from ..core.communicator import Communicator
    from ..core.native import MAX_LANES, MAX_STREAMS
    from ..elastic.rendezvous import auto_master_membership, create_group, take_membership
    from .process_group import ProcessGroupPCCL

    check_backend_string(requested_backends())
    timeout_s = config.timeout_s(config.as_seconds(dist_opts.timeout))
    lanes = config.lanes(MAX_LANES)
    streams = config.streams(MAX_STREAMS)
    store = dist_opts.store
    attempt = config.torchelastic_attempt()
    if attempt is not None:
        # torchrun (2.13, --standalone) keeps its store across restarts: an earlier
        # attempt's keys (its master's address, its ranks' addresses) would be read
        # by a process faster than the one that rewrites them.
        store = dist.PrefixStore(f"torchelastic-attempt-{attempt}", store)
    membership = take_membership(store)
    # The default group of a fixed world (torchrun, env://, tcp://) gets a
    # master started for the job, so update_topology and heartbeats work there
    # too; subgroups (new_group) keep the plain store bootstrap.
    if membership is None and not dist.is_initialized() and config.master_enabled():
        membership = auto_master_membership(store, dist_opts.group_rank,
                                            dist_opts.group_size, timeout_s)
    if membership is not None:
        return create_group(membership, dist_opts.group_rank, dist_opts.group_size, timeout_s,
                            lanes=lanes, streams=streams)
    comm = Communicator.bootstrap(store, dist_opts.group_rank, dist_opts.group_size,
                                  timeout_s, prefix="pccl", lanes=lanes, streams=streams)
    try:
        return ProcessGroupPCCL(comm, timeout_s)
    except BaseException:
        comm.close()
        raise
