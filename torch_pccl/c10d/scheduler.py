"""The lane scheduler of a process group: which op runs on which lane, and when.

A group's communicator has K lanes (``core.lanes.LaneSet``), each with an executor
(``c10d.work.Executor``) that runs its ops one at a time in call order. The n-th
collective issued (n counted from 0, and from 0 again after ``swap``) runs on lane
``n % K``: c10d makes every rank issue collectives in one order, so every rank picks
the same lane. Point-to-point ops run on lane 0. An op is a function of the lane's
``Communicator``, which the scheduler passes when the op's turn comes: the op never
looks its communicator up.

Also here: the layout guard an op runs under (``guarded``, ``guarded_by``: an op keeps
the storages of its tensors alive and refuses a tensor changed since the call) and
the profiler's end of an op's event (``recorded``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..config import BACKEND_NAME
from ..core.communicator import Communicator
from ..core.lanes import LaneSet
from ..errors import InvalidUsageError, PcclError
from .pending_connect import PendingConnect
from .torch_internals import profiler_enabled, record_begin, record_end
from .work import Executor, PcclWork

Op = Callable[[Communicator], None]
"""The body of an op: runs it on the lane Communicator it is given."""


def layout(t: torch.Tensor) -> tuple[int, int, int, tuple[int, ...]]:
    """(storage address, storage bytes, element address, shape) of ``t``."""
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.data_ptr(), tuple(t.shape))


def guarded(fn: Op, tensors: list[torch.Tensor]) -> Op:
    """``fn``, run only if every tensor still has the storage, address and size it had now.

    Holding the tensors (and so their storages) keeps ``del`` by the caller harmless; a
    ``resize_``/``set_`` on a tensor between the call and the op's turn changes what these
    read, and the op then raises ``InvalidUsageError`` without touching any tensor.
    """
    return guarded_by(tensors, [layout(t) for t in tensors], fn)


def guarded_by(tensors: list[torch.Tensor], layouts: list[tuple], fn: Op) -> Op:
    """``fn``, run only if ``tensors`` still have the ``layouts`` (``layout``) taken earlier.

    The storages the tensors have now are held until ``fn`` returns: a caller that gives a
    tensor other storage (``set_``) and frees the old one while the op runs cannot free
    the memory the native op reads or writes (gloo's ``UnboundBuffer`` keeps its memory
    alive the same way). Such an op completes into the old storage, and then raises
    ``InvalidUsageError``: the caller's tensor does not hold its result.
    """
    storages = [t.untyped_storage() for t in tensors]

    def check(when: str) -> None:
        for i, (t, before) in enumerate(zip(tensors, layouts)):
            if layout(t) != before:
                raise InvalidUsageError(
                    f"tensor {i} of this operation was resized or given other storage {when} "
                    f"({before} -> {layout(t)}); keep a tensor unchanged until its Work "
                    f"completes")

    def run(comm: Communicator) -> None:
        check("after the call and before the operation ran")
        try:
            fn(comm)
        finally:
            del storages[:]         # not before fn returns: see above
        check("while the operation ran (its result went to the storage the tensor had at "
              "the call)")

    return run


def recorded(event: object, fn: Op) -> Op:
    """``fn``, then the end of the profiler ``event`` (``record_begin``), whatever ``fn`` does."""
    def run(comm: Communicator) -> None:
        try:
            fn(comm)
        finally:
            record_end(event)

    return run


class LaneScheduler:
    """Runs a group's ops on the lanes of its current ``LaneSet``, one executor per lane."""

    def __init__(self, lanes: LaneSet, name: str, pending: PendingConnect | None = None,
                 count: int | None = None):
        """
        Args:
            lanes: the group's lanes; the scheduler does not own them (the group closes them).
            name: the executors' names (``-laneK`` added for lanes 1..).
            pending: the group's connect still running (c10d/pending_connect.py): ``lanes``
                is then lane 0 alone, and every op waits for the connect's lanes first.
            count: the lanes the connect brings (with ``pending``; default ``len(lanes)``).
        """
        self._lanes = lanes
        self._pending = pending
        self._seq_lock = threading.Lock()
        self._seq = 0  # collectives issued (since swap); picks their lanes
        self._executors = tuple(Executor(name + (f"-lane{k}" if k else ""))
                                for k in range(len(lanes) if count is None else count))

    @property
    def lanes(self) -> LaneSet:
        """The lanes ops run on now (``swap`` replaces them)."""
        return self._lanes

    @property
    def executors(self) -> tuple[Executor, ...]:
        """One executor per lane, lane 0 first."""
        return self._executors

    @property
    def issued(self) -> int:
        """Collectives issued since the scheduler was built or swapped (not p2p)."""
        with self._seq_lock:
            return self._seq

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._executors[0].closed

    def collective(self, fn: Op, outputs: list[torch.Tensor], inline: bool,
                   inputs: Sequence[torch.Tensor] = (),
                   event: tuple[str, Sequence[torch.Tensor]] = ("", ())) -> PcclWork:
        """Queues the collective ``fn`` on the next lane in sequence; returns its Work.

        Args:
            fn: the op, given the lane's Communicator when its turn comes.
            outputs: the tensors it writes (the Work's value); guarded with ``inputs``.
            inline: run on the caller's thread if nothing is queued on the lane
                (``async_op=False``); not while a profiler runs.
            event: the op's profiler name (after ``"pccl:"``) and the tensors whose
                shapes it records.
        """
        # A sparse tensor has no storage of its own to check: its op replaces its
        # indices and values at the end.
        fn = guarded(fn, [t for t in list(outputs) + list(inputs) if t.layout == torch.strided])
        with self._seq_lock:
            lane = self._seq % len(self._executors)
            self._seq += 1
        if profiler_enabled():
            # Ended on the executor's thread, so the profiler shows the op async, as
            # it shows gloo's (which always run on a worker thread).
            fn = recorded(record_begin(f"{BACKEND_NAME}:{event[0]}", event[1]), fn)
            inline = False
        return self._executors[lane].submit(self._bound(lane, fn), PcclWork(outputs), inline)

    def on_lane0(self, fn: Op, work: PcclWork, inline: bool) -> PcclWork:
        """Queues ``fn`` (a point-to-point op, already guarded) on lane 0 outside the
        collective sequence; ``work`` is resolved with its outcome."""
        return self._executors[0].submit(self._bound(0, fn), work, inline)

    def markers(self) -> list[PcclWork]:
        """One no-op per lane: each completes once the lane's earlier ops have (and the
        group's connect, which fails it)."""
        return [executor.submit(self._bound(k, lambda comm: None), PcclWork([]), inline=False)
                for k, executor in enumerate(self._executors)]

    def errored(self) -> PcclError | None:
        """The group's failed connect, else the sticky error of its lanes (``LaneSet.errored``)."""
        pending = self._pending
        if pending is not None and isinstance(pending.error, PcclError):
            return pending.error
        return self._lanes.errored()

    def abort(self) -> None:
        """Wakes and fails every op waiting on the lanes or on the group's connect."""
        pending = self._pending
        if pending is not None:
            pending.abort()
        self._lanes.abort()

    def drain(self) -> None:
        """Returns once every op queued so far, on every lane, has finished (or failed).

        Raises:
            InvalidUsageError: the scheduler was closed (the group shut down or aborted).
        """
        if self.closed:
            raise InvalidUsageError("process group was shut down or aborted")
        for marker in self.markers():
            marker.wait()

    def swap(self, lanes: LaneSet) -> LaneSet:
        """Makes later ops run on ``lanes`` (as many as before), numbered from lane 0 again;
        returns the previous set. Call ``drain()`` first."""
        old, self._lanes = self._lanes, lanes
        with self._seq_lock:
            self._seq = 0
        return old

    def close(self, drain: bool) -> None:
        """Stops every executor: ``drain`` runs the queued ops first, else fails them.
        Then ``lanes`` are all the group has to close: a connect still running is
        aborted (it closes what it opens), one that succeeded without an op to swap its
        lanes in has them swapped in now."""
        for executor in self._executors:
            executor.close(drain=drain)
        pending = self._pending
        if pending is not None:
            if not pending.done:
                pending.abort()
                self._lanes.abort()
            with self._seq_lock:
                if pending.lanes is not None and self._pending is pending:
                    self._lanes, self._pending = pending.lanes, None

    def _bound(self, lane: int, fn: Op) -> Callable[[], None]:
        # The lane's Communicator is read when the op's turn comes: ops queued before a
        # swap ran (drain) on the lanes they were queued for.
        def run() -> None:
            pending = self._pending
            if pending is not None:
                self._connected(pending)
            fn(self._lanes[lane])

        return run

    def _connected(self, pending: PendingConnect) -> None:
        # The first op to find the connect done swaps its lanes in; every op of a group
        # whose connect failed raises its error.
        lanes = pending.wait()
        with self._seq_lock:
            if self._pending is pending:
                self._lanes, self._pending = lanes, None
