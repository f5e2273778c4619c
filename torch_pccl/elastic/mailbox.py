"""Mailbox: the master's answers matched to one peer's requests (docs/membership.md).

Every request that waits for an answer (``update``, ``sync``, ``ready``, ``pending``)
goes through one mechanism: under one lock the request gets a fresh ``id`` and a slot;
the master echoes the id in its answer (or in a non-fatal ``error``), and the reader
thread's ``deliver`` puts the answer in that slot. An answer whose slot is gone (a late
answer to a request that timed out, or one sent on a lost connection) is dropped, so it
can never be taken for a newer request's. Messages that answer no request are kept by
kind: the ``welcome`` (the hello's answer), an ``assign`` without an id (the admission
of a pending peer) and the latest closed quorum rounds.

The mailbox also holds what every wait checks, set by ``MasterSession``
(master_session.py): the sticky failure (every wait raises it once set), whether the
connection is away (a member reconnecting: requests wait for it) and the generation of
the connection (a request sent on an older one is sent again). Every wait has a deadline
and wakes on an answer or on any of those changes; nothing polls. The mailbox sends
nothing itself: requests take the session's ``send``.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from ..errors import PcclError, PcclTimeoutError, PeerLostError

# The latest closed quorum rounds kept for ``closed_quorum`` and the ready sent ahead.
_QUORUMS_KEPT = 16

_RESEND = object()      # a request's connection was replaced before its answer came


class Mailbox:
    """The master's answers to this peer's requests, matched by id under one lock.

    Args:
        master_addr: the master's ``"host:port"``, for the messages of timeouts.
    """

    def __init__(self, master_addr: str):
        self.master_addr = master_addr
        self._cond = threading.Condition()
        self._last_id = 0                       # of requests; each try carries a new one
        self._slots: dict[int, dict | None] = {}    # open request id -> its answer, once in
        # One request at a time: a caller's requests are answered in the order made.
        self._turn = threading.Lock()
        self._welcome: dict | None = None
        self._admissions: deque[dict] = deque()     # assign without an id
        self._quorums: dict[int, dict] = {}         # closed round -> announcement (no id)
        # The last ready sent ahead (ask_ahead): (round, its message with id, generation).
        self._ahead: tuple[int, dict, int] | None = None
        self._failure: PcclError | None = None
        self._away = False          # the connection broke; the session reconnects
        self._generation = 0        # connections made after the first

    # -- the connection's state, as the waits see it ---------------------------

    @property
    def failure(self) -> PcclError | None:
        """The sticky error once the connection is lost for good or closed, else None."""
        return self._failure

    @property
    def away(self) -> bool:
        """True while the connection is lost and being re-established."""
        return self._away

    def sticky(self) -> PcclError | None:
        """A fresh copy of the sticky failure (same class and message), or None.

        A fresh exception per raise: one object re-raised from several threads would pile
        up their tracebacks."""
        failure = self._failure
        return None if failure is None else type(failure)(str(failure))

    def wait_failure(self, timeout_s: float) -> PcclError | None:
        """``sticky()``, waiting up to ``timeout_s`` seconds for a failure to come."""
        with self._cond:
            self._cond.wait_for(lambda: self._failure is not None, timeout=timeout_s)
        return self.sticky()

    def raise_failure(self) -> None:
        """Raises ``sticky()``, if there is a failure.

        Raises:
            PcclError: the failure's class (``PeerLostError``, ``GroupReplacedError``,
                ``IntegrityError``, ``AuthenticationError``), with its message.
        """
        err = self.sticky()
        if err is not None:
            raise err

    def fail(self, err: PcclError, keep_away: bool = False) -> bool:
        """Makes ``err`` the sticky failure unless there is one already, and wakes every
        wait. Unless ``keep_away``, the connection is not away any more: gone for good, so
        the next request raises the failure instead of waiting for a master. Returns
        whether ``err`` became the failure."""
        with self._cond:
            first = self._failure is None
            if first:
                self._failure = err
            if not keep_away:
                self._away = False
            self._cond.notify_all()
        return first

    def lose(self) -> bool:
        """The connection broke and is being re-established: requests wait for it. Returns
        False (and changes nothing) when there is a failure already."""
        with self._cond:
            if self._failure is not None:
                return False
            self._away = True
            self._cond.notify_all()
        return True

    def restore(self) -> None:
        """A new connection replaced the lost one: requests sent on the old one are sent
        again on it."""
        with self._cond:
            self._away = False
            self._generation += 1
            self._cond.notify_all()

    # -- what the reader thread delivers ----------------------------------------

    def deliver(self, msg: dict) -> None:
        """Files one validated message from the master (no fatal ``error``, no
        ``member_lost``: the session handles those) and wakes the waits."""
        kind = msg["type"]
        with self._cond:
            if kind == "welcome":
                self._welcome = msg
            elif kind == "quorum":
                self._quorums[msg["round"]] = {k: v for k, v in msg.items() if k != "id"}
                while len(self._quorums) > _QUORUMS_KEPT:
                    del self._quorums[min(self._quorums)]
            rid = msg.get("id")
            if kind == "assign" and rid is None:
                self._admissions.append(msg)
            elif rid in self._slots and self._slots[rid] is None:
                self._slots[rid] = {k: v for k, v in msg.items() if k != "id"}
            self._cond.notify_all()

    def closed_quorum(self, round_: int) -> dict | None:
        """The announcement of quorum round ``round_`` if it is one of the latest 16
        closed, else None; never blocks."""
        with self._cond:
            return self._quorums.get(round_)

    # -- waits --------------------------------------------------------------------

    def wait_welcome(self, timeout_s: float) -> dict:
        """The master's ``welcome``, waited for up to ``timeout_s`` seconds.

        Raises:
            PcclTimeoutError: none within ``timeout_s``.
            PcclError: the sticky failure (see ``raise_failure``).
        """
        return self._wait(lambda: self._welcome, time.monotonic() + timeout_s, timeout_s,
                          "the master's welcome")

    def wait_admission(self, timeout_s: float) -> dict:
        """The first ``assign`` without an id (this pending peer's admission), waited for
        up to ``timeout_s`` seconds.

        Raises:
            PcclTimeoutError: none within ``timeout_s``.
            PcclError: the sticky failure (see ``raise_failure``).
        """
        return self._wait(lambda: self._admissions.popleft() if self._admissions else None,
                          time.monotonic() + timeout_s, timeout_s,
                          "admission by the master (still pending)")

    def ask(self, msg: dict, send: Callable[[dict], None], timeout_s: float,
            what: str) -> dict:
        """Sends request ``msg`` (one at a time) and returns its answer, the answer itself
        or the master's non-fatal ``error``, without its ``id``.

        While the connection is away the request waits for the new one; if the connection
        is replaced before the answer comes, the request is sent again on the new one,
        each try with a fresh id. ``send(msg)`` raises ``PeerLostError`` when the link
        broke under it.

        Raises:
            PcclTimeoutError: no answer within ``timeout_s`` seconds (``what`` names it).
            PcclError: the sticky failure (see ``raise_failure``).
        """
        deadline = time.monotonic() + timeout_s
        broken = None               # the generation a send failed on: wait for the next
        with self._turn:
            while True:
                gen = self._wait(lambda: self._connection(broken), deadline, timeout_s, what)
                rid, sent = self._open(msg)
                try:
                    try:
                        send(sent)
                    except PeerLostError:
                        if self._failure is not None:
                            raise
                        broken = gen        # it broke under the send: after the reconnect
                        continue
                    reply = self._wait(lambda: self._answer(rid, gen), deadline, timeout_s,
                                       what)
                finally:
                    self._close(rid)
                if reply is not _RESEND:
                    return reply

    def ask_ahead(self, round_: int, msg: dict, send: Callable[[dict], None]) -> None:
        """Sends ``ready`` ``msg`` of quorum round ``round_`` now without waiting;
        ``collect_ahead(round_)`` waits for its answer later. Replaces an earlier one.
        Dropped while the connection is away (``collect_ahead`` sends it again).

        Raises:
            PcclError: the sticky failure (see ``raise_failure``).
        """
        rid, sent = self._open(msg)
        with self._cond:
            if self._ahead is not None:
                self._slots.pop(self._ahead[1]["id"], None)
            self._ahead = (round_, sent, self._generation)
        try:
            send(sent)
        except PeerLostError:
            if self._failure is not None:
                raise

    def collect_ahead(self, round_: int, send: Callable[[dict], None], timeout_s: float,
                      what: str) -> dict | None:
        """The answer to the ready ``ask_ahead`` sent for round ``round_``: the round's
        announcement or the master's non-fatal ``error``; None when the ready sent ahead
        (if any) was for another round. If the connection was replaced meanwhile the same
        ready is sent again on the new one (an answer on the old one is not waited for).

        Raises:
            PcclTimeoutError: no answer within ``timeout_s`` seconds (``what`` names it).
            PcclError: the sticky failure (see ``raise_failure``).
        """
        with self._cond:
            ahead = self._ahead
        if ahead is None or ahead[0] != round_:
            return None
        _, msg, gen = ahead
        rid = msg["id"]
        deadline = time.monotonic() + timeout_s

        def take():
            # The round's announcement answers it, whichever connection brought it.
            if round_ in self._quorums:
                return self._quorums[round_]
            if self._slots.get(rid) is not None:
                return self._slots[rid]
            if self._away or self._generation != gen:
                return _RESEND
            return None

        while True:
            got = self._wait(take, deadline, timeout_s, what)
            if got is not _RESEND:
                break
            # The master may never have seen it: again, on the new connection.
            gen = self._wait(self._connection, deadline, timeout_s, what)
            try:
                send(msg)
            except PeerLostError:
                if self._failure is not None:
                    raise
        with self._cond:
            if self._ahead is ahead:
                self._ahead = None
                self._slots.pop(rid, None)
        return got

    # -- internals ------------------------------------------------------------

    def _open(self, msg: dict) -> tuple[int, dict]:
        """A fresh id, assigned under the lock, its slot, and ``msg`` carrying it."""
        with self._cond:
            self._last_id += 1
            rid = self._last_id
            self._slots[rid] = None
        return rid, dict(msg, id=rid)

    def _close(self, rid: int) -> None:
        with self._cond:
            self._slots.pop(rid, None)

    def _connection(self, broken: int | None = None) -> int | None:
        """The current connection's generation, or None while it is away or is the
        ``broken`` one (a send failed on it; the reader has not seen it yet)."""
        return None if self._away or self._generation == broken else self._generation

    def _answer(self, rid: int, gen: int):
        """The answer to request ``rid`` sent on connection ``gen``, ``_RESEND`` when that
        connection is gone, None while neither."""
        if self._away or self._generation != gen:
            return _RESEND
        return self._slots.get(rid)

    def _wait(self, take: Callable[[], object], deadline: float, timeout_s: float,
              what: str):
        """``take()``'s first non-None value, checked under the lock at every change."""
        with self._cond:
            while True:
                got = take()
                if got is not None:
                    return got
                self.raise_failure()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PcclTimeoutError(
                        f"timed out after {timeout_s:g} s waiting for {what} "
                        f"(master {self.master_addr})")
                self._cond.wait(left)
