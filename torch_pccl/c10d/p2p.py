"""The p2p batcher: sends and receives held back and run together as one native batch.

``dist.isend`` followed by ``dist.irecv`` between two ranks would deadlock on full
socket buffers if each ran alone, so a group holds its sends and receives back and
hands them to lane 0 as one ``Communicator.p2p_batch`` (messages to one peer matched
in call order) when one of their Works is waited on or queried, or before the
group's next other op (``flush``).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ..config import BACKEND_NAME
from ..core.communicator import Communicator
from .checks import check_peer, check_tensor, single
from .scheduler import LaneScheduler, guarded, guarded_by, layout, recorded
from .staging import copy_back, host
from .torch_internals import profiler_enabled, record_begin
from .work import PcclWork


class P2POp(NamedTuple):
    """A send or receive held back until its batch is flushed (``P2PBatcher.flush``)."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    work: PcclWork
    layout: tuple          # scheduler.layout of the tensor at the call
    event: object | None   # its profiler event, when a profiler runs


class P2PBatcher:
    """Holds a group's sends and receives and runs them as one batch on lane 0."""

    def __init__(self, scheduler: LaneScheduler, timeout_s: float):
        """
        Args:
            scheduler: the group's scheduler (batches run on its lane 0).
            timeout_s: the deadline of each batch, seconds.
        """
        self._scheduler = scheduler
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: list[P2POp] = []

    def queue(self, is_send: bool, tensors: list[torch.Tensor], peer: int, tag: int) -> PcclWork:
        """Holds back a send (``is_send``) of ``tensors[0]`` to group rank ``peer``, or a
        receive into it from ``peer``, with ``tag``; returns its Work, which flushes the
        batch when waited on or queried.

        Raises:
            TypeError, InvalidArgumentError: at once, for a bad tensor or peer (checked
                against the group's current communicator, lane 0).
        """
        tensor = single(tensors, "tensors")
        check_tensor(tensor, "tensor")
        check_peer(self._scheduler.lanes[0], peer)
        work = PcclWork([tensor], start=self.flush)
        if not is_send:
            work.source = peer
        event = (record_begin(f"{BACKEND_NAME}:{'send' if is_send else 'recv'}", [tensor])
                 if profiler_enabled() else None)
        with self._lock:
            self._pending.append(P2POp(is_send, tensor, peer, tag, work, layout(tensor), event))
        return work

    def flush(self, blocking: bool = False) -> None:
        """Hands every held-back op to lane 0 as one native batch, in call order, ahead of
        whatever op comes next.

        Args:
            blocking: the caller waits for one of them right away (``dist.send`` /
                ``dist.recv``), so it runs the batch itself when lane 0 is idle, sparing
                two thread hand-offs.
        """
        with self._lock:
            batch, self._pending = self._pending, []
            if not batch:
                return
            timeout_s = self._timeout_s

            def run(comm: Communicator) -> None:
                hosts = [(op.is_send, host(op.tensor), op.peer, op.tag) for op in batch]
                comm.p2p_batch(hosts, timeout_s=timeout_s)
                for op, (_, staged, _, _) in zip(batch, hosts):
                    if not op.is_send:
                        copy_back(op.tensor, staged)

            outputs = [op.tensor for op in batch]
            run = guarded_by(outputs, [op.layout for op in batch], run)
            events = [op.event for op in batch if op.event is not None]
            for event in events:
                run = recorded(event, run)
            carrier = PcclWork(outputs)
            carrier.on_done(lambda done: settle(batch, done))
            # While a profiler runs, ops end on the executor's thread (see
            # LaneScheduler.collective).
            inline = blocking and not events
            if not inline:
                self._scheduler.on_lane0(run, carrier, inline=False)
                return
        # Outside the lock, so that other threads can queue sends meanwhile; the
        # executor still runs it only if nothing is queued ahead of it on lane 0.
        self._scheduler.on_lane0(run, carrier, inline=True)

    def recv_any_source(self, tensor: torch.Tensor, tag: int) -> PcclWork:
        """Receives into ``tensor`` from whichever rank sends ``tag`` to this one first, on
        lane 0 after the ops held back so far (not batched with them); the Work's
        ``source`` is the sender's rank once it completes. Arguments are checked by the
        caller; network errors arrive through the Work."""
        timeout_s = self._timeout_s
        work = PcclWork([tensor])

        def run(comm: Communicator) -> None:
            staged = host(tensor)
            src = comm.recv_any_source(staged, tag, timeout_s=timeout_s)
            copy_back(tensor, staged)
            work.source = src

        self.flush()
        run = guarded(run, [tensor])
        if profiler_enabled():
            run = recorded(record_begin(f"{BACKEND_NAME}:recvAnySource", [tensor]), run)
        return self._scheduler.on_lane0(run, work, inline=False)


def settle(batch: list[P2POp], carrier: PcclWork) -> None:
    """Resolves each send/recv Work of ``batch`` from the batch's finished ``carrier``."""
    exc = carrier.exception()
    for op in batch:
        if exc is not None:
            op.work.set_exception(exc)
        else:
            op.work.set_result()
