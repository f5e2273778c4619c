"""One process of a sharded replica trained with ``ReplicaDataParallel``, for
tests/elastic/test_replica_ddp.py.

Shard ``--shard`` of replica ``--replica`` (``--shards`` processes, an inner gloo group on
``--inner-port``) trains a two-layer MLP sharded with FSDP2 ``fully_shard`` (DTensor
parameters; AdamW, whose moments are DTensors too, and a LambdaLR schedule) on batches of
its own (seeded by replica, shard and step), and averages its local gradient shards with
the same shard of the other replicas every step over ``init_replica_group``'s ring.

It prints JSON lines: ``{"event": "admitted", "world", "rank"}``; after the constructor
(the first boundary) and after every step's ``boundary()`` ``{"event": "step", "step",
"epoch", "world", "recoveries", "joined", "digest"}``, where ``digest`` is the content
digest of this shard's local parameters, local optimizer state, learning rate and step,
taken here from the model and the optimizer (not from the wrapper); at the end
``{"event": "done"}`` or ``{"event": "error", "type", "message"}``. With ``--hold-at K`` it
prints ``{"event": "held", "step": K}`` after the backward that follows step K, before
``step()``, and waits (bounded) for a line on stdin: ``go`` goes on, ``probe`` prints
``{"event": "probe", "type", "message"}`` of ``torch_pccl.replica_error`` and exits. Every
event carries ``t``, the wall clock (seconds), for reading a slow run's timeline.
"""

import torch

torch.set_num_threads(1)

import torch_pccl  # noqa: E402
from torch_pccl.algorithms.diloco.shards import is_dtensor, local, reshard  # noqa: E402
from torch_pccl.elastic.groups import elastic_group  # noqa: E402

from replica_common import emit, init_inner, inner_failed, parser, run, wait_word  # noqa: E402

DIM, HIDDEN, BATCH = 24, 8, 8


def make_model(shards):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN, dtype=torch.float64),
                                torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, 1, dtype=torch.float64))
    mesh = init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",))
    return fully_shard(model, mesh=mesh)


def shard_digest(model, opt, step):
    """This shard's local parameters and optimizer state, the learning rate and the step."""
    reshard(model)
    state = {}
    for name, p in model.named_parameters():
        state[f"param/{name}"] = local(p)
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"opt/{name}/{key}"] = local(value) if is_dtensor(value) else value
    state["lr"] = torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64)
    state["step"] = torch.tensor(step, dtype=torch.int64)
    return torch_pccl.content_digest(state)


def main():
    ap = parser("one process of a sharded replica trained with ReplicaDataParallel")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    init_inner(args)
    run(lambda: train(args))


def train(args):
    model = make_model(args.shards)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))
    pg = torch_pccl.init_replica_group(args.master, args.replica, model, timeout=args.timeout)
    emit(event="admitted", world=pg.size(), rank=pg.rank())
    rdp = torch_pccl.ReplicaDataParallel(model, opt, sched, group=pg)
    target = torch.randn(DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def report(recoveries):
        emit(event="step", step=rdp.step_count,
             epoch=elastic_group(pg).membership.assignment.epoch, world=pg.size(),
             recoveries=recoveries, joined=list(rdp.last_boundary.joined),
             digest=shard_digest(model, opt, rdp.step_count))

    report(0)
    while rdp.step_count < args.steps:
        k = rdp.step_count
        seed = 1000 * k + 10 * args.shard + sum(map(ord, args.replica))
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(BATCH, DIM, generator=gen, dtype=torch.float64)
        y = torch.tanh(x @ target)
        opt.zero_grad()
        try:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            loss.backward()
        except RuntimeError as exc:
            inner_failed(pg, exc)           # the inner group failed: was the replica dropped?
        if k in args.hold_at:
            emit(event="held", step=k)
            wait_word(args, pg)
        changes = rdp.step()
        rdp.boundary()
        report(len(changes))


if __name__ == "__main__":
    main()
