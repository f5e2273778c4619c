"""Streaming DiLoCo's exchanges out of the way (issue 40): a fragment's exchange runs across
an outer-step boundary passed quiet, and ``tau`` sized from the measured exchange time.

- ``TauChooser`` (torch_pccl/algorithms/diloco/overlap.py), the pure rule, on recorded
  inputs;
- the wrapper on an in-process group of replicas (tests/harness/replicas.py): which inner
  step applies each fragment with a quiet group and with one that votes at every boundary,
  the outer state bit-identical on every replica after every step, and an automatic tau
  that follows exchanges taking k inner steps, on a simulated clock (each inner step one
  second; a wait for an exchange not done advances it to the exchange's end).
"""

import threading

import pytest
import torch

from harness.replicas import ThreadGroup, ThreadPeer, ThreadWork
from harness.threads import on_threads
from torch_pccl.algorithms.diloco import StreamingDiLoCo, fragment_offsets, fragments_due
from torch_pccl.algorithms.diloco import streaming as streaming_module
from torch_pccl.algorithms.diloco.overlap import TauChooser
from torch_pccl.algorithms.diloco.schedule import send_spacing

# -- the rule --------------------------------------------------------------------------


def test_the_proposal_covers_the_longest_exchange_of_the_round():
    c = TauChooser(sync_every=20)
    assert c.propose() == 1                      # nothing measured: the paper's tau
    for steps in (3, 5, 4):
        c.completed(steps)
    assert c.propose() == 5
    assert c.propose() == 5                      # nothing new: the last proposal stands
    c.completed(2)
    assert c.propose() == 2                      # a faster link shrinks it again


def test_a_wait_counts_in_inner_steps_of_the_measured_duration():
    # Recorded on the emulated 100 ms / 20 Mbit/s link (docs/wan-training.md): inner steps
    # of ~0.13 s, an exchange of ~0.9 s waited for at tau = 1.
    c = TauChooser(sync_every=20)
    for seconds in (0.13, 0.12, 0.14, 0.13):
        c.inner_step(seconds)
    c.waited(1, 0.77)
    assert c.propose() == 1 + 6                 # ceil(0.77 / ~0.13)
    c.waited(2, 0.0)                             # done as it was waited for
    assert c.propose() == 2


def test_proposals_stay_within_one_and_h_minus_one():
    c = TauChooser(sync_every=8)
    c.inner_step(0.1)
    c.waited(3, 60.0)                            # a stall: not more than H - 1
    assert c.propose() == 7
    c.completed(0)
    assert c.propose() == 1
    c.inner_step(float("nan"))                   # ignored, as a zero or negative one
    c.inner_step(0.0)
    c.waited(1, 0.25)
    assert c.propose() == 1 + 3                  # ceil(0.25 / 0.1)


def test_a_cap_below_h_bounds_the_proposals():
    c = TauChooser(sync_every=20, max_tau=6)
    c.completed(19)
    assert c.propose() == 6


def test_the_cap_is_the_spacing_between_two_sends():
    assert send_spacing(20, fragment_offsets(20, 3)) == 6        # offsets 0, 6, 13
    assert send_spacing(10, [0, 5]) == 5
    assert send_spacing(12, [0, 2, 9]) == 2
    assert send_spacing(20, [0]) == 19                           # one fragment: H - 1
    assert send_spacing(8, [3, 3]) == 7                          # sends together: H - 1
    assert send_spacing(2, [0, 1]) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="sync_every >= 2"):
        TauChooser(sync_every=1)
    with pytest.raises(ValueError, match="initial"):
        TauChooser(sync_every=4, initial=4)
    with pytest.raises(ValueError, match="max_tau"):
        TauChooser(sync_every=4, max_tau=4)
    with pytest.raises(ValueError, match="initial"):
        TauChooser(sync_every=8, initial=3, max_tau=2)


# -- across the boundary -----------------------------------------------------------------


class Blocks(torch.nn.Module):
    """Two 'transformer blocks' (blocks.0, blocks.1) of one float64 vector each."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Module() for _ in range(2))
        for b in self.blocks:
            b.w = torch.nn.Parameter(torch.randn(2, generator=g, dtype=torch.float64))

    def step(self, inner, targets):
        loss = sum(0.5 * ((b.w - t) ** 2).sum() for b, t in zip(self.blocks, targets))
        inner.zero_grad(set_to_none=True)
        loss.backward()
        inner.step()


class QuietPeer(ThreadPeer):
    """A replica of a quiet epoch: every boundary's pending query answers False, quiet, so
    no boundary votes (docs/membership.md, "Quiet epochs")."""

    def quiet(self):
        return True


def run_replicas(n, H, tau, steps, peer_class, targets_of=None, after_step=None):
    """``n`` replicas of ``Blocks`` (the same start, as a sync would make it; different
    targets) with
    ``StreamingDiLoCo(H, 2 fragments, tau)`` for ``steps`` inner steps on threads; per
    replica, {t: applied fragments} and the digest of its shared state after every step."""
    group = ThreadGroup(n)

    def replica(rank):
        model = Blocks()
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        targets = [torch.tensor([1.0 + rank, 2.0], dtype=torch.float64),
                   torch.tensor([-1.0, 4.0 - rank], dtype=torch.float64)]
        d = StreamingDiLoCo(model, inner, sync_every=H, num_fragments=2, tau=tau, alpha=0.5,
                            group=peer_class(group, rank))
        events, states, taus = {}, {}, {}
        for t in range(1, steps + 1):
            model.step(inner, targets)
            if after_step is not None:
                after_step(rank, t)
            result = d.step()
            if result is not None:
                events[t] = list(result.fragments)
            states[t] = [s.clone() for s in d.state().values()]
            taus[t] = d.tau
        d.finish()
        return events, states, taus, group

    return on_threads(replica, n, deadline_s=120.0)


# H = 6, offsets 0 and 3 (fragment 1 sends at t = 3, 9, 15; fragment 0 at 6, 12, 18), tau 4:
# fragment 1 is due at t = 7, 13, 19, past the boundaries at 6 and 12.
CROSSING = {6: [], 7: [1], 10: [0], 12: [], 13: [1], 16: [0], 18: []}
# A group that votes at every boundary completes fragment 1 there, early.
VOTING = {6: [1], 10: [0], 12: [1], 16: [0], 18: [1]}


@pytest.mark.parametrize("peer_class, expected", [(QuietPeer, CROSSING), (ThreadPeer, VOTING)],
                         ids=["quiet", "voting"])
def test_an_exchange_in_flight_crosses_a_quiet_boundary(in_process, peer_class, expected):
    results = run_replicas(3, H=6, tau=4, steps=18, peer_class=peer_class)
    for events, states, _, _ in results:
        assert events == expected
    # The outer state (outer parameters, outer-optimizer buffers, step) is bit-identical on
    # every replica after every inner step, whichever boundary the exchanges crossed.
    first = results[0][1]
    for _, states, _, _ in results[1:]:
        for t in first:
            assert all(torch.equal(a, b) for a, b in zip(first[t], states[t])), t
    group = results[0][3]
    # Quiet: no boundary synced (the constructor's sync at revision 0 only, and finish's).
    synced = sorted(group.digests)
    assert synced == ([0, 1] if peer_class is QuietPeer else [0, 1, 2, 3, 4])


def test_a_quiet_crossing_applies_the_same_update_as_an_early_one(in_process):
    """Crossing changes when a fragment is merged into the local parameters, not the
    average it applies: one replica, SGD lr 1, the outer fragment lands on the local
    parameters it had when it was sent, either way."""
    for peer_class in (QuietPeer, ThreadPeer):
        H = 6
        group = ThreadGroup(1)
        model = Blocks()
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        d = StreamingDiLoCo(model, inner, lambda p: torch.optim.SGD(p, lr=1.0), sync_every=H,
                            num_fragments=2, tau=4, alpha=0.5, group=peer_class(group, 0))
        targets = [torch.tensor([1.0, 2.0], dtype=torch.float64),
                   torch.tensor([-1.0, 4.0], dtype=torch.float64)]
        sent = {}
        for t in range(1, 3 * H + 1):
            model.step(inner, targets)
            for p in fragments_due(t, H, [0, 3]):
                sent[p] = model.blocks[p].w.detach().clone()
            result = d.step()
            for p in (result.fragments if result is not None else []):
                torch.testing.assert_close(d.outer_parameters[p], sent[p], rtol=0, atol=1e-12)


# -- tau from the measured exchange time -----------------------------------------------------


class Clock:
    """Per-thread simulated seconds: the replicas' ``time.monotonic``."""

    def __init__(self):
        self._local = threading.local()

    def monotonic(self):
        return getattr(self._local, "now", 0.0)

    def advance_to(self, when):
        self._local.now = max(self.monotonic(), when)


class SlowWork(ThreadWork):
    """An exchange that takes ``k`` simulated seconds (inner steps) from its send."""

    def __init__(self, group, seq, buf, clock, k):
        super().__init__(group, seq, buf)
        self.clock, self.done_at = clock, clock.monotonic() + k

    def is_completed(self):
        return self.clock.monotonic() >= self.done_at and super().is_completed()

    def wait(self):
        self.clock.advance_to(self.done_at)        # blocked until the exchange ends
        return super().wait()


def slow_peer_class(clock, k):
    class SlowPeer(QuietPeer):
        def all_reduce(self, buf, async_op):
            if not async_op:
                return super().all_reduce(buf, async_op)
            seq = self._next()
            self.group.contribute(seq, self.rank, "all_reduce", buf)
            return SlowWork(self.group, seq, buf, clock, k)

    return SlowPeer


# Exchanges of k inner steps; H = 10 and 2 fragments (offsets 0 and 5) cap tau at 5: an
# exchange longer than the spacing between sends is waited for at t + 5.
@pytest.mark.parametrize("k, tau", [(3, 3), (5, 5), (8, 5)])
def test_tau_follows_the_measured_exchange_time(in_process, monkeypatch, k, tau):
    clock = Clock()
    monkeypatch.setattr(streaming_module, "time", clock)

    def after_step(rank, t):
        clock.advance_to(float(t))           # each inner step: one simulated second

    H = 10
    results = run_replicas(3, H=H, tau=None, steps=4 * H, peer_class=slow_peer_class(clock, k),
                           after_step=after_step)
    for events, states, taus, _ in results:
        # Round 1 runs at tau 1 and measures k (waited for from t + 1 to t + k); the
        # group agrees on it (capped) at the next boundary (the MAX sent at the first
        # one), so every send from t = 2H on (the boundary's own, after the agreement)
        # is applied tau steps after it.
        assert taus[H] == 1 and taus[2 * H] == tau and taus[4 * H] == tau
        assert [t for t, frags in events.items() if t > 2 * H and frags] == \
            sorted(t + tau for t in range(2 * H, 4 * H + 1)
                   if fragments_due(t, H, [0, 5]) and t + tau <= 4 * H)
    first = results[0][1]
    for _, states, _, _ in results[1:]:
        for t in first:
            assert all(torch.equal(a, b) for a, b in zip(first[t], states[t])), t


def test_a_fixed_tau_is_kept_and_not_in_the_shared_state(in_process):
    group = ThreadGroup(1)
    model = Blocks()
    d = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6,
                        num_fragments=2, tau=2, group=group.peer(0))
    assert d.tau == 2 and "streaming/tau" not in d.state()
    auto = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6,
                           num_fragments=2, group=ThreadGroup(1).peer(0))
    assert auto.tau == 1 and int(auto.state()["streaming/tau"]) == 1
    with pytest.raises(ValueError, match="tau must be None or an int"):
        StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=6,
                        num_fragments=2, tau=6, group=ThreadGroup(1).peer(0))
