"""The part of a ``ProcessGroupPCCL`` that owns its lanes through epochs: ``GroupLanes``.

A group runs its ops on the lanes of one communicator at a time (``c10d.scheduler``).
This base class of ``ProcessGroupPCCL`` (ahead of ``dist.ProcessGroup``, as
``BackendView``) holds them and everything that changes them as a whole: building the
group for a first epoch (``create``), moving it to the next one (``configure``, or
``reconfigure`` with a communicator connected elsewhere), draining, the ring order, abort
and shutdown with the hooks that run after them. The c10d ops themselves are
``ProcessGroupPCCL``'s (process_group.py); they queue their bodies on ``scheduler``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.communicator import Communicator
from ..errors import InvalidArgumentError, PcclError
from .epoch import EpochConfig, connect_epoch_lanes
from .p2p import P2PBatcher
from .pending_connect import PendingConnect
from .scheduler import LaneScheduler
from .torch_internals import refresh_group_ranks


class GroupLanes:
    """A group's lanes, its op deadline and its close hooks; see the module docstring.

    Public seams for the layers above (as torchft's ``ProcessGroup`` has): ``create()``,
    ``configure()``, ``reconfigure()``, ``communicator``, ``scheduler``, ``timeout_s``,
    ``drain()``, ``errored()``, ``set_ring_order()``, ``on_close()``.
    """

    def _start_lanes(self, comm: Communicator, timeout_s: float | None,
                     pending: PendingConnect | None = None, lanes: int | None = None) -> None:
        # Called once by the group's __init__: the lanes of ``comm`` (connected, or
        # connecting in ``pending`` to ``lanes`` lanes), the default op deadline (seconds;
        # None: the communicator's).
        self._timeout_s = comm.timeout_s if timeout_s is None else float(timeout_s)
        self._scheduler = LaneScheduler(comm.lane_set, f"pccl-rank{comm.rank}", pending, lanes)
        self._p2p = P2PBatcher(self._scheduler, self._timeout_s)
        self._close_hooks: list[Callable[[], None]] = []

    @classmethod
    def create(cls, epoch: EpochConfig, timeout_s: float, lanes: int,
               on_created: Callable[[Communicator], None] | None = None) -> GroupLanes:
        """A group connected for its first ``epoch`` (a master's first assignment).

        Args:
            epoch: what to connect (``c10d.epoch.EpochConfig``).
            timeout_s: the group's default per-op deadline, seconds.
            lanes: connections per peer (``PCCL_LANES``).
            on_created: given the communicator before it connects (see
                ``connect_epoch_lanes``).

        Raises:
            As ``connect_epoch_lanes``: PcclError subclasses with ``unreached_ranks``.
        """
        return cls(connect_epoch_lanes(epoch, timeout_s, lanes, on_created), timeout_s)

    def configure(self, epoch: EpochConfig,
                  on_created: Callable[[Communicator], None] | None = None) -> None:
        """Moves the group to ``epoch``: connects its communicator, then swaps it in.

        A collective: every member calls it at the same point of its op sequence. The
        group builds and connects the epoch's communicator with its own lane count and
        op deadline, waits for the ops queued on the old one (the update's one drain),
        swaps the new lanes in (later ops are numbered from lane 0 again, as a joiner's
        new group numbers them), closes the old ones and refreshes c10d's rank map of
        the default group (``get_process_group_ranks``). On failure the group keeps its
        old communicator.

        Args:
            epoch: what to connect (``c10d.epoch.EpochConfig``).
            on_created: given the new communicator before it connects.

        Raises:
            PcclError subclasses of connecting, naming in ``unreached_ranks`` the ranks
            this member could not reach; InvalidUsageError: the group was shut down.
        """
        comm = connect_epoch_lanes(epoch, self._timeout_s, self.num_lanes, on_created)
        try:
            self.reconfigure(comm)
        except BaseException:
            comm.close()
            raise
        refresh_group_ranks(self, self.communicator.rank, epoch.world_size)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Calls ``hook()`` once the group has shut down or aborted and closed its
        communicator (the elastic layer leaves its master then). Hooks run in the order
        given, each once; they must not raise."""
        self._close_hooks.append(hook)

    @property
    def communicator(self) -> Communicator:
        """The underlying Communicator, lane 0 (``stats()`` and tuning cover every lane)."""
        return self._scheduler.lanes[0]

    @property
    def scheduler(self) -> LaneScheduler:
        """The lane scheduler: the lanes ops run on, their executors and sequence."""
        return self._scheduler

    @property
    def collectives_issued(self) -> int:
        """Collectives issued on this group since it was built or reconfigured (not p2p);
        equal on every member at one point of the op sequence (c10d's contract), so
        the elastic layer's pending queries key their answers by it."""
        return self._scheduler.issued

    @property
    def num_lanes(self) -> int:
        """K: how many collectives can be in flight at once (``Communicator.lanes``)."""
        return self._scheduler.lane_count

    @property
    def timeout_s(self) -> float:
        """The default per-op deadline, seconds (``opts.timeout`` overrides it per op)."""
        return self._timeout_s

    def errored(self) -> PcclError | None:
        """The sticky network error of the group's communicator (any lane), else None;
        mirrors torchft's ``ProcessGroup.errored()`` (``LaneSet.errored``)."""
        return self._scheduler.errored()

    # -- lifecycle ---------------------------------------------------------

    def abort(self) -> None:
        """Fails the running op and every queued op with ``AbortedError``, then frees the communicator.

        Then runs the ``on_close`` hooks (a group formed through a master leaves it: the
        others see this peer gone at their next update round).
        """
        self._p2p.flush()
        self._scheduler.abort()
        self._scheduler.close(drain=False)
        self._scheduler.lanes.close()
        self._closed()

    def shutdown(self) -> None:
        """Runs the queued ops to completion, then frees the communicator (``destroy_process_group``).

        Then runs the ``on_close`` hooks (a group formed through a master leaves it
        cleanly, not as an error, and closes its listener).
        """
        self._p2p.flush()
        self._scheduler.close(drain=True)
        self._scheduler.lanes.close()
        self._closed()

    def _closed(self) -> None:
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook()

    def drain(self) -> None:
        """Returns once every op submitted so far, on every lane, has finished (or failed).

        Raises:
            InvalidUsageError: the group was shut down or aborted.
        """
        self._p2p.flush()
        self._scheduler.drain()

    def set_ring_order(self, order) -> None:
        """Runs the group's ring collectives around ``order`` (rank at each ring position).

        Waits for the queued ops, then sets the order on every lane
        (``Communicator.set_ring_order``). A collective: every rank passes the
        same order at the same point of its op sequence; ``torch_pccl.optimize_topology``
        measures the links and calls this. ``reconfigure`` starts over in rank order.

        Raises:
            InvalidArgumentError: ``order`` is not a permutation of the ranks.
            InvalidUsageError: the group was shut down or aborted.
        """
        self.drain()
        self._scheduler.lanes.set_ring_order(order)

    @property
    def ring_order(self) -> tuple[int, ...]:
        """The rank at each position of the group's ring (rank order by default)."""
        return self._scheduler.lanes.ring_order

    def reconfigure(self, new_comm: Communicator) -> Communicator:
        """Swaps in ``new_comm`` after draining the queued ops; closes and returns the old one.

        Called on every rank at the same point of the op sequence (part of
        ``update_topology``, a collective). Later ops run on ``new_comm``'s lanes,
        numbered from lane 0 again (as a joiner's new group numbers them).

        Raises:
            InvalidArgumentError: ``new_comm`` has another number of lanes.
            InvalidUsageError: the group was shut down or aborted.
        """
        if len(new_comm.lanes) != self.num_lanes:
            raise InvalidArgumentError(f"new communicator has {len(new_comm.lanes)} lanes, "
                                       f"the group runs {self.num_lanes}")
        self.drain()
        old = self._scheduler.swap(new_comm.lane_set)
        old.close()
        return old[0]
