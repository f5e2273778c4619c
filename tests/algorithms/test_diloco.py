"""torch_pccl.algorithms.diloco: DiLoCo, StreamingDiLoCo and AsyncDiLoCo.

Two kinds of tests:

- the math, in this process: the wrappers run on an in-process group of
  replicas on threads (``harness.replicas.ThreadGroup``, substituted for the pccl
  transport), so pseudo-gradients, the Nesterov outer step, the fragment
  schedule, the merge and the async rule are checked against hand computations, and the async
  rule's stability against the stale Nesterov update on a tiny deterministic
  problem;
- end to end over pccl: each wrapper trains a small model on 3 peers, admits a
  late joiner, loses a SIGKILLed peer, and every survivor ends with
  bit-identical outer state (harness as tests/elastic/test_shared_state.py: a master
  in a thread, peers in tests/harness/diloco_worker.py subprocesses, every wait bounded,
  every process killed in a finally); the three scenarios run one after the
  other on the same processes (``Chain``), each on the previous one's survivors.
"""

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import torch_pccl
from harness import HARNESS
from harness.replicas import ThreadGroup
from harness.worker_process import StandbyPeer, call_all, wait_until
from torch_pccl.algorithms.diloco import (
    AsyncDiLoCo,
    DiLoCo,
    StreamingDiLoCo,
    fragment_offsets,
    fragments_due,
    pseudo_gradient,
    sparseloco_outer_optimizer,
    strided_fragments,
)
from torch_pccl.algorithms.topk import TopK, decode_add, encode

# -- an in-process group for the math (tests/harness/replicas.py) ---------------------


# The ``in_process`` fixture (tests/conftest.py) runs the wrappers on it.


def on_threads(n, fn):
    """fn(rank) on n threads at once; their results, in rank order (bounded wait)."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(fn, r) for r in range(n)]
        return [f.result(timeout=60) for f in futures]


class Vec(torch.nn.Module):
    """One float64 parameter vector: the smallest model the wrappers accept."""

    def __init__(self, init):
        super().__init__()
        self.w = torch.nn.Parameter(torch.as_tensor(init, dtype=torch.float64).clone())


def quadratic_step(model, inner, target, curvature=None):
    """One inner SGD step on 0.5 * sum(c * (w - target)^2)."""
    c = torch.ones_like(target) if curvature is None else curvature
    loss = 0.5 * (c * (model.w - target) ** 2).sum()
    inner.zero_grad(set_to_none=True)
    loss.backward()
    inner.step()
    return loss.item()


# -- the pure functions ----------------------------------------------------------------


def test_pseudo_gradient_is_outer_minus_local():
    outer = torch.tensor([1.0, 2.0, -3.0])
    local = torch.tensor([0.5, 3.0, -3.0], dtype=torch.float64, requires_grad=True)
    g = pseudo_gradient(outer, local)
    assert g.dtype == torch.float32 and not g.requires_grad
    assert torch.equal(g, torch.tensor([0.5, -1.0, 0.0]))
    # An outer SGD step with lr 1 and no momentum lands on the local parameters.
    assert torch.equal(outer - 1.0 * g, local.detach().float())


def test_strided_block_assignment():
    names = ["tok.weight", "blocks.0.a.weight", "blocks.0.b.weight", "blocks.1.a.weight",
             "blocks.2.a.weight", "blocks.3.a.weight", "blocks.3.a.bias", "layer10.weight",
             "head.weight"]
    numels = [1000, 10, 10, 10, 10, 10, 1, 5, 1000]
    frags = strided_fragments(names, 2, numels)
    named = [[names[i] for i in f] for f in frags]
    # blocks 0 and 2 -> fragment 0, blocks 1 and 3 -> fragment 1; the parameters in no
    # block ("layer10" is not an integer component) go together to the smaller fragment.
    assert named[0] == ["blocks.0.a.weight", "blocks.0.b.weight", "blocks.2.a.weight"]
    assert named[1] == ["tok.weight", "blocks.1.a.weight", "blocks.3.a.weight",
                        "blocks.3.a.bias", "layer10.weight", "head.weight"]
    assert strided_fragments(names, 1) == [list(range(len(names)))]
    # nn.Sequential names: block i is "i."; the first integer component decides.
    seq = ["0.weight", "0.bias", "2.weight", "2.bias", "4.layers.1.weight"]
    assert strided_fragments(seq, 3) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="4 blocks .* 5 fragments"):
        strided_fragments(names, 5)
    with pytest.raises(ValueError):
        strided_fragments(names, 0)


def test_fragment_schedule():
    assert fragment_offsets(8, 4) == [0, 2, 4, 6]
    assert fragment_offsets(10, 3) == [0, 3, 6]
    assert fragment_offsets(2, 4) == [0, 0, 1, 1]
    sends = {t: fragments_due(t, 8, [0, 2, 4, 6]) for t in range(0, 17)}
    assert sends[0] == []                                # nothing before the first step
    assert {t: f for t, f in sends.items() if f} == {
        2: [1], 4: [2], 6: [3], 8: [0], 10: [1], 12: [2], 14: [3], 16: [0]}


# -- DiLoCo's outer step against a hand computation --------------------------------------


def test_diloco_nesterov_outer_step_matches_hand_computation(in_process):
    H, inner_lr = 3, 0.1
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    model = Vec([0.0, 0.0, 0.0])
    inner = torch.optim.SGD(model.parameters(), lr=inner_lr)
    peer = ThreadGroup(1).peer(0)
    d = DiLoCo(model, inner, sync_every=H, group=peer)
    assert d.outer_parameters[0].dtype == torch.float64
    assert set(d.state()) == {"outer/w", "outer_opt/w/momentum_buffer", "step"}
    assert not d.state()["outer_opt/w/momentum_buffer"].any()

    theta = torch.zeros(3, dtype=torch.float64)
    buf = torch.zeros(3, dtype=torch.float64)
    for rnd in range(1, 4):
        x = theta.clone()
        for i in range(H):
            quadratic_step(model, inner, target)
            x = x - inner_lr * (x - target)
            result = d.step()
            assert (result is None) == (i < H - 1)
        delta = theta - x
        if rnd == 1:       # like a gradient, it points away from the target
            assert torch.equal(torch.sign(delta), torch.sign(theta - target))
        buf = buf.mul(0.9).add(delta)
        theta = theta - 0.7 * delta.add(buf, alpha=0.9)
        torch.testing.assert_close(d.outer_parameters[0], theta, rtol=0, atol=1e-12)
        torch.testing.assert_close(d.state()["outer_opt/w/momentum_buffer"], buf, rtol=0,
                                   atol=1e-12)
        assert torch.equal(model.w.detach(), d.outer_parameters[0])   # model := outer
        assert result.step == rnd == d.step_count and result.fragments == (0,)
        assert result.world_size == 1 and result.retries == 0
        assert peer.step == rnd        # reported to the master's status page


def test_diloco_two_replicas_average_and_stay_identical(in_process):
    """lr 1, no momentum: the outer step is FedAvg, the mean of the replicas' parameters."""
    group, H = ThreadGroup(2), 4
    targets = [torch.tensor([1.0, 3.0], dtype=torch.float64),
               torch.tensor([-1.0, 5.0], dtype=torch.float64)]

    def replica(rank):
        model = Vec([0.0, 0.0])
        inner = torch.optim.SGD(model.parameters(), lr=0.25)
        d = DiLoCo(model, inner, lambda p: torch.optim.SGD(p, lr=1.0), sync_every=H,
                   group=group.peer(rank))
        for _ in range(H - 1):
            quadratic_step(model, inner, targets[rank])
            assert d.step() is None
        quadratic_step(model, inner, targets[rank])
        local = model.w.detach().clone()
        d.step()
        return local, d.outer_parameters[0].clone()

    (l0, o0), (l1, o1) = on_threads(2, replica)
    assert torch.equal(o0, o1)
    torch.testing.assert_close(o0, (l0 + l1) / 2, rtol=0, atol=1e-12)
    assert len(set(group.digests[1].values())) == 1


def test_outer_state_is_float32_on_the_cpu_for_a_bfloat16_model(in_process):
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    d = DiLoCo(model, inner, lambda p: torch.optim.SGD(p, lr=1.0), sync_every=1,
               group=ThreadGroup(1).peer(0))
    assert [t.dtype for t in d.outer_parameters] == [torch.float32] * 2
    assert list(d.outer_state_dict()) == ["weight", "bias"]
    model(torch.ones(4, 3, dtype=torch.bfloat16)).sum().backward()
    inner.step()
    local = [p.detach().float() for p in model.parameters()]
    assert d.step().step == 1
    for o, lo, p in zip(d.outer_parameters, local, model.parameters()):
        torch.testing.assert_close(o, lo, rtol=0, atol=1e-6)   # FedAvg of one peer
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), o.to(torch.bfloat16))


def test_context_manager_runs_the_outer_step_from_the_inner_optimizer(in_process):
    model = Vec([0.0])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, inner, sync_every=2, group=ThreadGroup(1).peer(0))
    target = torch.tensor([1.0], dtype=torch.float64)
    with d as same:
        assert same is d
        for _ in range(4):
            quadratic_step(model, inner, target)
    assert d.step_count == 2 and d.last_outer_step.step == 2
    quadratic_step(model, inner, target)
    quadratic_step(model, inner, target)
    assert d.step_count == 2, "the hook outlived the with block"


# -- Streaming DiLoCo --------------------------------------------------------------------


class Blocks(torch.nn.Module):
    """Two 'transformer blocks' (blocks.0, blocks.1) of one float64 vector each."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Vec([0.0, 0.0]) for _ in range(2))

    def step(self, inner, targets):
        loss = sum(0.5 * ((b.w - t) ** 2).sum() for b, t in zip(self.blocks, targets))
        inner.zero_grad(set_to_none=True)
        loss.backward()
        inner.step()


# When each fragment's update is applied (H = 6, offsets 0 and 3: fragment 1 sends at
# t = 3, 9, 15, fragment 0 at 6, 12, 18), by tau; boundaries (t % 6 == 0) report too
# and complete what is still in flight (tau = 4: fragment 1 is applied early).
APPLIED = {
    0: {3: [1], 6: [0], 9: [1], 12: [0], 15: [1], 18: [0]},
    1: {4: [1], 6: [], 7: [0], 10: [1], 12: [], 13: [0], 16: [1], 18: []},
    2: {5: [1], 6: [], 8: [0], 11: [1], 12: [], 14: [0], 17: [1], 18: []},
    4: {6: [1], 10: [0], 12: [1], 16: [0], 18: [1]},
}


@pytest.mark.parametrize("tau", sorted(APPLIED))
def test_streaming_schedule_overlap_and_merge(in_process, tau):
    H, alpha = 6, 0.5
    targets = [torch.tensor([1.0, 2.0], dtype=torch.float64),
               torch.tensor([-1.0, 4.0], dtype=torch.float64)]
    model = Blocks()
    inner = torch.optim.SGD(model.parameters(), lr=0.2)
    d = StreamingDiLoCo(model, inner, lambda p: torch.optim.SGD(p, lr=1.0), sync_every=H,
                        num_fragments=2, tau=tau, alpha=alpha, group=ThreadGroup(1).peer(0))
    assert d.fragments == [["blocks.0.w"], ["blocks.1.w"]]
    assert d.fragment_offsets == [0, 3]
    sent = {}
    events = {}
    for t in range(1, 3 * H + 1):
        model.step(inner, targets)
        for p in fragments_due(t, H, [0, 3]):
            sent[p] = model.blocks[p].w.detach().clone()
        before = [b.w.detach().clone() for b in model.blocks]
        result = d.step()
        if result is None:
            continue
        events[t] = list(result.fragments)
        for p in result.fragments:
            # One peer, SGD lr 1: the outer fragment lands on the local parameters it
            # had when it was sent ...
            torch.testing.assert_close(d.outer_parameters[p], sent[p], rtol=0, atol=1e-12)
            # ... and the local fragment is merged with it when it is applied.
            expect = d.outer_parameters[p] if tau == 0 else \
                alpha * before[p] + (1 - alpha) * d.outer_parameters[p]
            torch.testing.assert_close(model.blocks[p].w.detach(), expect, rtol=0, atol=1e-12)
    assert events == APPLIED[tau]
    assert d.step_count == 3
    d.finish()                       # completes what is in flight; the model = outer
    assert all(torch.equal(b.w.detach(), o) for b, o in zip(model.blocks, d.outer_parameters))


def test_streaming_argument_checks(in_process):
    model = Blocks()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    peer = ThreadGroup(1).peer(0)
    for kw, match in [({"tau": 4}, "tau"), ({"tau": -1}, "tau"), ({"alpha": 1.5}, "alpha"),
                      ({"fragment_offsets": [0, 4]}, "fragment_offsets"),
                      ({"num_fragments": 3}, "blocks"),
                      ({"fragments": [[model.blocks[0].w]]}, "no fragment"),
                      ({"fragments": [[model.blocks[0].w], [model.blocks[0].w]]}, "two"),
                      ({"fragments": [[torch.zeros(2)]]}, "not a trainable")]:
        with pytest.raises(ValueError, match=match):
            StreamingDiLoCo(model, inner, sync_every=4, group=peer, **{"num_fragments": 2, **kw})
    d = StreamingDiLoCo(model, inner, sync_every=4, group=peer,
                        fragments=[[model.blocks[1].w], [model.blocks[0].w]])
    assert d.fragments == [["blocks.1.w"], ["blocks.0.w"]]


def test_argument_checks_come_before_any_communication():
    model = Vec([0.0])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, match in [({"sync_every": 0}, "sync_every"), ({"quantization": "int2"}, "int2"),
                      ({"max_retries": -1}, "max_retries")]:
        with pytest.raises(ValueError, match=match):
            DiLoCo(model, inner, **kw)
    with pytest.raises(ValueError, match="rule"):
        AsyncDiLoCo(model, inner, rule="late")
    with pytest.raises(ValueError, match="eager_weight"):
        AsyncDiLoCo(model, inner, eager_weight=0.0)
    frozen = Vec([0.0]).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        DiLoCo(frozen, inner)
    # No process group in this process: the transport refuses.
    with pytest.raises(torch_pccl.InvalidUsageError):
        DiLoCo(model, inner)


def test_outer_optimizer_state_is_created_up_front(in_process):
    """Adam's state exists (zeroed, step 0) before the first outer step, so a joiner
    and the incumbents sync the same entries; the parameters are untouched."""
    model = Vec([1.0, 2.0])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, inner, lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1),
               sync_every=2, group=ThreadGroup(1).peer(0))
    state = d.state()
    assert set(state) == {"outer/w", "outer_opt/w/step", "outer_opt/w/exp_avg",
                          "outer_opt/w/exp_avg_sq", "step"}
    assert all(not t.any() for n, t in state.items() if n.startswith("outer_opt/"))
    assert torch.equal(state["outer/w"], torch.tensor([1.0, 2.0], dtype=torch.float64))


# -- AsyncDiLoCo -----------------------------------------------------------------------


def test_async_eager_with_one_peer_reproduces_diloco(in_process):
    H = 4
    target = torch.tensor([3.0, -1.0, 0.5], dtype=torch.float64)

    def trajectory(cls, **kw):
        model = Vec([0.0, 0.0, 0.0])
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        d = cls(model, inner, sync_every=H, group=ThreadGroup(1).peer(0), **kw)
        starts = []
        for t in range(1, 6 * H + 1):
            quadratic_step(model, inner, target)
            if d.step() is not None:
                starts.append(model.w.detach().clone())
        return starts

    sync = trajectory(DiLoCo)
    eager = trajectory(AsyncDiLoCo)
    stale = trajectory(AsyncDiLoCo, rule="stale")
    for a, b in zip(sync, eager):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9)
    assert not torch.allclose(stale[2], sync[2])


def run_async_replicas(n, rounds, make, H=10, inner_lr=0.1):
    """n replicas on 0.5 * |w - b_r|^2 (targets spread around 1); returns the distance of
    the shared outer parameters from the optimum after each round, and the group."""
    group = ThreadGroup(n)
    dim = 4
    optimum = torch.ones(dim, dtype=torch.float64)
    spread = torch.linspace(-0.5, 0.5, n, dtype=torch.float64) if n > 1 else torch.zeros(1)

    def replica(rank):
        model = Vec(torch.zeros(dim))
        inner = torch.optim.SGD(model.parameters(), lr=inner_lr)
        d = make(model, inner, H, group.peer(rank))
        target = optimum + spread[rank]
        errors = []
        for _ in range(rounds):
            for _ in range(H):
                quadratic_step(model, inner, target)
                d.step()
            errors.append((d.outer_parameters[0] - optimum).norm().item())
        d.finish()
        return errors, d.outer_parameters[0].clone(), model.w.detach().clone()

    return on_threads(n, replica), group


@pytest.mark.parametrize("n", (2, 4))
def test_async_eager_is_stable_where_stale_nesterov_diverges(in_process, n):
    """Nesterov lr 0.7 / momentum 0.9, H = 10 inner SGD steps (lr 0.1) on quadratics:
    synchronous DiLoCo converges; the one-round-delayed stale update oscillates with
    growing amplitude; the eager rule converges like DiLoCo, and every replica holds
    the same shared state at every sync."""
    rounds = 40

    def run(make):
        replicas, group = run_async_replicas(n, rounds, make)
        errors = replicas[0][0]
        assert all(torch.equal(r[1], replicas[0][1]) for r in replicas)
        for revision, by_rank in group.digests.items():
            assert len(by_rank) == n and len(set(by_rank.values())) == 1, revision
        return errors

    sync = run(lambda m, i, H, g: DiLoCo(m, i, sync_every=H, group=g))
    eager = run(lambda m, i, H, g: AsyncDiLoCo(m, i, sync_every=H, group=g))
    stale = run(lambda m, i, H, g: AsyncDiLoCo(m, i, sync_every=H, group=g, rule="stale"))
    start = 2.0  # |0 - optimum|
    assert sync[-1] < 1e-5 * start, sync
    assert max(eager) <= start and eager[-1] < 1e-4 * start, eager
    assert max(stale[-10:]) > 50 * start, stale           # diverging, not converging
    assert max(stale[-10:]) > 5 * max(stale[10:20]), stale  # and still growing
    if n == 4:
        # The paper's mixture (eager_weight=None: w = 1/W) has not converged here.
        paper = run(lambda m, i, H, g: AsyncDiLoCo(m, i, sync_every=H, group=g,
                                                   eager_weight=None))
        assert max(paper[-10:]) > 0.5 * start, paper


def test_async_shared_state_parity_with_the_paper_weight(in_process):
    """Two replicas whose pseudo-gradients differ: the shared state (outer parameters,
    momentum, step) is identical at every sync (the constructor's, 5 rounds, finish),
    and after finish() both models hold it."""
    (r0, r1), group = run_async_replicas(2, 5, lambda m, i, H, g: AsyncDiLoCo(
        m, i, sync_every=H, group=g, eager_weight=None))
    assert torch.equal(r0[1], r1[1])
    assert torch.equal(r0[2], r1[2])       # finish() loads S into the model
    assert len(group.digests) == 7 and all(len(set(v.values())) == 1
                                           for v in group.digests.values())


# -- the sparse exchange (compression=TopK) ------------------------------------------------

SPARSE = TopK(density=0.25, bits=4, chunk=16, beta=0.9)


class Mlp(torch.nn.Module):
    """Two layers (``layers.0.``, ``layers.1.``: two blocks for Streaming's fragments):
    several parameters of several sizes, so chunks cross tensor boundaries."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 12), torch.nn.Linear(12, 1)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def sparse_replicas(cls, n, steps, before_boundary=None, **kw):
    """n replicas of ``cls(..., compression=SPARSE)`` from the same weights, each on its own
    data, ``steps`` inner SGD steps; ``before_boundary(rank, model, t)`` runs before
    each ``step()``. Returns per replica (the wrapper, its OuterSteps) and the group."""
    group = ThreadGroup(n)
    torch.manual_seed(0)
    init = Mlp().state_dict()

    def replica(rank):
        model = Mlp()
        model.load_state_dict(init)
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        d = cls(model, inner, sync_every=4, group=group.peer(rank), compression=SPARSE, **kw)
        gen = torch.Generator().manual_seed(100 + rank)
        outer = []
        for t in range(1, steps + 1):
            x = torch.randn(16, 6, generator=gen)
            loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()
            if before_boundary is not None:
                before_boundary(rank, model, t)
            o = d.step()
            if o is not None:
                outer.append(o)
        return d, outer

    return on_threads(n, replica), group


@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("cls,kw", [(DiLoCo, {}), (StreamingDiLoCo, dict(num_fragments=2, tau=1)),
                                    (AsyncDiLoCo, {})], ids=["diloco", "streaming", "async"])
def test_sparse_exchange_keeps_every_replica_bit_identical(in_process, cls, kw, n):
    """Every replica decodes every payload and adds them in rank order: the outer
    parameters and the shared state are bit-identical at every sync, over 10 outer
    steps; every collective is an all-gather (no dense all-reduce)."""
    replicas, group = sparse_replicas(cls, n, 40, **kw)
    outer = [torch.cat([p.reshape(-1) for p in d.outer_parameters]) for d, _ in replicas]
    assert all(torch.equal(o, outer[0]) for o in outer)
    for revision, by_rank in group.digests.items():
        assert len(by_rank) == n and len(set(by_rank.values())) == 1, revision
    assert len(group.digests) == 11
    assert set(group.kinds()) == {"all_gather"}
    assert all(bool(torch.isfinite(o).all()) for o in outer)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls,kw", [(DiLoCo, {}), (StreamingDiLoCo, dict(num_fragments=2, tau=1)),
                                    (AsyncDiLoCo, {})], ids=["diloco", "streaming", "async"])
def test_sparse_exchange_with_a_model_on_the_gpu(in_process, cls, kw):
    """The model on a GPU: the pseudo-gradients, accumulator and payloads live on the CPU
    (the outer state does), the model stays on the GPU, and two replicas end with
    bit-identical outer parameters that the model holds after finish()."""
    group = ThreadGroup(2)
    torch.manual_seed(0)
    init = Mlp().state_dict()

    def replica(rank):
        model = Mlp().cuda()
        model.load_state_dict(init)
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        d = cls(model, inner, sync_every=4, group=group.peer(rank), compression=SPARSE, **kw)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(16):
            x = torch.randn(16, 6, generator=gen).cuda()
            loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()
            d.step()
        d.finish()
        assert all(p.is_cuda for p in model.parameters())
        assert d._fragments[0].sparse.accumulator.device.type == "cpu"
        flat = torch.cat([p.reshape(-1) for p in d.outer_parameters])
        assert torch.equal(torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]),
                           flat)
        return flat

    outer = on_threads(2, replica)
    assert torch.equal(outer[0], outer[1])
    assert set(group.kinds()) == {"all_gather"}

def test_sparse_outer_step_is_the_mean_of_the_decoded_payloads(in_process):
    """DiLoCo's first outer step with compression, by hand: each replica's payload is
    encode(pseudo-gradient) (the accumulator starts at zero), the outer parameters move by
    minus the mean of the decoded payloads (SparseLoCo's SGD, lr 1), and each
    accumulator keeps what its payload did not carry."""
    locals_at = {}

    def snapshot(rank, model, t):
        if t == 4:
            locals_at[rank] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    torch.manual_seed(0)
    start = torch.cat([p.detach().reshape(-1) for p in Mlp().parameters()])
    replicas, _ = sparse_replicas(DiLoCo, 2, 4, before_boundary=snapshot,
                                  outer_optimizer=sparseloco_outer_optimizer)
    deltas = [start - locals_at[r] for r in range(2)]
    decoded = []
    for delta in deltas:
        out = torch.zeros_like(delta)
        assert decode_add(out, encode(delta, SPARSE), SPARSE)
        decoded.append(out)
    expected = start - (decoded[0] + decoded[1]) / 2
    for rank, (d, _) in enumerate(replicas):
        assert torch.equal(torch.cat([p.reshape(-1) for p in d.outer_parameters]), expected)
        accumulator = d._fragments[0].sparse.accumulator
        assert torch.equal(accumulator, deltas[rank] - decoded[rank])


def test_a_non_finite_payload_is_left_out_and_named(in_process):
    """Replica 1's model turns NaN before the first boundary: its payload is left out on
    every replica (named in OuterStep.rejected), the outer parameters stay finite and
    identical, and its accumulator starts over (the next rounds include it again)."""
    def poison(rank, model, t):
        if rank == 1 and t == 4:
            with torch.no_grad():
                model.layers[0].weight[0, 0] = float("nan")

    replicas, _ = sparse_replicas(DiLoCo, 3, 12, before_boundary=poison)
    outer = [torch.cat([p.reshape(-1) for p in d.outer_parameters]) for d, _ in replicas]
    assert all(torch.equal(o, outer[0]) for o in outer) and bool(torch.isfinite(outer[0]).all())
    for _, steps in replicas:
        assert [o.rejected for o in steps] == [("replica1",), (), ()], steps


# -- end to end over pccl --------------------------------------------------------------

T = 5.0                 # seconds: the groups' op timeout (PCCL_TIMEOUT)
JOIN_TIMEOUT_S = 60.0   # seconds: how long a peer may stay pending
START_S = 60.0          # seconds: a worker's start (imports torch) on a loaded machine
STEP_S = 2 * T + 40     # seconds: deadline of one command that holds collectives
WORKER = os.path.join(HARNESS, "diloco_worker.py")


class Peer(StandbyPeer):
    """One worker process, a standby until ``join``."""

    def __init__(self, master_addr, tmp_path, name):
        super().__init__(WORKER, master_addr, tmp_path, name, T, JOIN_TIMEOUT_S, START_S, STEP_S)


# One scenario per wrapper; the streaming one sends int8 (torch_pccl.all_reduce_quantized,
# async, several in flight on the group's lanes) with tau sized from the measured exchange
# time (its MAX all-reduce at every boundary), the others plain float32. The "-topk" ones
# exchange sparse payloads (compression=TopK, all-gathered; the fields of the TopK here);
# streaming-topk's fragment 1 (sent at t = 4 of every 8, tau 6) is in flight across every
# boundary the quiet epochs pass (tests/algorithms/test_streaming_overlap.py has the math).
TOPK = dict(density=0.25, chunk=64, bits=2, beta=0.9)
WRAPPERS = {
    "diloco": dict(kind="diloco", sync_every=5),
    "streaming-int8": dict(kind="streaming", sync_every=8, num_fragments=2, tau=None,
                           alpha=0.5, quantization="int8"),
    "async": dict(kind="async", sync_every=5),
    "diloco-topk": dict(kind="diloco", sync_every=5, compression=TOPK),
    "streaming-topk": dict(kind="streaming", sync_every=8, num_fragments=2, tau=6, alpha=0.5,
                           compression=TOPK),
    "async-topk": dict(kind="async", sync_every=5, compression=TOPK),
}
# The scenario of a peer killed where another joins runs for these (the others' paths are
# the same per wrapper: the sparse one is covered by diloco-topk).
KILLED_WHILE_JOINING = ["diloco", "streaming-int8", "async", "diloco-topk"]


class Chain:
    """A master and worker processes shared by the end-to-end tests: each test runs on
    the 3 survivors of the previous one plus a fresh standby as its joiner (importing
    torch is most of a worker's cost on 2 cores). A test that does not finish marks the
    chain broken, and the next one starts over with new processes."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.master = None
        self.peers = []
        self.incumbents = []
        self.standbys = []
        self.broken = True

    def take(self):
        """(master, 3 incumbents ordered by rank, a standby); the chain is broken until
        the test hands its survivors back with ``done``."""
        if self.broken or not self.standbys:
            self.restart()
        self.broken = True
        return self.master, self.incumbents, self.standbys.pop(0)

    def done(self, survivors):
        self.incumbents = sorted(survivors, key=lambda p: p.rank)
        self.broken = False

    def restart(self):
        from torch_pccl.master import start_in_thread

        self.close()
        # Heartbeats only catch hung peers here (a killed one closes its connection):
        # a long timeout keeps peers starved of CPU on a loaded machine in the world.
        m = self.master = start_in_thread("127.0.0.1", 0, world_size=3,
                                          heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0,
                                          round_timeout_s=20.0, quiet_epochs=True)
        n = 3 + len(WRAPPERS)          # the first test's joiners; the later ones start over
        base = len(self.peers)
        self.peers = [Peer(m.address, self.tmp_path, f"peer{base + i}") for i in range(n)]
        boot, self.standbys = self.peers[:3], self.peers[3:]
        for p in boot:
            p.join()
        for p in boot:
            p.ready()
        self.incumbents = sorted(boot, key=lambda p: p.rank)
        assert [p.rank for p in self.incumbents] == [0, 1, 2]

    def close(self):
        for p in self.peers:
            p.close()
        if self.master is not None:
            self.master.stop()
            self.master = None


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    c = Chain(tmp_path_factory.mktemp("diloco"))
    try:
        yield c
    finally:
        c.close()


def same_state(answers):
    """Every peer holds the same shared state: torch_pccl.state_hashes and an
    independent sha256 of all its bytes agree; returns the sha."""
    first = answers[0]
    for a in answers:
        assert a["hashes"] == first["hashes"], f"rank {a['rank']} differs from rank {first['rank']}"
        assert a["sha"] == first["sha"], a["rank"]
        assert a["step"] == first["step"], a["rank"]
    return first["sha"]


@pytest.mark.timeout(240)
@pytest.mark.pccl_only
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_training_with_a_late_joiner_and_a_killed_peer(chain, wrapper):
    # Every peer's loop also checks for joiners itself, at the top and the end of each inner
    # step (user_checks): the wrapper admits them at its boundaries all the same.
    cfg = WRAPPERS[wrapper]
    H = cfg["sync_every"]
    m, boot, joiner = chain.take()

    # Peers initialise their models differently; the constructor's sync equalises them.
    setups = call_all(boot, "setup", STEP_S, **cfg)
    same_state(setups)
    assert sum(s["changed"] > 0 for s in setups) == 2     # the lowest rank's init won
    assert all(s["step"] == 0 and s["world_size"] == 3 for s in setups)
    initial_eval = setups[0]["eval"]

    asked = m.snapshot()["counters"]["requests"]
    trained = call_all(boot, "train", STEP_S, steps=2 * H, user_checks=True)
    same_state(trained)
    assert trained[0]["step"] == 2 and trained[0]["outer"][-1]["world_size"] == 3
    # A quiet epoch (nobody pending, nothing stale): two outer steps and every inner step's
    # peers_pending sent the master nothing, no pending query and no sync vote.
    assert m.snapshot()["counters"]["requests"] == asked

    # A late joiner: admitted at the next boundary, it constructs its wrapper while the
    # incumbents are at their shared-state sync and leaves with the group's state.
    joiner.join()
    wait_until(lambda: m.snapshot()["pending"] == 1, 60, "the joiner pending")
    for p in boot:
        p.send("train", steps=H, user_checks=True)
    assert joiner.ready() == 3
    joined = joiner.call("setup", **cfg)
    answers = [p.recv(STEP_S, "train") for p in boot]
    last = answers[0]["outer"][-1]
    assert last["world_size"] == 4 and last["joined"] == [joiner.name], last
    assert joined["changed"] > 0 and joined["received"] > 0
    assert joined["step"] == 3
    assert joined["sha"] == same_state(answers)

    everyone = boot + [joiner]
    answers = call_all(everyone, "train", STEP_S, steps=2 * H, user_checks=True)
    same_state(answers)
    assert answers[0]["step"] == 5 and answers[0]["world_size"] == 4

    # A peer is SIGKILLed mid-round; the survivors' next exchange fails, they shrink the
    # world and redo it, and training goes on.
    victim, survivors = boot[1], [boot[0], boot[2], joiner]
    for p in survivors:
        p.send("train", steps=2 * H, user_checks=True)
    victim.send("train", steps=2 * H, die_at=2, user_checks=True)
    victim.recv(STEP_S, "killing")
    assert victim.proc.wait(30) == -signal.SIGKILL
    answers = [p.recv(4 * T + 60, "train") for p in survivors]
    same_state(answers)
    for a in answers:
        outer = a["outer"]
        assert sum(o["retries"] for o in outer) >= 1, outer
        assert [victim.name] == [n for o in outer for n in o["left"]], outer
        assert outer[-1]["world_size"] == 3 and a["world_size"] == 3
        # The exchanges sent bytes, counted across the communicators of both epochs. Not
        # per report: a report counts what went out since the previous one, and Streaming's
        # exchanges overlap (tau) and run across quiet boundaries, so a fragment's bytes
        # can land in another fragment's report or in a boundary's.
        assert sum(o["bytes_sent"] for o in outer) > 0, outer
        assert all(o["bytes_sent"] >= 0 for o in outer), outer
    assert answers[0]["step"] == 7

    finished = call_all(survivors, "finish", STEP_S)
    same_state(finished)
    final_eval = finished[0]["eval"]
    assert all(f["eval"] == final_eval for f in finished)
    assert final_eval < 0.5 * initial_eval, (initial_eval, final_eval)
    chain.done(survivors)


@pytest.mark.timeout(240)
@pytest.mark.pccl_only
@pytest.mark.parametrize("wrapper", KILLED_WHILE_JOINING)
def test_a_peer_killed_in_the_outer_step_where_another_joins(chain, wrapper):
    """The victim dies while a joiner is pending: the survivors' exchange fails, their
    recovery round (admit=False) leaves the joiner pending, they redo the exchange, and the
    boundary then admits the joiner, whose constructor syncs with them (before the fix the
    recovery round admitted it mid-step and the group hung until the round deadline)."""
    cfg = WRAPPERS[wrapper]
    H = cfg["sync_every"]
    m, boot, joiner = chain.take()
    same_state(call_all(boot, "setup", STEP_S, **cfg))
    same_state(call_all(boot, "train", STEP_S, steps=H))

    joiner.join()
    wait_until(lambda: m.snapshot()["pending"] == 1, 60, "the joiner pending")
    victim, survivors = boot[1], [boot[0], boot[2]]
    for p in survivors:
        p.send("train", steps=H)
    victim.send("train", steps=H, die_at=1)
    victim.recv(STEP_S, "killing")
    assert victim.proc.wait(30) == -signal.SIGKILL
    assert joiner.ready() == 2
    joined = joiner.call("setup", **cfg)
    answers = [p.recv(4 * T + 60, "train") for p in survivors]
    assert joined["sha"] == same_state(answers)
    outer = answers[0]["outer"]
    assert [victim.name] == [n for o in outer for n in o["left"]], outer
    assert outer[-1]["world_size"] == 3 and outer[-1]["joined"] == [joiner.name], outer

    everyone = survivors + [joiner]
    answers = call_all(everyone, "train", STEP_S, steps=2 * H)
    same_state(answers)
    assert all(a["world_size"] == 3 for a in answers)
    chain.done(everyone)


@pytest.mark.timeout(240)
@pytest.mark.pccl_only
def test_diloco_trains_on_while_its_master_is_away(chain):
    """The master stops (what SIGTERM or a crash does to the members): DiLoCo goes on for
    several outer steps with no master at all, bit-identical, skipping the boundaries'
    syncs alike; a master restarted on the same port takes the group back and admits a
    joiner, which receives the state."""
    from torch_pccl.master import start_in_thread

    cfg = WRAPPERS["diloco"]
    H = cfg["sync_every"]
    m, boot, joiner = chain.take()
    same_state(call_all(boot, "setup", STEP_S, **cfg))
    port = m.port
    m.stop()
    wait_until(lambda: all(a["away"] for a in call_all(boot, "master_away", STEP_S)), 30,
               "every member noticing the master is gone")
    trained = call_all(boot, "train", STEP_S, steps=3 * H, user_checks=True)
    same_state(trained)
    assert trained[0]["step"] == 3
    assert all(o["world_size"] == 3 for o in trained[0]["outer"]), trained[0]["outer"]
    assert all(a["away"] for a in call_all(boot, "master_away", STEP_S))

    chain.master = again = start_in_thread("127.0.0.1", port, world_size=3,
                                           heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0,
                                           round_timeout_s=20.0, quiet_epochs=True)
    wait_until(lambda: not any(a["away"] for a in call_all(boot, "master_away", STEP_S)), 30,
               "every member re-registered")
    joiner.join()
    wait_until(lambda: again.snapshot()["pending"] == 1, 60, "the joiner pending")
    for p in boot:
        p.send("train", steps=H, user_checks=True)
    assert joiner.ready() == 3
    joined = joiner.call("setup", **cfg)
    answers = [p.recv(STEP_S, "train") for p in boot]
    assert answers[0]["outer"][-1]["world_size"] == 4, answers[0]["outer"]
    assert answers[0]["outer"][-1]["joined"] == [joiner.name]
    assert joined["changed"] > 0 and joined["received"] > 0
    assert joined["sha"] == same_state(answers)
    everyone = boot + [joiner]
    same_state(call_all(everyone, "train", STEP_S, steps=2 * H))



@pytest.mark.timeout(300)
@pytest.mark.pccl_only
def test_sparse_exchange_parity_over_pccl_at_world_sizes_1_to_4(tmp_path):
    """compression=TopK over pccl: at each world size 1, 2, 3, 4 (peers admitted one at a
    time at an outer boundary), each wrapper is built anew and trains 3 outer steps; every
    peer ends every command with bit-identical shared state, and the payloads went out
    (bytes sent > 0 from world size 2 on, a sparse fraction of a dense exchange's)."""
    from torch_pccl.master import start_in_thread

    m = start_in_thread("127.0.0.1", 0, world_size=1, heartbeat_interval_s=0.5,
                        heartbeat_timeout_s=10.0, round_timeout_s=20.0)
    peers = [Peer(m.address, tmp_path, f"w{i}") for i in range(4)]
    try:
        members = [peers[0]]
        peers[0].join()
        assert peers[0].ready() == 0
        for world in (1, 2, 3, 4):
            for name in ("diloco-topk", "streaming-topk", "async-topk"):
                cfg = WRAPPERS[name]
                same_state(call_all(members, "setup", STEP_S, **cfg))
                answers = call_all(members, "train", STEP_S, steps=3 * cfg["sync_every"])
                same_state(answers)
                assert all(a["world_size"] == world for a in answers), (name, answers)
                sent = sum(o["bytes_sent"] for o in answers[0]["outer"])
                if world > 1:
                    # 1368 float32 parameters: a dense AVG all-reduce sends 2 (W-1)/W x 5472
                    # bytes per round; 3 rounds of payloads (704 bytes a peer) send far less.
                    dense = 3 * 2 * (world - 1) / world * 1368 * 4
                    assert 0 < sent < 0.6 * dense, (name, sent, dense)
            if world == 4:
                break
            joiner = peers[world]
            joiner.join()
            wait_until(lambda: m.snapshot()["pending"] == 1, 60, "the joiner pending")
            cfg = WRAPPERS["async-topk"]           # the incumbents' wrapper admits it
            for p in members:
                p.send("train", steps=cfg["sync_every"])
            assert joiner.ready() == world
            joined = joiner.call("setup", **cfg)
            answers = [p.recv(STEP_S, "train") for p in members]
            assert joined["sha"] == same_state(answers)
            members.append(joiner)
    finally:
        for p in peers:
            p.close()
        m.stop()
