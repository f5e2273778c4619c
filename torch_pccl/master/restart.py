"""The restart rules' memory (docs/membership.md, "When the master restarts"): what a master
knows about the run it serves, so that a restarted one never forms a second group beside it.

``RestartRules`` keeps the resume grace window, how the master learnt the run (a state file,
a member's re-registration, or neither), whether its current group was formed from joiners
only, the comm_ids of every epoch it formed or adopted, the current roster, and who
re-registered. ``MembershipState`` tells it what happened and asks it two questions: are
joiners held (``holding``), and does a re-registration carry the run (``adoptable``). Pure:
time is an argument.
"""

from __future__ import annotations

import collections

MAX_KNOWN_EPOCHS = 65_536
"""Bounds the comm_ids a master remembers: one per epoch it formed or adopted."""
STATE_FILE = "state file"
REREGISTRATION = "re-registration"


class RestartRules:
    """What a (re)started master knows of its run.

    Args:
        grace_s: the resume grace window, seconds (>= 0; 0: none), opened by
            ``open_window`` when the master starts without a record of the run.

    Raises:
        ValueError: a negative ``grace_s``.
    """

    def __init__(self, grace_s: float):
        if not grace_s >= 0:
            raise ValueError(f"resume_grace_s must be >= 0 seconds, got {grace_s!r}")
        self.grace_s = float(grace_s)
        self._grace_until: float | None = None
        self._source: str | None = None
        self._joiners_only = False
        self._known: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._roster: list[tuple[str, str]] = []
        self._resumed: collections.deque[str] = collections.deque(maxlen=1024)

    @property
    def holding(self) -> bool:
        """Whether the grace window runs: joiners are held, no group is formed from them."""
        return self._grace_until is not None

    @property
    def grace_until(self) -> float | None:
        """When the grace window ends (the caller's clock), None when none runs."""
        return self._grace_until

    @property
    def roster(self) -> list[tuple[str, str]]:
        """The current epoch's members as formed or adopted, by rank: (peer_id, data_addr)."""
        return list(self._roster)

    def open_window(self, now: float) -> bool:
        """Opens the grace window at ``now`` (seconds) if it has a length; whether it did."""
        if self.grace_s > 0:
            self._grace_until = now + self.grace_s
        return self.holding

    def window_over(self, now: float) -> bool:
        """Closes the window if it ran until ``now``; True exactly then."""
        if self._grace_until is None or now < self._grace_until:
            return False
        self._grace_until = None
        return True

    def formed(self, comm_id: int, roster: list[tuple[str, str]], joiners_only: bool) -> None:
        """The master formed epoch ``comm_id`` itself; ``joiners_only``: nobody in it was a
        member before (no history but this master's), else the lineage carries on."""
        if joiners_only:
            self._joiners_only, self._source = True, None
        self._remember(comm_id, roster)

    def adopted(self, comm_id: int, roster: list[tuple[str, str]], source: str) -> None:
        """The master adopted epoch ``comm_id`` from ``source`` (``STATE_FILE`` or
        ``REREGISTRATION``): the run is known, the window ends."""
        self._grace_until = None
        self._joiners_only, self._source = False, source
        self._remember(comm_id, roster)

    def resumed(self, peer_id: str) -> None:
        """``peer_id`` re-registered with this master."""
        self._resumed.append(peer_id)

    def adoptable(self, record: dict, live: bool, unconfirmed: bool,
                  shared_revision: int | None, epoch: int) -> bool:
        """Whether re-registration ``record`` (a hello's ``resume``), for another epoch than
        the current one, carries the run, so that the master adopts it.

        Yes when the master has no live group (``live`` False), or its group is the state
        file's and no member confirmed it yet (``unconfirmed``: the file can be one epoch
        off, the master may have died between writing it and sending the assigns). No for
        an epoch of this master's own history (the group moved on without that member).
        Against a group this master formed from joiners only, the side with more history
        wins: the higher ``(shared-state revision, epoch)``, ``shared_revision`` and
        ``epoch`` being the current group's.
        """
        if record["comm_id"] in self._known:
            return False
        if not live:
            return True
        if self._source == STATE_FILE and unconfirmed:
            return True
        if self._joiners_only:
            mine = -1 if shared_revision is None else shared_revision
            return (record["revision"], record["epoch"]) > (mine, epoch)
        return False

    def view(self, held: list[str], resuming: list[str]) -> dict:
        """The rules now, for the status page: ``source``, ``grace_until``, the joiners
        ``held`` (given by the caller, [] unless ``holding``), the members ``resuming``
        (not re-registered yet) and those ``resumed``."""
        return {"source": self._source, "grace_until": self._grace_until,
                "held": list(held) if self.holding else [], "resuming": list(resuming),
                "resumed": list(self._resumed)}

    def _remember(self, comm_id: int, roster: list[tuple[str, str]]) -> None:
        self._known[comm_id] = None
        while len(self._known) > MAX_KNOWN_EPOCHS:
            self._known.popitem(last=False)
        self._roster = list(roster)
