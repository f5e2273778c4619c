"""Membership: the owner of a group's elastic epoch (docs/membership.md).

One ``Membership`` per group formed through a master holds the link to the master
(client, data-plane listener, current assignment) and everything that lives for an
epoch: the keys of its pending queries, its ledger of all-or-nothing exchanges, the
DiLoCo wrapper that owns its boundaries, what its heartbeats report. It performs the
transition to the next epoch itself (``update``: request the update -> connect ->
reconfigure -> roll forward); ``topology``, ``shared_state``, ``links`` and the
DiLoCo transport ask it through methods and read it through properties.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from datetime import timedelta

import torch.distributed as dist

from .. import config
from ..c10d.process_group import ProcessGroupPCCL
from ..c10d.torch_internals import refresh_default_group_ranks
from ..core.communicator import Communicator
from ..core.native import MAX_STREAMS
from ..errors import (
    InvalidUsageError,
    PcclError,
    PcclSystemError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from .master_client import Assignment, MasterClient

# Errors after which a smaller world can retry: the network's, not the caller's.
RETRYABLE_ERRORS = (PeerLostError, RemoteError, PcclTimeoutError, PcclSystemError, ProtocolError)


class Membership:
    """The owner of a group's elastic epoch: its link to the master and the transition.

    It also turns the master's ``member_lost`` notices into prompt failures: every
    communicator of an epoch given to ``watch`` is aborted with ``PeerLostError``
    naming the dropped member as soon as the notice comes, so a member blocked on a
    stopped or vanished peer fails within about a second of the master's drop
    instead of at its op deadline (which may be minutes on a slow link).

    Args:
        client: this peer's connection to the master.
        listener: the data-plane ``Listener`` every epoch's communicator accepts on.
        assignment: the first epoch's assignment.
        master: the ``MasterThread`` this process hosts for the job, if any (stopped by
            ``close``).
    """

    def __init__(self, client: MasterClient, listener, assignment: Assignment, master=None):
        self._client = client
        self._listener = listener
        self._assignment = assignment
        self._master = master
        # The revision of this peer's last completed sync_shared_state; None
        # until then (the master's election treats the peer as fresh).
        self._shared_revision: int | None = None
        # True from admission (or bootstrap) until this peer's first update_topology,
        # sync_shared_state or collective: the members' update round that admitted it
        # counts as its own (see torch_pccl.peers_pending).
        self._admission_open = True
        # The last keyed pending query of this epoch: (collectives issued, index).
        self._last_query: tuple[int, int] | None = None
        # The last such query answered here (False) while the master was away; a master
        # that comes back answers it and every earlier key alike (see resume_record).
        self._quiet_key: tuple[int, int] = (-1, -1)
        # Whether the last pending query was answered quiet (alone while the master was
        # away, or so by a master whose members are re-registering): every member's
        # answer to that key is, so a DiLoCo wrapper skips that boundary's sync alike.
        self._last_quiet = False
        # The all-or-nothing exchanges of this epoch (begin_exchange / end_exchange).
        self._exchanges_done = 0
        self._last_result = None      # the last completed exchange's result tensor
        self._in_progress = None      # the tensor of the exchange under way
        self._rolled_forward = False  # the exchange under way was completed by roll_forward
        # A DiLoCo wrapper that admits peers at its own outer boundaries (``own``).
        self._owner: weakref.ref | None = None
        self._owner_calls = 0
        # What this peer shows on the master's status page (``report``): its last outer
        # step, the bytes its shared-state syncs moved, and its row of
        # optimize_topology's measured link rates (bytes/s, by rank).
        self._step: int | None = None
        self._sync_bytes = 0
        self._link_rates: list[float] | None = None
        self._lock = threading.Lock()
        self._watched: dict[int, list] = {}   # epoch -> its Communicators
        self._lost: dict[int, str] = {}       # epoch -> why its first lost member was lost
        client.set_member_lost_handler(self._member_lost)
        client.set_resume_source(self.resume_record)
        client.set_report_source(self.report)

    # -- what others read ----------------------------------------------------

    @property
    def client(self) -> MasterClient:
        """This peer's connection to the master."""
        return self._client

    @property
    def listener(self):
        """The data-plane ``Listener`` (one address for the peer's whole life)."""
        return self._listener

    @property
    def assignment(self) -> Assignment:
        """The current epoch's assignment (replaced whole at each transition)."""
        return self._assignment

    @property
    def shared_revision(self) -> int | None:
        """The revision of this peer's last completed shared-state sync; None before one."""
        return self._shared_revision

    @property
    def admission_open(self) -> bool:
        """True until this peer's first update, sync or collective since its admission."""
        return self._admission_open

    @property
    def exchanges_done(self) -> int:
        """All-or-nothing exchanges completed here in this epoch."""
        return self._exchanges_done

    @property
    def rolled_forward(self) -> bool:
        """The exchange under way was completed by the last transition's roll forward (its
        result is in its tensor): it must not be redone."""
        return self._rolled_forward

    @property
    def last_quiet(self) -> bool:
        """Whether the last pending query was answered quiet (see ``pending``)."""
        return self._last_quiet

    @property
    def quiet_key(self) -> tuple[int, int]:
        """``(ops, index)`` of the last pending query answered alone while the master was
        away; ``(-1, -1)`` when none in this epoch."""
        return self._quiet_key

    # -- the transition to the next epoch --------------------------------------

    def update(self, pg: ProcessGroupPCCL, group, timeout_s: float, admit: bool) -> Assignment:
        """Moves ``pg`` to the next epoch, a collective of the members: request the update,
        connect, reconfigure, roll forward. The caller has drained ``pg``.

        Args:
            pg: the group this membership belongs to.
            group: the c10d group ``pg`` serves (None: the default group), for the roll
                forward's broadcast.
            timeout_s: deadline of the master's rounds, seconds.
            admit: whether pending peers are admitted (False: a recovery).

        Returns:
            The new epoch's assignment.

        Raises:
            As ``request_update`` and ``connect``; ``pg`` keeps its old communicator then.
        """
        self.request_update(timeout_s, admit)
        # Streams as a new member chooses them (PCCL_STREAMS, else from the new epoch's
        # addresses), so joiners and incumbents agree.
        comm, assignment = self.connect(pg.timeout_s, pg.num_lanes, config.streams(MAX_STREAMS),
                                        timeout_s, admit)
        self.reconfigure(pg, comm)
        self.roll_forward(group)
        return assignment

    def request_update(self, timeout_s: float, admit: bool) -> Assignment:
        """Joins the master's update round of this epoch and moves to the next one's
        assignment (not yet connected). The round carries this member's exchange count
        (-1 while its admission is open: it has counted none).

        Raises:
            As ``MasterClient.request_update``.
        """
        done = -1 if self._admission_open else self._exchanges_done
        a = self._client.request_update(self._assignment.epoch, timeout_s, admit=admit,
                                        done=done)
        self.set_assignment(a)
        return a

    def connect(self, op_timeout_s: float, lanes: int, streams: int | None,
                update_timeout_s: float, admit: bool) -> tuple[Communicator, Assignment]:
        """Connects the communicator of the current assignment's epoch; returns it and that
        assignment (which may be a later epoch's).

        Each try is bounded by ``PCCL_CONNECT_TIMEOUT`` (at most ``op_timeout_s``). When it
        fails with a network error, this member tells the master which ranks it could not
        connect with (the master drops those admitted in that epoch, and the others are
        told), joins an update round of that epoch (``request_update``), and connects the
        next epoch: so a joiner that cannot be reached costs the members one connect
        deadline, not their run. A peer the master dropped raises the master's reason.

        Args:
            op_timeout_s: the communicator's op deadline, seconds.
            lanes: connections per peer; ``streams``: TCP streams each (None: chosen from
                the addresses), as ``Communicator.connect``.
            update_timeout_s: deadline of the update rounds joined after a failure.
            admit: carried by those rounds.

        Raises:
            PeerLostError: this peer was dropped (e.g. nobody could reach its address).
            Network PcclErrors of the last try after ``config.CONNECT_ATTEMPTS`` retries;
            errors of the update round (``MasterClient.request_update``).
        """
        connect_s = min(op_timeout_s, config.connect_timeout_s())
        for attempt in range(config.CONNECT_ATTEMPTS + 1):
            a = self._assignment
            comm = Communicator(a.rank, a.world_size, a.comm_id, None, op_timeout_s,
                                listener=self._listener)
            try:
                self.watch(a.epoch, comm)
                comm.connect(list(a.addrs), timeout_s=connect_s, lanes=lanes, streams=streams)
                return comm, a
            except RETRYABLE_ERRORS as exc:
                unreached = comm.unreached_ranks()
                comm.close()
                failure = self._client.failure
                if failure is not None:
                    raise type(failure)(str(failure)) from exc
                if attempt == config.CONNECT_ATTEMPTS:
                    raise
                # Only this member's own deadline says who is unreachable: a connect aborted
                # because the master dropped someone else leaves slower peers half-connected.
                if isinstance(exc, PcclTimeoutError) and unreached:
                    self._client.report_unreached(a.epoch, unreached)
                self.request_update(update_timeout_s, admit)
            except BaseException:
                comm.close()
                raise
        raise AssertionError("not reached")

    def reconfigure(self, pg: ProcessGroupPCCL, comm: Communicator) -> None:
        """Swaps ``comm`` (connected for the current epoch) into ``pg`` and tells c10d the
        new world size (the default group's rank map). ``comm`` is closed if ``pg``
        refuses it."""
        try:
            pg.reconfigure(comm)
        except BaseException:
            comm.close()
            raise
        refresh_default_group_ranks(pg, self._assignment.world_size)

    def roll_forward(self, group) -> None:
        """Makes the exchange that some survivors completed complete on all of them.

        A member lost inside an all-reduce can leave survivors that received every byte
        (their exchange completed) beside others that did not (it failed and left their
        tensor unchanged). Every member sent the master its count of exchanges completed
        in the epoch just left, and the assignment lists them: if they differ (by one; an
        exchange needs everyone's previous one), the lowest rank that completed it
        broadcasts its result on the new epoch (``group``) into the tensor of those that
        did not, which then count it as done (``rolled_forward``) instead of redoing it.
        So an exchange is applied on every survivor or, when none completed it, redone by
        all. The ledger then starts the new epoch.

        Raises:
            ProtocolError: the counts differ by more than one.
            InvalidUsageError: this member counted fewer exchanges but holds no tensor.
            PcclError subclasses of the broadcast.
        """
        a = self._assignment
        done = list(a.done)
        try:
            if len(done) != a.world_size or min(done) < 0 or max(done) == min(done):
                return
            top = max(done)
            if min(done) != top - 1:
                raise ProtocolError(f"exchange counts {done} differ by more than one")
            src, mine = done.index(top), done[a.rank]
            buf = self._last_result if mine == top else self._in_progress
            if buf is None:
                raise InvalidUsageError(f"this member counted {mine} exchanges of {top} but "
                                        "holds no tensor for them")
            dist.broadcast(buf, group_src=src, group=group)
            if mine < top:
                self._rolled_forward = True
                self._in_progress = None
        finally:
            self.new_epoch_ledger()

    def set_assignment(self, assignment: Assignment) -> None:
        """Moves to the epoch of ``assignment`` (after an update round)."""
        self._assignment = assignment
        self._last_query = None
        self._quiet_key = (-1, -1)

    def close_admission(self) -> bool:
        """Ends this peer's admission (its first update, sync or collective); True if it was
        still open."""
        was, self._admission_open = self._admission_open, False
        return was

    # -- pending queries -------------------------------------------------------

    def pending(self, ops: int, timeout: float | timedelta | None) -> bool:
        """``torch_pccl.peers_pending`` for this peer, ``ops`` collectives into the epoch:
        whether peers wait for admission, the same answer on every member.

        Args:
            ops: the group's ``collectives_issued``.
            timeout: deadline of the master round trip, seconds or timedelta (None:
                ``config.QUERY_TIMEOUT_S``).

        Raises:
            PcclTimeoutError, PeerLostError, PcclError: as ``MasterClient.pending_answer``
            (a timeout while the master went away is answered alone instead).
        """
        self._last_quiet = False
        if self.deferred():
            return False        # the DiLoCo wrapper admits them at its next outer boundary
        if ops == 0 and self._admission_open:
            return True         # the round that admitted this peer was its update
        key = self.next_query(ops)
        if ops == 0:
            return False
        if self._client.away:
            return self.answer_alone(key)      # no master to ask
        try:
            count, self._last_quiet = self._client.pending_answer(
                config.to_seconds(timeout, config.QUERY_TIMEOUT_S), key=key)
        except PcclTimeoutError:
            if not self._client.away:
                raise
            return self.answer_alone(key)      # the master died under the query
        return count > 0

    def next_query(self, ops: int) -> tuple[int, int, int]:
        """The key of this peer's next pending query, ``ops`` collectives into the epoch:
        ``(epoch, ops, index)``, index counting the queries made at that ``ops``."""
        last = self._last_query
        index = last[1] + 1 if last and last[0] == ops else 0
        self._last_query = (ops, index)
        return (self._assignment.epoch, ops, index)

    def answer_alone(self, key: tuple[int, int, int]) -> bool:
        """Answers pending query ``key`` here, False, while the master is away: nobody is
        admitted until it is back, and it will answer this key (and every earlier one)
        as every member answered it meanwhile (``quiet_key``, ``last_quiet``)."""
        self._quiet_key = max(self._quiet_key, key[1:])
        self._last_quiet = True
        return False

    # -- shared state ----------------------------------------------------------

    def request_sync(self, revision: int, strategy: str, content: str,
                     timeout_s: float) -> dict:
        """Votes in the master's shared-state sync round of this epoch
        (``MasterClient.request_sync``; fresh while no sync completed here)."""
        return self._client.request_sync(self._assignment.epoch, revision, strategy,
                                         self._shared_revision is None, content, timeout_s)

    def synced(self, revision: int, moved_bytes: int) -> None:
        """A sync completed here at ``revision``, its data plane moving ``moved_bytes``
        bytes (sent and received; the status page shows the total)."""
        self._shared_revision = revision
        self._sync_bytes += moved_bytes

    # -- all-or-nothing exchanges ----------------------------------------------

    def begin_exchange(self, tensor) -> None:
        """An all-or-nothing exchange (an all-reduce of ``tensor`` in place) starts."""
        self._in_progress = tensor
        self._rolled_forward = False

    def end_exchange(self, result) -> None:
        """The exchange completed here; ``result`` (kept, not copied) holds its bytes until
        the next exchange, so a survivor that missed them can get them from this peer."""
        self._exchanges_done += 1
        self._last_result = result
        self._in_progress = None

    def new_epoch_ledger(self) -> None:
        """The exchanges counted so far belong to the epoch just left."""
        self._exchanges_done = 0
        self._last_result = None

    # -- the DiLoCo wrapper that owns the boundaries ---------------------------

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

    # -- quorum rounds (DiLoCo's quorum option) -------------------------------

    def quorum(self, round_: int, tokens: int, stale: int, min_peers: int, grace_s: float,
               timeout_s: float) -> dict:
        """This member is ready for quorum round ``round_``: waits for the master to close
        it (``MasterClient.request_quorum``, same arguments and errors); the announcement."""
        self._admission_open = False
        return self._client.request_quorum(self._assignment.epoch, round_, tokens, stale,
                                           min_peers, grace_s, timeout_s)

    def send_ready(self, round_: int, tokens: int, stale: int, min_peers: int,
                   grace_s: float) -> None:
        """``quorum``'s ``ready`` sent now, answered at the ``quorum`` call for the same
        round (``MasterClient.send_ready``)."""
        self._client.send_ready(self._assignment.epoch, round_, tokens, stale, min_peers,
                                grace_s)

    def closed_quorum(self, round_: int) -> dict | None:
        """The announcement of quorum round ``round_`` once the master closed it, else
        None (``MasterClient.closed_quorum``); never blocks."""
        return self._client.closed_quorum(round_)

    # -- the status page -------------------------------------------------------

    def report_step(self, step: int) -> None:
        """The outer step this peer has reached (a DiLoCo wrapper tells it)."""
        self._step = step

    def report_links(self, rates: list[float]) -> None:
        """This rank's row of measured link rates, bytes/s by rank (``optimize_topology``)."""
        self._link_rates = list(rates)

    def report(self) -> dict:
        """What this peer's heartbeats tell the master's status page (protocol ``_report``):
        ``step``, ``sent``/``received`` (data-plane bytes of the epoch's communicator), the
        native ``op`` running (``"idle"``), the ``ring`` order, ``links`` (bytes/s to each
        rank, -1 unmeasured) and ``sync_bytes``. Called on the client's heartbeat thread;
        never waits for an op in flight."""
        out = {"sync_bytes": self._sync_bytes}
        if self._step is not None:
            out["step"] = self._step
        if self._link_rates is not None:
            out["links"] = [float(r) for r in self._link_rates]
        with self._lock:
            comms = self._watched.get(self._assignment.epoch) or [None]
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
        a = self._assignment
        return {"epoch": a.epoch, "comm_id": a.comm_id, "rank": a.rank,
                "peer_ids": list(a.peer_ids), "addrs": list(a.addrs),
                "revision": -1 if self._shared_revision is None else self._shared_revision,
                "last_key": list(self._quiet_key)}

    # -- lost members and the end ----------------------------------------------

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
            if epoch < self._assignment.epoch:
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
            self._client.leave()
        else:
            self._client.close()
        with self._lock:
            self._watched.clear()
        self._listener.close()
        master, self._master = self._master, None
        if master is not None:
            try:
                master.stop()
            except Exception:  # noqa: BLE001 - closing must not raise; the thread is a daemon
                pass
