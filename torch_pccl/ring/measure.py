"""The links between peers, timed: ``measure_links`` and the pairing of its probes.

Every pair of ranks is timed once, in the rounds of a round-robin tournament
(``round_robin_pairs``: the pairs of one round run at once, no rank in two),
and the rows are all-gathered so that every rank holds the same matrices:
the input of ``ring.order.best_ring``, which must give every rank the same ring.
"""

from __future__ import annotations

import time

import torch

from .. import config
from ..core.communicator import Communicator
from ..errors import InvalidArgumentError

# Tag of the probes' data-plane messages ("RING"), apart from the application's.
PROBE_TAG = 0x52494E47
PROBE_BYTES = config.PROBE_BYTES


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


__all__ = ["PROBE_BYTES", "PROBE_TAG", "measure_links", "round_robin_pairs"]
