"""Warming a new striped group up: every lane's streams opened to the path's rate before
the caller's first operation, and the path's rate measured on the way.

Why: each lane of a group has its own TCP connections, and a new connection starts slow
(TCP's start-up doubles what it sends once per round trip). Measured on an emulated
1 Gbit/s, 100 ms link with the cap at the link's rate (2 peers, 64 MiB all-reduce): the
first op on each of a new group's lanes 1.34 s (40 % of the link), later ops 0.64 s (84 %);
after one 64 MiB all-reduce on each lane in turn, every op from the first 0.64 s.
Warming the lanes at the same time instead made it worse (22-28 %, then 70 %): BBR, the
kernel's default congestion control here, remembers the share each connection had, so
four lanes warmed together each learn a quarter of the path.

How: on each lane in turn, all-reduces of zeros, each sized to take ``config.WARMUP_OP_S``
at the fastest rate seen so far (within ``config.WARMUP_BYTES``), agreed after every op with
a one-element MAX all-reduce so that every rank runs the same ops, until the lane is warm on
every rank or ``config.WARMUP_LANE_S`` (or ``config.WARMUP_LANE_RTTS`` round trips, on a
long path) has passed. A rank calls its lane warm when an op as
long as the path asks carried ``config.WARMUP_WARM`` of the path's rate to its ring
successor (``Communicator.last_rate``; the rate: the measured estimate, or the pinned cap)
and moved the estimate by at most ``config.WARMUP_SETTLED``; with no rate known yet (the
path never filled: fast, or still starting up), when the largest op has run. A lane whose
first op took less than ``config.WARMUP_SHORT_S`` is on a LAN or one host: warm at once.
The first lane's ops are also what the native pacing measures the path from
(native/src/pacing.hpp), so that the caller's first op already runs paced. A path that
holds little in flight (``config.WARMUP_SMALL_BDP``: a slow link) warms lane 0 only: there a
cold connection opens within its first op, and warming the other lanes took seconds each
(so did every change of membership, which forms a new group).

The stripe: one TCP stream holds at most its send buffer in flight (Linux autotunes it up to
``tcp_wmem``'s 4 MiB by default: ~3.4 MB, so ~270 Mbit/s at 100 ms), so a long fat path
needs several, and more the longer it is. When the group picks its own stripe, lane 0's
warm-up ends with the count the measured bandwidth-delay product needs (``stripe_for``),
and lane 0 is warmed again on it. Measured through the emulator, 1 Gbit/s, 100 ms, 64 MiB
all-reduces, pacing on: 4 streams 73-76 % of the link, 6 streams 83-93 %; 8 streams 51-54 %
(there the emulator's forwarder runs out of CPU: each stream's GSO packets shrink with its
share of the rate; docs/performance.md).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from .. import config

log = logging.getLogger("torch_pccl")


def warm_up(lanes, successor: int, budget_s: float = config.WARMUP_LANE_S,
            sizes: tuple[int, int] = config.WARMUP_BYTES, op_s: float = config.WARMUP_OP_S,
            warm_share: float = config.WARMUP_WARM,
            settle: float = config.WARMUP_SETTLED,
            short_s: float = config.WARMUP_SHORT_S,
            stripes: tuple[int, int] | None = None) -> list[int]:
    """Warms every lane up, one after another; a collective: every rank of the group calls
    it with its own ring successor, before any other operation on the lanes.

    Args:
        lanes: the group's ``LaneSet`` (``Communicator.lane_set``), lane 0 first.
        successor: the rank this rank sends to in the ring (the next ring position's rank).
        budget_s: seconds per lane after which a rank stops asking for more.
        sizes: (smallest, largest) bytes of one warm-up all-reduce.
        op_s: seconds one op should take at the fastest rate seen (sizes its next op).
        warm_share: the share of the path's rate that makes a lane warm (0 .. 1].
        settle: the estimate has settled when an op changed it by at most this share.
        short_s: a lane whose first op took less than this (seconds) is warm at once.
        stripes: (fewest, most) streams per peer to stripe over, when the group picks its
            stripe (``Communicator.connect``): after lane 0 is warm, one all-reduce of the
            largest size measures what the stripe carries, and the count the path's
            bandwidth-delay product needs (``stripe_for``) is agreed by MAX over the ranks;
            lane 0 is warmed again after each change, at most ``config.STRIPE_ROUNDS``
            times. The stripe only grows (a wider stripe measuring less shows the CPU,
            not the path). None: the stripe stays.

    Returns:
        The number of warm-up all-reduces run on each lane (equal on every rank; 0 for the
        lanes a path with little in flight leaves cold).

    Raises:
        PcclError: as ``Communicator.all_reduce`` (a peer lost, the deadline passed): the
            group failed while warming up, and its lanes' errors are sticky.
    """
    low, high = sizes
    buf = torch.zeros(high // 4)
    size = low              # agreed by every rank: the first op, then each vote's MAX
    rounds = []
    every = list(lanes)
    for k, lane in enumerate(every):
        if k == 1 and _small_path(lanes, successor, every[0]):
            rounds += [0] * (len(every) - 1)     # cold lanes open within their first op
            break
        n, size = _warm_lane(lane, successor, buf, size, budget_s, sizes, op_s, warm_share,
                             settle, short_s)
        for _ in range(config.STRIPE_ROUNDS if k == 0 and stripes else 0):
            stripe = lane.stripe
            rtt = lanes.min_rtt(successor)
            world = lane.world_size
            rate = _rate_bound(lane, successor, rtt, stripe, 2 * (world - 1) / world * high)
            # Every rank must run the same ops: measure if any rank needs it.
            agreed = torch.tensor([float(rate == 0.0)], dtype=torch.float64)
            lane.all_reduce(agreed, op=dist.ReduceOp.MAX)
            if agreed[0]:
                # One op of the largest size shows what the stripe carries (streams held
                # by their windows leave no queue, so no estimate; the warm-up's own ops
                # are sized from a rate they may not have reached).
                start = time.monotonic()
                lane.all_reduce(buf)
                n += 1
                carried = 2 * (world - 1) / world * buf.numel() * 4 / (time.monotonic() - start)
                rate = max(_rate(lane, successor), carried)
            # The stripe only grows here. More streams that measure less than fewer did
            # show the forwarding CPU, not the path: under load a 1 Gbit/s, 100 ms path
            # read 1003 Mbit/s on 4 streams, then 539-707 Mbit/s on 6 and 9, and shrinking
            # back on that left it on 4 (tests/core/test_wan_pacing.py failed in CI).
            want = max(stripe, stripe_for(rate, rtt, stripe, stripes))
            agreed = torch.tensor([float(want)], dtype=torch.float64)
            lane.all_reduce(agreed, op=dist.ReduceOp.MAX)
            if int(agreed[0]) == stripe:
                break
            lanes.set_stripe(int(agreed[0]))     # clears the estimate: measured again
            more, size = _warm_lane(lane, successor, buf, size, budget_s, sizes, op_s,
                                    warm_share, settle, short_s)
            n += more
        rounds.append(n)
    return rounds


def stripe_for(rate: float, rtt_s: float, stripe: int, bounds: tuple[int, int],
               window: float | None = None) -> int:
    """The streams per peer that carry a path of ``rate`` bytes/s and ``rtt_s`` seconds of
    round trip, within ``bounds`` (fewest, most): the bandwidth-delay product with
    ``config.STRIPE_MARGIN``, over what one stream holds in flight (``window`` bytes;
    default ``stream_window()``). When the ``stripe`` streams that measured ``rate`` were
    themselves full (it is at least ``config.STRIPE_FULL`` of their windows), the path may
    carry more than they showed: ``config.STRIPE_GROWTH`` times as many, at least. ``stripe`` when nothing is measured.
    """
    if rate <= 0 or rtt_s <= 0:
        return stripe
    window = stream_window() if window is None else window
    in_flight = rate * rtt_s
    need = math.ceil(in_flight * config.STRIPE_MARGIN / window)
    if in_flight >= config.STRIPE_FULL * stripe * window:
        need = max(need, math.ceil(stripe * config.STRIPE_GROWTH))
    fewest, most = bounds
    return max(fewest, min(most, need))


def stream_window() -> float:
    """The bytes one TCP stream of this host holds in flight at most, from the send
    buffer's autotuning limit (``net.ipv4.tcp_wmem``'s last field; 4 MiB, Linux's default,
    when unreadable) times ``config.STRIPE_WINDOW_SHARE`` (the rest is the kernel's per-
    packet overhead: one stream through an emulated 100 ms link carried 3.4 MB per round
    trip with 4 MiB, ../shared/reference/network.md)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            limit = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        limit = 4 << 20
    return limit * config.STRIPE_WINDOW_SHARE


def _warm_lane(lane, successor: int, buf, size: int, budget_s: float,
               sizes: tuple[int, int], op_s: float, warm_share: float, settle: float,
               short_s: float) -> tuple[int, int]:
    """Warms one lane (the module's loop); returns (its ops, the agreed size of the next)."""
    low, high = sizes
    vote = torch.zeros(2, dtype=torch.float64)   # [another op?, its bytes]: MAX of ranks
    start = time.monotonic()
    n = 0
    while True:
        before = _rate(lane, successor)
        op_start = time.monotonic()
        lane.all_reduce(buf[:size // 4])
        short = time.monotonic() - op_start < short_s
        n += 1
        after = _rate(lane, successor)
        rate = max(after, lane.last_rate(successor))
        if n == 1:   # a long path's start-up takes round trips, not seconds
            budget_s = max(budget_s, config.WARMUP_LANE_RTTS * lane.lane_set.min_rtt(successor))
        # Warm, and the estimate settled (the op neither raised nor lowered it much).
        settled = before > 0 and abs(after - before) <= settle * before
        # ... by an op as long as the path asks (small ops leave windows half open).
        full = size >= _op_bytes(after, low, high, op_s)
        # A first op that short is a LAN's (or one host's): TCP's start-up there takes
        # microseconds, and there is nothing to warm.
        lan = n == 1 and short
        warm = lan or (settled and full and _warm(lane, successor, warm_share, size >= high))
        more = not warm and time.monotonic() - start < budget_s
        log.debug("warm-up op %d: %d bytes in %.3f s; estimate %.0f -> %.0f B/s, last rate "
                  "%.0f B/s; settled %s, full %s, warm %s, more %s", n, size,
                  time.monotonic() - op_start, before, after, lane.last_rate(successor),
                  settled, full, warm, more)
        vote[0], vote[1] = float(more), float(low if lan else _op_bytes(rate, low, high, op_s))
        lane.all_reduce(vote, op=dist.ReduceOp.MAX)
        size = int(vote[1])
        if not vote[0]:
            return n, size


def _rate(lane, successor: int) -> float:
    """The path's rate to ``successor`` as the lanes know it, bytes/s: the measured
    estimate, else the pinned cap, else 0."""
    estimate, cap = lane.pacing(successor)
    return estimate if estimate > 0 else cap


def _small_path(lanes, successor: int, lane_zero) -> bool:
    """Whether every rank's path to its successor holds at most ``config.WARMUP_SMALL_BDP``
    bytes in flight, as lane 0's warm-up measured it (a collective on lane 0: a MAX vote).

    There a cold TCP connection opens to the path in a few round trips of its first op,
    while warming it takes at least one ``WARMUP_BYTES[0]`` op: 2.4 s per lane on a
    20 Mbit/s link across 4 peers, where warming the other three lanes made every change of
    membership cost ~12 s more (benchmarks/wan_training.py). An unknown rate is not small.
    """
    rate = lane_zero.pacing(successor)[0]
    in_flight = rate * lanes.min_rtt(successor)
    vote = torch.tensor([0.0 if 0 < in_flight <= config.WARMUP_SMALL_BDP else 1.0],
                        dtype=torch.float64)
    lane_zero.all_reduce(vote, op=dist.ReduceOp.MAX)
    return not vote[0]


def _rate_bound(lane, successor: int, rtt_s: float, stripe: int, op_bytes: float) -> float:
    """The path's rate (bytes/s) when the warm-up showed it is bound by the path's rate and
    not by the streams' windows, and the measuring op (``op_bytes`` sent per rank) would
    take longer than a lane's warm-up budget (``config.WARMUP_LANE_S``); else 0: it is
    measured (on a fast path it costs under a second, and its op is one the estimate
    has always been taken over).

    The native estimate exists only after an op filled the path (a queue at its bottleneck,
    a rate that stopped growing: native/src/pacing.hpp); if that rate x the round trip is
    well inside what the ``stripe`` streams' windows hold (``config.STRIPE_FULL``), the
    windows did not hold it back. Then the largest measuring op would only repeat the
    estimate, at a cost that grows as the path slows: 64 MiB across 4 peers on a
    20 Mbit/s link is 40 s (benchmarks/wan_training.py's link), where it made a group
    take 65 s to form.
    """
    estimate = lane.pacing(successor)[0]
    if estimate > 0 and rtt_s > 0 and op_bytes / estimate > config.WARMUP_LANE_S and \
            estimate * rtt_s < config.STRIPE_FULL * stripe * stream_window():
        return estimate
    return 0.0


def _op_bytes(rate: float, low: int, high: int, op_s: float) -> int:
    """The next warm-up op's bytes: ``op_s`` at ``rate``, whole MiB within [low, high]."""
    mib = 1 << 20
    return int(min(high, max(low, rate * op_s)) // mib * mib)


def _warm(lane, successor: int, warm_share: float, largest_ran: bool) -> bool:
    """Whether ``lane``'s last op carried the path's rate to ``successor`` (see the module);
    with no rate known, whether the largest op has run."""
    rate = _rate(lane, successor)
    if rate <= 0:
        return largest_ran
    return lane.last_rate(successor) >= warm_share * rate
