"""The warm-up of a new striped group (torch_pccl/core/warmup.py), on fake lanes: no
network, no clock but the one the fakes advance. What it asks of the lanes, not how fast
a real path runs (benchmarks/wan.py):

- lane 0 runs growing all-reduces until every rank says its path is warm, and the ranks'
  votes ride in those ops (no vote op of its own); a rank still starting up keeps it going;
- then every other lane runs one op of about the measured bandwidth-delay product, one lane
  after another;
- a rank sends at most the budget (64 MiB by default) in all, whatever the path;
- a first op as short as a LAN's ends the warm-up at once, with no stripe vote;
- the stripe is the smallest any rank asks for (a MIN all-reduce), from the path's
  bandwidth-delay product.
"""

import pytest
import torch
import torch.distributed as dist

from torch_pccl.core import warmup

MIB = 1 << 20


class _Group:
    """What every rank's fake lanes share: the other ranks' votes and stripe wishes, and a
    clock advanced by each op's bytes at the path's rate."""

    def __init__(self, rate, rtt_s, other_votes, other_stripe=None):
        self.rate, self.rtt_s = rate, rtt_s
        self.other_votes = list(other_votes)   # what the other ranks add, op by op
        self.other_stripe = other_stripe
        self.clock = 0.0


class _Lane:
    def __init__(self, group, lanes, index, world):
        self.group, self.lanes, self.index, self.world_size = group, lanes, index, world
        self.stripe = 4
        self.sizes = []

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        g = self.group
        if tensor.dtype == torch.float64:          # a vote of its own (MAX or MIN)
            if op == dist.ReduceOp.MIN and g.other_stripe is not None:
                tensor[0] = min(float(tensor[0]), g.other_stripe)
            return
        nbytes = tensor.numel() * 4
        self.sizes.append(nbytes)
        g.clock += self.lanes.op_seconds(nbytes)
        if self.index == 0:
            tensor[-1] += g.other_votes.pop(0) if g.other_votes else 0.0
        self.lanes.ops += 1

    def last_rate(self, successor):
        return self.lanes.estimate if self.lanes.ops >= self.lanes.warm_after else 0.0


class _Lanes:
    """A LaneSet of one rank: the estimate appears, and the path fills, after
    ``warm_after`` ops (that many round trips of start-up, say)."""

    def __init__(self, group, count=4, world=2, warm_after=3, short=False):
        self.group, self.short = group, short
        self.lanes = [_Lane(group, self, k, world) for k in range(count)]
        self.warm_after = warm_after
        self.ops = 0
        self.stripes = []

    @property
    def estimate(self):
        return self.group.rate if self.ops >= 1 else 0.0

    def op_seconds(self, nbytes):
        return 0.001 if self.short else 5 * self.group.rtt_s + nbytes / self.group.rate

    def __iter__(self):
        return iter(self.lanes)

    def __getitem__(self, k):
        return self.lanes[k]

    def pacing(self, successor):
        return self.estimate, 1.05 * self.estimate

    def path_state(self, successor):
        return self.ops >= self.warm_after, 4

    def min_rtt(self, successor):
        return self.group.rtt_s

    def set_stripe(self, n):
        self.stripes.append(n)


GBIT = 1e9 / 8


def test_lane_zero_grows_until_every_rank_is_warm_then_each_lane_runs_one_op():
    g = _Group(GBIT, 0.1, other_votes=[1, 1, 0, 0, 0])
    lanes = _Lanes(g, warm_after=1)         # this rank is warm after its first op
    ran = warmup.warm_up(lanes, successor=1, clock=lambda: g.clock, budget=1 << 40)
    sizes0 = lanes[0].sizes
    assert sizes0 == sorted(sizes0) and len(set(sizes0)) == len(sizes0)    # growing
    # The other rank's votes (1, 1, then 0) kept it going for three ops.
    assert len(sizes0) == 3
    assert ran == [3, 1, 1, 1]
    bdp = GBIT * 0.1
    for lane in lanes.lanes[1:]:
        (nbytes,) = lane.sizes
        assert nbytes % MIB == 0 and 0.5 * bdp <= nbytes <= bdp     # about the BDP


def test_a_rank_that_is_not_warm_keeps_lane_zero_going():
    g = _Group(GBIT, 0.1, other_votes=[0] * 10)          # the other rank is warm at once
    lanes = _Lanes(g, warm_after=3)
    warmup.warm_up(lanes, successor=1, clock=lambda: g.clock, budget=1 << 40)
    # This rank's votes: 1 in the first three ops (warm after the third), 0 in the fourth.
    assert len(lanes[0].sizes) == 4


def test_a_rank_sends_at_most_the_budget():
    for rate, rtt in ((GBIT, 0.1), (GBIT, 0.25), (10 * GBIT, 0.25), (20e6 / 8, 0.1)):
        for world in (2, 4, 8):
            g = _Group(rate, rtt, other_votes=[1] * 20)      # never warm elsewhere
            lanes = _Lanes(g, world=world, warm_after=100)
            warmup.warm_up(lanes, successor=1, clock=lambda: g.clock)
            sent = sum(2 * (world - 1) / world * n for lane in lanes for n in lane.sizes)
            assert sent <= warmup.BUDGET_BYTES, (rate, rtt, world, sent)


def test_a_lan_stops_after_one_op_with_no_stripe_vote():
    g = _Group(GBIT, 0.0002, other_votes=[1] * 5, other_stripe=2)
    lanes = _Lanes(g, short=True)
    assert warmup.warm_up(lanes, successor=1, clock=lambda: g.clock, stripes=(4, 12)) == [1, 0, 0, 0]
    assert lanes.stripes == []


@pytest.mark.parametrize("other, want", [(12, 6), (5, 5), (None, 6)])
def test_the_stripe_is_the_smallest_any_rank_asks_for(other, want):
    # 1 Gbit/s at 100 ms with 3 MB per stream and a 1.4 margin asks for 6.
    g = _Group(GBIT, 0.1, other_votes=[0] * 5, other_stripe=other)
    lanes = _Lanes(g, warm_after=1)
    old = warmup.stream_window
    warmup.stream_window = lambda: 3e6
    try:
        warmup.warm_up(lanes, successor=1, clock=lambda: g.clock, stripes=(4, 12))
    finally:
        warmup.stream_window = old
    assert lanes.stripes == [want]


def test_the_stripe_grows_with_the_bandwidth_delay_product():
    window = 3e6                          # bytes one stream holds in flight
    bounds = (4, 12)
    near, far, farther = (warmup.stripe_for(GBIT, rtt, 4, bounds, window)
                          for rtt in (0.02, 0.1, 0.25))
    assert near == 4                      # 2.5 MB in flight: the fewest
    assert 4 < far < farther <= 12        # 12.5 MB, then 31 MB, bounded
    assert warmup.stripe_for(0.0, 0.1, 5, bounds, window) == 5        # nothing measured: kept
    assert warmup.stripe_for(100 * GBIT, 0.25, 4, bounds, window) == 12
