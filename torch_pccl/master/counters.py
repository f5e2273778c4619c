"""What the master counts for its metrics: joins, drops by cause, rounds and their
durations, sync bytes, resumes (master/status.py and master/http.py read them)."""

from __future__ import annotations

import bisect
import dataclasses

# Upper bounds (seconds) of the update-round duration histogram (``Counters``).
ROUND_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass
class Counters:
    """What the master counts for its metrics (``/metrics``, master/status.py).

    Attributes:
        joins: peers admitted into a group (bootstrap or update round).
        drops: peers gone, by cause: ``left`` (a clean leave), ``connection`` (closed or
            reset), ``heartbeat``, ``handshake`` (no hello in time), ``round_timeout``,
            ``unreachable`` (members could not connect to it), ``refused`` (a bad first
            message, an id in use, a resume that does not fit), ``replaced`` (a member
            of a group formed from joiners only, which gave way to a resumed group).
        update_rounds: update rounds completed; ``round_buckets``: how many took at most
            each of ``ROUND_BUCKETS_S`` (not cumulative; the last: longer), and
            ``round_seconds_sum`` their total duration (a Prometheus histogram).
        sync_rounds: shared-state sync rounds completed.
        sync_bytes: data-plane bytes the members' shared-state syncs moved (the growth of
            each peer's reported ``sync_bytes``, so a peer leaving takes nothing back).
        resumes: members that re-registered with this master after it (re)started.
        requests: messages members sent, by type (``pending``, ``sync``, ``update``,
            ``ready``, ``awake``...; not heartbeats, which go by the clock, not by the
            training's steps): what a quiet epoch's outer steps do not send.
    """

    joins: int = 0
    drops: dict = dataclasses.field(default_factory=dict)
    update_rounds: int = 0
    round_buckets: list = dataclasses.field(
        default_factory=lambda: [0] * (len(ROUND_BUCKETS_S) + 1))
    round_seconds_sum: float = 0.0
    sync_rounds: int = 0
    sync_bytes: int = 0
    resumes: int = 0
    requests: dict = dataclasses.field(default_factory=dict)

    def requested(self, kind: str) -> None:
        """A member sent a message of type ``kind`` (a validated type: bounded)."""
        self.requests[kind] = self.requests.get(kind, 0) + 1

    def dropped(self, cause: str) -> None:
        """A peer is gone; ``cause`` is its key in ``drops``."""
        self.drops[cause] = self.drops.get(cause, 0) + 1

    def round_done(self, seconds: float) -> None:
        """An update round completed after ``seconds``."""
        self.update_rounds += 1
        self.round_seconds_sum += seconds
        self.round_buckets[bisect.bisect_left(ROUND_BUCKETS_S, seconds)] += 1

    def joined(self, n: int) -> None:
        """``n`` peers were admitted into a group."""
        self.joins += n

    def synced(self) -> None:
        """A sync round completed (elected, or failed to)."""
        self.sync_rounds += 1

    def sync_moved(self, nbytes: int) -> None:
        """A peer's syncs moved ``nbytes`` more bytes since its last report."""
        self.sync_bytes += nbytes

    def resumed(self) -> None:
        """A member re-registered."""
        self.resumes += 1
