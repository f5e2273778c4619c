"""The keys of a member's pending queries in an epoch (``torch_pccl.peers_pending``).

The master keys each query by ``(epoch, collectives issued in the epoch, index of the
query since the last collective)`` and gives every member the answer it fixed when that
key was first asked, so members agree however far apart in time they ask. While the
master is away a member answers alone (False: nobody is admitted until it is back), and
remembers the last key it so answered: a master that comes back answers that key and
every earlier one as the members did (docs/membership.md, "When the master dies").
"""

from __future__ import annotations


class PendingKeys:
    """The pending queries of one member in the current epoch."""

    def __init__(self):
        # The last keyed query of this epoch: (collectives issued, index).
        self._last: tuple[int, int] | None = None
        # The last key answered here alone while the master was away.
        self._quiet_key: tuple[int, int] = (-1, -1)
        # Whether the last query was answered quiet (see ``last_quiet``).
        self._last_quiet = False

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
        self._quiet_key = max(self._quiet_key, key[1:])
        self._last_quiet = True
        return False

    def new_epoch(self) -> None:
        """Keys start over in a new epoch."""
        self._last = None
        self._quiet_key = (-1, -1)
