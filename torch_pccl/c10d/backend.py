"""Registration of the "pccl" backend with torch.distributed (once, idempotent).

After ``register()``, ``dist.init_process_group(backend="pccl")`` and
``dist.new_group(backend="pccl")`` build a ``ProcessGroupPCCL``,
``dist.Backend.PCCL == "pccl"``, and ``init_method="pccl://host:port"``
rendezvous through the elastic layer's master.

Groups formed through a master (the ``pccl://`` rendezvous, a fixed world's
automatic master) belong to the elastic layer, which sits above this one: it
registers its group factory and rendezvous handler here
(``register_group_factory``), as a backend registers its creator with torch's
``Backend.register_backend``; this module never imports it. ``register`` takes
the function that imports the registering modules (the package's wiring,
``torch_pccl._autoload``, passes one), called at the first group or rendezvous.

torch runs ``register()`` while it is itself being imported (the
``torch.backends`` entry point), so this module imports only
``torch.distributed`` at the top; the modules that load the native extension
are imported when a group or a rendezvous is created, and a missing build
fails there, not at ``import torch``.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch.distributed as dist

from .. import config
from ..errors import InvalidArgumentError, InvalidUsageError
from .torch_internals import requested_backends

BACKEND_NAME = config.BACKEND_NAME
_lock = threading.Lock()
# What the elastic layer registered (register_group_factory), and how to load it.
_group_factory: Callable | None = None
_rendezvous_handler: Callable | None = None
_load_factories: Callable[[], None] | None = None


def register(load_factories: Callable[[], None] | None = None) -> None:
    """Registers the "pccl" c10d backend (cpu and cuda) and the ``pccl://`` rendezvous.

    Args:
        load_factories: imports the modules that call ``register_group_factory``; called
            once, at the first group or ``pccl://`` rendezvous that finds no factory
            (it loads the native extension, which ``import torch`` must not).

    Later calls only record a ``load_factories`` they pass.
    """
    global _load_factories
    with _lock:
        if load_factories is not None:
            _load_factories = load_factories
        if BACKEND_NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        try:
            dist.register_rendezvous_handler(BACKEND_NAME, _rendezvous)
        except RuntimeError:
            pass  # registered already (a reloaded module)


def register_group_factory(factory: Callable, rendezvous_handler: Callable) -> None:
    """Makes ``factory`` build the groups formed through a master and ``rendezvous_handler``
    serve ``pccl://`` URLs (the elastic layer calls it; a later call replaces both).

    Args:
        factory: ``factory(store, rank, world_size, timeout_s, lanes, streams)`` with the
            creator's (torchelastic-prefixed) store, ranks, op deadline in seconds, lane
            and stream counts: the ``ProcessGroupPCCL`` of a group formed through a
            master, or None for a group bootstrapped from ``store`` alone.
        rendezvous_handler: a c10d rendezvous handler, ``handler(url, **kwargs)`` yielding
            ``(store, rank, world_size)``.
    """
    global _group_factory, _rendezvous_handler
    with _lock:
        _group_factory, _rendezvous_handler = factory, rendezvous_handler


def _registered() -> tuple[Callable | None, Callable | None]:
    """The elastic layer's (group factory, rendezvous handler), loaded if need be."""
    with _lock:
        load = _load_factories if _group_factory is None else None
    if load is not None:
        load()
    with _lock:
        return _group_factory, _rendezvous_handler


def _rendezvous(url: str, **kwargs):
    """The ``pccl://host:port`` rendezvous handler: the elastic layer's.

    Raises:
        InvalidUsageError: no elastic layer registered (``register`` was called without
            ``load_factories`` and ``torch_pccl.elastic.rendezvous`` was never imported).
    """
    _, handler = _registered()
    if handler is None:
        raise InvalidUsageError("pccl:// needs torch_pccl's elastic layer: call "
                                "torch_pccl.register() (or import torch_pccl.elastic.rendezvous)")
    return handler(url, **kwargs)


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
    ``backend_options`` is unused. The elastic layer's factory
    (``register_group_factory``) builds a group whose store came from the ``pccl://``
    rendezvous, and the default group of a fixed world with its automatic master, from
    the master's assignment instead.

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
    from ..core.address import root_store
    from .pending_connect import PendingConnect, detached_read
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
    factory, _ = _registered()
    if factory is not None:
        group = factory(store, dist_opts.group_rank, dist_opts.group_size, timeout_s, lanes,
                        streams)
        if group is not None:
            return group
    if dist_opts.global_ranks_in_group and config.lazy_connect():
        # A subgroup (the default group's ranks list is empty): connects in the
        # background (c10d/pending_connect.py), its keys in the run's store under its
        # c10d name (every member's is the same) and the torchelastic attempt.
        root = root_store(store)
        comm, finish = Communicator.publish(
            root, dist_opts.group_rank, dist_opts.group_size, timeout_s,
            prefix=f"pccl-group/{attempt or 0}/{dist_opts.group_id}")

        def connect():
            # Lanes 1.. connect at the group's second collective (LaneScheduler): a mesh's
            # groups that carry one op at a time never open them.
            finish(lanes, streams, defer_lanes=True, read=detached_read(root))
            return comm.lane_set

        try:
            pending = PendingConnect(connect, _store_timeout_s(root) + timeout_s)
        except BaseException:
            comm.close()
            raise
        try:
            return ProcessGroupPCCL(comm, timeout_s, pending, lanes)
        except BaseException:
            pending.abort()
            comm.abort()
            comm.close()
            raise
    comm = Communicator.bootstrap(store, dist_opts.group_rank, dist_opts.group_size,
                                  timeout_s, prefix="pccl", lanes=lanes, streams=streams)
    try:
        return ProcessGroupPCCL(comm, timeout_s)
    except BaseException:
        comm.close()
        raise


def _store_timeout_s(store) -> float:
    """The store's own request deadline in seconds (how long its ``get`` waits for a key)."""
    return store.timeout.total_seconds()
