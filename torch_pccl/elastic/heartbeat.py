"""Heartbeat: the thread that keeps a peer alive at its master while the caller is blocked
(in ``init_process_group``, in a collective, in ``update_topology``), and the frame it
sends, with the peer's optional status report (docs/membership.md, the heartbeat timeout).

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from ..errors import PcclError
from ..control import protocol

log = logging.getLogger("torch_pccl")


class LiveSession(Protocol):
    """What the heartbeat needs of the session it keeps alive (``MasterSession``)."""

    heartbeat_interval_s: float     # the master's, seconds; a new master may change it
    away: bool                      # the connection is being re-established
    failure: PcclError | None       # the sticky failure

    def wait_stop(self, timeout_s: float) -> bool: ...
    def send_frame(self, frame: bytes) -> None: ...


def heartbeat_frame(report_source: Callable[[], dict] | None) -> bytes:
    """An encoded ``heartbeat``, carrying ``report_source()`` (protocol ``_report``) when
    there is a source and it returns a valid report; without one otherwise."""
    if report_source is not None:
        try:
            return protocol.encode({"type": "heartbeat", "report": report_source()})
        except Exception:  # noqa: BLE001 - a report is optional; the heartbeat is not
            log.debug("status report failed; heartbeat sent without it", exc_info=True)
    return protocol.encode({"type": "heartbeat"})


class Heartbeat:
    """A daemon thread that sends a heartbeat every ``session.heartbeat_interval_s``
    seconds until the session stops or fails; nothing while the session is away (the
    re-registration counts as the next sign of life).

    Args:
        session: the session it keeps alive.
        name: the thread's name.
    """

    def __init__(self, session: LiveSession, name: str):
        self._session = session
        self._report_source: Callable[[], dict] | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)

    def set_report_source(self, source: Callable[[], dict]) -> None:
        """Makes every heartbeat carry ``source()``, called on the heartbeat thread."""
        self._report_source = source

    def start(self) -> None:
        """Starts the thread (once)."""
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` seconds for the thread to end (after the session
        stopped); returns at once if it never started or this is that thread."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        session = self._session
        while not session.wait_stop(session.heartbeat_interval_s):
            if session.away:
                continue
            try:
                session.send_frame(heartbeat_frame(self._report_source))
            except PcclError:
                if session.failure is not None:
                    return
