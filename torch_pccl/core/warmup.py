"""Warming a new striped group up: its streams opened to the path's rate before the caller's
first operation, in one short pass, and the stripe sized from what the path showed.

Why: a new TCP connection starts slow (BBR's Startup doubles what it sends once per round
trip: ~10 round trips to fill a 1 Gbit/s, 100 ms path), and each lane of a group has its
own connections. Left cold, a group's first op on each lane runs at a fraction of the link.

How (``warm_up``): lane 0 runs all-reduces of zeros of growing size (``SIZES``) until every
rank says the path is warm; each op carries the ranks' votes in its last element (a rank
adds 1 while it wants another op), so the agreement costs no round trip of its own. Then
every other lane runs one all-reduce of about the path's bandwidth-delay product, one
lane after another, all within ``BUDGET_BYTES`` sent per rank. Lanes are warmed one at a
time because the kernel's BBR keeps a bandwidth estimate per connection: lanes warmed at
once each learn a share of the path, and a lane that later runs alone then climbs back by
BBR's 1.25x probes, one every eight round trips (measured before: 22-28 % of an emulated
1 Gbit/s link for such a lane's first ops). A rank calls the path warm when its rate
controller has left start-up (the pipe was full, native/src/rate.hpp) or the op ran as
fast as the estimate says the path goes; a first op shorter than ``SHORT_S`` is a LAN's or
one host's, where there is nothing to warm. What the controller learned is the path's: it
is kept by peer address across lanes, groups and epochs, so a later group to the same
peers starts paced.

The stripe: one TCP stream holds at most its send buffer in flight (Linux autotunes it up
to ``tcp_wmem``'s 4 MiB by default: ~3.4 MB, ~270 Mbit/s at 100 ms), so a long fat path
needs several. After the warm-up the group takes the count the measured bandwidth-delay
product needs (``stripe_for``), the smallest any rank asks for; from then on the native
controller's hill climb proposes wider or narrower stripes from what each carried.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from .. import config

log = logging.getLogger("torch_pccl")

SIZES = (2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20)
"""Bytes of the successive warm-up all-reduces of a lane (each lane runs the same)."""
BUDGET_BYTES = 64 << 20
"""The most a rank sends in one warm-up, all lanes together (a ring all-reduce of n bytes
sends 2 (W-1)/W n from every rank): links are billed by the byte."""
SHORT_S = 0.05
"""A first warm-up op shorter than this (seconds) ran on a LAN or one host: nothing to warm."""
WARM_SHARE = 0.8
"""A path is warm once an op carried this share of the controller's estimate."""


def warm_up(lanes, successor: int, stripes: tuple[int, int] | None = None,
            budget: int = BUDGET_BYTES, clock=time.monotonic) -> list[int]:
    """Warms every lane's streams up; a collective: every rank of the group calls it with
    its own ring successor, before any other operation on the lanes.

    Lane 0 runs all-reduces of ``SIZES`` until every rank's path is warm (see the module);
    then each other lane runs one, sized to the bandwidth-delay product lane 0 measured
    (what a cold connection's start-up sends before it fills the path; an op that ends
    earlier leaves BBR in its start-up, which the lane's first real op finishes within a
    round trip or two). Within ``budget`` bytes sent by a rank in all.

    Args:
        lanes: the group's ``LaneSet`` (``Communicator.lane_set``), lane 0 first.
        successor: the rank this rank sends to in the ring.
        stripes: (fewest, most) streams per peer when the group picks its stripe
            (``Communicator.connect`` with ``streams=None``); None: the stripe stays.
        budget: bytes a rank may send in the warm-up, all lanes together.
        clock: seconds, monotonic (the tests' fake lanes advance their own).

    Returns:
        The warm-up all-reduces run on each lane, lane 0 first (equal on every rank).

    Raises:
        PcclError: as ``Communicator.all_reduce`` (a peer lost, the deadline passed): the
            group failed while warming up, and its lanes' errors are sticky.
    """
    every = list(lanes)
    world = every[0].world_size
    per_byte = 2 * (world - 1) / world      # bytes a rank sends per byte of an all-reduce
    buf = torch.zeros(max(SIZES) // 4)
    spent = 0.0
    ran = [0] * len(every)
    wants = True            # this rank's vote, carried by lane 0's next op
    lan = False
    for k, nbytes in enumerate(SIZES):
        if spent + nbytes * per_byte > budget / 2 and k > 0:
            break           # half the budget for lane 0; the rest for the others
        start = clock()
        votes = _op(every[0], buf, nbytes, 1.0 if wants else 0.0)
        seconds = clock() - start
        spent += nbytes * per_byte
        ran[0] += 1
        # Every rank's first op ran the same bytes: a LAN's (or one host's) is as short
        # on each, so none asks for more.
        lan = k == 0 and seconds < SHORT_S
        if votes == 0 or lan:
            break
        wants = not _warm(lanes, successor)
        log.debug("warm-up lane 0 op %d: %d bytes in %.3f s; estimate %.0f B/s, last rate "
                  "%.0f B/s; votes %d, wants more %s", k, nbytes, seconds,
                  lanes.pacing(successor)[0], every[0].last_rate(successor), votes, wants)
    if not lan and len(every) > 1:
        nbytes = _lane_bytes(lanes, successor, (budget - spent) / (len(every) - 1) / per_byte)
        for i, lane in enumerate(every[1:], start=1):
            _op(lane, buf, nbytes, 0.0)
            ran[i] += 1
    if stripes is not None and not lan:
        _pick_stripe(lanes, successor, stripes)
    return ran


def _op(lane, buf, nbytes: int, vote: float) -> int:
    """One all-reduce of ``nbytes`` of zeros on ``lane``, its last element carrying this
    rank's vote; returns the sum of the ranks' votes (equal on every rank)."""
    numel = nbytes // 4
    work = buf[:numel]
    work.zero_()
    work[-1] = vote
    lane.all_reduce(work)
    return int(round(float(work[-1])))


def _lane_bytes(lanes, successor: int, most: float) -> int:
    """The warm-up op of a lane after lane 0: the path's bandwidth-delay product as lane 0
    measured it (each rank's own, agreed by MAX on lane 0), whole MiB within
    ``SIZES``' bounds and ``most``."""
    bdp = lanes.pacing(successor)[0] * lanes.min_rtt(successor)
    agreed = torch.tensor([bdp], dtype=torch.float64)
    lanes[0].all_reduce(agreed, op=dist.ReduceOp.MAX)
    mib = 1 << 20
    want = min(max(float(agreed[0]), SIZES[0]), SIZES[-1], max(most, SIZES[0]))
    return int(want // mib * mib)


def _warm(lanes, successor: int) -> bool:
    """Whether the path to ``successor`` is warm (see the module)."""
    estimate, cap = lanes.pacing(successor)
    carried = max(lane.last_rate(successor) for lane in lanes)
    if estimate <= 0:       # pinned (the cap is the rate), or nothing measured yet
        return 0 < cap and carried >= WARM_SHARE * cap / 1.05
    return carried >= WARM_SHARE * estimate and lanes.path_state(successor)[0]


def _pick_stripe(lanes, successor: int, stripes: tuple[int, int]) -> None:
    """Sets the stripe the path's bandwidth-delay product asks for, the smallest of the
    ranks' (a MIN all-reduce on lane 0)."""
    stripe = lanes[0].stripe
    want = stripe_for(lanes.pacing(successor)[0], lanes.min_rtt(successor), stripe, stripes)
    agreed = torch.tensor([float(want)], dtype=torch.float64)
    lanes[0].all_reduce(agreed, op=dist.ReduceOp.MIN)
    if int(agreed[0]) != stripe:
        lanes.set_stripe(int(agreed[0]))


def stripe_for(rate: float, rtt_s: float, stripe: int, bounds: tuple[int, int],
               window: float | None = None) -> int:
    """The streams per peer that carry a path of ``rate`` bytes/s and ``rtt_s`` seconds of
    round trip, within ``bounds`` (fewest, most): the bandwidth-delay product with
    ``config.STRIPE_MARGIN``, over what one stream holds in flight (``window`` bytes;
    default ``stream_window()``). ``stripe`` when nothing is measured."""
    if rate <= 0 or rtt_s <= 0:
        return stripe
    window = stream_window() if window is None else window
    need = math.ceil(rate * rtt_s * config.STRIPE_MARGIN / window)
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
