"""Membership: the owner of a group's elastic epoch and of its transition (docs/membership.md).

One ``Membership`` per group formed through a master holds the link to the master
(client, data-plane listener, current assignment) and what lives for an epoch, each
part in a module of its own: the keys of its pending queries (``pending``), its ledger
of all-or-nothing exchanges (``ledger``), the DiLoCo wrapper that owns its boundaries
(``owner``), the member-lost watch (``watch``), what its heartbeats report
(``report``). It drives the transition to the next epoch (``update``: request the
update -> ``ProcessGroupPCCL.configure`` -> roll forward), asking the process group to
connect, never building what lies below; ``topology``, ``shared_state`` and the DiLoCo
transport ask it through methods.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from .. import config
from ..c10d.epoch import EpochConfig
from ..c10d.process_group import ProcessGroupPCCL
from ..core.native import MAX_STREAMS
from ..errors import (
    PcclSystemError,
    PcclTimeoutError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from .ledger import ExchangeLedger
from .master_client import Assignment, MasterClient
from .owner import BoundaryOwner
from .pending import PendingKeys
from .report import PeerReport
from .watch import LostMemberWatch

# Errors after which a smaller world can retry: the network's, not the caller's.
RETRYABLE_ERRORS = (PeerLostError, RemoteError, PcclTimeoutError, PcclSystemError, ProtocolError)


class Membership:
    """The owner of a group's elastic epoch: its link to the master and the transition.

    It also turns the master's ``member_lost`` notices into prompt failures
    (``watch.LostMemberWatch``): every communicator of an epoch is aborted with
    ``PeerLostError`` naming the dropped member as soon as the notice comes.

    Args:
        client: this peer's connection to the master.
        listener: the data-plane ``Listener`` every epoch's communicator accepts on.
        assignment: the first epoch's assignment.
        master: the ``MasterThread`` this process hosts for the job, if any (stopped by
            ``close``).
        shard: this process's shard index in its sharded replica (None: a peer of its
            own). The master's epochs then span every process of every replica, and this
            membership's group is the ring of its shard index (``Assignment.ring``):
            ``assignment`` is that ring's view, ``group_assignment`` the whole epoch.
    """

    def __init__(self, client: MasterClient, listener, assignment: Assignment, master=None,
                 shard: int | None = None):
        self._client = client
        self._listener = listener
        self._shard = shard
        self._set_views(assignment)
        self._master = master
        # The revision of this peer's last completed sync_shared_state; None
        # until then (the master's election treats the peer as fresh).
        self._shared_revision: int | None = None
        # True from admission (or bootstrap) until this peer's first update_topology,
        # sync_shared_state or collective: the members' update round that admitted it
        # counts as its own (see torch_pccl.peers_pending).
        self._admission_open = True
        self._keys = PendingKeys()
        self._keys.new_epoch(assignment.epoch)
        self._ledger = ExchangeLedger()
        self._round_opened = -1     # the latest epoch whose update round the master announced
        # The ops at which this epoch's first boundary is passed quiet: its round found
        # members inside their next exchange (roll_forward); None: it is not.
        self._quiet_ops: int | None = None
        self._owner = BoundaryOwner()
        self._report = PeerReport()
        self._watch = LostMemberWatch()
        client.set_member_lost_handler(self._member_lost)
        client.set_wake_handler(self._wake)
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
        """The current epoch's assignment as this group sees it (replaced whole at each
        transition): a sharded replica's process sees its shard's ring."""
        return self._assignment

    @property
    def group_assignment(self) -> Assignment:
        """The current epoch's assignment as the master made it: every member."""
        return self._global

    @property
    def shard(self) -> int | None:
        """This process's shard index in its sharded replica (None: a peer of its own)."""
        return self._shard

    def _set_views(self, assignment: Assignment) -> None:
        self._global = assignment
        if self._shard is None:
            self._assignment, self._group_ranks = assignment, tuple(range(assignment.world_size))
        else:
            self._assignment, self._group_ranks = assignment.ring(self._shard)

    def _ring_ranks(self, group_ranks) -> list[int]:
        """The ranks of this group for ``group_ranks`` of the master's epoch (others dropped)."""
        where = {g: r for r, g in enumerate(self._group_ranks)}
        return [where[g] for g in group_ranks if g in where]

    @property
    def shared_revision(self) -> int | None:
        """The revision of this peer's last completed shared-state sync; None before one."""
        return self._shared_revision

    @property
    def exchanges_done(self) -> int:
        """All-or-nothing exchanges completed here in this epoch."""
        return self._ledger.done

    @property
    def rolled_forward(self) -> bool:
        """The exchange under way was completed by the last transition's roll forward (its
        result is in its tensor): it must not be redone."""
        return self._ledger.rolled_forward

    @property
    def last_quiet(self) -> bool:
        """Whether the last pending query was answered quiet (``PendingKeys.last_quiet``)."""
        return self._keys.last_quiet

    @property
    def quiet_key(self) -> tuple[int, int]:
        """``(ops, index)`` of the last pending query answered alone while the master was
        away; ``(-1, -1)`` when none in this epoch."""
        return self._keys.quiet_key

    # -- the transition to the next epoch --------------------------------------

    def form(self, timeout_s: float, lanes: int, streams: int | None) -> ProcessGroupPCCL:
        """The group of the first assignment's epoch (``ProcessGroupPCCL.create``).

        Args:
            timeout_s: the group's default op deadline, seconds.
            lanes: connections per peer; ``streams``: TCP streams each (None: chosen from
                the addresses), as ``Communicator.connect``.

        Raises:
            As ``connect``.
        """
        return self.connect(
            lambda epoch, watch: ProcessGroupPCCL.create(epoch, timeout_s, lanes, watch),
            timeout_s, streams, config.UPDATE_TIMEOUT_S, admit=True)

    def update(self, pg: ProcessGroupPCCL, timeout_s: float, admit: bool) -> Assignment:
        """Moves ``pg`` to the next epoch, a collective of the members: request the update,
        ``pg.configure`` (which drains it once), roll forward.

        Args:
            pg: the group this membership belongs to.
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
        self.connect(pg.configure, pg.timeout_s, config.streams(MAX_STREAMS), timeout_s,
                       admit)
        self.roll_forward(pg)
        return self._assignment

    def request_update(self, timeout_s: float, admit: bool) -> Assignment:
        """Joins the master's update round of this epoch and moves to the next one's
        assignment (not yet connected). The round carries this member's exchange count
        (-1 while its admission is open: it has counted none).

        Raises:
            As ``MasterClient.request_update``.
        """
        done = -1 if self._admission_open else self._ledger.done
        a = self._client.request_update(self._assignment.epoch, timeout_s, admit=admit,
                                        done=done, busy=self._ledger.busy and done >= 0)
        self.set_assignment(a)
        return a

    def connect(self, attempt: Callable[[EpochConfig, Callable], object], op_timeout_s: float,
                streams: int | None, update_timeout_s: float, admit: bool):
        """Runs ``attempt(epoch, watch)`` for the current assignment's epoch until it
        succeeds; returns what it returned.

        ``attempt`` is ``ProcessGroupPCCL.create`` or ``.configure``; ``watch`` hands this
        membership the communicator before it connects (``LostMemberWatch``). Each try is
        bounded by ``PCCL_CONNECT_TIMEOUT`` (at most ``op_timeout_s``). When it fails with
        a network error, this member tells the master which ranks it could not connect
        with (the error's ``unreached_ranks``; the master drops those admitted in that
        epoch, and the others are told), joins an update round of that epoch
        (``request_update``), and connects the next epoch: so a joiner that cannot be
        reached costs the members one connect deadline, not their run. A peer the master
        dropped raises the master's reason.

        Raises:
            PeerLostError: this peer was dropped (e.g. nobody could reach its address).
            Network PcclErrors of the last try after ``config.CONNECT_ATTEMPTS`` retries;
            errors of the update round (``MasterClient.request_update``).
        """
        connect_s = min(op_timeout_s, config.connect_timeout_s())
        for tries in range(config.CONNECT_ATTEMPTS + 1):
            a = self._assignment
            epoch = EpochConfig(a.rank, a.world_size, a.comm_id, tuple(a.addrs),
                                self._listener, connect_s, streams)
            try:
                return attempt(epoch, lambda comm, n=a.epoch: self._watch.watch(n, comm))
            except RETRYABLE_ERRORS as exc:
                failure = self._client.failure
                if failure is not None:
                    raise type(failure)(str(failure)) from exc
                if tries == config.CONNECT_ATTEMPTS:
                    raise
                # Only this member's own deadline says who is unreachable: a connect aborted
                # because the master dropped someone else leaves slower peers half-connected.
                if isinstance(exc, PcclTimeoutError) and exc.unreached_ranks:
                    self._client.report_unreached(
                        a.epoch, [self._group_ranks[r] for r in exc.unreached_ranks
                                  if 0 <= r < len(self._group_ranks)])
                self.request_update(update_timeout_s, admit)
        raise AssertionError("not reached")

    def roll_forward(self, pg: ProcessGroupPCCL) -> None:
        """Makes the exchange that some survivors completed complete on all of them.

        Every member sent the master its count of exchanges completed in the epoch just
        left, and the assignment lists them: if they differ (by one; an exchange needs
        everyone's previous one), the lowest rank that completed it broadcasts its result
        on ``pg``, now in the new epoch, into the tensor of those that did not, which then
        count it as done (``rolled_forward``) instead of redoing it
        (``ExchangeLedger.roll_forward_source``). So an exchange is applied on every
        survivor or, when none completed it, redone by all. The ledger then starts the
        new epoch.

        Raises:
            ProtocolError: the counts differ by more than one.
            InvalidUsageError: this member counted fewer exchanges but holds no tensor.
            PcclError subclasses of the broadcast.
        """
        a = self._assignment
        passed = ExchangeLedger.passed(list(a.done), list(a.busy))
        try:
            done = list(a.done)
            plan = (self._ledger.roll_forward_source(done, a.rank)
                    if len(done) == a.world_size else None)
            if plan is None:
                return
            src, buf = plan
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            pg.broadcast([buf], opts).wait()
            if done[a.rank] < done[src]:
                self._ledger.rolled()
        finally:
            self._ledger.new_epoch()
            # Members inside their next exchange had passed the boundary after the last
            # one quiet: the others pass it so too, at its ops here (after the broadcast).
            self._quiet_ops = pg.collectives_issued if passed else None

    def set_assignment(self, assignment: Assignment) -> None:
        """Moves to the epoch of ``assignment`` (after an update round)."""
        self._set_views(assignment)
        self._keys.new_epoch(assignment.epoch)
        self._quiet_ops = None

    def _wake(self, msg: dict) -> None:
        """The master's ``wake`` (reader thread): this epoch's quiet grant ends; answered
        with the last key answered alone (``PendingKeys.wake``). With ``update``, a member
        opened an update round of that epoch (``round_opened``)."""
        if msg.get("update"):
            self._round_opened = max(self._round_opened, msg["epoch"])
        key = self._keys.wake(msg["epoch"])
        if key is not None:
            self._client.send_awake(msg["epoch"], key)

    @property
    def round_opened(self) -> bool:
        """Whether a member opened an update round of this epoch while this one is past
        its last boundary (answered quiet, ``ExchangeLedger.busy``): it joins the round at
        its next inner step (docs/membership.md, "Quiet epochs") instead of keeping the
        others waiting in it for the rest of its inner phase."""
        return self._round_opened == self._assignment.epoch and self._ledger.busy

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
        self._keys.answered(False)
        if self._owner.held_elsewhere():
            return False        # the DiLoCo wrapper admits them at its next outer boundary
        if ops == 0 and self._admission_open:
            return True         # the round that admitted this peer was its update
        key = self._keys.next_key(self._assignment.epoch, ops)
        if ops == self._quiet_ops:
            # Members that came to this epoch's round from inside their next exchange had
            # passed this boundary quiet: every member passes it so (ExchangeLedger.passed).
            self._keys.answered(True)
            return False
        if ops == 0:
            return False
        pending = self._ask(key, timeout)
        if self._keys.last_quiet:
            # The boundary may be passed without a vote: the last exchange's result must
            # outlive the refill of its tensor (ExchangeLedger.keep).
            self._ledger.keep()
        return pending

    def _ask(self, key: tuple[int, int, int], timeout: float | timedelta | None) -> bool:
        """The answer to keyed query ``key``: alone while the master is away or under this
        epoch's quiet grant, else the master's (``pending``)."""
        if self._client.away:
            return self._keys.answer_alone(key)      # no master to ask
        if self._client.failure is None and self._keys.answer_granted(key, self._client.links):
            return False        # a quiet epoch: nobody pending, no master round trip
        try:
            count, quiet = self._client.pending_answer(
                config.to_seconds(timeout, config.QUERY_TIMEOUT_S), key=key)
        except PcclTimeoutError:
            if not self._client.away:
                raise
            return self._keys.answer_alone(key)      # the master died under the query
        self._keys.answered(quiet)
        return count > 0

    # -- shared state ----------------------------------------------------------

    def request_sync(self, revision: int, strategy: str, content: str,
                     timeout_s: float) -> dict:
        """Votes in the master's shared-state sync round of this epoch
        (``MasterClient.request_sync``; fresh while no sync completed here). The answer's
        ``sources`` and ``outdated`` are ranks of this group (the master elects a sharded
        replica's shard with the same shard of the other replicas, by the epoch's ranks)."""
        result = self._client.request_sync(self._assignment.epoch, revision, strategy,
                                           self._shared_revision is None, content, timeout_s)
        if result.get("quiet") and not result["error"]:
            self._keys.grant(self._client.links)     # docs/membership.md, "Quiet epochs"
        if self._shard is not None:
            result = dict(result, sources=self._ring_ranks(result["sources"]),
                          outdated=self._ring_ranks(result["outdated"]))
        return result

    def synced(self, revision: int, moved_bytes: int) -> None:
        """A sync completed here at ``revision``, its data plane moving ``moved_bytes``
        bytes (sent and received; the status page shows the total)."""
        self._shared_revision = revision
        self._report.synced(moved_bytes)

    # -- all-or-nothing exchanges (``ledger``) ----------------------------------

    def begin_exchange(self, tensor) -> None:
        """An all-or-nothing exchange (an all-reduce of ``tensor`` in place) starts."""
        self._ledger.begin(tensor)

    def end_exchange(self, result) -> None:
        """The exchange completed here; ``result`` is kept until the next one
        (``ExchangeLedger.end``)."""
        self._ledger.end(result)

    # -- the DiLoCo wrapper that owns the boundaries (``owner``) ----------------

    def own(self, owner) -> None:
        """Makes ``owner`` (held weakly) the one that changes this group's membership:
        while it lives, ``peers_pending()`` from other code answers False and
        ``update_topology()`` from other code raises; its own calls run inside
        ``as_owner()``."""
        self._owner.own(owner)

    def as_owner(self):
        """The owner's own membership calls run inside this (a context manager)."""
        return self._owner.as_owner()

    def held_by_owner(self) -> bool:
        """True when a DiLoCo wrapper owns this group's membership changes and the call
        under way is not its own (``BoundaryOwner.held_elsewhere``)."""
        return self._owner.held_elsewhere()

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

    # -- the status page (``report``) --------------------------------------------

    def report_step(self, step: int) -> None:
        """The outer step this peer has reached (a DiLoCo wrapper tells it)."""
        self._report.step(step)

    def report_links(self, rates: list[float]) -> None:
        """This rank's row of measured link rates, bytes/s by rank (``optimize_topology``)."""
        self._report.links(rates)

    def report(self) -> dict:
        """What this peer's heartbeats tell the master's status page
        (``PeerReport.build`` of the epoch's last communicator). Called on the client's
        heartbeat thread; never waits for an op in flight."""
        return self._report.build(self._watch.latest(self._assignment.epoch))

    def resume_record(self) -> dict:
        """What this member re-registers with when its master comes back (the hello's
        ``resume``): its assignment, shared-state revision and ``quiet_key``. Called on the
        client's reconnect thread; reads fields that are replaced whole, never mutated."""
        a = self._global
        return {"epoch": a.epoch, "comm_id": a.comm_id, "rank": a.rank,
                "peer_ids": list(a.peer_ids), "addrs": list(a.addrs),
                "revision": -1 if self._shared_revision is None else self._shared_revision,
                "last_key": list(self._keys.quiet_key)}

    # -- lost members and the end ----------------------------------------------

    def _member_lost(self, msg: dict) -> None:
        self._watch.member_lost(msg, self._assignment.epoch)

    def close(self, leave: bool = True) -> None:
        """Leaves the master (``leave``: a clean departure) or disconnects; closes the listener,
        and stops the master if this process hosts it (see ``auto_master_membership``).

        Close every communicator created on the listener first. Never raises.
        """
        if leave:
            self._client.leave()
        else:
            self._client.close()
        self._watch.clear()
        self._listener.close()
        master, self._master = self._master, None
        if master is not None:
            try:
                master.stop()
            except Exception:  # noqa: BLE001 - closing must not raise; the thread is a daemon
                pass
