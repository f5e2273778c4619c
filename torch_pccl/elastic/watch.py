"""Lost members end the epoch's communicators at once: ``LostMemberWatch``.

The master tells every member when it drops one (``member_lost``). A member blocked on
a stopped or vanished peer would otherwise fail only at its op deadline, which may be
minutes on a slow link; the watch aborts every communicator of that epoch with
``PeerLostError`` naming the dropped member as soon as the notice comes, so it fails
within about a second of the master's drop.
"""

from __future__ import annotations

import threading


class LostMemberWatch:
    """The communicators of each watched epoch, and why an epoch lost its first member."""

    def __init__(self):
        self._lock = threading.Lock()
        self._watched: dict[int, list] = {}   # epoch -> its communicators
        self._lost: dict[int, str] = {}       # epoch -> why its first lost member was lost

    def watch(self, epoch: int, comm) -> None:
        """Aborts ``comm`` (with ``PeerLostError``) when a member of ``epoch`` is dropped.

        At once if one already was. Call it before connecting ``comm``, so that a member
        lost during the connect phase ends that too. Forgets older epochs.
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

    def member_lost(self, msg: dict, current_epoch: int) -> None:
        """The master's ``member_lost`` notice ``msg`` (epoch, peer_id, rank, reason):
        aborts that epoch's communicators, unless this member has left it behind."""
        epoch = msg["epoch"]
        why = (f"peer {msg['peer_id']} (rank {msg['rank']} of epoch {epoch}) is gone: the master "
               f"{msg['reason']}")
        with self._lock:
            if epoch < current_epoch:
                return          # an epoch this peer has left behind
            self._lost.setdefault(epoch, why)
            comms = list(self._watched.get(epoch, ()))
        for comm in comms:
            comm.abort(lost=why)

    def latest(self, epoch: int):
        """The last communicator watched for ``epoch``, or None."""
        with self._lock:
            comms = self._watched.get(epoch)
            return comms[-1] if comms else None

    def clear(self) -> None:
        """Forgets every epoch (the member leaves)."""
        with self._lock:
            self._watched.clear()
