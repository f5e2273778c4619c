"""What a wrapper reports: ``OuterStep``, and the ``Tally`` that counts it between two
reports (retries, peers joined and left, contributions rejected, seconds blocked, bytes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...elastic.topology import TopologyChange

__all__ = ["OuterStep", "Tally"]


@dataclass(frozen=True)
class OuterStep:
    """What one ``step()`` (or the exchange it completed) did on this peer.

    Attributes:
        step: the shared outer-step counter after the call (outer rounds of H
            inner steps completed by the group).
        world_size: the group's size after the call.
        bytes_sent, bytes_received: data-plane bytes of this peer since the
            previous ``OuterStep`` (exchanges, membership queries, the
            shared-state sync; headers included).
        seconds: wall time this peer spent blocked in the outer machinery since
            the previous ``OuterStep`` (waiting for exchanges, outer steps,
            membership, the sync), seconds.
        retries: topology updates made after network failures (a lost peer).
        joined, left: master peer ids admitted / gone in those updates and in
            the admission of pending peers.
        fragments: the fragments whose outer update was applied in this call
            (``DiLoCo``: ``(0,)``; ``AsyncDiLoCo``: ``(0,)`` from its second
            boundary on; empty when the call only ran the membership boundary).
        rejected: master peer ids whose pseudo-gradients held an inf or NaN and were
            left out of the exchanges completed since the previous ``OuterStep``
            (``reject_nonfinite``), once per exchange; () when none was (also on a
            peer that got an average from the recovery round instead of computing it).
        participants: with a quorum (``DiLoCo(quorum=...)``): master peer ids whose
            pseudo-gradients the outer update merged (the round's announcement, the
            same on every peer); () without a quorum.
        late: with a quorum: the members of the round that were not ready when it
            closed (their work is merged in a later round); ().
        rounds: with a quorum: every round this peer saw decided since the previous
            ``OuterStep``, oldest first, as ``(participants, late)`` (``StreamingDiLoCo``
            holds one per fragment send; ``participants`` and ``late`` are the last
            one's); () without a quorum.
    """

    step: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    retries: int
    joined: tuple[str, ...]
    left: tuple[str, ...]
    fragments: tuple[int, ...] = ()
    rejected: tuple[str, ...] = ()
    participants: tuple[str, ...] = ()
    late: tuple[str, ...] = ()
    rounds: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()


class Tally:
    """What the outer machinery did on this peer since the previous ``OuterStep``.

    Attributes:
        retries: topology updates after network failures, and the sync's own.
        joined, left: master peer ids admitted / gone in the topology updates.
        rejected: master peer ids whose contributions were left out of an exchange.
        seconds: wall time blocked in the outer machinery (the wrappers add it).
        traffic: the transport's (sent, received) byte totals at the previous report.
    """

    def __init__(self) -> None:
        self.traffic = (0, 0)
        self.reset()

    def reset(self) -> None:
        self.retries = 0
        self.joined: list[str] = []
        self.left: list[str] = []
        self.rejected: list[str] = []
        self.participants: tuple[str, ...] = ()
        self.late: tuple[str, ...] = ()
        self.rounds: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        self.seconds = 0.0

    def topology_changed(self, change: TopologyChange, retry: bool) -> None:
        """Counts an ``update_topology`` (``retry``: made after a network failure)."""
        self.retries += int(retry)
        self.joined.extend(change.joined)
        self.left.extend(change.left)

    def quorum_round(self, participants: tuple[str, ...], late: tuple[str, ...]) -> None:
        """A quorum round decided: who took part and who was late."""
        self.participants, self.late = participants, late
        self.rounds.append((participants, late))

    def report(self, step: int, world_size: int, traffic: tuple[int, int],
               applied: Sequence[int]) -> OuterStep:
        """The ``OuterStep`` of what was counted (bytes: ``traffic`` minus the previous
        report's); the count starts again."""
        result = OuterStep(step=step, world_size=world_size,
                           bytes_sent=traffic[0] - self.traffic[0],
                           bytes_received=traffic[1] - self.traffic[1],
                           seconds=self.seconds, retries=self.retries,
                           joined=tuple(self.joined), left=tuple(self.left),
                           fragments=tuple(applied), rejected=tuple(self.rejected),
                           participants=self.participants, late=self.late,
                           rounds=tuple(self.rounds))
        self.traffic = traffic
        self.reset()
        return result
