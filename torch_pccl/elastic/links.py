"""The links between peers, measured, and the ring that avoids the slow ones: ``optimize_topology``.

A pipelined ring all-reduce moves every byte over every hop of its ring, so it
runs at the speed of its slowest hop. Where peers sit on links of different
speeds (datacentres joined by the internet, one peer behind a thin uplink), the
order of the ring decides the speed of every collective. ``optimize_topology``
measures every pair (throughput and round-trip time, bounded in bytes and so in
time), gives every rank the same matrix (an all-gather), picks the ring with the
largest bottleneck (``ring_order.best_ring``) and applies it
(``ProcessGroupPCCL.set_ring_order``): c10d's ranks stay as they are, only the
internal ring position changes. PCCL (arXiv 2505.14065) measured its links too,
but minimised the sum of 1/bandwidth and never applied the order it found.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import config
from ..c10d.process_group import pccl_group
from ..core.communicator import Communicator
from ..errors import InvalidArgumentError
from .groups import membership_of
from .ring_order import best_ring, ring_bottleneck

# Tag of the probes' data-plane messages ("RING"), apart from the application's.
PROBE_TAG = 0x52494E47
PROBE_BYTES = config.PROBE_BYTES
MIN_GAIN = config.MIN_GAIN


@dataclass(frozen=True)
class RingChoice:
    """What ``optimize_topology`` measured and chose (the same on every rank).

    Attributes:
        order: the rank at each ring position, now applied (position 0 holds rank 0).
        previous: the order the group ran before.
        bandwidth: bandwidth[i][j], bytes/s that ranks i and j moved each way while
            exchanging the probe at once (0.0 on the diagonal); given, or measured.
        rtt_s: rtt_s[i][j], the round-trip time of a one-element exchange, seconds
            (0.0 on the diagonal; all 0.0 when ``bandwidth`` was given).
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


def round_robin_pairs(world_size: int) -> list[list[int | None]]:
    """Rounds in which every pair of ranks meets once: ``rounds[k][r]`` is r's partner or None.

    The circle method (Kirkman's schedule): W - 1 rounds for an even W, W for an
    odd one (each rank sits out once), every rank in at most one pair per round,
    so the probes of one round run at once without sharing a link.
    """
    n = world_size + (world_size % 2)
    ranks = list(range(n))
    rounds = []
    for _ in range(n - 1):
        partner: list[int | None] = [None] * world_size
        for i in range(n // 2):
            a, b = ranks[i], ranks[n - 1 - i]
            if a < world_size and b < world_size:
                partner[a], partner[b] = b, a
        rounds.append(partner)
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


def measure_links(comm: Communicator, probe_bytes: int = PROBE_BYTES,
                  timeout_s: float | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """Times every pair of ranks; returns (bandwidth, rtt_s), the same matrices on every rank.

    A collective of ``comm``'s ranks. Per round of ``round_robin_pairs``, each pair
    first exchanges one element in two ping-pongs (the first waits for the
    partner, the lower rank's timing of the second is the round-trip time), then
    ``probe_bytes`` each way at once (both time it:
    bandwidth = probe_bytes / seconds, each direction loaded as a ring loads it).
    The rows are then all-gathered, each pair's entry being the lower rank's
    measurement (bandwidth) so both directions read alike.

    Args:
        comm: a connected communicator (its streams are used, as collectives use them).
        probe_bytes: bytes each rank sends each peer (>= 4).
        timeout_s: deadline of each exchange (default: the communicator's).

    Raises:
        InvalidArgumentError: ``probe_bytes`` < 4.
        PeerLostError, PcclTimeoutError, ...: a probe failed.
    """
    if not isinstance(probe_bytes, int) or probe_bytes < 4:
        raise InvalidArgumentError(f"probe_bytes must be an int >= 4, got {probe_bytes!r}")
    n, me = comm.world_size, comm.rank
    row = torch.zeros(2 * n, dtype=torch.float64)        # bandwidth row, then rtt row
    probe = torch.zeros(probe_bytes // 4, dtype=torch.float32)
    landing = torch.empty_like(probe)
    ping, pong = torch.zeros(1), torch.empty(1)
    for partner in (rnd[me] for rnd in round_robin_pairs(n)):
        if partner is None:
            continue
        # Two ping-pongs: the first waits for the partner to reach this round, the
        # second is the round trip alone.
        for _ in range(2):
            start = time.monotonic()
            if me < partner:
                comm.send(ping, partner, tag=PROBE_TAG, timeout_s=timeout_s)
                comm.recv(pong, partner, tag=PROBE_TAG, timeout_s=timeout_s)
            else:
                comm.recv(pong, partner, tag=PROBE_TAG, timeout_s=timeout_s)
                comm.send(ping, partner, tag=PROBE_TAG, timeout_s=timeout_s)
            row[n + partner] = time.monotonic() - start
        start = time.monotonic()
        comm.p2p_batch([(True, probe, partner, PROBE_TAG), (False, landing, partner, PROBE_TAG)],
                       timeout_s=timeout_s)
        row[partner] = probe.numel() * 4 / max(time.monotonic() - start, 1e-9)
    rows = torch.empty(n * 2 * n, dtype=torch.float64)
    comm.all_gather(row, rows, tag=PROBE_TAG, timeout_s=timeout_s)
    got = rows.view(n, 2 * n).tolist()
    bandwidth = [[got[min(i, j)][max(i, j)] if i != j else 0.0 for j in range(n)]
                 for i in range(n)]
    rtt = [[got[min(i, j)][n + max(i, j)] if i != j else 0.0 for j in range(n)]
           for i in range(n)]
    return bandwidth, rtt


def optimize_topology(group=None, probe_bytes: int = PROBE_BYTES,
                      bandwidth: Sequence[Sequence[float]] | None = None,
                      min_gain: float = MIN_GAIN) -> RingChoice:
    """Measures the links, picks the ring with the largest bottleneck and applies it; a collective.

    Every rank of the group calls it at the same point of its op sequence (like
    any collective). It waits for the group's queued ops, measures every pair
    (``measure_links``: about ``W - 1`` rounds of a ping-pong and a
    ``probe_bytes`` exchange), computes ``ring_order.best_ring`` of the measured
    matrix (identical on every rank) and, when that ring's slowest hop is at
    least ``min_gain`` times the current ring's, makes it the group's ring order
    (``ProcessGroupPCCL.set_ring_order``) and warms the lanes up on it
    (``Communicator.warm_up``: the new neighbours' connections are cold). c10d ranks, ``dist.get_rank()`` and
    result layouts do not change. A membership change (``update_topology``)
    starts the new epoch in rank order: call this again after it.

    Args:
        group: a pccl process group (default: the default group).
        probe_bytes: bytes each rank sends each peer to time the link.
        bandwidth: a known matrix (bytes/s, ``bandwidth[i][j]`` from rank i to
            rank j, the same on every rank) instead of measuring, e.g. from an
            operator who knows the links.
        min_gain: the factor by which the new ring's bottleneck must beat the
            current one's (default 1.2: measurement noise never reorders a ring).

    Returns:
        RingChoice(order, previous, bandwidth, rtt_s, bottleneck, previous_bottleneck, seconds).

    Raises:
        InvalidUsageError: ``group`` is not a pccl group.
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
    comm = pg.communicator
    if bandwidth is None:
        matrix, rtt = measure_links(comm, probe_bytes)
    else:
        matrix = [[float(v) for v in row] for row in bandwidth]
        if len(matrix) != n or any(len(row) != n for row in matrix):
            raise InvalidArgumentError(f"bandwidth must be {n} x {n}, got {len(matrix)} rows")
        rtt = [[0.0] * n for _ in range(n)]
    previous = comm.ring_order
    try:
        order = tuple(best_ring(matrix))
    except ValueError as e:     # a given matrix with NaN, negative or non-numbers
        raise InvalidArgumentError(f"bandwidth: {e}") from None
    before, after = ring_bottleneck(previous, matrix), ring_bottleneck(order, matrix)
    if after > before * min_gain:
        pg.set_ring_order(order)
        comm.warm_up()      # the new neighbours' connections are cold (and unmeasured)
    else:
        order, after = previous, before
    membership = membership_of(pg)
    if membership is not None:        # this rank's row, shown on the master's status page
        membership.report_links(matrix[pg.getRank()])
    return RingChoice(order=order, previous=previous,
                      bandwidth=tuple(tuple(row) for row in matrix),
                      rtt_s=tuple(tuple(row) for row in rtt), bottleneck=after,
                      previous_bottleneck=before, seconds=time.monotonic() - started)


__all__ = ["MIN_GAIN", "PROBE_BYTES", "RingChoice", "measure_links", "optimize_topology",
           "round_robin_pairs"]
