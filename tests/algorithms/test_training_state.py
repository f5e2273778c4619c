"""TrainingState alone (no group): what a DDP run's shared state holds, and how numbers and
lazily created optimizer state come back after a sync (docs/elastic-ddp.md)."""

import pytest
import torch
import torch.nn as nn

from torch_pccl.algorithms.elastic_ddp import TrainingState
from torch_pccl.errors import InvalidArgumentError


def _run(steps, opt_cls=torch.optim.AdamW, **opt_kw):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = opt_cls(net.parameters(), lr=0.1, **opt_kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(steps):
        opt.zero_grad()
        net(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
        sched.step()
    return net, opt, sched, TrainingState(net, opt, sched)


def test_entries_name_model_optimizer_scheduler_and_step():
    net, opt, sched, state = _run(3)
    e = state.entries()
    assert e["model/0.weight"].data_ptr() == net[0].weight.data_ptr()  # by reference
    assert "model/1.running_mean" in e and "model/1.num_batches_tracked" in e
    assert e["optimizer/state/0.weight/exp_avg"] is opt.state[net[0].weight]["exp_avg"]
    assert e["optimizer/groups/0/lr"].dtype == torch.float64
    assert e["optimizer/groups/0/lr"].item() == opt.param_groups[0]["lr"] == 0.05
    assert e["optimizer/groups/0/betas/1"].item() == 0.999
    assert e["scheduler/last_epoch"].dtype == torch.int64 and e["scheduler/last_epoch"] == 3
    assert e["optimizer/groups/0/amsgrad"].dtype == torch.bool
    assert e["step"].dtype == torch.int64


def test_restore_writes_the_numbers_back_with_their_types():
    _, opt_a, sched_a, a = _run(5)          # the run's state
    _, opt_b, sched_b, b = _run(1)          # a peer that is behind
    ea, eb = a.entries(), b.entries()
    assert ea.keys() == eb.keys()
    for name, t in eb.items():               # what a sync does: the elected bytes, in place
        t.copy_(ea[name])
    b.restore(eb)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    assert type(opt_b.param_groups[0]["lr"]) is float
    assert opt_b.param_groups[0]["betas"] == (0.9, 0.999)
    assert type(opt_b.param_groups[0]["amsgrad"]) is bool
    assert sched_b.last_epoch == sched_a.last_epoch == 5 and type(sched_b.last_epoch) is int
    assert sched_b.get_last_lr() == sched_a.get_last_lr()
    sched_a.step()
    sched_b.step()
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.AdamW, {}),
                                        (torch.optim.SGD, {"momentum": 0.9}),
                                        (torch.optim.RMSprop, {"momentum": 0.5})])
def test_materialize_gives_a_fresh_optimizer_the_layout_of_one_that_stepped(opt_cls, kw):
    _, _, _, stepped = _run(2, opt_cls, **kw)
    net, opt, _, fresh = _run(0, opt_cls, **kw)
    params = [p.detach().clone() for p in net.parameters()]
    hooks = []
    opt.register_step_post_hook(lambda *a: hooks.append(1))
    wanted = stepped.has_state()
    assert wanted.tolist() == [1] * len(params) and fresh.has_state().sum() == 0
    assert fresh.materialize(wanted) == len(params)
    layout = {k: (v.dtype, v.shape) for k, v in fresh.entries().items()}
    assert layout == {k: (v.dtype, v.shape) for k, v in stepped.entries().items()}
    # The module and its gradients are as they were; the user's hooks saw nothing.
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), params))
    assert all(p.grad is None for p in net.parameters()) and not hooks
    assert fresh.materialize(wanted) == 0


def test_materialize_creates_only_what_others_have():
    net, opt, _, state = _run(0, torch.optim.SGD, momentum=0.9)
    wanted = torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.int32)
    assert state.materialize(wanted) == 1
    assert state.has_state().tolist() == wanted.tolist()


def test_refuses_what_it_cannot_share():
    net = nn.Linear(2, 2)
    other = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="not the module's"):
        TrainingState(net, torch.optim.SGD(other.parameters(), lr=0.1))
