"""The all-or-nothing ledger of an epoch: which exchanges completed here, and the roll forward.

A member lost inside an all-reduce can leave survivors that received every byte (their
exchange completed) beside others that did not (it failed and left their tensor
unchanged). Each member counts the exchanges it completed in the epoch and keeps the
last one's result; at the next update every member sends its count to the master, and
the assignment lists them all. ``ExchangeLedger.roll_forward_source`` then says, the
same on every member, who broadcasts the missing result to whom (docs/membership.md,
"All or nothing").
"""

from __future__ import annotations

from ..errors import InvalidUsageError, ProtocolError


class ExchangeLedger:
    """This member's count of completed exchanges in the current epoch, the last one's
    result and the tensor of the exchange under way."""

    def __init__(self):
        self._done = 0
        self._last_result = None      # the last completed exchange's result tensor
        self._in_progress = None      # the tensor of the exchange under way
        self._rolled_forward = False  # the exchange under way was completed by a roll forward
        self._spare = None            # this ledger's own copy of a result (``keep``)
        self._ahead = False           # passed the boundary after the last exchange (``keep``)

    @property
    def done(self) -> int:
        """Exchanges completed here in this epoch."""
        return self._done

    @property
    def rolled_forward(self) -> bool:
        """The exchange under way was completed by the last roll forward (its result is in
        its tensor): it must not be redone."""
        return self._rolled_forward

    @property
    def busy(self) -> bool:
        """Whether this member is past the boundary after its last completed exchange: an
        exchange is under way here (begun, neither completed nor rolled forward), or it
        answered that boundary's query quiet (``keep``) and trains towards the next one.
        An update round sent now comes from inside its next exchange."""
        return self._in_progress is not None or self._ahead

    def keep(self) -> None:
        """This member answered a pending query quiet after its last exchange: it may pass
        that boundary without a vote and refill the exchange's tensor while a member whose
        copy of the exchange failed still needs its result (docs/membership.md, "Quiet
        epochs"). Copies the result into a tensor of the ledger's own (reused while its
        shape, dtype and device stay); a no-op when kept already or nothing completed."""
        last = self._last_result
        if last is None:
            return
        self._ahead = True
        if last is self._spare:
            return
        spare = self._spare
        if spare is None or spare.shape != last.shape or spare.dtype != last.dtype or \
                spare.device != last.device:
            self._spare = last.clone()
        else:
            spare.copy_(last)
        self._last_result = self._spare

    @staticmethod
    def passed(done: list[int], busy: list[bool]) -> bool:
        """Whether the members of the epoch just left passed the boundary after its last
        completed exchange without a vote: some member that completed the most exchanges
        (``done``, by rank, the assignment's) came to the update round from inside its next
        one (``busy``, aligned). A member still at that boundary, or rolled forward to it,
        then passes it the same way (quiet, no sync), so that every member meets the others
        in that next exchange (docs/membership.md, "Quiet epochs")."""
        if not done or len(busy) != len(done):
            return False
        top = max(done)
        return top >= 0 and any(b for d, b in zip(done, busy) if d == top)

    def begin(self, tensor) -> None:
        """An exchange (an all-reduce of ``tensor`` in place) starts."""
        self._in_progress = tensor
        self._rolled_forward = False

    def end(self, result) -> None:
        """The exchange completed here; ``result`` (kept, not copied) holds its bytes until
        the next exchange, so a survivor that missed them can get them from this peer."""
        self._done += 1
        self._last_result = result
        self._in_progress = None
        self._ahead = False

    def roll_forward_source(self, done: list[int], rank: int):
        """What the roll forward of the epoch just left does here.

        Args:
            done: every member's count of completed exchanges, by its new rank (the
                assignment's ``done``; -1 for a member that counted none, a joiner).
            rank: this member's new rank.

        Returns:
            None when there is nothing to roll forward (every count equal, or a member
            without one); else ``(src, tensor)``: the lowest rank that completed the
            exchange broadcasts ``tensor`` (its result there, the tensor under way on a
            member that did not complete it).

        Raises:
            ProtocolError: the counts differ by more than one.
            InvalidUsageError: this member counted fewer exchanges but holds no tensor.
        """
        if not done or min(done) < 0 or max(done) == min(done):
            return None
        top = max(done)
        if min(done) != top - 1:
            raise ProtocolError(f"exchange counts {done} differ by more than one")
        mine = done[rank]
        buf = self._last_result if mine == top else self._in_progress
        if buf is None:
            raise InvalidUsageError(f"this member counted {mine} exchanges of {top} but "
                                    "holds no tensor for them")
        return done.index(top), buf

    def rolled(self) -> None:
        """The exchange under way was completed here by the roll forward."""
        self._rolled_forward = True
        self._in_progress = None

    def new_epoch(self) -> None:
        """The exchanges counted so far belong to the epoch just left."""
        self._done = 0
        self._last_result = None
        self._ahead = False
