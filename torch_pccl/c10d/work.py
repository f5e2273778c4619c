"""PcclWork (a Future-backed ``dist.Work``) and the FIFO executor that completes it.

A process group has one executor per lane (``ProcessGroupPCCL``); each runs
its lane's ops one at a time, in call order. Call order is the same on every
rank, so every rank enters a lane's native collectives in the same order. A
synchronous op with nothing queued ahead of it on its lane runs inline on the
caller's thread (no thread hand-off: that is most of a small op's latency);
everything else runs on the executor's thread. Either way the Work's future is
always resolved, with the outputs or with the exception.
"""

from __future__ import annotations

import _thread
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import config
from ..errors import AbortedError, InvalidUsageError, PcclTimeoutError


class PcclWork(dist.Work):
    """Handle of one submitted op; mirrors the ``dist.Work`` returned by ``async_op=True``.

    Backed by a ``torch.futures.Future`` whose value is the list of output
    tensors (what DDP's reducer reads from ``get_future()``). Errors are
    re-raised by ``wait()`` and ``result()`` with their original class
    (``PeerLostError``, ``PcclTimeoutError``, ...); ``exception()`` returns it.
    The future that ``get_future()`` hands out carries a failure as a C++ error
    (see there), so it raises ``RuntimeError`` naming that class, as gloo's does.
    """

    def __init__(self, outputs: list[torch.Tensor], start: Callable[[], None] | None = None):
        """
        Args:
            outputs: the tensors the op writes; the future's value.
            start: called as ``start(blocking)`` before any wait (``blocking``
                True: the caller blocks until the op ends, so it may run the op
                itself) or query (False), for ops that are held back until
                someone needs them (batched isend/irecv); idempotent.
        """
        super().__init__()
        self._outputs = outputs
        self._future: torch.futures.Future = torch.futures.Future()
        self._exception: BaseException | None = None
        self._chained: torch.futures.Future | None = None  # what get_future() hands out
        self._start = start
        self.source: int | None = None  # a receive's sender, once known (_source_rank)

    def _started(self, blocking: bool = False) -> None:
        if self._start is not None:
            self._start(blocking)

    def set_result(self) -> None:
        """Resolves the future with the outputs. Called once, by whoever ran the op."""
        self._future.set_result(self._outputs)

    def set_exception(self, exc: BaseException) -> None:
        """Resolves the future with ``exc``, which every wait re-raises. Called once."""
        self._exception = exc
        self._future.set_exception(exc)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Blocks until the op is done; returns True or raises its error.

        Args:
            timeout: how long to wait; ``timedelta(0)`` (c10d's "no timeout")
                waits until the op ends, which its own deadline bounds.

        Raises:
            The op's exception (a PcclError subclass, TypeError or ValueError).
            PcclTimeoutError: ``timeout`` passed first; the op keeps running
                and still completes or fails on its own deadline.
        """
        seconds = config.as_seconds(timeout)
        self._started(blocking=seconds <= 0)
        if seconds > 0 and not self._future.done():
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())
            if not done.wait(seconds):
                raise PcclTimeoutError(f"Timed out waiting {seconds * 1000:.0f}ms for Work.wait; "
                                           f"the op goes on until its own deadline")
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """Returns the future; its value is the list of output tensors.

        A failed op completes it with an error that torch's C++ side sees: its
        ``wait()`` and ``value()`` raise ``RuntimeError`` whose message names the
        PcclError class and text ("... PeerLostError: ..."). A Python future
        given an exception with ``set_exception`` is, to C++, completed *with the
        exception object as its value*: DDP's reducer read that as its bucket's
        tensors and crashed the process (a segfault in
        ``c10d::detail::parseCppCommHookResult``) when a peer died during
        backward. ``Work.wait()`` and ``exception()`` give the PcclError itself.
        """
        self._started()
        if self._chained is None:
            # A callback that raises is the one way Python can fail a torch future in C++
            # terms (Future::then marks the child with the error); racing callers each
            # get a valid chained future.
            self._chained = self._future.then(self._unwrap)
        return self._chained

    def _unwrap(self, _done: torch.futures.Future) -> list[torch.Tensor]:
        if self._exception is not None:
            raise self._exception
        return self._outputs

    def on_done(self, callback: Callable[[PcclWork], None]) -> None:
        """Calls ``callback(self)`` once the op has finished, successfully or not (at once
        if it has), on the thread that finishes it; ``exception()`` tells which."""
        self._future.add_done_callback(lambda _: callback(self))

    def is_completed(self) -> bool:
        """True once the op has finished, successfully or not."""
        self._started()
        return self._future.done()

    def is_success(self) -> bool:
        """True once the op has finished without an error."""
        return self._future.done() and self._exception is None

    def exception(self) -> BaseException | None:
        """The op's exception, or None (also None while it is running)."""
        return self._exception

    def result(self) -> list[torch.Tensor]:
        """Waits and returns the output tensors; raises the op's exception."""
        self._started(blocking=True)
        return self._future.wait()

    def _source_rank(self) -> int:
        """The group rank a receive got its message from (what ``dist.recv`` returns).

        Raises:
            InvalidUsageError: not a receive, or a receive from any source that has not
                completed.
        """
        if self.source is None:
            raise InvalidUsageError("_source_rank() is defined only for a recv, and for a recv "
                                    "from any source only once it has completed")
        return self.source

    def synchronize(self) -> None:
        """Nothing to do: outputs are written on the host before the future resolves."""


class Executor:
    """Runs submitted ops one at a time in submission order.

    ``submit(fn, work, inline)`` runs ``fn()`` and resolves ``work``. With
    ``inline=True`` and nothing queued or running, ``fn`` runs on the calling
    thread before ``submit`` returns; otherwise it is queued for the
    executor's daemon thread. ``close()`` fails queued ops with AbortedError.
    """

    def __init__(self, name: str):
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[Callable[[], None], PcclWork]] = deque()
        self._busy = False  # an op is running, inline or on the thread
        self._closed = False
        self.name = name
        self._ended = threading.Event()
        # The low-level start: ``threading.Thread.start`` waits until the new thread runs,
        # and a device mesh starts a thread per lane for each of its subgroups, one group
        # after the other, on hosts with more ranks than cores, where each such wait is a
        # scheduling delay (benchmarks/mesh_setup.py, docs/performance.md). A thread that
        # cannot be started still fails here, at the group's creation.
        self._ident = _thread.start_new_thread(self._main, ())

    def submit(self, fn: Callable[[], None], work: PcclWork, inline: bool) -> PcclWork:
        with self._cond:
            if self._closed:
                work.set_exception(AbortedError("process group was shut down or aborted"))
                return work
            if not (inline and not self._busy and not self._queue):
                self._queue.append((fn, work))
                self._cond.notify()
                return work
            self._busy = True
        try:
            _run(fn, work)
        finally:
            self._release()
        return work

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._closed

    def close(self, drain: bool) -> None:
        """Stops accepting ops and ends the thread.

        Args:
            drain: run the queued ops first (graceful shutdown); otherwise fail
                them at once with AbortedError (abort).
        """
        with self._cond:
            self._closed = True
            dropped = [] if drain else list(self._queue)
            if not drain:
                self._queue.clear()
            self._cond.notify_all()
        for _, work in dropped:
            work.set_exception(AbortedError("process group was aborted before this op ran"))
        if threading.get_ident() != self._ident:
            self._ended.wait()

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            # Wake the thread only when it has something to run: an idle
            # wake-up per inline op would cost a context switch.
            if self._queue:
                self._cond.notify()

    def _main(self) -> None:
        try:
            self._loop()
        finally:
            self._ended.set()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue or self._busy:
                    if self._closed and not self._queue:
                        return
                    self._cond.wait()
                fn, work = self._queue.popleft()
                self._busy = True
            try:
                _run(fn, work)
            finally:
                self._release()


def _run(fn: Callable[[], None], work: PcclWork) -> None:
    # Every path resolves the future: a pending future would hang DDP, which
    # only ever reads get_future().
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter, not swallowed
        work.set_exception(exc)
    else:
        work.set_result()
