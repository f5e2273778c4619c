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

A group that connects in the background may leave lanes 1 .. K-1 for later
(``Communicator.connect(defer_lanes=True)``): the first op that runs on one of them
connects them all (``Communicator.connect_deferred_lanes``), on its lane's thread or the
caller's, and ops on the other later lanes wait for it. Every rank runs that op at the
same point of its sequence, so the connect is a collective like the op itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ..config import BACKEND_NAME
from ..core.communicator import Communicator
from ..core.lanes import LaneSet
from ..errors import InvalidUsageError, PcclError, PcclSystemError, PcclTimeoutError
from .pending_connect import PendingConnect, again
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
        # The deferred lanes' connect (_connect_later): one thread runs it, the others wait
        # for the lock within the connect's own deadline.
        self._later_lock = threading.Lock()
        self._later_error: BaseException | None = None
        self._name = name
        self._count = len(lanes) if count is None else count
        # A group connecting in the background starts the executors of lanes 1.. with
        # their first op (_start_executors): a mesh's groups that carry one op at a time
        # never need them.
        started = 1 if pending is not None else self._count
        self._executors: list[Executor | None] = [self._executor(k) for k in range(started)]
        self._executors += [None] * (self._count - started)

    @property
    def lanes(self) -> LaneSet:
        """The lanes ops run on now (``swap`` replaces them)."""
        return self._lanes

    @property
    def executors(self) -> tuple[Executor, ...]:
        """The executors started so far, lane 0 first: one per lane, but those of a group
        connecting in the background whose lanes 1.. have had no op yet."""
        return tuple(e for e in self._executors if e is not None)

    @property
    def lane_count(self) -> int:
        """K: the group's lanes, connected or not (``PCCL_LANES``)."""
        return self._count

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
            lane = self._seq % self._count
            executor = self._executors[lane] or self._start_executors()[lane]
            self._seq += 1
        if profiler_enabled():
            # Ended on the executor's thread, so the profiler shows the op async, as
            # it shows gloo's (which always run on a worker thread).
            fn = recorded(record_begin(f"{BACKEND_NAME}:{event[0]}", event[1]), fn)
            inline = False
        return executor.submit(self._bound(lane, fn), PcclWork(outputs), inline)

    def on_lane0(self, fn: Op, work: PcclWork, inline: bool) -> PcclWork:
        """Queues ``fn`` (a point-to-point op, already guarded) on lane 0 outside the
        collective sequence; ``work`` is resolved with its outcome."""
        return self._executors[0].submit(self._bound(0, fn), work, inline)

    def markers(self) -> list[PcclWork]:
        """One no-op per lane: each completes once the lane's earlier ops have (and the
        group's connect, which fails it). A marker never connects a deferred lane: one
        that no op has used has nothing to wait for."""
        return [executor.submit(self._bound(k, lambda comm: None, needs_lane=False),
                                PcclWork([]), inline=False)
                for k, executor in enumerate(self._executors) if executor is not None]

    def errored(self) -> PcclError | None:
        """The group's failed connect, else the sticky error of its lanes (``LaneSet.errored``)."""
        pending = self._pending
        if pending is not None and isinstance(pending.error, PcclError):
            return pending.error
        if isinstance(self._later_error, PcclError):
            return self._later_error
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
        with self._seq_lock:
            executors = self.executors
        for executor in executors:
            executor.close(drain=drain)
        pending = self._pending
        if pending is not None:
            if not pending.done:
                pending.abort()
                self._lanes.abort()
            with self._seq_lock:
                if pending.lanes is not None and self._pending is pending:
                    self._lanes, self._pending = pending.lanes, None

    def _executor(self, lane: int) -> Executor:
        return Executor(self._name + (f"-lane{lane}" if lane else ""))

    def _start_executors(self) -> list[Executor]:
        # Under _seq_lock. A thread that cannot start fails the op that needed it, before
        # it takes its place in the sequence. A closed group starts none: its ops fail on
        # the closed lane 0 executor.
        if self.closed:
            return [self._executors[0]] * self._count
        try:
            for k in range(1, self._count):
                if self._executors[k] is None:
                    self._executors[k] = self._executor(k)
        except RuntimeError as e:           # "can't start new thread"
            raise PcclSystemError(f"could not start a lane's thread: {e}") from e
        return self._executors

    def _bound(self, lane: int, fn: Op, needs_lane: bool = True) -> Callable[[], None]:
        # The lane's Communicator is read when the op's turn comes: ops queued before a
        # swap ran (drain) on the lanes they were queued for.
        def run() -> None:
            pending = self._pending
            if pending is not None:
                self._connected(pending)
            if lane >= len(self._lanes):
                if not needs_lane:
                    return
                self._connect_later()
            fn(self._lanes[lane])

        return run

    def _connect_later(self) -> None:
        # The first op on a deferred lane connects them all; an op on another one waits
        # for it. A failure fails every later op on them, as a failed connect does.
        lane0 = self._lanes[0]
        deadline_s = lane0.timeout_s + 1.0      # the connect's own deadline, then a margin
        if not self._later_lock.acquire(timeout=deadline_s):
            raise PcclTimeoutError(f"the group's lanes 1 .. {self._count - 1} did "
                                   f"not connect within {deadline_s:g} s")
        try:
            if len(self._lanes) == self._count:
                return
            if self._later_error is not None:
                raise again(self._later_error) from self._later_error
            try:
                lanes = lane0.connect_deferred_lanes()
            except BaseException as e:
                self._later_error = e
                raise
            with self._seq_lock:
                if self._lanes[0] is lane0:
                    self._lanes = lanes
            if self.closed:         # closed meanwhile (an inline op): what it closed lacked these
                LaneSet(lanes.lanes[1:]).close()
        finally:
            self._later_lock.release()

    def _connected(self, pending: PendingConnect) -> None:
        # The first op to find the connect done swaps its lanes in; every op of a group
        # whose connect failed raises its error.
        lanes = pending.wait()
        with self._seq_lock:
            if self._pending is pending:
                self._lanes, self._pending = lanes, None
