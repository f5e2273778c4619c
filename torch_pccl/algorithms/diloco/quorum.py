"""``Quorum``: outer steps that wait for a quorum of peers, not for the slowest one
(docs/diloco.md, "Stragglers: quorum rounds").

The rule and its sources:

- **Who takes part.** A peer that has done its H inner steps is *ready* and tells the
  master; the master closes the outer step's round when every member is ready, or when
  ``min_peers`` are and ``grace`` seconds have passed since the ``min_peers``-th came
  (Decoupled DiLoCo's minimum quorum and grace window, arXiv 2604.21428, with a fixed
  window: master/quorum.py says why). It announces the participants and their tokens
  to every member; only peer ids and counts go through the master.
- **Token-weighted merging.** The outer pseudo-gradient is the weighted mean
  ``sum_i w_i delta_i / sum_i w_i`` over the participants, ``w_i`` the tokens peer i
  trained on since it last took part (Decoupled DiLoCo), divided by ``1 + s_i`` where
  ``s_i`` is the number of rounds that closed without it meanwhile (staleness-aware
  SGD, Zhang et al., arXiv 1511.05950: a gradient s steps stale gets 1/s of the
  rate). Every member runs the exchange (a peer that is not a participant sends zeros,
  as torchft's healing replicas do), so the mean and the outer update are the same
  bytes on every peer.
- **Late peers lose nothing.** A peer that was not ready keeps training; at its next
  inner step it joins the round's exchange with zeros, steps the outer parameters like
  everyone, and moves its local parameters by what the outer ones moved
  (``local += outer_new - outer_old``), so what it trained since it last took part stays
  in ``outer - local``; its next contribution merges it, weighted as above.
- **One round per exchange.** ``DiLoCo`` and ``AsyncDiLoCo`` hold one round per outer
  step; ``StreamingDiLoCo`` one per fragment send, P per outer step, each fragment with
  its own ``Credit`` (a peer late for one fragment's round keeps that fragment's work for
  its next round, and takes part in the others' on time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Credit", "Quorum", "round_weights"]


@dataclass(frozen=True)
class Quorum:
    """The quorum option of ``DiLoCo`` (``quorum=Quorum(...)``).

    Args:
        min_peers: ready peers that make a quorum (>= 1). A group smaller than this
            waits for all its members.
        grace: seconds the round stays open after the quorum was reached, for the
            stragglers that are about to finish (>= 0; 0: close at the quorum). The
            master checks its deadlines every 0.5 s (half the heartbeat interval), so
            a window closes up to that much late.

    Raises:
        ValueError: ``min_peers`` < 1 or ``grace`` negative or not finite.
    """

    min_peers: int
    grace: float = 1.0

    def __post_init__(self):
        if type(self.min_peers) is not int or self.min_peers < 1:
            raise ValueError(f"min_peers must be an int >= 1, got {self.min_peers!r}")
        if not isinstance(self.grace, (int, float)) or not math.isfinite(self.grace) \
                or self.grace < 0:
            raise ValueError(f"grace must be a number of seconds >= 0, got {self.grace!r}")


@dataclass
class Credit:
    """What this peer trained for one quorum stream (``DiLoCo``'s outer steps, or one
    fragment's sends in ``StreamingDiLoCo``) since it last took part in one of its rounds.

    Attributes:
        since: inner steps (a peer is ready once it has done H of them).
        tokens: the tokens of those steps (its merging weight's numerator).
        missed: the rounds of the stream that closed without it meanwhile.
    """

    since: int = 0
    tokens: int = 0
    missed: int = 0

    def train(self, tokens: int) -> None:
        """One inner step on ``tokens`` tokens."""
        self.since += 1
        self.tokens += tokens

    def took_part(self) -> None:
        """This peer's work went into a round: nothing is owed any more."""
        self.since = self.tokens = self.missed = 0


def round_weights(peer_ids: Sequence[str], tokens: Sequence[int],
                  stale: Sequence[int]) -> dict[str, float]:
    """Participant peer id -> its merging weight ``tokens / (1 + stale)`` (float).

    Args:
        peer_ids, tokens, stale: the round's announcement, aligned: each participant's
            tokens since it last took part and the rounds it missed meanwhile.
    """
    return {p: float(t) / (1.0 + s) for p, t, s in zip(peer_ids, tokens, stale)}
