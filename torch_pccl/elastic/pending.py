"""The keys of a member's pending queries in an epoch (``torch_pccl.peers_pending``).

The master keys each query by ``(epoch, collectives issued in the epoch, index of the
query since the last collective)`` and gives every member the answer it fixed when that
key was first asked, so members agree however far apart in time they ask. While the
master is away a member answers alone (False: nobody is admitted until it is back), and
remembers the last key it so answered: a master that comes back answers that key and
every earlier one as the members did (docs/membership.md, "When the master dies").

After a sync round that grants it (its ``sync_result``'s ``quiet``) an epoch is answered
alone the same way, without the master being away, until the master's ``wake``: the member's reader thread
ends the grant (``wake``) and tells the master the last key answered alone, atomically with
respect to the queries, so the master fixes every later key for all members alike
(docs/membership.md, "Quiet epochs"). A grant holds only on the link it came on: a master
that restarted knows of none.
"""

from __future__ import annotations

import threading


class PendingKeys:
    """The pending queries of one member in the current epoch."""

    def __init__(self):
        # The last keyed query of this epoch: (collectives issued, index).
        self._last: tuple[int, int] | None = None
        # The last key answered here alone while the master was away.
        self._quiet_key: tuple[int, int] = (-1, -1)
        # Whether the last query was answered quiet (see ``last_quiet``).
        self._last_quiet = False
        # The reader thread ends a grant (``wake``) while queries run on the caller's.
        self._lock = threading.Lock()
        self._epoch = -1                    # the epoch these keys are of
        self._grant_link: int | None = None  # the master link a quiet grant came on
        self._woken = -1                    # the latest epoch the master woke

    @property
    def quiet_key(self) -> tuple[int, int]:
        """``(ops, index)`` of the last query answered alone while the master was away;
        ``(-1, -1)`` when none in this epoch."""
        return self._quiet_key

    @property
    def last_quiet(self) -> bool:
        """Whether the last query was answered quiet: alone while the master was away, or
        so by a master whose members are re-registering. Every member's answer to that key
        is, so a DiLoCo wrapper skips that boundary's sync alike."""
        return self._last_quiet

    def next_key(self, epoch: int, ops: int) -> tuple[int, int, int]:
        """The key of the next query, ``ops`` collectives into ``epoch``:
        ``(epoch, ops, index)``, index counting the queries made at that ``ops``."""
        last = self._last
        index = last[1] + 1 if last and last[0] == ops else 0
        self._last = (ops, index)
        return (epoch, ops, index)

    def answered(self, quiet: bool) -> None:
        """The last query was answered by the master, quiet or not."""
        self._last_quiet = quiet

    def answer_alone(self, key: tuple[int, int, int]) -> bool:
        """Answers query ``key`` here, False, while the master is away."""
        with self._lock:
            self._quiet_key = max(self._quiet_key, key[1:])
        self._last_quiet = True
        return False

    def answer_granted(self, key: tuple[int, int, int], link: int) -> bool:
        """Answers query ``key`` alone, False and quiet, if this epoch's quiet grant holds
        on master link ``link`` (``MasterClient.links``); whether it did."""
        with self._lock:
            if self._grant_link != link:
                return False
            self._quiet_key = max(self._quiet_key, key[1:])
        self._last_quiet = True
        return True

    def wake(self, epoch: int) -> tuple[int, int] | None:
        """The master's ``wake`` for ``epoch`` (on the reader thread): the grant ends; the
        last key answered alone in that epoch for the ``awake`` ((-1, -1): none, or an
        epoch this member has not reached yet, whose grant then never starts). None for
        an epoch already left (no answer owed: the master has moved on too)."""
        with self._lock:
            self._woken = max(self._woken, epoch)
            if epoch < self._epoch:
                return None
            if epoch > self._epoch:
                return (-1, -1)
            self._grant_link = None
            return self._quiet_key

    def grant(self, link: int) -> None:
        """A sync round granted this epoch quiet, on master link ``link``: queries are
        answered alone from now, unless the master already woke the epoch (its ``wake``
        came first)."""
        with self._lock:
            if self._epoch > self._woken:
                self._grant_link = link

    def new_epoch(self, epoch: int = -1) -> None:
        """Keys start over in ``epoch``, without a quiet grant."""
        self._last = None
        with self._lock:
            self._epoch = epoch
            self._quiet_key = (-1, -1)
            self._grant_link = None
