"""A group that connects in the background: ``PendingConnect``.

``dist.new_group`` and ``init_device_mesh`` form groups one after the other, and each
rank waits in every group's creation for that group's peers to arrive and for its
links to come up. A group made by the c10d creator for a subgroup instead publishes its
address and returns (``Communicator.publish``); the rest of its bootstrap (reading the
id and every address from the store, connecting, warming the links up) runs on a thread
of its own, and the group's first op, on any lane, waits for it. So a rank forms its next
group while the peers of the last one arrive, as NCCL's process group does by default
(its communicators are created at the first collective) and gloo does with
``TORCH_GLOO_LAZY_INIT=1``.

The cost: a connect that fails is raised by the group's first op (and every later one),
not by ``new_group``. ``PCCL_LAZY_CONNECT=0`` connects every group before its creation
returns, as before.

The connect waits for its peers' addresses on a store connection of its own
(``detached_read``): a ``TCPStore`` client serves one request at a time, so a wait on the
caller's would hold every other store call of the process, the next group's creation or
the caller's own ``store.set``, until the peers arrive, and a peer that waits for such a
call before it forms the group would wait for the store's deadline. So such a group keeps
its keys in the run's store itself (``core.address.root_store``), under a name of its own (the c10d
group name), where one cloned connection per process reads every group's.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable

import torch.distributed as dist

from ..core.lanes import LaneSet
from ..errors import AbortedError, PcclError, PcclTimeoutError


_clones: dict[int, tuple[dist.Store, dist.Store]] = {}    # id(root) -> (root, its clone)
_clones_lock = threading.Lock()
_MAX_CLONES = 4     # roots of this process's default groups, newest kept


def detached_read(root: dist.Store) -> Callable[[list[str]], list[bytes]]:
    """``read(keys)``: the values of ``keys`` (of ``root``, a ``core.address.root_store``) in one
    ``multi_get``, waiting for the missing ones on this process's clone of ``root`` (a
    connection of its own, made at the first such wait: ``Store.clone``), so that the wait
    holds no other thread's store calls. The groups' background connects share the clone:
    each waits for the last one's peers first, as groups formed one after the other
    would. A store that cannot be cloned is read as it is.

    Raises:
        The store's errors (``DistStoreError`` at its deadline).
    """
    def read(keys: list[str]) -> list[bytes]:
        clone = _clone_of(root, make=False)
        if clone is None:
            # The first wait of this process makes the clone; until then a read whose
            # keys are all there needs none.
            if root.check(keys):
                return root.multi_get(keys)
            clone = _clone_of(root, make=True)
        return clone.multi_get(keys)

    return read


def _clone_of(root: dist.Store, make: bool) -> dist.Store | None:
    with _clones_lock:
        held = _clones.get(id(root))
        if held is not None and held[0] is root:
            return held[1]
        if not make:
            return None
        try:
            clone = root.clone()
        except (RuntimeError, NotImplementedError):
            clone = root
        if len(_clones) >= _MAX_CLONES:
            _clones.pop(next(iter(_clones)))
        _clones[id(root)] = (root, clone)    # holding root keeps its id from being reused
        return clone


class PendingConnect:
    """The rest of one group's bootstrap, running on its own thread from construction.

    Args:
        connect: completes the bootstrap and returns the group's lanes (on failure it
            raises, having closed what it opened).
        deadline_s: longest ``wait`` in seconds: the store's timeout (the wait for the
            peers' addresses) plus the group's connect deadline.
    """

    def __init__(self, connect: Callable[[], LaneSet], deadline_s: float):
        self._connect = connect
        self._deadline_s = float(deadline_s)
        self._done = threading.Event()
        self._lock = threading.Lock()  # the outcome is set once: connect or abort first
        self._lanes: LaneSet | None = None
        self._error: BaseException | None = None
        # A thread that cannot start fails the group's creation, as a failed connect
        # did; started without waiting for it to run (see Executor).
        _thread.start_new_thread(self._run, ())

    @property
    def done(self) -> bool:
        """True once the connect succeeded, failed or was aborted."""
        return self._done.is_set()

    @property
    def lanes(self) -> LaneSet | None:
        """The connected lanes (None: not connected, or failed, or aborted first)."""
        return self._lanes if self._done.is_set() else None

    @property
    def error(self) -> BaseException | None:
        """Why the connect failed (None: it succeeded or has not ended)."""
        return self._error if self._done.is_set() else None

    def wait(self) -> LaneSet:
        """The group's lanes once connected.

        Raises:
            The connect's error, as a new exception of its class when it is a
            ``PcclError`` (each op raises its own), else ``PcclError`` naming it;
            AbortedError: the group was aborted first; PcclTimeoutError: the connect
            ran past ``deadline_s``.
        """
        if not self._done.wait(self._deadline_s):
            raise PcclTimeoutError(f"the group's connect did not end within "
                                   f"{self._deadline_s:g} s")
        if self._error is not None:
            raise again(self._error) from self._error
        return self._lanes

    def abort(self) -> None:
        """Ends every ``wait`` now with ``AbortedError``; a connect still running ends on
        its own (its communicator is aborted or closed by the group)."""
        with self._lock:
            if not self._done.is_set():
                self._error = AbortedError("the process group was aborted before it "
                                           "connected")
                self._done.set()

    def _run(self) -> None:
        try:
            lanes = self._connect()
        except BaseException as e:  # noqa: BLE001 - handed to every op of the group
            with self._lock:
                if not self._done.is_set():
                    self._error = e
                    self._done.set()
            return
        with self._lock:
            aborted = self._done.is_set()
            if not aborted:
                self._lanes = lanes
                self._done.set()
        if aborted:                 # the group never sees these lanes: they end here
            lanes.abort()
            lanes.close()


def again(e: BaseException) -> PcclError:
    """A fresh exception for one op from the connect's error ``e``: a ``PcclError`` of the
    same class; a store that timed out waiting for a peer's address, ``PcclTimeoutError``;
    anything else, ``PcclError`` naming it."""
    if isinstance(e, PcclError):
        again = type(e)(str(e), e.code, e.detail)
        again.unreached_ranks = e.unreached_ranks
        return again
    text = f"the process group could not connect: {type(e).__name__}: {e}"
    if isinstance(e, dist.DistStoreError):
        return PcclTimeoutError(text)
    return PcclError(text)
