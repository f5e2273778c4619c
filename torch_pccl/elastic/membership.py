"""Membership: a group's link to its master (client, data-plane listener, assignment)."""

from __future__ import annotations

import contextlib
import threading
import weakref

from ..errors import PcclError
from .master_client import Assignment, MasterClient


class Membership:
    """A group's link to the master: the client, the data-plane listener, the current assignment.

    It also turns the master's ``member_lost`` notices into prompt failures: every
    communicator of an epoch given to ``watch`` is aborted with ``PeerLostError``
    naming the dropped member as soon as the notice comes, so a member blocked on a
    stopped or vanished peer fails within about a second of the master's drop
    instead of at its op deadline (which may be minutes on a slow link).
    """

    def __init__(self, client: MasterClient, listener, assignment: Assignment, master=None):
        self.client = client
        self.listener = listener
        self.assignment = assignment
        self.master = master  # the MasterThread this process hosts for the job, if any
        # The revision of this peer's last completed sync_shared_state; None
        # until then (the master's election treats the peer as fresh).
        self.shared_revision: int | None = None
        # True from admission (or bootstrap) until this peer's first update_topology,
        # sync_shared_state or collective: the members' update round that admitted it
        # counts as its own (see torch_pccl.peers_pending).
        self.admission_open = True
        # The last keyed pending query of this epoch: (collectives issued, index).
        self.last_query: tuple[int, int] | None = None
        # The last such query answered here (False) while the master was away; a master
        # that comes back answers it and every earlier key alike (see resume_record).
        self.quiet_key: tuple[int, int] = (-1, -1)
        # Whether the last pending query was answered quiet (alone while the master was
        # away, or so by a master whose members are re-registering): every member's
        # answer to that key is, so a DiLoCo wrapper skips that boundary's sync alike.
        self.last_quiet = False
        # The all-or-nothing exchanges of this epoch (begin_exchange / end_exchange).
        self.exchanges_done = 0
        self.last_result = None      # the last completed exchange's result tensor
        self.in_progress = None      # the tensor of the exchange under way
        self.rolled_forward = False  # the exchange under way was completed by roll_forward
        # A DiLoCo wrapper that admits peers at its own outer boundaries (``own``).
        self._owner: weakref.ref | None = None
        self._owner_calls = 0
        # What this peer shows on the master's status page (``report``): its last outer
        # step (a DiLoCo wrapper sets it), the bytes its shared-state syncs moved, and
        # its row of optimize_topology's measured link rates (bytes/s, by rank).
        self.step: int | None = None
        self.sync_bytes = 0
        self.link_rates: list[float] | None = None
        self._lock = threading.Lock()
        self._watched: dict[int, list] = {}   # epoch -> its Communicators
        self._lost: dict[int, str] = {}       # epoch -> why its first lost member was lost
        client.set_member_lost_handler(self._member_lost)
        client.set_resume_source(self.resume_record)
        client.set_report_source(self.report)

    def report(self) -> dict:
        """What this peer's heartbeats tell the master's status page (protocol ``_report``):
        ``step``, ``sent``/``received`` (data-plane bytes of the epoch's communicator), the
        native ``op`` running (``"idle"``), the ``ring`` order, ``links`` (bytes/s to each
        rank, -1 unmeasured) and ``sync_bytes``. Called on the client's heartbeat thread;
        never waits for an op in flight."""
        out = {"sync_bytes": self.sync_bytes}
        if self.step is not None:
            out["step"] = self.step
        if self.link_rates is not None:
            out["links"] = [float(r) for r in self.link_rates]
        with self._lock:
            comms = self._watched.get(self.assignment.epoch) or [None]
        comm = comms[-1]
        if comm is not None:
            try:
                out["sent"], out["received"] = comm.stats()
            except PcclError:
                pass        # closed (a failed connect, or the group shut down)
            out["op"] = comm.current_op or "idle"
            out["ring"] = list(comm.last_ring_order)
        return out

    def resume_record(self) -> dict:
        """What this member re-registers with when its master comes back (the hello's
        ``resume``): its assignment, shared-state revision and ``quiet_key``. Called on the
        client's reconnect thread; reads fields that are replaced whole, never mutated."""
        a = self.assignment
        return {"epoch": a.epoch, "comm_id": a.comm_id, "rank": a.rank,
                "peer_ids": list(a.peer_ids), "addrs": list(a.addrs),
                "revision": -1 if self.shared_revision is None else self.shared_revision,
                "last_key": list(self.quiet_key)}

    def begin_exchange(self, tensor) -> None:
        """An all-or-nothing exchange (an all-reduce of ``tensor`` in place) starts."""
        self.in_progress = tensor
        self.rolled_forward = False

    def end_exchange(self, result) -> None:
        """The exchange completed here; ``result`` (kept, not copied) holds its bytes until
        the next exchange, so a survivor that missed them can get them from this peer."""
        self.exchanges_done += 1
        self.last_result = result
        self.in_progress = None

    def new_epoch_ledger(self) -> None:
        """The exchanges counted so far belong to the epoch just left."""
        self.exchanges_done = 0
        self.last_result = None

    def own(self, owner) -> None:
        """Makes ``owner`` (held weakly) the one that changes this group's membership.

        A DiLoCo wrapper admits peers only at its outer boundaries, where a joiner's
        constructor lines up with the members; while it lives, ``peers_pending()``
        from other code answers False and ``update_topology()`` from other code
        raises (see ``deferred``). Its own calls run inside ``as_owner()``.
        """
        self._owner = weakref.ref(owner)

    @contextlib.contextmanager
    def as_owner(self):
        """The owner's own membership calls run inside this."""
        self._owner_calls += 1
        try:
            yield
        finally:
            self._owner_calls -= 1

    def deferred(self) -> bool:
        """True when an owner lives and this call is not its own."""
        return self._owner is not None and self._owner() is not None and self._owner_calls == 0

    def next_query(self, ops: int) -> tuple[int, int, int]:
        """The key of this peer's next pending query, ``ops`` collectives into the epoch:
        ``(epoch, ops, index)``, index counting the queries made at that ``ops``."""
        index = self.last_query[1] + 1 if self.last_query and self.last_query[0] == ops else 0
        self.last_query = (ops, index)
        return (self.assignment.epoch, ops, index)

    def answer_alone(self, key: tuple[int, int, int]) -> bool:
        """Answers pending query ``key`` here, False, while the master is away: nobody is
        admitted until it is back, and it will answer this key (and every earlier one)
        as every member answered it meanwhile (``quiet_key``, ``last_quiet``)."""
        self.quiet_key = max(self.quiet_key, key[1:])
        self.last_quiet = True
        return False

    def set_assignment(self, assignment: Assignment) -> None:
        """Moves to the epoch of ``assignment`` (after an update round)."""
        self.assignment = assignment
        self.last_query = None
        self.quiet_key = (-1, -1)

    def watch(self, epoch: int, comm) -> None:
        """Aborts ``comm`` (with ``PeerLostError``) when a member of ``epoch`` is dropped.

        At once if one already was. Call it before connecting ``comm``, so that a
        member lost during the connect phase ends that too. Forgets older epochs.
        """
        with self._lock:
            for old in [e for e in self._watched if e < epoch]:
                del self._watched[old]
            for old in [e for e in self._lost if e < epoch]:
                del self._lost[old]
            self._watched.setdefault(epoch, []).append(comm)
            why = self._lost.get(epoch)
        if why is not None:
            comm.abort(lost=why)

    def _member_lost(self, msg: dict) -> None:
        epoch = msg["epoch"]
        why = (f"peer {msg['peer_id']} (rank {msg['rank']} of epoch {epoch}) is gone: the master "
               f"{msg['reason']}")
        with self._lock:
            if epoch < self.assignment.epoch:
                return          # an epoch this peer has left behind
            self._lost.setdefault(epoch, why)
            comms = list(self._watched.get(epoch, ()))
        for comm in comms:
            comm.abort(lost=why)

    def close(self, leave: bool = True) -> None:
        """Leaves the master (``leave``: a clean departure) or disconnects; closes the listener,
        and stops the master if this process hosts it (see ``auto_master_membership``).

        Close every communicator created on the listener first. Never raises.
        """
        if leave:
            self.client.leave()
        else:
            self.client.close()
        with self._lock:
            self._watched.clear()
        self.listener.close()
        master, self.master = self.master, None
        if master is not None:
            try:
                master.stop()
            except Exception:  # noqa: BLE001 - closing must not raise; the thread is a daemon
                pass
