"""The links' measurement, pure: when a pair stops exchanging probes, the rate of its link,
the matrices every rank builds from the gathered rows, and the ring chosen from them, on
probe exchanges recorded through the WAN emulator."""

import pytest

from torch_pccl.ring.measure import (
    FULL_COUNT,
    PROBE_EXCHANGES,
    link_matrices,
    pair_rate,
    probe_again,
)
from torch_pccl.ring.optimize import MIN_GAIN, choose_ring

PROBE = 4 << 20                     # bytes per exchange in the recording
RANK_ORDER = (0, 1, 2, 3)
AROUND_THE_SLOW_PAIRS = {(0, 3, 1, 2), (0, 2, 1, 3)}

# benchmarks/wan.py scenario (c): 4 peers, 50 ms RTT, pairs (0,1) and (2,3) at 100 Mbit/s,
# the others at 1 Gbit/s, after three 16 MiB all-reduces in rank order; 8 exchanges of
# 4 MiB per pair (a meeting ping-pong, then ping-pong + exchange each time), seconds as the
# lower rank of each pair timed them. Exchange 0 is what measure_links timed before (all
# 1 Gbit/s pairs 0.36-0.38 s: TCP's start-up, not the rate). The pairs (0,3) and (1,2)
# carry rank order's ring (3->0, 1->2) and remember its pace, the slow hops': (1,2) ran at
# 10 MB/s in exchange 1, (0,3) in exchange 6.
RECORDED = {
    (0, 1): [0.627, 0.368, 0.381, 0.37, 0.366, 0.398, 0.403, 0.41],
    (0, 2): [0.371, 0.091, 0.09, 0.097, 0.095, 0.096, 0.106, 0.098],
    (0, 3): [0.369, 0.218, 0.223, 0.21, 0.191, 0.174, 0.417, 0.146],
    (1, 2): [0.383, 0.407, 0.124, 0.318, 0.113, 0.105, 0.108, 0.103],
    (1, 3): [0.361, 0.078, 0.08, 0.081, 0.079, 0.083, 0.087, 0.078],
    (2, 3): [0.643, 0.417, 0.378, 0.374, 0.401, 0.41, 0.396, 0.406],
}


def _run(times):
    """The exchanges measure_links runs on a pair whose exchanges take ``times``."""
    done = []
    for t in times:
        if not probe_again(done):
            return done
        done.append(t)
    assert not probe_again(done), "the recording ends before the pair would stop"
    return done


def _bandwidth(rate_of):
    rows = [[0.0] * 8 for _ in range(4)]            # the lower rank's rows, as gathered
    for (i, j), times in RECORDED.items():
        rows[i][j] = rate_of(times)
    return link_matrices(rows)[0]


@pytest.mark.parametrize("exchange", [1, 3, 6])
def test_one_exchange_per_pair_can_keep_rank_order(exchange):
    # What measure_links did before (one exchange per pair): where a hop of the current
    # ring still ran at its old pace, the better ring's gain was below MIN_GAIN.
    order, after, before = choose_ring(_bandwidth(lambda ts: PROBE / ts[exchange]), RANK_ORDER)
    assert order == RANK_ORDER and after == before


def test_a_fixed_two_exchanges_can_keep_rank_order():
    assert choose_ring(_bandwidth(lambda ts: pair_rate(PROBE, ts[:2])), RANK_ORDER)[0] == \
        RANK_ORDER


def test_exchanging_until_the_rate_stops_growing_finds_the_ring_around_the_slow_pairs():
    order, after, before = choose_ring(
        _bandwidth(lambda ts: pair_rate(PROBE, _run(ts))), RANK_ORDER)
    assert order in AROUND_THE_SLOW_PAIRS
    assert after > 1.5 * before > 1.5 * 10e6           # measured 1.96x; the slow pairs ~11 MB/s
    assert [len(_run(ts)) for ts in RECORDED.values()] == [5, 5, 5, 6, 5, 5]


def test_a_pair_stops_after_three_exchanges_without_a_quarter_more():
    assert probe_again([])                                      # at least one exchange
    assert all(probe_again([1.0] * k) for k in range(FULL_COUNT + 1))
    assert not probe_again([1.0] * (FULL_COUNT + 1))            # the first sets the mark
    assert probe_again([1.0, 0.9, 0.9, 0.79])                   # 0.79 * 1.25 < 1: growth
    assert not probe_again([1.0, 0.81, 0.81, 0.81])             # 0.81 * 1.25 > 1: stale
    assert probe_again([1.0, 2.0, 2.0, 0.5, 0.6, 0.6])          # growth resets the count
    assert not probe_again([1.0, 0.5, 0.25, 0.125], most=4)     # the bound holds regardless
    assert not probe_again([1.0], most=1)
    assert not probe_again([2.0 ** -k for k in range(PROBE_EXCHANGES)])


def test_a_pair_s_rate_is_its_fastest_exchange():
    assert pair_rate(1000, [0.5, 0.1, 0.2]) == pytest.approx(10_000)
    assert pair_rate(1000, [0.25]) == pytest.approx(4000)
    with pytest.raises(ValueError):
        pair_rate(1000, [])


def test_the_matrices_hold_the_lower_rank_s_measurement_both_ways():
    # Row r: r's rate to each rank, then its round trip to each; the higher rank's own
    # timing (which waited for its partner) is never read.
    rows = [[0.0, 5.0, 7.0, 0.0, 0.1, 0.2],
            [99.0, 0.0, 3.0, 9.0, 0.0, 0.3],
            [99.0, 99.0, 0.0, 9.0, 9.0, 0.0]]
    bandwidth, rtt = link_matrices(rows)
    assert bandwidth == [[0.0, 5.0, 7.0], [5.0, 0.0, 3.0], [7.0, 3.0, 0.0]]
    assert rtt == [[0.0, 0.1, 0.2], [0.1, 0.0, 0.3], [0.2, 0.3, 0.0]]


def test_choose_ring_replaces_the_ring_only_beyond_min_gain():
    bw = [[10.0] * 4 for _ in range(4)]
    for a, b in ((0, 1), (2, 3)):
        bw[a][b] = bw[b][a] = 10.0 / MIN_GAIN               # exactly MIN_GAIN: kept
    assert choose_ring(bw, RANK_ORDER) == (RANK_ORDER, 10.0 / MIN_GAIN, 10.0 / MIN_GAIN)
    for a, b in ((0, 1), (2, 3)):
        bw[a][b] = bw[b][a] = 10.0 / MIN_GAIN / 1.01
    order, after, before = choose_ring(bw, RANK_ORDER)
    assert order in AROUND_THE_SLOW_PAIRS and (after, before) == (10.0, bw[0][1])
    assert choose_ring(bw, order, MIN_GAIN) == (order, 10.0, 10.0)     # already the best
