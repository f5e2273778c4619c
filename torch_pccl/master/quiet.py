"""An epoch's quiet grant (docs/membership.md, "Quiet epochs"): pure logic, no I/O.

A DiLoCo boundary asks the master whether peers are pending (a keyed query) and then votes in
a shared-state sync: two round trips on a long link at every outer step, even when nothing
changes. When a sync round that every member voted in elects with no peer pending, its
``sync_result`` carries a *quiet grant*: the state is equal everywhere and the members answer
their pending queries alone (no peer pending, quiet, so a DiLoCo boundary skips
its sync alike on every member) and send the master nothing at a boundary.

When a peer becomes pending, a member is lost or a member opens an update round (the others
must join it, and hear of it only through their queries), the master *wakes* the epoch: a ``wake`` to every member, which
stops answering alone and replies ``awake`` with the last key it answered alone. A query
that reaches the master before every member has answered waits: a member still answering
alone might answer that very key 0. Once all have, every key up to the largest of theirs
answers 0 (quiet; ``PendingAnswers.quiet_up_to``) and later keys are fixed as always, so
every member answers every key alike. A member lost meanwhile owes no answer. A member that
asks before any wake (it re-registered on a new link, where its grant does not hold) gets what
the others answer alone: 0, quiet.

Off unless the master is started with ``--quiet-epochs``, until the churn soak has run clean
long enough: a death inside an exchange can leave members a boundary apart, and the members'
side lines them up again (``ExchangeLedger.keep`` and ``passed``; docs/membership.md).
"""

from __future__ import annotations


class QuietGrant:
    """The quiet grant of the current epoch, and its waking.

    Args:
        enabled: whether a sync round may grant quiet epochs at all (``--quiet-epochs``;
            off by default for now).
    """

    def __init__(self, enabled: bool = False):
        self.enabled = bool(enabled)
        self._granted = False
        self._owed: set[int] | None = None   # members that owe an ``awake`` (None: not waking)
        self._last_key: tuple[int, int] = (-1, -1)
        self._held: list[tuple[int, dict]] = []  # (conn, pending query) waiting for them

    @property
    def granted(self) -> bool:
        """Whether the current epoch was formed quiet and is not awake yet (members may
        still be answering alone)."""
        return self._granted

    @property
    def unwoken(self) -> bool:
        """Granted and no ``wake`` sent yet: every member may be answering alone, so any
        key asked now answers 0, quiet."""
        return self._granted and self._owed is None

    @property
    def waking(self) -> bool:
        """A ``wake`` went out and some member still owes its ``awake``."""
        return bool(self._owed)

    def new_epoch(self) -> list[tuple[int, dict]]:
        """An epoch formed, without a grant; returns the queries still held for the old
        epoch's wake (the caller refuses them: their epoch is gone)."""
        held = self._held
        self._granted = False
        self._owed = None
        self._last_key = (-1, -1)
        self._held = []
        return held

    def grant(self) -> None:
        """A sync round that every member voted in elected with nobody pending: the epoch
        is quiet (its ``sync_result`` says so) until a peer is pending. Queries still held
        for an earlier wake of this epoch stay held until it is released."""
        if self._owed:
            return                  # members still owe their awake: that wake goes on
        self._granted = True
        self._owed = None
        self._last_key = (-1, -1)

    def wake(self, members: list[int], epoch: int,
             update: bool = False) -> list[tuple[int, dict]]:
        """A peer is pending (or a member was lost, or ``update``: a member opened an update
        round): the ``wake`` of ``epoch`` to send to each member (connection ids), as
        ``(conn, message)``; [] when the epoch is not quiet or already woken. With
        ``update``, in an epoch granted quiet even if woken already, a ``wake`` with
        ``update: true`` to every member: one that passed its boundary quiet and trains
        on joins the round at its next inner step rather than after its inner phase."""
        if update and self._owed is not None:
            return [(conn, {"type": "wake", "epoch": epoch, "update": True}) for conn in members]
        if not self._granted or self._owed is not None:
            return []
        self._owed = set(members)
        msg = {"type": "wake", "epoch": epoch, **({"update": True} if update else {})}
        return [(conn, dict(msg)) for conn in members]

    def hold(self, conn: int, msg: dict) -> bool:
        """Whether the pending query ``msg`` of member ``conn`` must wait for the members'
        ``awake`` (kept here until ``released``)."""
        if not self._owed:
            return False
        self._held.append((conn, msg))
        return True

    def awake(self, conn: int, key: tuple[int, int]) -> None:
        """Member ``conn`` answered ``wake``: ``key`` is the last one it answered alone."""
        if self._owed is None or conn not in self._owed:
            return
        self._owed.discard(conn)
        self._last_key = max(self._last_key, tuple(key))

    def forget(self, conn: int) -> None:
        """Member ``conn`` is gone: it owes nothing, and its held queries are dropped."""
        if self._owed is not None:
            self._owed.discard(conn)
        self._held = [(c, m) for c, m in self._held if c != conn]

    def release(self, answers) -> list[tuple[int, dict]]:
        """Once no member owes an ``awake``: ends the grant, makes every key up to the
        largest answered alone quiet in ``answers`` (``PendingAnswers.quiet_up_to``) and
        returns the held queries to answer now, in arrival order; [] while waking or when
        the epoch was not woken."""
        if self._owed is None or self._owed or not self._granted:
            return []
        self._granted = False
        answers.quiet_up_to(self._last_key)
        held, self._held = self._held, []
        return held
