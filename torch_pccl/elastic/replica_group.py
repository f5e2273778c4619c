"""Joining a group of sharded replicas: ``init_replica_group`` (docs/sharded-replicas.md).

A *replica* is the set of processes that together hold one copy of the model, sharded
among them over an inner group fixed for the replica's life (the user's own
``init_process_group``: gloo on CPU, NCCL on GPU; FSDP2, tensor parallel, any DTensor
layout), launched by one ``torchrun`` per site. Across replicas each process joins the
ring of its shard index through the master, which admits and drops replicas whole
(master/replicas.py): shard i of every replica exchanges with shard i of the others, as
HSDP's replicate dimension does.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import config
from ..c10d.process_group import ProcessGroupPCCL
from ..c10d.torch_internals import forget_outside_group, register_outside_group
from ..core.address import advertised_host, format_address, parse_address
from ..core.listener import Listener
from ..core.native import MAX_LANES, MAX_STREAMS
from ..errors import InvalidUsageError, PcclError
from .assignment import default_peer_id
from .groups import elastic_group
from .master_client import MasterClient
from .membership import Membership
from .rendezvous import create_group
from .replica_layout import ReplicaLayout, replica_layout


def _master_address(master: str) -> tuple[str, str]:
    """``(host, "host:port")`` of ``host:port`` or ``pccl://host:port``."""
    host, port = parse_address(master.removeprefix("pccl://"))
    return host, format_address(host, port)


def init_replica_group(master: str, replica_id: str, model: torch.nn.Module | None = None,
                       *, shard: int | None = None, shards: int | None = None,
                       layout: ReplicaLayout | None = None,
                       timeout: timedelta | float = timedelta(minutes=10),
                       peer_id: str | None = None) -> ProcessGroupPCCL:
    """Registers this process as shard ``shard`` of replica ``replica_id`` with the master
    and returns the pccl group of its shard ring, once the master admitted the whole
    replica.

    The group connects the processes holding shard ``shard`` of every admitted replica
    (rank order is the replicas' order in the epoch, the same in every ring). Pass it as
    ``group=`` to ``DiLoCo`` / ``StreamingDiLoCo`` / ``AsyncDiLoCo`` (and to
    ``update_topology``, ``sync_shared_state``...): each ring exchanges its shard's
    pseudo-gradients, and the master moves every ring to a new epoch in the same update.
    When any process of a replica dies, stalls past the heartbeat timeout or leaves, the
    master drops the whole replica: the others go on, and this replica's other processes
    raise ``ReplicaLostError`` from their next membership call or outer step.

    Args:
        master: the master's ``host:port`` (or ``pccl://host:port``).
        replica_id: the replica's name, the same on all its processes (1-64 printable
            characters), unique among the replicas of the run.
        model: the replica's model (its parameters DTensors or local tensors): its layout
            (``replica_layout(model, shards)``) must equal every other replica's, or the master refuses
            the replica. None with ``layout`` None: only the shard count is checked.
        shard: this process's shard index, 0 .. shards - 1 (default: its rank in the
            default process group, the replica's inner group).
        shards: the replica's shard count (default: the default group's world size).
        layout: the layout to register (default: ``replica_layout(model, shards)``).
        timeout: how long to wait for admission, and the group's default op deadline
            (timedelta or seconds).
        peer_id: this process's id at the master (default: ``<replica_id>/<shard>-`` and
            the host, pid and a random suffix).

    Returns:
        A ``ProcessGroupPCCL`` of world size = the admitted replicas, formed through the
        master (``torch_pccl.elastic_group`` finds its membership).

    Raises:
        InvalidUsageError: ``shard``/``shards`` not given and no default process group.
        ValueError: a malformed ``master``, or ``shard`` outside 0 .. shards - 1.
        ReplicaLayoutError: the master refused the replica: its layout or shard count
            differs from the group's, or its shard index is already registered.
        PcclTimeoutError: not admitted within ``timeout`` (the replica's other shards
            never registered, or no update admitted it).
        PeerLostError / ReplicaLostError: the master cannot be reached, or dropped this
            process (another process of its replica died before admission).
    """
    if shard is None or shards is None:
        if not dist.is_initialized():
            raise InvalidUsageError("init_replica_group needs shard= and shards=, or the "
                                    "replica's inner process group (init_process_group) "
                                    "to take them from")
        shard = dist.get_rank() if shard is None else shard
        shards = dist.get_world_size() if shards is None else shards
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in 0 .. {shards - 1}, got {shard}")
    if layout is None:
        layout = replica_layout(model, shards) if model is not None else \
            ReplicaLayout("", "")
    host, master_addr = _master_address(master)
    timeout_s = config.to_seconds(timeout)
    listener = Listener(advertised_host(target=host))
    client = None
    try:
        client = MasterClient(
            master_addr, listener.address,
            peer_id=peer_id or f"{replica_id[:24]}/{shard}-{default_peer_id()}"[:64],
            timeout_s=min(timeout_s, config.MASTER_CONNECT_TIMEOUT_S),
            meta={"pid": os.getpid()},
            replica={"id": replica_id, "shard": shard, "shards": shards,
                     "layout": layout.digest, "description": layout.description})
        assignment = client.wait_assignment(timeout_s)
        membership = Membership(client, listener, assignment, shard=shard)
    except BaseException:
        if client is not None:
            client.close()
        listener.close()
        raise
    ring = membership.assignment
    pg = create_group(membership, ring.rank, ring.world_size, timeout_s,
                      lanes=config.lanes(MAX_LANES), streams=config.streams(MAX_STREAMS))
    # c10d's functions (and its logger, when a collective raises) look the group up.
    register_outside_group(pg, pg.rank())
    pg.on_close(lambda: forget_outside_group(pg))
    return pg


def replica_error(group, timeout: float = 0.0) -> PcclError | None:
    """Why the master dropped this process from ``group`` (a group of
    ``init_replica_group``), or None while it is a member.

    Call it when the replica's inner group fails (a gloo or NCCL collective raised because
    another process of the replica died): a ``ReplicaLostError`` here says the master
    dropped the replica for that, naming the lost shard, and the other replicas went on;
    the process may then exit and the replica rejoin as a new one. The master's word can
    come a moment after the inner group's error: this waits up to ``timeout`` seconds for
    it (0: answers at once).

    Raises:
        InvalidUsageError: ``group`` was not formed through a master, or shut down.
    """
    client = elastic_group(group).membership.client
    return client.wait_failure(config.to_seconds(timeout)) if timeout else client.failure


__all__ = ["init_replica_group", "replica_error"]
