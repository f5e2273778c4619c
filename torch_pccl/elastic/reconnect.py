"""Outliving the master: a member's re-registration with a master that came back
(docs/membership.md, "When the master dies").

``MasterSession`` (master_session.py) calls ``reconnect`` on a thread of its own when its
connection breaks: it dials the same address with backoff until a master there welcomes
the member's ``resume`` record, the member is refused for good, or the time is up. The
session swaps in the returned link; what the member re-registers with is the session's.

This module loads neither torch nor the native extension.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NamedTuple

from .. import config
from ..errors import AuthenticationError, PcclError, PeerLostError, ProtocolError
from .master_link import MasterLink, refusal_class

log = logging.getLogger("torch_pccl")


class Refused(Exception):
    """The master answered a re-registration with a fatal error: stop reconnecting.

    Attributes:
        error: the ``PcclError`` (``refusal_class`` of the master's message) the member
            fails with.
    """

    def __init__(self, error: PcclError):
        super().__init__(str(error))
        self.error = error


class Rejoined(NamedTuple):
    """A welcomed re-registration.

    Attributes:
        link: the new connection (its welcome read).
        heartbeat_interval_s: the interval the new master asks for, seconds.
        rest: the validated messages that came after the welcome, in order.
        quiet: True when nothing about the loss was logged at WARNING (a master that said
            it was stopping came back within ``config.STOPPED_MASTER_QUIET_S``).
    """

    link: MasterLink
    heartbeat_interval_s: float
    rest: list[dict]
    quiet: bool


def rejoin(link: MasterLink, hello: bytes, master_addr: str,
           deadline: float) -> tuple[float, list[dict]]:
    """One re-registration on a dialed ``link``: sends the ``hello`` frame (with its
    ``resume`` record), reads the welcome by ``deadline`` (``time.monotonic()`` seconds).

    Returns:
        (the welcome's heartbeat interval in seconds, the messages after the welcome).

    Raises:
        Refused: the master refused the re-registration (its fatal error inside).
        ProtocolError: the master answered with something else than a welcome.
        PcclError, OSError: the link failed (the caller tries again).
    """
    link.send(hello)
    msgs = link.read_first(deadline, "the master's welcome")
    first = msgs[0]
    if first["type"] == "error":
        raise Refused(refusal_class(first)(
            f"the master at {master_addr} refused this peer's re-registration: "
            f"{first['message']}"))
    if first["type"] != "welcome":
        raise ProtocolError(f"the master at {master_addr} answered a hello with "
                            f"{first['type']}")
    return float(first["heartbeat_interval_s"]), msgs[1:]


def reconnect(attempt: Callable[[float], tuple[MasterLink, float, list[dict]]],
              stop: threading.Event, master_addr: str, reconnect_s: float, why: str,
              stopping: bool) -> Rejoined | None:
    """Re-registers with the master at ``master_addr`` for up to ``reconnect_s`` seconds.

    Args:
        attempt: one try by a deadline (``time.monotonic()`` seconds): dial and ``rejoin``;
            returns (link, heartbeat interval in seconds, messages after the welcome).
        stop: set when the client closes; the backoff waits on it.
        master_addr: the master's ``"host:port"``, for the messages.
        reconnect_s: how long to keep trying, seconds (``PCCL_MASTER_RECONNECT``).
        why: how the connection was lost, for the final error.
        stopping: the master said it was stopping: nothing is logged at WARNING unless it
            stays away ``config.STOPPED_MASTER_QUIET_S`` seconds (the end of a torchrun
            job, whose rank 0 stops its master as the others finish, is no failure).

    Returns:
        The welcomed link, or None when ``stop`` was set first.

    Raises:
        PeerLostError: no master answered within ``reconnect_s``.
        AuthenticationError, GroupReplacedError, PeerLostError: the master refused the
            member (a refusal for good is logged at ERROR).
    """
    started = time.monotonic()
    deadline = started + reconnect_s
    delay = config.RECONNECT_BACKOFF_S[0]
    quiet = stopping
    while not stop.is_set():
        if quiet and time.monotonic() - started >= config.STOPPED_MASTER_QUIET_S:
            quiet = False
            log.warning("pccl: the master at %s stopped %.0f s ago and is not back; "
                        "collectives go on, membership changes wait; reconnecting for "
                        "up to %g s", master_addr, time.monotonic() - started, reconnect_s)
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerLostError(
                f"lost the connection to the master at {master_addr}: {why}; no master "
                f"answered there within {reconnect_s:g} s (PCCL_MASTER_RECONNECT)")
        try:
            link, interval, rest = attempt(time.monotonic() + min(left, config.MASTER_ATTEMPT_S))
        except Refused as e:
            log.error("pccl: %s", e.error)
            raise e.error from None
        except AuthenticationError:
            raise
        except (PcclError, OSError) as e:
            log.debug("pccl: reconnecting to the master at %s: %s", master_addr, e)
            # Backoff between attempts at a master that is not back yet.
            stop.wait(min(delay, left))
            delay = min(2 * delay, config.RECONNECT_BACKOFF_S[1])
            continue
        return Rejoined(link, interval, rest, quiet)
    return None
