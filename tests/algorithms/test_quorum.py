"""DiLoCo's quorum option (torch_pccl.algorithms.diloco.quorum), its math in this process.

The replicas run on threads (``harness.replicas.ThreadGroup``, whose quorum rounds go
through the master's own rule, ``torch_pccl.master.quorum.QuorumRounds``). One replica
is held back by a hook (an event it waits on before its inner steps) until the others
closed a round without it; then:

- every replica holds bit-identical outer parameters after every round;
- the round's outer update is the token-weighted mean of its participants'
  pseudo-gradients, computed here by hand with an outer SGD of lr 1;
- the held-back replica keeps what it trained: ``outer - local`` after the round equals
  what it had before, and its next round merges it, weighted by 1 / (1 + rounds missed);
- dense, int8 and sparse exchanges alike (the sparse one weighs at decoding).
"""

import threading

import pytest
import torch

from harness.replicas import ThreadGroup
from torch_pccl.algorithms.diloco import DiLoCo, Quorum
from torch_pccl.algorithms.diloco.quorum import round_weights
from torch_pccl.algorithms.topk import TopK, decode_add

pytestmark = pytest.mark.usefixtures("in_process")


class Vec(torch.nn.Module):
    def __init__(self, init, dtype=torch.float64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.as_tensor(init, dtype=dtype).clone())


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def run_on_threads(n, fn):
    results, errors = [None] * n, []

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a replica hung"
    if errors:
        raise errors[0]
    return results


def test_quorum_arguments():
    with pytest.raises(ValueError):
        Quorum(0)
    with pytest.raises(ValueError):
        Quorum(2, grace=-1)
    with pytest.raises(ValueError):
        Quorum(2, grace=float("nan"))
    assert round_weights(["a", "b"], [10, 30], [0, 2]) == {"a": 10.0, "b": 10.0}


@pytest.mark.parametrize("kind", ["dense", "int8", "sparse"])
def test_a_held_back_replica_is_left_out_then_merged_later(kind):
    n, h = 3, 2
    group = ThreadGroup(n)
    dim = 64
    targets = [torch.linspace(-1, 1, dim, dtype=torch.float64) * (r + 1) for r in range(n)]
    options = {"dense": {}, "int8": {"quantization": "int8"},
               "sparse": {"compression": TopK(density=1 / 4, bits=4, chunk=32)}}[kind]
    seen = {}

    def replica(r):
        model = Vec(torch.zeros(dim), torch.float32 if kind != "dense" else torch.float64)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCo(model, inner, outer_optimizer=sgd, sync_every=h, group=group.peer(r),
                   quorum=Quorum(min_peers=2, grace=0.0), **options)
        log = []
        waited = False
        while d.step_count < 3:
            if r < 2 and d.step_count == 1 and not waited:
                # The other hook: in round 1, replicas 0 and 1 train once replica 2 is
                # ready (on threads it could otherwise come last again).
                with group.cond:
                    assert group.cond.wait_for(
                        lambda: group.quorum.open is not None and 2 in group.quorum.open.ready
                        or 1 in group.mailbox[r], 30)
                waited = True
            inner.zero_grad()
            (0.5 * ((model.w - targets[r].to(model.w.dtype)) ** 2).sum()).backward()
            inner.step()
            if r == 2 and d.step_count == 0:
                # The hook: replica 2 waits after its first inner step until the others
                # closed round 0 without it.
                with group.cond:
                    assert group.cond.wait_for(lambda: 0 in group.mailbox[2], 30)
            before = [o.clone() for o in d.outer_parameters]
            drift = (before[0] - model.w.detach().to(before[0].dtype)).clone()
            out = d.step(tokens=10 * (r + 1))
            if out is not None:
                log.append((out.step, out.participants, out.late, before[0], drift,
                            d.outer_parameters[0].clone(),
                            (d.outer_parameters[0] - model.w.detach().to(before[0].dtype))))
        d.finish()
        seen[r] = log
        return d.outer_parameters[0].clone()

    finals = run_on_threads(n, replica)
    for r in range(1, n):
        assert torch.equal(finals[0], finals[r]), f"replica {r} differs"
    for r in range(n):
        assert [x[0] for x in seen[r]] == [1, 2, 3]
        for x, y in zip(seen[0], seen[r]):
            assert torch.equal(x[5], y[5]), f"replica {r}: outer after round {x[0]} differs"
    # Round 0 closed without replica 2: it was late, and the update is the weighted
    # mean of replicas 0 and 1 (tokens 2 x 10 and 2 x 20).
    step, participants, late, before, _, after, _ = seen[0][0]
    assert participants == ("replica0", "replica1") and late == ("replica2",)
    deltas = [x[4] for x in (seen[0][0], seen[1][0])]
    want = before - (20 * deltas[0] + 40 * deltas[1]) / 60
    if kind == "dense":
        assert torch.allclose(after, want, rtol=0, atol=1e-12)
    elif kind == "int8":  # quantized on the wire: close, not equal
        assert torch.allclose(after, want, rtol=0, atol=0.02 * float(want.abs().max()))
    else:
        # Sparse: the weighted mean of the payloads the wire carried (the first
        # all-gather is round 0's), decoded here; replica 2's zeros are not decoded.
        seq = group.kinds().index("all_gather")
        decoded = []
        for r in (0, 1):
            x = torch.zeros(dim)
            assert decode_add(x, group.contribs[seq][r][1], options["compression"])
            decoded.append(x)
        want = before - (20 * decoded[0] + 40 * decoded[1]) / 60
        assert torch.allclose(after, want, rtol=0, atol=1e-6)
    # Replica 2 kept its first inner step's work through the round it missed.
    _, participants2, _, _, drift2, _, kept2 = seen[2][0]
    assert participants2 == participants
    if kind == "dense":
        assert torch.allclose(kept2, drift2, atol=1e-12)
    # It took part in round 1 with what it trained since round 0 began.
    assert "replica2" in seen[0][1][1], seen[0][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_held_back_replica_with_the_model_on_the_gpu(kind):
    """The model on a GPU: a replica held back from round 0 moves its GPU parameters by the
    outer update it took no part in (the outer state stays on the CPU), and every replica
    ends with bit-identical outer parameters that its model holds after finish()."""
    n, h, dim = 3, 2, 64
    group = ThreadGroup(n)
    options = {"dense": {}, "sparse": {"compression": TopK(density=1 / 4, bits=4, chunk=32)}}
    targets = [torch.linspace(-1, 1, dim) * (r + 1) for r in range(n)]

    def replica(r):
        model = Vec(torch.zeros(dim), torch.float32).cuda()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCo(model, inner, outer_optimizer=sgd, sync_every=h, group=group.peer(r),
                   quorum=Quorum(min_peers=2, grace=0.0), **options[kind])
        kept = None
        while d.step_count < 3:
            inner.zero_grad()
            (0.5 * ((model.w - targets[r].cuda()) ** 2).sum()).backward()
            inner.step()
            if r == 2 and d.step_count == 0:
                with group.cond:
                    assert group.cond.wait_for(lambda: 0 in group.mailbox[2], 30)
                drift = d.outer_parameters[0] - model.w.detach().cpu()
            out = d.step()
            if r == 2 and out is not None and out.step == 1:
                assert out.late == ("replica2",)
                kept = d.outer_parameters[0] - model.w.detach().cpu()
                assert torch.allclose(kept, drift, atol=1e-6)
        d.finish()
        assert model.w.is_cuda
        assert torch.equal(model.w.detach().cpu(), d.outer_parameters[0])
        return d.outer_parameters[0].clone()

    finals = run_on_threads(n, replica)
    assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], finals[2])
