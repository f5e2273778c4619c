"""Warming a new striped group up: its streams opened to the path's rate before the caller's
first operation, in one short pass, and the stripe sized from what the path showed.

Why: a new TCP connection starts slow (BBR's Startup doubles what it sends once per round
trip: ~10 round trips to fill a 1 Gbit/s, 100 ms path), and each lane of a group has its
own connections. Left cold, a group's first op on each lane runs at a fraction of the link.

How (``warm_up``): first every lane at once runs a few small all-reduces (``RAMP``): the
start-up of every new stream together, stopped while BBR is still in its start-up. Then each
lane alone, one after another, runs one all-reduce sized to finish its start-up: the
kernel's BBR keeps a bandwidth estimate per connection, so lanes that filled the path
together would each keep a share of it, and a lane that later runs alone would climb back
by BBR's 1.25x probes, one every eight round trips (measured: 22-28 % of an emulated
1 Gbit/s link for such a lane's first ops). Last, lane 0 runs growing all-reduces
(``SIZES``) until every rank's rate controller (native/src/rate.hpp) has found the pipe
full and the last op carried its estimate; the ranks' votes ride in those ops' last
elements, so agreeing costs no round trip of its own. All within ``BUDGET_BYTES`` sent per
rank. A first op shorter than ``SHORT_S`` is a LAN's or one host's: nothing to warm. A path
that holds little in flight (``SMALL_BDP``) stops after the ramp: its cold connections open
within their first op. What the controller learned is the path's: it is kept by peer
address across lanes, groups and epochs, so a later group to the same peers starts paced.

The stripe is not the warm-up's: the rate controller of each path picks it per op, from
the bandwidth-delay product once the pipe was full, then by what each stripe carried
(native/src/rate.hpp); the sender alone decides it, as the receiver reads every stream.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist


log = logging.getLogger("torch_pccl")

RAMP = (256 << 10, 512 << 10, 1 << 20)
"""Bytes of the all-reduces every lane runs at once, first: about four round trips of TCP's
start-up on every new stream, which leave BBR still in its start-up (lanes that filled the
path together would each keep a share of it; see the module)."""
LANE_BYTES = (1 << 20, 16 << 20)
"""The fewest and most bytes of the one all-reduce each lane then runs alone."""
LANE_RTTS = 8
"""... sized to this many round trips at the rate the ramp's last op carried: a rate still
in start-up (through the emulator at 1 Gbit/s, 100 ms it read 1/8 of the link), so this
is about the bytes a lane's start-up sends before it fills the path."""
SIZES = (8 << 20, 16 << 20, 32 << 20)
"""Bytes of the all-reduces lane 0 then runs alone until the rate controller is filled."""
SMALL_BDP = 384 << 10
"""A path that holds at most this many bytes in flight (20 Mbit/s at 100 ms: 250 KB) ends
the warm-up after the ramp: a cold connection opens to it within a few round trips of its
first op, sooner than a warm-up op per lane runs (warming every lane made each change of
membership ~12 s longer on such a link, benchmarks/wan_training.py)."""
BUDGET_BYTES = 64 << 20
"""The most a rank sends in one warm-up, all lanes together (a ring all-reduce of n bytes
sends 2 (W-1)/W n from every rank): links are billed by the byte."""
SHORT_S = 0.05
"""A first warm-up op shorter than this (seconds) ran on a LAN or one host: nothing to warm."""
WARM_SHARE = 0.8
"""A path with a pinned cap is warm once an op carried this share of it."""


def warm_up(lanes, successor: int, budget: int = BUDGET_BYTES,
            clock=time.monotonic) -> list[int]:
    """Warms every lane's streams up; a collective: every rank of the group calls it with
    its own ring successor, before any other operation on the lanes.

    1. Every lane at once runs all-reduces of ``RAMP`` bytes: the start-up of every new
       stream together, short enough to leave BBR in its start-up. A first op as short as
       a LAN's on every rank ends the warm-up after the second (the ranks' votes ride in
       it: each rank times its own op); so does a path that holds at most ``SMALL_BDP`` in flight
       at the rate the ramp's last op carried (the ranks agree by a MAX all-reduce).
    2. Each lane alone, lane 0 last, runs one all-reduce of ``LANE_RTTS`` round trips at
       the rate the ramp showed (within ``LANE_BYTES``): each lane's start-up reaches the
       path's rate by itself (BBR keeps a rate per connection).
    3. Lane 0 alone runs all-reduces of ``SIZES`` until every rank's rate controller has
       found the pipe full and its last op carried the estimate.
    All within ``budget`` bytes sent by a rank. The ranks' votes in step 3 ride in the ops'
    last elements, so agreeing costs no round trip of its own.

    Args:
        lanes: the group's ``LaneSet`` (``Communicator.lane_set``), lane 0 first.
        successor: the rank this rank sends to in the ring.
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
    buffers = [torch.zeros(max(RAMP + SIZES + LANE_BYTES) // 4)] + [
        torch.zeros(max(RAMP + LANE_BYTES) // 4) for _ in every[1:]]
    spent = 0.0
    ran = [0] * len(every)
    rate = 0.0
    go = 1.0                # this rank's vote (go on?), carried by lane 0's next ramp op
    for k, nbytes in enumerate(RAMP):
        start = clock()
        votes = _together(every, buffers, nbytes, go)
        seconds = clock() - start
        spent += nbytes * per_byte * len(every)
        ran = [n + 1 for n in ran]
        if votes == 0:      # every rank's first op was as short as a LAN's (or one host's)
            return ran
        # Each rank times its own op (one that started first waited for the others), so
        # whether this is a LAN is agreed by the next op's votes.
        go = 0.0 if k == 0 and seconds < SHORT_S else 1.0
        rate = nbytes * per_byte * len(every) / seconds   # a lower bound: still starting
    rtt = lanes.min_rtt(successor)
    # What the ramp showed, agreed (MAX over the ranks: the fastest path of the ring).
    shown = torch.tensor([rate * rtt, LANE_RTTS * rate * rtt], dtype=torch.float64)
    every[0].all_reduce(shown, op=dist.ReduceOp.MAX)
    bdp, wish = shown.tolist()
    log.debug("warm-up ramp: %d ops, %.0f B/s at the end, RTT %.3f s; agreed in flight %.0f B",
              len(RAMP), rate, rtt, bdp)
    if bdp <= SMALL_BDP:
        return ran
    lane_bytes = _whole_mib(wish, LANE_BYTES)
    for i in list(range(1, len(every))) + [0]:
        if spent + lane_bytes * per_byte > budget:
            break
        _op(every[i], buffers[i], lane_bytes)
        spent += lane_bytes * per_byte
        ran[i] += 1
    go = 0.0 if _warm(lanes, successor) else 1.0   # this rank's vote, carried by the next op
    for nbytes in SIZES:
        if spent + nbytes * per_byte > budget:
            break
        start = clock()
        votes = _op(every[0], buffers[0], nbytes, go)
        spent += nbytes * per_byte
        ran[0] += 1
        if votes == 0:
            break
        go = 0.0 if _warm(lanes, successor) else 1.0
        log.debug("warm-up lane 0: %d bytes in %.3f s; estimate %.0f B/s, last rate %.0f B/s; "
                  "votes %d, go on %s", nbytes, clock() - start, lanes.pacing(successor)[0],
                  every[0].last_rate(successor), votes, go)
    return ran


def _whole_mib(nbytes: float, bounds: tuple[int, int]) -> int:
    """``nbytes`` in whole MiB within ``bounds``."""
    mib = 1 << 20
    return int(min(max(nbytes, bounds[0]), bounds[1]) // mib * mib)


def _together(every, buffers, nbytes: int, vote: float) -> int:
    """One all-reduce of ``nbytes`` of zeros on every lane at once (a thread per lane but
    lane 0, which runs on the caller's), lane 0's last element carrying this rank's vote;
    returns the sum of the ranks' votes. Raises the first lane's error."""
    errors: list[BaseException] = []

    def run(lane, buf):
        try:
            lane.all_reduce(buf[:nbytes // 4])
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    for buf in buffers:
        buf[:nbytes // 4].zero_()
    buffers[0][nbytes // 4 - 1] = vote
    threads = [threading.Thread(target=run, args=(lane, buf), daemon=True)
               for lane, buf in zip(every[1:], buffers[1:])]
    for t in threads:
        t.start()
    run(every[0], buffers[0])
    for t in threads:
        t.join()    # each lane's op runs under the group's deadline
    if errors:
        raise errors[0]
    return int(round(float(buffers[0][nbytes // 4 - 1])))


def _op(lane, buf, nbytes: int, vote: float = 0.0) -> int:
    """One all-reduce of ``nbytes`` of zeros on ``lane``, its last element carrying this
    rank's vote; returns the sum of the ranks' votes (equal on every rank)."""
    numel = nbytes // 4
    work = buf[:numel]
    work.zero_()
    work[-1] = vote
    lane.all_reduce(work)
    return int(round(float(work[-1])))


def _warm(lanes, successor: int) -> bool:
    """Whether the path to ``successor`` is warm: its rate controller found the pipe full
    (native/src/rate.hpp); with the cap pinned, whether a lane's last op carried 80 % of it."""
    estimate, cap = lanes.pacing(successor)
    if estimate <= 0:       # pinned (the cap is the rate), or nothing measured yet
        return 0 < cap and max(lane.last_rate(successor) for lane in lanes) >= WARM_SHARE * cap
    return lanes.path_state(successor)[0]
