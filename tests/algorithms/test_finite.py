"""Non-finite contributions are rejected and their senders named (issue 12, item 3):
``torch_pccl.all_reduce_finite`` and the DiLoCo wrappers' ``reject_nonfinite``.

Two kinds of tests:

- in this process, on an in-process group of replicas (``harness.replicas``): the
  slow path's own logic (``exclude_nonfinite``: a peer that says "finite" and is not,
  chunked gathers, every contribution rejected, an overflow), and each wrapper with
  one replica's local parameters set to NaN: the others' outer parameters stay
  finite and identical and the report names the offender; with the option off the
  same run poisons every replica (so the tests show the option matters);
- over pccl, 3 processes (tests/harness/finite_worker.py; a fixed world whose rank 0
  starts the automatic master, so ranks have peer ids): ``all_reduce_finite`` plain
  and quantized, with a NaN or an inf on one rank, against the expected result
  computed by every rank, and DiLoCo on the real transport. Every wait is bounded;
  every process is killed in a finally.
"""

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import HARNESS, REPO
from harness.replicas import ThreadGroup
from harness.threads import on_threads
from harness.worker_process import WorkerProcess, call_all
from torch_pccl import NonFiniteError
from torch_pccl.algorithms import finite
from torch_pccl.algorithms.diloco import AsyncDiLoCo, DiLoCo, StreamingDiLoCo
from torch_pccl.algorithms.finite import exclude_nonfinite

pytestmark = pytest.mark.timeout(180)

AVG, SUM = dist.ReduceOp.AVG, dist.ReduceOp.SUM
NAN = float("nan")


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


# -- exclude_nonfinite on an in-process group ------------------------------------------


def screen_on_threads(contributions, op=AVG, lie=None):
    """Each replica r all-reduces contributions[r] (AVG, as the replicas do) and runs
    exclude_nonfinite on the result; ``lie``: a rank that says its contribution is finite.
    Returns per rank (result tensor, rejected ranks or the exception) and the group."""
    group = ThreadGroup(len(contributions))

    def rank(r):
        peer = group.peer(r)
        contribution = contributions[r].clone()
        t = contribution.clone()
        peer.all_reduce(t, async_op=False)
        gathers = []

        def all_gather(out, inp):
            if r == lie and not gathers:     # the first gather holds the claims
                inp = torch.zeros(1)         # "my contribution is finite"
            gathers.append(inp.numel())
            peer.all_gather(out, inp)

        try:
            got = exclude_nonfinite(t, contribution, op, group.n, all_gather, peer.members())
        except NonFiniteError as exc:
            got = exc
        return t, got

    return on_threads(rank, len(contributions)), group


def test_a_peer_that_says_finite_is_caught_and_the_pass_starts_over(monkeypatch, caplog):
    # Chunks of 3 elements per rank: rank 2's NaN sits in the last chunk.
    monkeypatch.setattr(finite, "GATHER_CHUNK_BYTES", 3 * 3 * 4)
    xs = [torch.arange(10, dtype=torch.float32) * (r + 1) + 0.1 for r in range(3)]
    xs[2][9] = NAN
    with caplog.at_level("WARNING", logger="torch_pccl"):
        out, group = screen_on_threads(xs, lie=2)
    named = [r for r in caplog.records if "rank 2 (peer replica2 at thread-2)" in r.getMessage()]
    assert len(named) == 3, caplog.text          # one warning per replica
    expected = (xs[0] + xs[1]) / 2
    for t, rejected in out:
        assert rejected == (2,)
        assert same_bits(t, expected)
    # all-reduce, the claims, 4 chunks cut short at the last one, the 4 chunks again.
    assert group.kinds() == ["all_reduce"] + ["all_gather"] * 9


def test_every_contribution_rejected_or_an_overflow_raises_and_restores():
    xs = [torch.tensor([1.0, NAN]), torch.tensor([NAN, 2.0])]
    out, _ = screen_on_threads(xs)
    for (t, err), x in zip(out, xs):
        assert isinstance(err, NonFiniteError) and isinstance(err, ValueError), err
        assert "every contribution" in str(err) and "peer replica1" in str(err), err
        assert same_bits(t, x), "the tensor does not hold its contribution again"
    # Two finite contributions whose sum overflows float32, and a NaN one.
    xs = [torch.tensor([3e38, 1.0]), torch.tensor([3e38, 1.0]), torch.tensor([NAN, 1.0])]
    out, _ = screen_on_threads(xs, op=SUM)
    for (t, err), x in zip(out, xs):
        assert isinstance(err, NonFiniteError) and "overflows" in str(err), err
        assert "rank 2 (peer replica2 at thread-2)" in str(err), err
        assert same_bits(t, x)


def test_a_finite_result_costs_nothing_on_the_wire():
    xs = [torch.randn(100, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    out, group = screen_on_threads(xs)
    assert all(rejected == () for _, rejected in out)
    assert group.kinds() == ["all_reduce"]


# -- the DiLoCo wrappers on an in-process group ------------------------------------------


# The ``in_process`` fixture (tests/conftest.py) runs the wrappers on it.


class Vec(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))


class Blocks(torch.nn.Module):
    """Two 'blocks' (blocks.0.w, blocks.1.w: Streaming's two fragments) of one float64
    vector each."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Vec() for _ in range(2))

    def vectors(self):
        return [b.w for b in self.blocks]


WRAPPERS = {
    "diloco": lambda m, i, g, reject: DiLoCo(
        m, i, lambda p: torch.optim.SGD(p, lr=1.0), sync_every=H, group=g,
        reject_nonfinite=reject),
    "streaming": lambda m, i, g, reject: StreamingDiLoCo(
        m, i, sync_every=H, num_fragments=2, tau=1, group=g, reject_nonfinite=reject),
    "async": lambda m, i, g, reject: AsyncDiLoCo(m, i, sync_every=H, group=g,
                                                 reject_nonfinite=reject),
}
H, ROUNDS, POISON_T, VICTIM = 4, 4, 6, 1   # replica 1 turns NaN after inner step 6


def run_replicas(make, reject, n=3):
    """n replicas on 0.5 * |w - target_r|^2; after inner step POISON_T replica VICTIM's
    parameters become NaN. Returns per replica the list of (t, OuterStep, outer
    parameters) of every step that reported, and the group."""
    group = ThreadGroup(n)

    def replica(r):
        model = Blocks()
        inner = torch.optim.SGD(model.parameters(), lr=0.2)
        d = make(model, inner, group.peer(r), reject)
        target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + r
        reports = []
        for t in range(1, H * ROUNDS + 1):
            loss = sum(0.5 * ((w - target) ** 2).sum() for w in model.vectors())
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()
            if r == VICTIM and t == POISON_T:
                with torch.no_grad():
                    for w in model.vectors():
                        w.fill_(NAN)
            o = d.step()
            if o is not None:
                reports.append((t, o, [p.clone() for p in d.outer_parameters]))
        return reports

    return on_threads(replica, n, deadline_s=60), group


def poisoned_from(reports):
    """The first inner step at which a replica's outer parameters were not finite (None:
    never)."""
    for t, _, outer in reports:
        if not all(bool(torch.isfinite(p).all()) for p in outer):
            return t
    return None


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_nan_pseudo_gradient_is_left_out_and_its_sender_named(in_process, wrapper):
    by_replica, group = run_replicas(WRAPPERS[wrapper], reject=True)
    first = by_replica[0]
    assert len({len(r) for r in by_replica}) == 1
    named = []
    for k, (t, o, outer) in enumerate(first):
        for other in by_replica[1:]:          # the same report and bytes on every replica
            assert other[k][0] == t and other[k][1].rejected == o.rejected, wrapper
            assert all(same_bits(a, b) for a, b in zip(other[k][2], outer)), (wrapper, t)
        named += [(t, p) for p in o.rejected]
    assert poisoned_from(first) is None, f"{wrapper}: outer parameters became non-finite"
    assert named and all(p == f"replica{VICTIM}" for _, p in named), named
    assert min(t for t, _ in named) > POISON_T
    assert "all_gather" in group.kinds()
    if wrapper == "diloco":
        # The outer step is FedAvg (SGD lr 1): the victim's NaN round is exactly the mean
        # of the two others' local parameters, and the victim is healed by it (its model
        # gets the outer parameters), so only that round names it.
        assert [t for t, _ in named] == [8]


def test_the_diloco_nan_round_averages_the_others_exactly(in_process):
    """One round, by hand: the outer parameters = outer - (g_0 + g_2) / 2, g_r = outer -
    local_r, the sum in rank order (what the slow path documents)."""
    group = ThreadGroup(3)

    def replica(r):
        model = Blocks()
        inner = torch.optim.SGD(model.parameters(), lr=0.5)
        d = WRAPPERS["diloco"](model, inner, group.peer(r), True)
        with torch.no_grad():
            for k, w in enumerate(model.vectors()):
                w.copy_(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) * (r + 1) + k)
                if r == VICTIM:
                    w[1] = NAN
        for _ in range(H - 1):
            assert d.step() is None
        locals_ = [w.detach().clone() for w in model.vectors()]
        return d.step(), d.outer_parameters, locals_

    out = on_threads(replica, 3)
    zero = torch.zeros(3, dtype=torch.float64)
    for o, outer, _ in out:
        assert o.rejected == (f"replica{VICTIM}",)
        for k in range(2):
            g0, g2 = zero - out[0][2][k], zero - out[2][2][k]
            assert same_bits(outer[k], zero - 1.0 * ((g0 + g2) / 2)), k


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_without_the_option_one_nan_poisons_every_replica(in_process, wrapper):
    by_replica, group = run_replicas(WRAPPERS[wrapper], reject=False)
    for reports in by_replica:
        t = poisoned_from(reports)
        assert t is not None and t > POISON_T, (wrapper, t)
        assert all(not o.rejected for _, o, _ in reports)
        # ... and for good: every later report is non-finite too.
        assert all(not all(bool(torch.isfinite(p).all()) for p in outer)
                   for tt, _, outer in reports if tt >= t), wrapper
    assert set(group.kinds()) == {"all_reduce"}


def test_reject_nonfinite_must_be_a_bool():
    model = Blocks()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for cls in (DiLoCo, StreamingDiLoCo, AsyncDiLoCo):
        with pytest.raises(ValueError, match="reject_nonfinite"):
            cls(model, inner, reject_nonfinite=1)


# -- over pccl: 3 processes -----------------------------------------------------------------

T = 10.0        # seconds: the group's op timeout
START_S = 120.0  # seconds: a worker's start (imports torch) on a loaded 2-core machine
STEP_S = 2 * T + 30
WORKER = os.path.join(HARNESS, "finite_worker.py")


class Rank(WorkerProcess):
    def __init__(self, tmp_path, port, rank, world):
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"))
                                              if p))
        super().__init__(f"rank{rank}", [sys.executable, WORKER, str(port), str(rank),
                                         str(world), str(T)], env, tmp_path / f"rank{rank}.stderr")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, backend):
    """3 worker processes in one pccl group, and each one's (peer id, address)."""
    if backend != "pccl":
        pytest.skip("pccl-only behaviour")
    world = 3
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    tmp = tmp_path_factory.mktemp("finite")
    procs = []
    try:
        procs = [Rank(tmp, store.port, r, world) for r in range(world)]
        for p in procs:
            p.recv(START_S, "ready")
        who = call_all(procs, "whoami", STEP_S)
        assert [w["rank"] for w in who] == [0, 1, 2]
        yield procs, [(w["peer_id"], w["addr"]) for w in who]
    finally:
        for p in procs:
            p.close()


POISONED = {
    "nan-avg": dict(seed=1, numel=10_007, op="AVG", poison={"1": "nan"}),
    "inf-sum": dict(seed=2, numel=513, op="SUM", poison={"2": "inf"}),
    "-inf-bf16": dict(seed=3, numel=300, op="AVG", dtype="bfloat16", poison={"0": "-inf"}),
    "nan-int8": dict(seed=4, numel=5000, op="AVG", bits=8, poison={"1": "nan"}),
    "inf-int4": dict(seed=5, numel=777, op="SUM", bits=4, poison={"2": "inf"}),
    "two-of-three": dict(seed=6, numel=100, op="AVG", poison={"0": "nan", "2": "inf"}),
}


@pytest.mark.parametrize("case", sorted(POISONED))
def test_a_non_finite_contribution_is_rejected_and_its_sender_named(ranks, case):
    procs, members = ranks
    cfg = POISONED[case]
    res = call_all(procs, "reduce", STEP_S, **cfg)
    bad = sorted(int(r) for r in cfg["poison"])
    assert len({r["sha"] for r in res}) == 1, f"{case}: results differ across ranks"
    for r in res:
        assert r["finite"] and r["sha"] == r["expected_sha"], (case, r)
        assert r["rejected"] == bad and r["accepted"] == 3 - len(bad), (case, r)
        assert r["peer_ids"] == [members[b][0] for b in bad], (case, r, members)
        assert r["addrs"] == [members[b][1] for b in bad], (case, r, members)


@pytest.mark.parametrize("case", [dict(op="AVG"), dict(op="SUM"), dict(op="AVG", bits=8),
                                  dict(op="SUM", bits=4), dict(op="SUM", dtype="float64")],
                         ids=["avg", "sum", "int8", "int4", "float64"])
def test_finite_contributions_give_exactly_the_plain_all_reduce(ranks, case):
    procs, _ = ranks
    res = call_all(procs, "reduce", STEP_S, seed=9, numel=4099, **case)
    for r in res:
        assert r["sha"] == r["expected_sha"] and r["rejected"] == [] and r["peer_ids"] == []
    assert len({r["sha"] for r in res}) == 1


def test_every_contribution_non_finite_raises_everywhere_and_the_group_goes_on(ranks):
    procs, _ = ranks
    for bits in (0, 8):
        res = call_all(procs, "all_rejected", STEP_S, numel=1000, bits=bits)
        for r in res:
            assert r["error"] and r["error"]["type"] == "NonFiniteError", r
            assert "ValueError" in r["error"]["mro"] and r["unchanged"], r
    res = call_all(procs, "reduce", STEP_S, seed=10, numel=50, op="AVG")
    assert all(r["sha"] == r["expected_sha"] for r in res)


def test_bad_arguments_raise_before_the_network(ranks):
    procs, _ = ranks
    for r in call_all(procs, "bad_arguments", STEP_S):
        assert all(mro and "InvalidArgumentError" in mro and "ValueError" in mro
                   for mro in r["errors"].values()), r["errors"]
        assert r["after"] == [3.0] * 5           # 0 + 1 + 2: the group is still in step


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_diloco_over_pccl_names_the_sender_and_stays_finite(ranks, quantization):
    procs, members = ranks
    kw = dict(rounds=4, poison_round=2, poison_rank=1, quantization=quantization)
    on = call_all(procs, "diloco", STEP_S, reject=True, **kw)
    for k in range(4):
        rounds = [r["rounds"][k] for r in on]
        assert len({r["sha"] for r in rounds}) == 1, f"round {k + 1}: outer parameters differ"
        assert all(r["finite"] for r in rounds), f"round {k + 1}: not finite"
        expect = [members[1][0]] if k + 1 == 2 else []
        assert all(r["rejected"] == expect for r in rounds), (k + 1, rounds)
    if quantization is None:
        off = call_all(procs, "diloco", STEP_S, reject=False, **kw)
        for r in off:
            assert [x["finite"] for x in r["rounds"]] == [True, False, False, False], r
            assert all(x["rejected"] == [] for x in r["rounds"])
