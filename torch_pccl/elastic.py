"""Elastic membership for process groups formed through a master (docs/membership.md).

``init_process_group(backend="pccl", init_method="pccl://host:port")`` goes
through ``rendezvous_handler``: the process opens its data-plane ``Listener``,
registers with the master (``MasterClient``) and waits, *pending*, until the
master admits it (bootstrap, or an update round of the running members). The
group is then built from the master's ``Assignment`` instead of a store.

Between membership changes collectives never talk to the master. At points
the application chooses, every member calls ``update_topology()``: the master
admits pending peers and forgets dead ones, and each member rebuilds its
communicator for the new epoch. ``peers_pending()`` tells every rank, with the
same answer, whether that is worth doing; ``all_reduce_with_retry`` shrinks
the world and retries after a peer failure.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist

from .errors import (
    InvalidUsageError,
    PcclSystemError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from .membership import Assignment, MasterClient

# Default deadline of update_topology, in seconds: longer than the master's
# default round timeout (30 s), after which it drops members that never came.
UPDATE_TIMEOUT_S = 60.0
# Default deadline of the master round trip in peers_pending, in seconds.
QUERY_TIMEOUT_S = 10.0
# Errors after which a smaller world can retry: the network's, not the caller's.
RETRYABLE_ERRORS = (PeerLostError, RemoteError, PcclTimeoutError, PcclSystemError, ProtocolError)

# The store a pccl:// rendezvous yields carries this key; its value names the
# Membership waiting in _PENDING for the backend creator.
_STORE_KEY = "torch_pccl/membership"
_PENDING: dict[str, Membership] = {}
_pending_lock = threading.Lock()


@dataclass(frozen=True)
class TopologyChange:
    """What ``update_topology`` changed.

    Attributes:
        epoch: the new membership epoch.
        rank: this process's rank in the new world.
        world_size: the new world size.
        joined: master peer ids admitted in this epoch.
        left: master peer ids gone since the previous epoch (left or dropped).
    """

    epoch: int
    rank: int
    world_size: int
    joined: tuple[str, ...]
    left: tuple[str, ...]


class Membership:
    """A group's link to the master: the client, the data-plane listener, the current assignment."""

    def __init__(self, client: MasterClient, listener, assignment: Assignment, master=None):
        self.client = client
        self.listener = listener
        self.assignment = assignment
        self.master = master  # the MasterThread this process hosts for the job, if any
        # The revision of this peer's last completed sync_shared_state; None
        # until then (the master's election treats the peer as fresh).
        self.shared_revision: int | None = None

    def close(self, leave: bool = True) -> None:
        """Leaves the master (``leave``: a clean departure) or disconnects; closes the listener,
        and stops the master if this process hosts it (see ``auto_master_membership``).

        Close every communicator created on the listener first. Never raises.
        """
        if leave:
            self.client.leave()
        else:
            self.client.close()
        self.listener.close()
        master, self.master = self.master, None
        if master is not None:
            try:
                master.stop()
            except Exception:  # noqa: BLE001 - closing must not raise; the thread is a daemon
                pass


# -- rendezvous ---------------------------------------------------------------


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
    from .communicator import Listener, _format_address, advertised_host

    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if ("rank" in query and query["rank"] != "-1") or (
            "world_size" in query and query["world_size"] != "-1"):
        raise ValueError("pccl:// rendezvous: the master assigns rank and world size; "
                         "do not pass rank= or world_size= to init_process_group")
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"pccl:// rendezvous needs pccl://host:port, got {url!r}")
    master_addr = _format_address(parsed.hostname, parsed.port)
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    listener = Listener(advertised_host(target=parsed.hostname))
    client = None
    try:
        client = MasterClient(master_addr, listener.address,
                              peer_id=query.get("peer_id") or os.environ.get("PCCL_PEER_ID"),
                              timeout_s=min(timeout_s, 60.0), meta={"pid": os.getpid()})
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


_MASTER_KEY = "pccl/master_addr"


def auto_master_membership(store, rank: int, world_size: int, timeout_s: float) -> Membership:
    """Membership of a fixed world (torchrun / ``env://`` / ``tcp://``) through a master it starts.

    Rank 0 starts a master in a background thread on its advertised address
    (bootstrap world size ``world_size``) and publishes the address in the
    group's c10d store (an address, no tensor data); every rank registers with
    it, giving its rank as a hint so the master keeps c10d's ranks, and waits
    for its assignment. The group then supports ``update_topology`` and
    heartbeats like a ``pccl://`` one. The master lives in rank 0's process
    (it ends with it). Env ``PCCL_MASTER=0`` turns this off.

    Raises:
        InvalidUsageError: the master assigned another rank than c10d's.
        PcclTimeoutError / PeerLostError: the master could not be reached or
            did not admit the world within ``timeout_s`` seconds.
    """
    from .communicator import Listener, advertised_host
    from .master import start_in_thread

    host = advertised_host(store)
    master = None
    if rank == 0:
        master = start_in_thread(host, 0, world_size=world_size)
        store.set(_MASTER_KEY, master.address)
    listener = client = None
    try:
        master_addr = store.get(_MASTER_KEY).decode("ascii")
        listener = Listener(host)
        client = MasterClient(master_addr, listener.address, timeout_s=min(timeout_s, 60.0),
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
                 lanes: int = 1):
    """Builds the ProcessGroupPCCL of a pccl:// world from its first assignment.

    ``lanes`` connections per peer (``Communicator.connect``); ``update_topology``
    keeps the count.

    Raises:
        InvalidUsageError: ``rank``/``world_size`` disagree with the assignment.
        PcclError subclasses from connecting (the membership is closed then).
    """
    from .communicator import Communicator
    from .process_group import ProcessGroupPCCL

    try:
        a = membership.assignment
        if (rank, world_size) != (a.rank, a.world_size):
            raise InvalidUsageError(f"c10d asked for rank {rank} of {world_size}, the master "
                                    f"assigned rank {a.rank} of {a.world_size}")
        comm = Communicator.from_assignment(membership.listener, a, timeout_s, lanes=lanes)
    except BaseException:
        membership.close(leave=True)
        raise
    return ProcessGroupPCCL(comm, timeout_s, membership=membership)


# -- public API ---------------------------------------------------------------


def update_topology(group=None, timeout: float | timedelta | None = None) -> TopologyChange:
    """Admits pending peers, drops dead ones and rebuilds the group; a collective of the members.

    Every live member must call it at the same point of its op sequence. It
    waits for the queued ops, joins the master's update round for the current
    epoch (blocking until every live member has joined, or the master's round
    deadline drops the missing ones), then connects a new communicator for the
    next epoch and swaps it in. Afterwards ``dist.get_rank()``,
    ``dist.get_world_size()`` and the group's ``getRank``/``getSize`` report
    the new world (c10d's frozen rank maps, ``get_process_group_ranks``, are
    refreshed for the default group only). Clears a sticky network error:
    the next op runs on the new communicator.

    Args:
        group: a group formed with ``init_method="pccl://..."`` (default: the
            default group).
        timeout: deadline for the master's round in seconds or a timedelta
            (default ``UPDATE_TIMEOUT_S`` = 60 s); connecting the new
            communicator is bounded by the group's op timeout.

    Returns:
        TopologyChange(epoch, rank, world_size, joined, left).

    Raises:
        InvalidUsageError: the group was not formed through a master, or is shut down.
        PcclTimeoutError: the round did not complete in time.
        PeerLostError: the connection to the master is lost, or the master
            dropped this peer (heartbeat or round timeout); its message.
        PcclError: the master refused the update (a stale epoch); its message.
        PeerLostError, PcclTimeoutError, ...: connecting the new epoch failed
            (the group keeps its old, failed communicator; call again).
    """
    from .communicator import Communicator

    pg = _elastic_group(group)
    m = pg.membership
    timeout_s = _seconds(timeout, UPDATE_TIMEOUT_S)
    pg._drain()
    assignment = m.client.request_update(m.assignment.epoch, timeout_s)
    m.assignment = assignment
    comm = Communicator.from_assignment(m.listener, assignment, pg._timeout_s,
                                        lanes=pg.num_lanes)
    try:
        pg._reconfigure(comm)
    except BaseException:
        comm.close()
        raise
    _refresh_c10d_ranks(pg, assignment.world_size)
    return TopologyChange(epoch=assignment.epoch, rank=assignment.rank,
                          world_size=assignment.world_size, joined=assignment.joined,
                          left=assignment.left)


def peers_pending(group=None, timeout: float | timedelta | None = None) -> bool:
    """True if any peer waits for admission; a collective, the same answer on every rank.

    Each rank asks the master (one round trip), then the group takes the
    maximum with one 8-byte all-reduce, so all ranks take the same branch even
    when a peer arrives between their queries.

    Args:
        group: a pccl:// group (default: the default group).
        timeout: deadline for the master round trip, seconds or timedelta
            (default ``QUERY_TIMEOUT_S`` = 10 s).

    Raises:
        InvalidUsageError: the group was not formed through a master.
        PcclTimeoutError, PeerLostError, PcclError: the master did not answer.
        network PcclErrors of the all-reduce (PeerLostError, ...).
    """
    pg = _elastic_group(group)
    count = pg.membership.client.pending_count(_seconds(timeout, QUERY_TIMEOUT_S))
    flag = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def epoch(group=None) -> int:
    """The group's membership epoch (1 for the first group; +1 per ``update_topology``).

    Raises:
        InvalidUsageError: the group was not formed through a master.
    """
    return _elastic_group(group).membership.assignment.epoch


def all_reduce_with_retry(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          max_retries: int = 3,
                          timeout: float | timedelta | None = None) -> list[TopologyChange]:
    """``dist.all_reduce`` that survives lost peers: on a network error, shrink and retry.

    A failed all-reduce leaves ``tensor`` unchanged, so after a network error
    (``RETRYABLE_ERRORS``: PeerLostError, RemoteError, PcclTimeoutError,
    PcclSystemError, ProtocolError) this calls ``update_topology(group,
    timeout)`` and runs the same all-reduce on the new world; SUM and AVG
    then cover the new world's members (AVG divides by the new size). Every
    live member must call it (the retry's ``update_topology`` is a collective).

    Args:
        tensor: the in-place all-reduce's tensor (as ``dist.all_reduce``).
        op: a ``dist.ReduceOp`` (SUM, AVG, MIN, MAX, PRODUCT).
        group: a pccl:// group (default: the default group).
        max_retries: how many topology updates to try (>= 0).
        timeout: passed to ``update_topology``.

    Returns:
        The TopologyChanges made, in order ([] when the first try succeeded).

    Raises:
        The last network PcclError when ``max_retries`` updates did not help;
        any other error of ``dist.all_reduce`` or ``update_topology`` at once.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    changes: list[TopologyChange] = []
    while True:
        try:
            dist.all_reduce(tensor, op=op, group=group)
            return changes
        except RETRYABLE_ERRORS:
            if len(changes) >= max_retries:
                raise
        changes.append(update_topology(group, timeout))


# -- internals ----------------------------------------------------------------


def _elastic_group(group):
    from .process_group import pccl_group

    pg = pccl_group(group)
    if pg.membership is None:
        raise InvalidUsageError("this group was not formed through a master "
                                "(use init_method='pccl://host:port'), or it was shut down")
    return pg


def _seconds(timeout, default: float) -> float:
    if timeout is None:
        return default
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return seconds


def _refresh_c10d_ranks(pg, world_size: int) -> None:
    # c10d records the default group's ranks once at init; keep that map in
    # step so get_process_group_ranks/get_global_rank agree with the new world.
    world = dist.distributed_c10d._world
    if pg is dist.distributed_c10d.GroupMember.WORLD and pg in world.pg_group_ranks:
        world.pg_group_ranks[pg] = {i: i for i in range(world_size)}


__all__ = [
    "Assignment",
    "Membership",
    "TopologyChange",
    "all_reduce_with_retry",
    "epoch",
    "peers_pending",
    "update_topology",
]
