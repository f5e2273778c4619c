"""The warm-up of a new striped group (torch_pccl/core/warmup.py), on fake lanes: no
network, no clock but the one the fakes advance. What it asks of the lanes, not how fast
a real path runs (benchmarks/wan.py):

- every lane runs the ramp at once, then each lane one op alone (lane 0 last), then lane 0
  grows until every rank says its path is warm, the ranks' votes riding in those ops;
- a rank that is not warm yet keeps lane 0 going; one that is warm stops voting for more;
- a rank sends at most the budget (64 MiB by default) in all, whatever the path and world;
- a first op as short as a LAN's on every rank (they vote) ends the warm-up after its second
  op; a path that holds little in
  flight ends it after the ramp.
"""

import torch
import torch.distributed as dist

from torch_pccl.core import warmup

MIB = 1 << 20
GBIT = 1e9 / 8


class _Group:
    """What this rank's fake lanes see of the others: their votes in lane 0's growing ops,
    their stripe wish, and a clock advanced by each op at the path's rate."""

    def __init__(self, rate, rtt_s, other_votes=(), other_stripe=None, other_ramp=(1, 1, 1)):
        self.rate, self.rtt_s = rate, rtt_s
        self.other_votes = list(other_votes)
        self.other_ramp = list(other_ramp)      # the other rank's votes in the ramp's ops
        self.other_stripe = other_stripe
        self.clock = 0.0


class _Lane:
    def __init__(self, lanes, index, world):
        self.lanes, self.index, self.world_size = lanes, index, world
        self.stripe = 4
        self.sizes = []

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        g = self.lanes.group
        if tensor.dtype == torch.float64:          # an agreement of its own (MAX or MIN)
            if op == dist.ReduceOp.MIN and g.other_stripe is not None:
                tensor[0] = min(float(tensor[0]), g.other_stripe)
            return
        nbytes = tensor.numel() * 4
        self.sizes.append(nbytes)
        if len(self.sizes) > len(warmup.RAMP):
            g.clock += self.lanes.op_seconds(nbytes)
        elif self.index == 0:       # the ramp: every lane at once, sharing the path
            g.clock += self.lanes.op_seconds(nbytes * len(self.lanes.lanes))
        if self.index == 0 and len(self.sizes) <= len(warmup.RAMP):
            tensor[-1] += g.other_ramp[len(self.sizes) - 1]
        elif self.index == 0 and nbytes in warmup.SIZES and len(self.sizes) > len(warmup.RAMP) + 1:
            tensor[-1] += g.other_votes.pop(0) if g.other_votes else 0.0
        self.lanes.ops += 1

    def last_rate(self, successor):
        return self.lanes.estimate if self.lanes.warm else 0.0


class _Lanes:
    """A LaneSet of one rank: an estimate from the first op on; the pipe full after
    ``warm_after`` ops."""

    def __init__(self, group, count=4, world=2, warm_after=3, short=False):
        self.group, self.short, self.warm_after = group, short, warm_after
        self.lanes = [_Lane(self, k, world) for k in range(count)]
        self.ops = 0
        self.stripes = []

    @property
    def warm(self):
        return self.ops >= self.warm_after

    @property
    def estimate(self):
        return self.group.rate if self.ops >= 1 else 0.0

    def op_seconds(self, nbytes):
        return 0.001 if self.short else 3 * self.group.rtt_s + nbytes / self.group.rate

    def __iter__(self):
        return iter(self.lanes)

    def __getitem__(self, k):
        return self.lanes[k]

    def pacing(self, successor):
        return self.estimate, 1.05 * self.estimate

    def path_state(self, successor):
        return self.warm, 4

    def min_rtt(self, successor):
        return self.group.rtt_s

    def set_stripe(self, n):
        self.stripes.append(n)


def _run(lanes, **kw):
    return warmup.warm_up(lanes, successor=1, clock=lambda: lanes.group.clock, **kw)


def test_the_ramp_runs_on_every_lane_then_each_lane_alone_then_lane_zero_grows():
    g = _Group(GBIT, 0.1, other_votes=[1, 0])
    lanes = _Lanes(g, warm_after=0)             # this rank is warm at once
    ran = _run(lanes, budget=1 << 40)
    ramp = list(warmup.RAMP)
    for lane in lanes:
        assert lane.sizes[:len(ramp)] == ramp    # the ramp, on every lane
        assert len(lane.sizes) >= len(ramp) + 1  # then one op alone
    solo = lanes[1].sizes[len(ramp)]
    assert all(lane.sizes[len(ramp)] == solo for lane in lanes)
    assert warmup.LANE_BYTES[0] <= solo <= warmup.LANE_BYTES[1] and solo % MIB == 0
    # Lane 0's growing ops: the other rank voted 1 then 0, so two ran.
    grown = lanes[0].sizes[len(ramp) + 1:]
    assert grown == list(warmup.SIZES[:2])
    assert ran == [len(ramp) + 3] + [len(ramp) + 1] * 3


def test_a_rank_that_is_not_warm_keeps_lane_zero_going():
    g = _Group(GBIT, 0.1, other_votes=[0] * 10)          # the other rank is warm at once
    lanes = _Lanes(g, warm_after=len(warmup.RAMP) * 4 + 4 + 2)
    _run(lanes, budget=1 << 40)
    # This rank votes 1 until its pipe is full (two ops into the growing ones), then 0.
    assert lanes[0].sizes[len(warmup.RAMP) + 1:] == list(warmup.SIZES[:3])


def test_a_rank_sends_at_most_the_budget():
    for rate, rtt in ((GBIT, 0.1), (GBIT, 0.25), (10 * GBIT, 0.25), (200e6 / 8, 0.05)):
        for world in (2, 4, 8):
            g = _Group(rate, rtt, other_votes=[1] * 20)      # never warm elsewhere
            lanes = _Lanes(g, world=world, warm_after=10 ** 6)
            _run(lanes)
            sent = sum(2 * (world - 1) / world * n for lane in lanes for n in lane.sizes)
            assert sent <= warmup.BUDGET_BYTES, (rate, rtt, world, sent)


def test_a_lan_stops_after_two_ops_when_every_rank_says_so():
    # This rank's first op is short; the other rank's too (it votes 0 in the second op).
    g = _Group(GBIT, 0.0002, other_votes=[1] * 5, other_ramp=[1, 0, 0])
    assert _run(_Lanes(g, short=True)) == [2, 2, 2, 2]
    # The other rank's first op was not (it started first and waited): both go on, so
    # that no rank runs its next op while another is still warming up.
    g = _Group(GBIT, 0.0002, other_votes=[1] * 5, other_ramp=[1, 1, 1])
    assert _run(_Lanes(g, short=True))[1:] == [len(warmup.RAMP) + 1] * 3


def test_a_path_with_little_in_flight_stops_after_the_ramp():
    g = _Group(20e6 / 8, 0.1, other_votes=[1] * 5)       # 250 KB in flight
    lanes = _Lanes(g)
    assert _run(lanes) == [len(warmup.RAMP)] * 4
