"""The ring that avoids the slow links, chosen and applied: ``optimize_ring_order``.

A pipelined ring all-reduce moves every byte over every hop of its ring, so it
runs at the speed of its slowest hop. Where peers sit on links of different
speeds (datacentres joined by the internet, one peer behind a thin uplink), the
order of the ring decides the speed of every collective. ``optimize_ring_order``
measures every pair (``ring.measure.measure_links``: throughput and round-trip
time, bounded in bytes and so in time; every rank gets the same matrix), picks
the ring with the largest bottleneck (``ring.order.best_ring``) and applies it
(``ProcessGroupPCCL.set_ring_order``): c10d's ranks stay as they are, only the
internal ring position changes. PCCL (arXiv 2505.14065) measured its links too,
but minimised the sum of 1/bandwidth and never applied the order it found.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .. import config
from ..c10d.process_group import ProcessGroupPCCL, pccl_group
from ..c10d.work import PcclWork
from ..core.communicator import Communicator
from ..errors import InvalidArgumentError
from .measure import PROBE_BYTES, measure_links
from .order import best_ring, ring_bottleneck

MIN_GAIN = config.MIN_GAIN

T = TypeVar("T")


@dataclass(frozen=True)
class RingChoice:
    """What ``optimize_topology`` measured and chose (the same on every rank).

    Attributes:
        order: the rank at each ring position, now applied (position 0 holds rank 0).
        previous: the order the group ran before.
        bandwidth: bandwidth[i][j], bytes/s that ranks i and j moved each way in
            their fastest exchange of the probe (0.0 on the diagonal); given, or
            measured (``ring.measure.measure_links``).
        rtt_s: rtt_s[i][j], the smallest round-trip time of a one-element exchange,
            seconds (0.0 on the diagonal; all 0.0 when ``bandwidth`` was given).
        bottleneck: the slowest hop of ``order``, bytes/s.
        previous_bottleneck: the slowest hop of ``previous``, bytes/s.
        seconds: wall time of the call on this rank.
    """

    order: tuple[int, ...]
    previous: tuple[int, ...]
    bandwidth: tuple[tuple[float, ...], ...]
    rtt_s: tuple[tuple[float, ...], ...]
    bottleneck: float
    previous_bottleneck: float
    seconds: float


def on_lane0(pg: ProcessGroupPCCL, fn: Callable[[Communicator], T]) -> T:
    """``fn(lane 0's Communicator)`` run as an op of ``pg``'s lane 0; returns what it returns.

    The probes are point-to-point messages and an all-gather outside the group's
    collective sequence, as the p2p batches are (``LaneScheduler.on_lane0``): queued
    behind lane 0's earlier ops and ahead of any submitted meanwhile (from another
    thread), so nothing else runs on lane 0 in between, and the collective count that
    picks later ops' lanes is unchanged. Inline on the caller's thread when lane 0 is
    idle (it is, after ``drain``), as a synchronous op runs.

    Raises:
        What ``fn`` raises (through the Work, with its class).
    """
    out: list[T] = []
    pg.scheduler.on_lane0(lambda comm: out.append(fn(comm)), PcclWork([]), inline=True).wait()
    return out[0]


def choose_ring(bandwidth: Sequence[Sequence[float]], previous: Sequence[int],
                min_gain: float = MIN_GAIN) -> tuple[tuple[int, ...], float, float]:
    """The ring to run on: ``best_ring`` of ``bandwidth`` if it beats ``previous`` enough.

    Pure (every rank decides alike from the same matrix). The best ring replaces
    ``previous`` only when its slowest hop is more than ``min_gain`` times
    ``previous``'s: on links of one speed the measurements differ by noise alone.

    Returns:
        (order, bottleneck, previous_bottleneck): ``order`` is ``previous`` (as a
        tuple) when it stays; bytes/s.

    Raises:
        ValueError: a bad matrix or order (``ring.order.best_ring``).
    """
    previous = tuple(previous)
    order = tuple(best_ring(bandwidth))
    before, after = ring_bottleneck(previous, bandwidth), ring_bottleneck(order, bandwidth)
    if after > before * min_gain:
        return order, after, before
    return previous, before, before


def optimize_ring_order(group=None, probe_bytes: int = PROBE_BYTES,
                        bandwidth: Sequence[Sequence[float]] | None = None,
                        min_gain: float = MIN_GAIN) -> RingChoice:
    """Measures the links, picks the ring with the largest bottleneck and applies it; a collective.

    ``torch_pccl.optimize_topology`` is this plus the report of the measured row
    to a group's membership (the master's status page); its docstring is the
    reference. Every rank calls it at the same point of its op sequence. The
    group's queued ops finish first (``drain``), the probes then run as one op of
    lane 0 (``on_lane0``); when ``best_ring`` of the matrix (identical on every
    rank) beats the current ring's slowest hop ``min_gain`` times, it becomes the
    group's ring order (``ProcessGroupPCCL.set_ring_order``) and the lanes are
    warmed up on it (``Communicator.warm_up``, also an op of lane 0).

    Args:
        group: a pccl process group (default: the default group).
        probe_bytes: bytes each rank sends each peer to time the link.
        bandwidth: a known matrix (bytes/s, ``bandwidth[i][j]`` from rank i to
            rank j, the same on every rank) instead of measuring.
        min_gain: the factor by which the new ring's bottleneck must beat the
            current one's (>= 1).

    Returns:
        RingChoice(order, previous, bandwidth, rtt_s, bottleneck, previous_bottleneck, seconds).

    Raises:
        InvalidUsageError: ``group`` is not a pccl group, or it was shut down.
        InvalidArgumentError: a bad ``probe_bytes``, ``bandwidth`` (not W x W) or
            ``min_gain`` (< 1).
        PeerLostError, PcclTimeoutError, ...: a probe failed (the order is unchanged).
    """
    started = time.monotonic()
    if not min_gain >= 1.0:
        raise InvalidArgumentError(f"min_gain must be >= 1, got {min_gain!r}")
    pg = pccl_group(group)
    n = pg.getSize()
    pg.drain()
    if bandwidth is None:
        matrix, rtt = on_lane0(pg, lambda comm: measure_links(comm, probe_bytes))
    else:
        matrix = [[float(v) for v in row] for row in bandwidth]
        if len(matrix) != n or any(len(row) != n for row in matrix):
            raise InvalidArgumentError(f"bandwidth must be {n} x {n}, got {len(matrix)} rows")
        rtt = [[0.0] * n for _ in range(n)]
    previous = pg.ring_order
    try:
        order, after, before = choose_ring(matrix, previous, min_gain)
    except ValueError as e:     # a given matrix with NaN, negative or non-numbers
        raise InvalidArgumentError(f"bandwidth: {e}") from None
    if order != previous:
        pg.set_ring_order(order)
        # The new neighbours' connections are cold (and unmeasured).
        on_lane0(pg, lambda comm: comm.warm_up())
    return RingChoice(order=order, previous=previous,
                      bandwidth=tuple(tuple(row) for row in matrix),
                      rtt_s=tuple(tuple(row) for row in rtt), bottleneck=after,
                      previous_bottleneck=before, seconds=time.monotonic() - started)


__all__ = ["MIN_GAIN", "RingChoice", "choose_ring", "on_lane0", "optimize_ring_order"]
