"""Streaming DiLoCo's overlap ``tau`` sized from the measured exchange time (issue 40).

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) applies a fragment's averaged
pseudo-gradients ``tau`` inner steps after sending them. A ``tau`` shorter than the exchange
leaves the peer waiting at every apply (on the emulated 100 ms / 20 Mbit/s link a fragment's
exchange took ~0.9 s against 5 overlapped steps of 0.13 s, docs/wan-training.md); a longer
one only adds staleness. ``TauChooser`` measures how many inner steps each exchange really
took and proposes the smallest ``tau`` that would have covered the slowest one of the last
outer round. The proposal is this peer's: the wrapper agrees on one ``tau`` for the group
(the maximum of every peer's proposal, a MAX all-reduce), because every peer must wait for an
exchange at the same inner step (the collectives a wait may issue, a non-finite average's
all-gather or a redone exchange, must come in one order on every rank).

No clock is read here: the wrapper reports inner-step durations and exchange lengths, so the
rule is tested on recorded inputs (tests/algorithms/test_overlap.py).
"""

from __future__ import annotations

import math

__all__ = ["TauChooser"]


class TauChooser:
    """Proposes Streaming DiLoCo's ``tau`` from the exchange lengths it is told about.

    An exchange's *length* is counted in inner steps from the step that sent it: ``k`` when
    the wrapper first saw it complete after ``k`` inner steps (its poll at every step: an
    upper bound, at most one step long), or, when the wrapper had to wait for it at its apply
    step ``k`` steps after sending, ``k`` plus the seconds it waited over one inner step's
    duration, rounded up.

    Args:
        sync_every: H.
        initial: the ``tau`` proposed before any exchange was measured (the paper's 1).
        max_tau: the largest proposal, 1 .. H - 1 (default H - 1: a fragment's exchange
            must be applied before the same fragment sends again, H steps later;
            ``StreamingDiLoCo`` passes the spacing between two fragments' sends).

    Raises:
        ValueError: ``sync_every`` < 2, ``max_tau`` outside ``1 .. H - 1`` or
            ``initial`` outside ``1 .. max_tau``.
    """

    def __init__(self, sync_every: int, initial: int = 1, max_tau: int | None = None):
        if not isinstance(sync_every, int) or sync_every < 2:
            raise ValueError(f"an automatic tau needs sync_every >= 2, got {sync_every!r}")
        max_tau = sync_every - 1 if max_tau is None else max_tau
        if not isinstance(max_tau, int) or not 1 <= max_tau < sync_every:
            raise ValueError(f"max_tau must be an int in 1 .. {sync_every - 1}, got {max_tau!r}")
        if not isinstance(initial, int) or not 1 <= initial <= max_tau:
            raise ValueError(f"initial must be an int in 1 .. {max_tau}, got {initial!r}")
        self.sync_every = sync_every
        self.max_tau = max_tau
        self._proposal = initial
        self._lengths: list[int] = []
        self._step_s: float | None = None

    def inner_step(self, seconds: float) -> None:
        """An inner step (the user's compute between two ``step()`` calls, the wrapper's own
        work left out) took ``seconds``: the unit a wait in seconds is converted with (an
        exponential moving average, weight 1/4 on the newest)."""
        if not math.isfinite(seconds) or seconds <= 0:
            return
        self._step_s = seconds if self._step_s is None else 0.75 * self._step_s + 0.25 * seconds

    def completed(self, steps: int) -> None:
        """An exchange was first seen complete ``steps`` inner steps after it was sent."""
        self._lengths.append(max(1, int(steps)))

    def waited(self, steps: int, seconds: float) -> None:
        """An exchange not seen complete by its apply step, ``steps`` inner steps after it
        was sent, was waited for ``seconds``."""
        extra = 0
        if seconds > 0 and self._step_s:
            extra = math.ceil(seconds / self._step_s)
        self._lengths.append(max(1, int(steps) + extra))

    def propose(self) -> int:
        """This peer's ``tau`` for the next outer round: the longest exchange measured since
        the last proposal, in ``1 .. max_tau`` (the previous proposal when none was
        measured). Forgets the lengths."""
        if self._lengths:
            self._proposal = min(self.max_tau, max(1, max(self._lengths)))
            self._lengths.clear()
        return self._proposal
