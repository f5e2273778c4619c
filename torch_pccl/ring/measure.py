"""The links between peers, timed: ``measure_links`` and the pairing of its probes.

Every pair of ranks is timed in the rounds of a round-robin tournament
(``round_robin_pairs``: the pairs of one round run at once, no rank in two),
and the rows are all-gathered so that every rank holds the same matrices
(``link_matrices``): the input of ``ring.order.best_ring``, which must give
every rank the same ring.

What a probe's time says: ``probe_bytes`` over a link of rate ``r`` takes
``probe_bytes / r`` only once the TCP streams carry the path's rate, and two
things keep them from it at a probe's start (recorded through the WAN emulator
of benchmarks/wan.py, scenario (c): 4 peers, 50 ms RTT, pairs (0,1) and (2,3)
at 100 Mbit/s, the others at 1 Gbit/s, 4 MiB probes):

* A stream that never carried data (a ring uses each pair in one direction
  only) or sat idle longer than a retransmission timeout
  (``tcp_slow_start_after_idle``) starts from its initial window, and a probe
  smaller than the bandwidth-delay product then takes the round trips of
  TCP's start-up whatever the rate: in five of six recorded runs every
  1 Gbit/s pair's first exchange took 0.35-0.45 s (9-12 MB/s), the 100 Mbit/s
  pairs' 0.60-0.76 s.
* A stream the current ring uses remembers the rate that ring drove it at
  (BBR's bandwidth filter, and the per-path pacing cap of native/src/rate.hpp
  at 1.25x its estimate): the slowest hop's. BBR raises it by 1.25x per probe
  cycle of 8 round trips, so such a hop can read as slow as the slow hops for a
  while: the 1 Gbit/s pair (0,3) moved 9.3 MB/s in its 2nd and 3rd exchanges
  and 22 MB/s in its 4th; (1,2) 10.3 MB/s in its 2nd, 34 MB/s in its 3rd. The
  better ring must use exactly those hops.

With one exchange per pair (as before) the better ring beat rank order by only
1.4-2.3x at the first exchange, and single later exchanges kept rank order
(the ``min_gain`` of 1.2) in three of six runs; so did the fastest of a
fixed two (two runs) or three (one run). So a pair exchanges its probe until
its rate stops growing (``probe_again``: BBR's own full-pipe test, three
exchanges in a row less than 25 % faster than the mark; ``PROBE_EXCHANGES``
at most) and its link's rate is that of the fastest exchange (``pair_rate``):
a start-up or a busy host only ever makes an exchange slower.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .. import config
from ..core.communicator import Communicator
from ..errors import InvalidArgumentError

# Tag of the probes' data-plane messages ("RING"), apart from the application's.
PROBE_TAG = 0x52494E47
PROBE_BYTES = config.PROBE_BYTES
PROBE_EXCHANGES = config.PROBE_EXCHANGES
# BBR's full-pipe test (Cardwell et al., ACM Queue 14(5), 2016): the rate has stopped
# growing once FULL_COUNT exchanges in a row were less than FULL_GROWTH x faster.
FULL_GROWTH = 1.25
FULL_COUNT = 3


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


def probe_again(seconds: Sequence[float], most: int = PROBE_EXCHANGES) -> bool:
    """Whether a pair exchanges its probe once more, given the times of its exchanges so far.

    Until its rate has stopped growing: BBR's full-pipe test (Cardwell et al., ACM
    Queue 14(5), 2016; ``bbr_check_full_bw_reached`` in Linux's tcp_bbr.c) on the
    exchanges. An exchange ``FULL_GROWTH`` times faster than the mark (the time of
    the last such exchange; the first sets it) grows; stop once ``FULL_COUNT`` in a
    row did not, so after at least ``FULL_COUNT + 1`` exchanges, and after ``most``
    whatever. Pure: the lower rank of a pair decides, and tells the other in the
    next ping.

    Args:
        seconds: each exchange's time so far, in order, as the lower rank timed it.
        most: the most exchanges a pair runs (>= 1).
    """
    if len(seconds) >= most:
        return False
    stale, mark = 0, None
    for t in seconds:
        if mark is None or t * FULL_GROWTH <= mark:
            mark, stale = t, 0
        else:
            stale += 1
    return stale < FULL_COUNT


def pair_rate(probe_bytes: int, seconds: Sequence[float]) -> float:
    """A link's rate, bytes/s, from the times of its probe exchanges: over the fastest one.

    The exchanges ran back to back on the same streams; an early one is slowed by
    TCP's start-up (a cold or idle stream's window opens one round trip at a time),
    any one by a busy host, and nothing makes one faster than the link: the
    fastest is the closest to the link's rate (the best-of-n rule of timing
    benchmarks).

    Args:
        probe_bytes: bytes each side sent per exchange.
        seconds: each exchange's time, as the lower rank timed it (> 0).

    Raises:
        ValueError: no exchange.
    """
    if not seconds:
        raise ValueError("no probe exchange to rate")
    return probe_bytes / max(min(seconds), 1e-9)


def link_matrices(rows: Sequence[Sequence[float]]) -> tuple[list[list[float]], list[list[float]]]:
    """(bandwidth, rtt_s) from every rank's row; the same on every rank that has the same rows.

    ``rows[r]`` is rank r's ``2 n`` values: its rate to each rank, then its round
    trip to each. Each pair's entry in both directions is the lower rank's
    measurement, so the matrices are symmetric whatever the higher rank timed; the
    diagonal is 0.0.
    """
    n = len(rows)
    bandwidth = [[float(rows[min(i, j)][max(i, j)]) if i != j else 0.0 for j in range(n)]
                 for i in range(n)]
    rtt = [[float(rows[min(i, j)][n + max(i, j)]) if i != j else 0.0 for j in range(n)]
           for i in range(n)]
    return bandwidth, rtt


def measure_links(comm: Communicator, probe_bytes: int = PROBE_BYTES,
                  timeout_s: float | None = None,
                  exchanges: int = PROBE_EXCHANGES) -> tuple[list[list[float]], list[list[float]]]:
    """Times every pair of ranks; returns (bandwidth, rtt_s), the same matrices on every rank.

    A collective of ``comm``'s ranks. Per round of ``round_robin_pairs``, each
    pair first exchanges one element (a ping-pong that waits for the partner to
    reach this round), then, while ``probe_again`` says so (at most
    ``exchanges`` times): a ping-pong whose ping tells the higher rank whether
    another exchange follows (the lower rank's timing is a round-trip time; the
    higher rank starts its probe as it answers, a one-way delay before the lower
    rank, so the lower rank's timing of the probe is its transfer alone), then
    ``probe_bytes`` each way at once, each direction loaded as a ring loads it.
    The lower rank's row holds the pair's rate (``pair_rate``: over the fastest
    exchange) and smallest round trip; the rows are all-gathered
    (``link_matrices``).

    Args:
        comm: a connected communicator (its streams are used, as collectives use them).
        probe_bytes: bytes each rank sends each peer per exchange (>= 4).
        timeout_s: deadline of each exchange (default: the communicator's).
        exchanges: the most probe exchanges per pair (>= 1).

    Raises:
        InvalidArgumentError: ``probe_bytes`` < 4 or ``exchanges`` < 1.
        PeerLostError, PcclTimeoutError, ...: a probe failed.
    """
    if not isinstance(probe_bytes, int) or probe_bytes < 4:
        raise InvalidArgumentError(f"probe_bytes must be an int >= 4, got {probe_bytes!r}")
    if not isinstance(exchanges, int) or exchanges < 1:
        raise InvalidArgumentError(f"exchanges must be an int >= 1, got {exchanges!r}")
    n, me = comm.world_size, comm.rank
    row = torch.zeros(2 * n, dtype=torch.float64)        # bandwidth row, then rtt row
    probe = torch.zeros(probe_bytes // 4, dtype=torch.float32)
    landing = torch.empty_like(probe)
    ping, pong = torch.zeros(1), torch.empty(1)

    def ping_pong(partner: int, again: bool) -> tuple[float, bool]:
        """(seconds, whether another exchange follows): the lower rank's ``again``."""
        start = time.monotonic()
        if me < partner:
            ping.fill_(1.0 if again else 0.0)
            comm.send(ping, partner, tag=PROBE_TAG, timeout_s=timeout_s)
            comm.recv(pong, partner, tag=PROBE_TAG, timeout_s=timeout_s)
            return time.monotonic() - start, again
        comm.recv(pong, partner, tag=PROBE_TAG, timeout_s=timeout_s)
        comm.send(ping, partner, tag=PROBE_TAG, timeout_s=timeout_s)
        return time.monotonic() - start, bool(pong.item())

    for partner in (rnd[me] for rnd in round_robin_pairs(n)):
        if partner is None:
            continue
        ping_pong(partner, True)             # waits for the partner to reach this round
        rtts, seconds = [], []
        while True:
            rtt, again = ping_pong(partner, probe_again(seconds, exchanges))
            rtts.append(rtt)
            if not again:
                break
            start = time.monotonic()
            comm.p2p_batch([(True, probe, partner, PROBE_TAG),
                            (False, landing, partner, PROBE_TAG)], timeout_s=timeout_s)
            seconds.append(time.monotonic() - start)
        row[partner] = pair_rate(probe.numel() * 4, seconds)
        row[n + partner] = min(rtts)
    rows = torch.empty(n * 2 * n, dtype=torch.float64)
    comm.all_gather(row, rows, tag=PROBE_TAG, timeout_s=timeout_s)
    return link_matrices(rows.view(n, 2 * n).tolist())


__all__ = ["FULL_COUNT", "FULL_GROWTH", "PROBE_BYTES", "PROBE_EXCHANGES", "PROBE_TAG",
           "link_matrices", "measure_links", "pair_rate", "probe_again", "round_robin_pairs"]
