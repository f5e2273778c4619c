"""How a process joins an elastic group: the ``pccl://`` rendezvous and the automatic master.

``init_process_group(backend="pccl", init_method="pccl://host:port")`` goes
through ``rendezvous_handler``: the process opens its data-plane ``Listener``,
registers with the master (``MasterClient``) and waits, *pending*, until the
master admits it (bootstrap, or an update round of the running members). The
backend's creator then finds that ``Membership`` (``take_membership``) and
builds the group from the master's ``Assignment`` (``create_group``) instead
of a store. A fixed world (torchrun, ``env://``, ``tcp://``) gets a master
started in rank 0 for the job (``auto_master_membership``).
"""

from __future__ import annotations

import os
import threading
import uuid
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from .. import config
from ..c10d.backend import register_group_factory
from ..c10d.process_group import ProcessGroupPCCL
from ..core.address import advertised_host, format_address
from ..core.listener import Listener
from ..errors import InvalidUsageError
from .master_client import MasterClient
from .groups import attach
from .membership import Membership

# The store a pccl:// rendezvous yields carries this key; its value names the
# Membership waiting in _PENDING for the backend creator.
_STORE_KEY = "torch_pccl/membership"
_PENDING: dict[str, Membership] = {}
_pending_lock = threading.Lock()
# The automatic master's address, in the group's c10d store (an address, no tensor data).
_MASTER_KEY = "pccl/master_addr"


def rendezvous_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """The ``pccl://host:port`` rendezvous: registers with the master, waits to be admitted.

    Yields ``(store, rank, world_size)`` once, where ``store`` is a private
    ``HashStore`` that lets the backend creator find this process's
    membership. Options in the query: ``peer_id=NAME`` (default env
    ``PCCL_PEER_ID``, else ``hostname-pid-random``). The data-plane address is
    that of the interface routing to the master's host (or env ``PCCL_HOST``).

    Raises:
        ValueError: no host or port in the URL, or ``rank``/``world_size``
            passed to ``init_process_group`` (the master assigns them).
        PcclTimeoutError: not admitted within ``timeout``.
        PeerLostError: the master cannot be reached, refused or dropped this peer.
    """
    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if ("rank" in query and query["rank"] != "-1") or (
            "world_size" in query and query["world_size"] != "-1"):
        raise ValueError("pccl:// rendezvous: the master assigns rank and world size; "
                         "do not pass rank= or world_size= to init_process_group")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"pccl:// rendezvous needs pccl://host:port, got {url!r}")
    master_addr = format_address(parsed.hostname, parsed.port)
    timeout_s = config.to_seconds(timeout)
    listener = Listener(advertised_host(target=parsed.hostname))
    client = None
    try:
        client = MasterClient(master_addr, listener.address,
                              peer_id=query.get("peer_id") or config.peer_id(),
                              timeout_s=min(timeout_s, config.MASTER_CONNECT_TIMEOUT_S),
                              meta={"pid": os.getpid()})
        assignment = client.wait_assignment(timeout_s)
    except BaseException:
        if client is not None:
            client.close()
        listener.close()
        raise
    token = uuid.uuid4().hex
    with _pending_lock:
        _PENDING[token] = Membership(client, listener, assignment)
    store = dist.HashStore()
    store.set(_STORE_KEY, token)
    yield store, assignment.rank, assignment.world_size
    raise RuntimeError("pccl:// rendezvous cannot be repeated; create a new process")


def auto_master_membership(store, rank: int, world_size: int, timeout_s: float) -> Membership:
    """Membership of a fixed world (torchrun / ``env://`` / ``tcp://``) through a master it starts.

    Rank 0 starts a master in a background thread on its advertised address
    (bootstrap world size ``world_size``) and publishes the address in the
    group's c10d store (an address, no tensor data); every rank registers with
    it, giving its rank as a hint so the master keeps c10d's ranks, and waits
    for its assignment. The group then supports ``update_topology`` and
    heartbeats like a ``pccl://`` one. The master lives in rank 0's process
    (it ends with it) and serves its status page on loopback when
    ``PCCL_STATUS_PORT`` is set. Env ``PCCL_MASTER=0`` turns this off.

    Raises:
        InvalidUsageError: the master assigned another rank than c10d's.
        PcclTimeoutError / PeerLostError: the master could not be reached or
            did not admit the world within ``timeout_s`` seconds.
    """
    host = advertised_host(store)
    master = None
    if rank == 0:
        # Only the rank that hosts it pays the control plane's import (asyncio and the
        # master's modules, ~80 ms): forming a group on one host is mostly imports.
        from ..master import start_in_thread
        master = start_in_thread(host, 0, world_size=world_size,
                                 http_port=config.status_port())
        store.set(_MASTER_KEY, master.address)
    listener = client = None
    try:
        master_addr = store.get(_MASTER_KEY).decode("ascii")
        listener = Listener(host)
        client = MasterClient(master_addr, listener.address,
                              timeout_s=min(timeout_s, config.MASTER_CONNECT_TIMEOUT_S),
                              meta={"pid": os.getpid(), "rank": rank})
        assignment = client.wait_assignment(timeout_s)
        if (assignment.rank, assignment.world_size) != (rank, world_size):
            raise InvalidUsageError(
                f"the job's master assigned rank {assignment.rank} of {assignment.world_size}, "
                f"c10d expects rank {rank} of {world_size}")
    except BaseException:
        if client is not None:
            client.close()
        if listener is not None:
            listener.close()
        if master is not None:
            master.stop()
        raise
    return Membership(client, listener, assignment, master=master)


def take_membership(store) -> Membership | None:
    """Returns (once) the Membership behind a store yielded by ``rendezvous_handler``, else None.

    Unwraps c10d's PrefixStores. A second call for the same rendezvous
    (``new_group`` on a pccl:// world) raises ``InvalidUsageError``.
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.HashStore) or not store.check([_STORE_KEY]):
        return None
    token = store.get(_STORE_KEY).decode("ascii")
    with _pending_lock:
        membership = _PENDING.pop(token, None)
    if membership is None:
        raise InvalidUsageError("a pccl:// world has one elastic group; new_group on it "
                                "is not supported")
    return membership


def create_group(membership: Membership, rank: int, world_size: int, timeout_s: float,
                 lanes: int = 1, streams: int | None = 1) -> ProcessGroupPCCL:
    """Builds the ProcessGroupPCCL of a pccl:// world from its first assignment.

    ``lanes`` connections per peer, each with ``streams`` TCP streams
    (``Communicator.connect``; None: chosen from the addresses); ``update_topology``
    keeps the lanes and chooses the streams the same way for each epoch. The group is
    attached to ``membership`` (``groups.attach``): its shutdown leaves the master.

    Raises:
        InvalidUsageError: ``rank``/``world_size`` disagree with the assignment.
        PcclError subclasses from connecting (the membership is closed then).
    """
    try:
        a = membership.assignment
        if (rank, world_size) != (a.rank, a.world_size):
            raise InvalidUsageError(f"c10d asked for rank {rank} of {world_size}, the master "
                                    f"assigned rank {a.rank} of {a.world_size}")
        pg = membership.form(timeout_s, lanes, streams)
    except BaseException:
        membership.close(leave=True)
        raise
    attach(pg, membership)
    return pg


def master_group(store, rank: int, world_size: int, timeout_s: float, lanes: int,
                 streams: int | None) -> ProcessGroupPCCL | None:
    """The elastic layer's group factory, registered with c10d below: the group of a
    master's membership, or None for a group c10d bootstraps from ``store`` alone.

    A store yielded by ``rendezvous_handler`` gives its membership (``take_membership``);
    the default group of a fixed world (torchrun, ``env://``, ``tcp://``) gets a master
    started for the job (``auto_master_membership``, unless ``PCCL_MASTER=0``), so
    ``update_topology`` and heartbeats work there too; subgroups (``new_group``) keep the
    plain store bootstrap. Arguments as ``create_group``'s.

    Raises:
        ValueError: a malformed ``PCCL_MASTER``.
        As ``take_membership``, ``auto_master_membership`` and ``create_group``.
    """
    membership = take_membership(store)
    if membership is None and not dist.is_initialized() and config.master_enabled():
        membership = auto_master_membership(store, rank, world_size, timeout_s)
    if membership is None:
        return None
    return create_group(membership, rank, world_size, timeout_s, lanes=lanes, streams=streams)


# c10d never imports this layer: it is told here (c10d.backend, at the import of this module).
register_group_factory(master_group, rendezvous_handler)
