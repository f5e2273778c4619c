"""Quorum rounds for the overlapping variants, ``StreamingDiLoCo(quorum=...)`` and
``AsyncDiLoCo(quorum=...)``: their math in this process (docs/diloco.md, "Stragglers:
quorum rounds").

The replicas run on threads (``harness.replicas.ThreadGroup``: the master's own quorum
rule, every collective numbered and checked for kind). One replica is held back by a hook
(an event it waits on after its first inner step) until the others closed the first round
without it. Then:

- every replica holds bit-identical shared state after every outer step (the digests the
  group's sync records per revision) and the same outer parameters at the end;
- the first round's exchange carried the participants' pseudo-gradients times their
  weights (tokens) and the held-back replica's zeros, and the outer update is their
  token-weighted mean (outer SGD of lr 1: exact in float64);
- the held-back replica keeps what it trained through the round it missed (``outer -
  local`` unchanged by the update it followed) and takes part in a later round of the
  same stream with a non-zero contribution;
- Streaming: one round per fragment send, in send order; its exchanges stay in flight
  while the replicas train (applied tau inner steps after they were sent).
"""

import pytest
import torch

from harness.replicas import ThreadGroup
from harness.threads import on_threads
from torch_pccl.algorithms.diloco import AsyncDiLoCo, Quorum, StreamingDiLoCo
from torch_pccl.algorithms.topk import TopK

pytestmark = pytest.mark.usefixtures("in_process")

DIM = 32


class Two(torch.nn.Module):
    """Two parameters: Streaming's two fragments."""

    def __init__(self, dtype):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(DIM, dtype=dtype))
        self.b = torch.nn.Parameter(torch.zeros(DIM, dtype=dtype))


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def targets(r, dtype):
    return (torch.linspace(-1, 1, DIM, dtype=dtype) * (r + 1),
            torch.linspace(1, -1, DIM, dtype=dtype) * (r + 2))


def train_once(model, inner, r):
    ta, tb = targets(r, model.a.dtype)
    inner.zero_grad()
    (0.5 * ((model.a - ta) ** 2).sum() + 0.5 * ((model.b - tb) ** 2).sum()).backward()
    inner.step()


def hold(group, rank, round_):
    """Waits until quorum round ``round_`` closed and reached ``rank``'s mailbox."""
    with group.cond:
        assert group.cond.wait_for(lambda: round_ in group.mailbox[rank], 30)


def wait_for_replica_2(group, rank, round_):
    """Holds ``rank`` until replica 2 is ready in the open round or round ``round_`` closed
    (so that the round takes replica 2); True."""
    with group.cond:
        assert group.cond.wait_for(
            lambda: group.quorum.open is not None and 2 in group.quorum.open.ready
            or round_ in group.mailbox[rank], 30)
    return True


def drifts(d, model):
    """``outer - local`` of both parameters."""
    return [o - p.detach() for o, p in zip(d.outer_parameters, (model.a, model.b))]


def same_digests(group, n):
    assert group.digests, "no sync recorded"
    for revision, per_rank in group.digests.items():
        assert len(per_rank) == n and len(set(per_rank.values())) == 1, \
            f"shared state differs at revision {revision}"


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_streaming_rounds_per_fragment_with_a_held_back_replica(kind):
    n, h, tau = 3, 4, 1
    group = ThreadGroup(n)
    dtype = torch.float64 if kind == "dense" else torch.float32
    options = {"dense": {}, "sparse": {"compression": TopK(density=1 / 4, bits=4, chunk=16)}}
    records = {}

    def replica(r):
        model = Two(dtype)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        d = StreamingDiLoCo(model, inner, outer_optimizer=sgd, sync_every=h,
                            fragments=[[model.a], [model.b]], tau=tau, alpha=0.5,
                            group=group.peer(r), quorum=Quorum(min_peers=2, grace=0.0),
                            **options[kind])
        assert d.fragment_offsets == [0, 2]      # fragment 1 sends first, at step 2
        log, waited, t = [], False, 0
        while d.step_count < 3:
            if r < 2 and d.step_count == 1 and not waited:
                # In the second outer step, 0 and 1 train on once replica 2 is ready for
                # its round (on threads it could otherwise come last again).
                waited = wait_for_replica_2(group, r, 2)
            train_once(model, inner, r)
            t += 1
            if r == 2 and t == 1:
                hold(group, 2, 0)              # round 0 (fragment 1) closes without it
            drift = drifts(d, model)
            out = d.step(tokens=10 * (r + 1))
            after = drifts(d, model)
            log.append((t, drift, after, len(d._pending), out,
                        [o.clone() for o in d.outer_parameters]))
        d.finish()
        records[r] = log
        return [o.clone() for o in d.outer_parameters]

    finals = on_threads(replica, n)
    for r in range(1, n):
        assert all(torch.equal(a, b) for a, b in zip(finals[0], finals[r])), r
    same_digests(group, n)
    # Rounds 0..5 (3 outer steps x 2 fragments), numbered revision * 2 + position.
    announced = group.mailbox[0]
    assert sorted(announced)[:6] == [0, 1, 2, 3, 4, 5]
    for r in range(n):
        for k in range(6):
            assert group.mailbox[r][k] == announced[k], (r, k)
    first = announced[0]
    assert first["peer_ids"] == ["replica0", "replica1"]
    assert first["tokens"] == [20, 40]           # two inner steps each, told a step ahead
    # The first collective is round 0's exchange of fragment 1 (b): the participants'
    # weighted pseudo-gradients, replica 2's zeros.
    kinds = group.kinds()
    assert kinds[0] == ("all_reduce" if kind == "dense" else "all_gather")
    sent = group.contribs[0]
    # Each participant sent at the step it saw the round closed (its second or, had the
    # other's ready not come yet, its third: it trains on while the round is open), and
    # applied it tau = 1 inner step later: in flight across that step.
    issued = {r: next(i for i, x in enumerate(records[r]) if x[3]) for r in (0, 1)}
    for r in (0, 1):
        assert records[r][issued[r]][0] in (2, 3), records[r][issued[r]][0]
        assert records[r][issued[r]][5][1].abs().max() == 0     # b not moved yet
        assert records[r][issued[r] + 1][5][1].abs().max() > 0  # applied at the next step
    if kind == "dense":
        assert torch.count_nonzero(sent[2][1]) == 0
        for r in (0, 1):
            drift_b = records[r][issued[r]][1][1]    # outer - local of b when it was sent
            assert torch.allclose(sent[r][1], (20 * (r + 1)) * drift_b, rtol=0, atol=1e-12)
        # Outer SGD lr 1: the weighted mean of the two.
        want = -(sent[0][1] + sent[1][1]) / 60
        applied = records[0][issued[0] + 1][5][1]
        assert torch.allclose(applied, want, rtol=0, atol=1e-12)
    # Replica 2 followed round 0's update and kept its own work on b.
    t1 = records[2][0]
    assert t1[0] == 1
    if kind == "dense":
        assert torch.allclose(t1[2][1], t1[1][1], rtol=0, atol=1e-12)
        assert torch.count_nonzero(t1[1][1]) > 0
    # ... and took part in a later round of fragment 1 (rounds 2 and 4).
    later = [announced[k] for k in (2, 4)]
    assert any("replica2" in a["peer_ids"] for a in later), later
    k = 2 if "replica2" in announced[2]["peer_ids"] else 4
    i = announced[k]["peer_ids"].index("replica2")
    assert announced[k]["stale"][i] == 1         # merged with 1 / (1 + 1) of its tokens


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_async_rounds_with_a_held_back_replica(kind):
    n, h = 3, 2
    group = ThreadGroup(n)
    dtype = torch.float64 if kind == "dense" else torch.float32
    options = {"dense": {}, "sparse": {"compression": TopK(density=1 / 4, bits=4, chunk=16)}}
    records = {}

    def replica(r):
        model = Two(dtype)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        d = AsyncDiLoCo(model, inner, outer_optimizer=sgd, sync_every=h, group=group.peer(r),
                        quorum=Quorum(min_peers=2, grace=0.0), **options[kind])
        log, waited, t = [], False, 0
        while d.step_count < 4:
            if r < 2 and d.step_count == 2 and not waited:
                waited = wait_for_replica_2(group, r, 2)    # round 2: with replica 2
            train_once(model, inner, r)
            t += 1
            if r == 2 and t == 1:
                hold(group, 2, 1)              # rounds 0 and 1 close without it
            drift = drifts(d, model)
            out = d.step(tokens=10 * (r + 1))
            after = drifts(d, model)
            log.append((t, drift, after, out, [o.clone() for o in d.outer_parameters]))
        d.finish()
        records[r] = log
        return [o.clone() for o in d.outer_parameters]

    finals = on_threads(replica, n)
    for r in range(1, n):
        assert all(torch.equal(a, b) for a, b in zip(finals[0], finals[r])), r
    same_digests(group, n)
    announced = group.mailbox[0]
    for k in (0, 1):
        assert announced[k]["peer_ids"] == ["replica0", "replica1"], announced[k]
        for r in range(n):
            assert group.mailbox[r][k] == announced[k]
    assert announced[0]["tokens"] == [20, 40]
    sent = group.contribs[0]
    if kind == "dense":
        # Each sent what it trained until it saw round 0 closed (at its second or third
        # step: it trains on while the round is open).
        at = {r: next(x for x in records[r] if x[3] is not None) for r in (0, 1)}
        assert all(at[r][0] in (2, 3) for r in (0, 1)), [at[r][0] for r in (0, 1)]
        flat = [torch.cat([x.reshape(-1) for x in at[r][1]]) for r in (0, 1)]
        assert torch.count_nonzero(sent[2][1]) == 0
        for r in (0, 1):
            assert torch.allclose(sent[r][1], (20 * (r + 1)) * flat[r], rtol=0, atol=1e-12)
        # S takes round 0's weighted mean one round later (round 1's close), not before.
        s0 = torch.cat([o.reshape(-1) for o in at[0][4]])
        assert s0.abs().max() == 0
        r1 = next(x for x in records[0] if x[3] is not None and x[3].step == 2)
        s1 = torch.cat([o.reshape(-1) for o in r1[4]])
        assert torch.allclose(s1, -(sent[0][1] + sent[1][1]) / 60, rtol=0, atol=1e-12)
        # Replica 2 followed that update at its second step (round 1, closed without
        # it): S moved, and what it trained stayed in S - local.
        t2 = records[2][1]
        assert t2[0] == 2 and t2[3].participants == ("replica0", "replica1")
        assert torch.equal(t2[4][0], r1[4][0])
        for before, after in zip(t2[1], t2[2]):
            assert torch.allclose(after, before, rtol=0, atol=1e-12)
            assert torch.count_nonzero(before) > 0
    # ... and took part in round 2 with it, 2 rounds stale.
    assert "replica2" in announced[2]["peer_ids"], announced[2]
    i = announced[2]["peer_ids"].index("replica2")
    assert announced[2]["stale"][i] == 2
    seq = 2      # round 2's exchange: the third collective
    assert torch.count_nonzero(group.contribs[seq][2][1]) > 0


def test_streaming_quorum_arguments():
    """At most 16 fragments with a quorum (the rounds' announcements a late member can
    still read); tokens must be an int >= 0."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(2)) for _ in range(17)])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="at most 16"):
        StreamingDiLoCo(model, inner, sync_every=34, fragments=[[p] for p in model],
                        group=ThreadGroup(1).peer(0), quorum=Quorum(1))
    group = ThreadGroup(1)
    d = StreamingDiLoCo(model, inner, sync_every=4, fragments=[[p] for p in model[:2]]
                        + [list(model[2:])], group=group.peer(0), quorum=Quorum(1), tau=1)
    with pytest.raises(ValueError, match="tokens"):
        d.step(tokens=-1)
    a = AsyncDiLoCo(model, inner, sync_every=2, group=ThreadGroup(1).peer(0), quorum=Quorum(1))
    with pytest.raises(ValueError, match="tokens"):
        a.step(tokens=1.5)
