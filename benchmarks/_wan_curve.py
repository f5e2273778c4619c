"""The arithmetic of benchmarks/wan_training.py, apart from any process or network.

What reaching a target means (``crossing``), how compute and link utilisation are counted
(``utilisation``, ``link_utilisation``), when the churn row kills and adds a peer
(``churn_schedule``), how parity is judged from the peers' digests (``parity``) and how two
rows' times compare when one of them never reached the target (``speedup``). Pure functions
on plain numbers, so tests/benchmarks/test_wan_training.py checks them directly.

Times are seconds, rates Mbit/s (10^6 bit/s), sizes bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Point:
    """One evaluation of a row's outer parameters (DDP: the model).

    Attributes:
        step: inner steps done (per peer) when the parameters were taken.
        seconds: wall-clock since the row's first inner step, on the observing peer.
        tokens: tokens the group had trained on by then (all peers together).
        loss: eval loss of those parameters (nats per character).
    """

    step: int
    seconds: float
    tokens: int
    loss: float


def crossing(curve: Iterable[Point], target: float) -> Point | None:
    """The first point of ``curve`` (in step order) whose loss is at or below ``target``;
    None if none is. Nothing is interpolated between points, nor extrapolated past the last:
    the time to target is that of the first evaluation that showed it."""
    for point in sorted(curve, key=lambda p: p.step):
        if point.loss <= target:
            return point
    return None


def utilisation(compute_s: float, wall_s: float) -> float:
    """Compute utilisation: seconds spent in inner-step compute (forward, backward, inner
    optimizer step) over wall-clock seconds, in [0, 1]. Raises ValueError when ``wall_s`` is
    not positive or ``compute_s`` is negative or larger than ``wall_s`` by more than 1 %
    (a clock mix-up, not a measurement)."""
    if wall_s <= 0 or compute_s < 0 or compute_s > wall_s * 1.01:
        raise ValueError(f"compute {compute_s} s in a wall-clock of {wall_s} s")
    return min(1.0, compute_s / wall_s)


def link_utilisation(bytes_sent: int, blocked_s: float, rate_mbit: float) -> float | None:
    """The share of the link's rate a peer's traffic used while its exchanges were in flight:
    ``bytes_sent`` (all its traffic, as the link saw it) over ``blocked_s`` (those seconds),
    over the rate. None when there were none."""
    if blocked_s <= 0:
        return None
    return bytes_sent * 8 / blocked_s / (rate_mbit * 1e6)


def churn_schedule(steps: int) -> tuple[int, int]:
    """(kill step, join step) of a run of ``steps`` inner steps: one peer SIGKILLs itself as
    it starts step ``steps // 3`` (a third of the token budget), and a new peer is started
    once the group has passed step ``steps // 2`` (half); it is admitted at the outer step
    after that. Raises ValueError for fewer than 6 steps (the two would coincide)."""
    if steps < 6:
        raise ValueError(f"a churn run needs at least 6 steps, not {steps}")
    return steps // 3, steps // 2


def parity(digests: Mapping[str, Mapping[int, str]]) -> tuple[bool, int, int] | None:
    """Whether the peers ended with bit-identical parameters.

    ``digests``: peer -> {step: digest of its outer parameters taken after that step}. The
    peers that reached the last step any peer reached are compared at that step (a peer
    killed on the way, or one that joined, counts only if it was there at the end).

    Returns:
        (identical, that step, how many peers were compared), or None when fewer than two
        peers reached it (nothing to compare).
    """
    last = max((max(d) for d in digests.values() if d), default=None)
    if last is None:
        return None
    at_end = [d[last] for d in digests.values() if last in d]
    if len(at_end) < 2:
        return None
    return len(set(at_end)) == 1, last, len(at_end)


def equal_time_losses(fast: Sequence[Mapping], slow: Sequence[Mapping]
                      ) -> tuple[float, float, float] | None:
    """Both rows' eval losses at the same wall-clock: at the slow row's last evaluation time
    that the fast row's curve also covers, each row's latest evaluation at or before it.

    ``fast``, ``slow``: curves as results.json lists them (``seconds``, ``loss``, ...).
    Returns (seconds, fast loss, slow loss), or None when the curves share no time.
    """
    if not fast or not slow:
        return None
    horizon = min(fast[-1]["seconds"], slow[-1]["seconds"])

    def at(curve):
        seen = [p for p in curve if p["seconds"] <= horizon]
        return seen[-1]["loss"] if seen else None

    f, s = at(fast), at(slow)
    return None if f is None or s is None else (horizon, f, s)


def speedup(fast_s: float | None, slow_s: float | None, slow_cap_s: float) -> tuple[float, bool] | None:
    """How many times sooner the fast row reached the target than the slow one.

    Returns (ratio, exact): exact False when the slow row never reached the target within
    ``slow_cap_s`` seconds, in which case the ratio is a lower bound (``slow_cap_s / fast_s``:
    it would have taken longer than its cap). None when the fast row never reached it.
    """
    if fast_s is None:
        return None
    fast_s = max(fast_s, 1e-9)
    if slow_s is None:
        return slow_cap_s / fast_s, False
    return slow_s / fast_s, True
