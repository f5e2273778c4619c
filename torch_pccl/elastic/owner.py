"""The one wrapper that changes a group's membership: ``BoundaryOwner``.

A DiLoCo wrapper admits pending peers only at its outer boundaries, where a joiner's
constructor lines up with the members. While it lives, ``peers_pending()`` from other
code answers False and ``update_topology()`` from other code raises; its own calls run
inside ``as_owner()``.
"""

from __future__ import annotations

import contextlib
import weakref


class BoundaryOwner:
    """Which wrapper (held weakly) owns a group's membership changes, and whether the
    call under way is its own."""

    def __init__(self):
        self._owner: weakref.ref | None = None
        self._own_calls = 0

    def own(self, owner) -> None:
        """Makes ``owner`` (held weakly) the one that changes the group's membership."""
        self._owner = weakref.ref(owner)

    @contextlib.contextmanager
    def as_owner(self):
        """The owner's own membership calls run inside this."""
        self._own_calls += 1
        try:
            yield
        finally:
            self._own_calls -= 1

    def held_elsewhere(self) -> bool:
        """True when an owner lives and the call under way is not its own: pending peers
        then wait for the owner's next boundary, and other code must not update."""
        return self._owner is not None and self._owner() is not None and self._own_calls == 0
