"""One process of a sharded replica, for tests/elastic/test_replicas.py.

Shard ``--shard`` of replica ``--replica`` (``--shards`` processes, an inner gloo group on
``--inner-port``) trains a least-squares model whose weight vector is cut into
``--shards`` slices, one per process (tensor parallel by hand: every forward sums the
slices' partial products with an inner all-reduce, so a replica cannot step without all
its processes), with DiLoCo across replicas over ``init_replica_group``. ``--fsdp``
instead trains a two-layer MLP sharded with FSDP2 ``fully_shard`` (DTensor parameters).

It prints JSON lines: ``{"event": "admitted", "world", "rank"}``, then after every outer
step ``{"event": "outer", "step", "epoch", "world", "peers", "digest"}`` (``digest``: the
content digest of DiLoCo's shared state, i.e. this shard's outer parameters, outer
optimizer state and step), and at the end ``{"event": "done"}`` or ``{"event": "error",
"type", "message"}``. With ``--hold-at K`` it prints ``{"event": "held", "step": K}``
after outer step K and waits (bounded) for a line on stdin: ``go`` trains on, ``probe``
prints ``{"event": "probe", "type", "message"}`` of ``torch_pccl.replica_error`` and exits.
An inner step that fails raises ``replica_error``'s error when the master dropped the
replica.
"""

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import torch_pccl  # noqa: E402
from torch_pccl.algorithms.diloco import DiLoCo  # noqa: E402
from torch_pccl.algorithms.diloco.quorum import Quorum  # noqa: E402
from torch_pccl.algorithms.topk import TopK  # noqa: E402
from torch_pccl.elastic.groups import elastic_group  # noqa: E402

from replica_common import emit, init_inner, inner_failed, parser, run, wait_word  # noqa: E402

DIM, BATCH = 48, 16


class Slice(torch.nn.Module):
    """This process's slice of the weight vector (float64)."""

    def __init__(self, full: torch.Tensor, shard: int, shards: int):
        super().__init__()
        self.w = torch.nn.Parameter(full.chunk(shards)[shard].clone())


def make_model(args):
    full = torch.randn(DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    if not args.fsdp:
        return Slice(full, args.shard, args.shards)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 16, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(16, 1, dtype=torch.float64))
    mesh = init_device_mesh("cpu", (args.shards,), mesh_dim_names=("shard",))
    return fully_shard(model, mesh=mesh)


def inner_step(args, model, opt, x, y):
    opt.zero_grad()
    if args.fsdp:
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
    else:
        cols = x.chunk(args.shards, dim=1)[args.shard]
        partial = cols @ model.w.detach()
        dist.all_reduce(partial)                      # the inner group: the whole replica
        resid = partial - y
        model.w.grad = 2.0 * cols.T @ resid / len(y)
    opt.step()


def main():
    ap = parser("one process of a sharded replica trained with DiLoCo")
    ap.add_argument("--outer-steps", type=int, default=6)
    ap.add_argument("--sync-every", type=int, default=3)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--topk", action="store_true")
    ap.add_argument("--quorum", type=int, default=0)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--dim-scale", type=int, default=1, help="another layout: DIM x this")
    args = ap.parse_args()
    global DIM
    DIM *= args.dim_scale
    init_inner(args)
    run(lambda: train(args))


def train(args):
    model = make_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pg = torch_pccl.init_replica_group(args.master, args.replica, model, timeout=args.timeout)
    emit(event="admitted", world=pg.size(), rank=pg.rank())
    diloco = DiLoCo(model, opt, sync_every=args.sync_every, group=pg,
                    quantization=args.quantization,
                    compression=TopK(density=0.25, chunk=16) if args.topk else None,
                    quorum=Quorum(min_peers=args.quorum, grace=1.0) if args.quorum else None)
    gen = torch.Generator().manual_seed(sum(map(ord, args.replica)))
    target = torch.randn(DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    while diloco.step_count < args.outer_steps:
        x = torch.randn(BATCH, DIM, generator=gen, dtype=torch.float64)
        y = x @ target
        try:
            inner_step(args, model, opt, x, y)
        except RuntimeError as exc:
            inner_failed(pg, exc)           # the inner group failed: was the replica dropped?
        if diloco.step() is None:
            continue
        group = elastic_group(pg).membership.assignment
        emit(event="outer", step=diloco.step_count, epoch=group.epoch, world=pg.size(),
             peers=list(group.peer_ids), digest=torch_pccl.content_digest(diloco.state()))
        if diloco.step_count in args.hold_at:
            emit(event="held", step=diloco.step_count)
            wait_word(args, pg)


if __name__ == "__main__":
    main()
