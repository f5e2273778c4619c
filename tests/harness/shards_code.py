"""Sharded replicas under the DiLoCo wrappers, run in a pool of 2 gloo workers for
tests/algorithms/test_diloco_shards.py.

The two workers are the two shards of ONE replica: its model is sharded over a 1-D CPU
mesh of both (FSDP2's ``fully_shard``, or tensor parallel's ``parallelize_module``). The
group across replicas, which would join this shard with the same shard of every other
replica, is faked in each worker by ``SecondReplica``: a second replica whose contribution
to every exchange is computed here, from the same seed, in the same layout. Each worker
also runs the unsharded model from the same seed against the same fake, so a sharded run
is right when its outer parameters, gathered from the shards (``full_tensor()``), are the
unsharded run's. Everything is float64; only comparisons go back to the parent.
"""

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from torch_pccl.algorithms import diloco
from torch_pccl.algorithms.diloco import (AsyncDiLoCo, DiLoCo, Quorum, StreamingDiLoCo,
                                          replica_layout)
from torch_pccl.algorithms.diloco.shards import local
from torch_pccl.algorithms.topk import TopK

from harness.replicas import FixedMembership

_MESH = []


def _mesh():
    """The 1-D CPU mesh of both workers, made once per worker: DTensor caches sharding
    decisions by mesh equality, so an equal mesh made later would reuse the first's groups."""
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)))
    return _MESH[0]


def _mlp(seed, dims):
    """Linear(dims[0], dims[1]), Tanh, Linear(dims[1], dims[2]), float64; nn.Sequential
    names ("0.weight", "2.weight"...), i.e. two blocks, so Streaming DiLoCo can make two
    fragments."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.Tanh(),
                               torch.nn.Linear(dims[1], dims[2])).double()


# FSDP2: 7 and 3 rows over 2 shards are 4 + 3 and 2 + 1, so the padded shards run too.
FSDP_DIMS = (5, 7, 3)
# Tensor parallel: even, so the colwise output feeds the rowwise input shard for shard.
TP_DIMS = (6, 8, 4)


def _sharded(kind, seed):
    """(the model sharded over the mesh, the same model unsharded, its widths).

    ``fsdp``: ``fully_shard`` on the root only (its parameters are then the root's, which
    FSDP2 leaves unsharded after a forward without backward); ``fsdp_nested``: on each
    Linear, then the root; ``tp``: ColwiseParallel then RowwiseParallel."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    dims = TP_DIMS if kind == "tp" else FSDP_DIMS
    ref = _mlp(seed, dims)
    model = copy.deepcopy(ref)
    mesh = _mesh()
    if kind == "tp":
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        if kind == "fsdp_nested":
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, ref, dims


def _shard_of(full, p):
    """This worker's part of ``full`` laid out like parameter ``p`` (``full`` itself for a
    plain tensor): ``distribute_tensor`` without communication."""
    if not isinstance(p, DTensor):
        return full
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class Done:
    """The Work of an exchange the fake completed when it was issued."""

    def wait(self):
        return True

    def is_completed(self):
        return True


class SecondReplica(FixedMembership):
    """A ``Transport`` (torch_pccl.algorithms.diloco.transport) of two replicas: this one
    and a second one, simulated, whose contribution to the n-th all-reduce is
    ``other(buf)`` (``buf``: this replica's contribution) and whose all-gather payload is
    this replica's; shared-state syncs change nothing and record each entry's shape.
    Quorum rounds close at once with both replicas, 1 token each."""

    def __init__(self, other):
        self.other = other
        self.synced = {}

    def world_size(self):
        return 2

    def all_reduce(self, buf, async_op):
        buf.add_(self.other(buf)).div_(2)
        return Done() if async_op else None

    def all_reduce_max(self, buf):
        return Done()              # the simulated replica proposes what this one does

    def all_gather(self, out, inp, async_op=False):
        out.view(2, -1).copy_(inp.reshape(1, -1).expand(2, -1))
        return Done() if async_op else None

    def members(self):
        return (("replica0", "fake-0"), ("replica1", "fake-1"))

    def sync(self, state, revision, max_retries):
        self.synced = {name: list(t.shape) for name, t in state.items()}
        return SimpleNamespace(revision=revision, changed=(), retries=0, bytes_sent=0,
                               bytes_received=0, content=None)

    def report_step(self, step):
        pass

    def peer_id(self):
        return "replica0"

    def quorum_ready(self, round_, tokens, stale, min_peers, grace_s):
        return {"round": round_, "peer_ids": ["replica0", "replica1"], "tokens": [1, 1],
                "stale": [0, 0], "pending": 0}

    def quorum_early(self, round_, tokens, stale, min_peers, grace_s):
        pass

    def quorum_closed(self, round_):
        return None


def _fixed_pseudo_gradient(model, seed):
    """``other`` of a second replica whose pseudo-gradient is fixed: per parameter a seeded
    normal tensor (scale 0.01) of its global shape, of which this worker takes its shard,
    so that position i of shard s is the same element in the sharded and unsharded runs.
    For the wrappers with one fragment (the whole model)."""
    g = torch.Generator().manual_seed(seed)
    parts = [_shard_of(0.01 * torch.randn(p.shape, generator=g, dtype=torch.float64), p)
             for p in model.parameters()]
    flat = torch.cat([t.reshape(-1) for t in parts])

    def other(buf):
        assert buf.numel() == flat.numel(), (buf.numel(), flat.numel())
        return flat.to(buf.dtype)
    return other


def _elementwise(buf):
    """``other`` of a second replica whose contribution is a fixed function of this one's,
    element by element (so any fragment, in any layout, meets the same numbers)."""
    return -0.5 * buf + 1e-3


WRAPPERS = {
    "diloco": (DiLoCo, {}, "fixed"),
    "diloco_int8": (DiLoCo, {"quantization": "int8"}, "fixed"),
    "diloco_quorum": (DiLoCo, {"quorum": Quorum(min_peers=2)}, "elementwise"),
    "streaming": (StreamingDiLoCo, {"num_fragments": 2, "tau": 1, "alpha": 0.5},
                  "elementwise"),
    "async": (AsyncDiLoCo, {}, "fixed"),
    "diloco_topk": (DiLoCo, {"compression": TopK(density=0.5, chunk=4)}, "fixed"),
}


def _wrap(name, model, inner, seed):
    cls, kwargs, other = WRAPPERS[name]
    other = _fixed_pseudo_gradient(model, seed) if other == "fixed" else _elementwise
    fake = SecondReplica(other)
    return cls(model, inner, sync_every=2, group=fake, **kwargs), fake


class _FakeGroups:
    """``transport_for`` returns the group argument (a ``SecondReplica``) while entered,
    as the ``in_process`` fixture of tests/conftest.py does."""

    def __enter__(self):
        self.saved = diloco.transport.transport_for
        diloco.transport.transport_for = lambda group, timeout, bits: group

    def __exit__(self, *exc):
        diloco.transport.transport_for = self.saved


def _batches(seed, dims, steps):
    """(input, target) pairs of 4 rows, the same on both workers: each shard of a replica
    sees the replica's whole batch."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, dims[0], generator=g, dtype=torch.float64),
             torch.randn(4, dims[-1], generator=g, dtype=torch.float64))
            for _ in range(steps)]


def _train(model, wrapper, batches, lr):
    """SGD (momentum 0.9) inner steps, ``wrapper.step()`` after each, then ``finish()``;
    the losses."""
    inner = wrapper.inner_optimizer
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        wrapper.step()
        losses.append(loss.item())
    wrapper.finish()
    return losses


def run_sharded_and_unsharded(kind, wrapper_name, seed, steps=7, lr=0.1):
    """The wrapper ``wrapper_name`` on the sharded model and on the unsharded one, each
    against its ``SecondReplica`` (the same second replica), ``steps`` inner steps at
    H = 2 (the last round left in flight), then ``finish()``. Returns what the parent
    asserts on: per parameter the local and global element counts, the outer copy's and
    the shared state's shapes, the largest |sharded - unsharded| of the gathered outer
    parameters and model parameters, how far the outer parameters moved, and the losses."""
    with _FakeGroups():
        model, ref, dims = _sharded(kind, seed)
        names = [n for n, _ in model.named_parameters()]
        inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        ref_inner = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
        wrapper, fake = _wrap(wrapper_name, model, inner, seed + 1)
        ref_wrapper, _ = _wrap(wrapper_name, ref, ref_inner, seed + 1)
        initial = [o.clone() for o in ref_wrapper.outer_parameters]
        accumulators = [f.sparse.accumulator.numel() for f in wrapper._fragments
                        if f.sparse is not None]
        batches = _batches(seed + 2, dims, steps)
        losses = _train(model, wrapper, batches, lr)
        ref_losses = _train(ref, ref_wrapper, batches, lr)
        outer = wrapper.outer_state_dict()
        params = dict(model.named_parameters())
        out = {"names": names, "losses": losses, "ref_losses": ref_losses,
               "accumulators": accumulators, "synced": fake.synced, "params": {}}
        for i, name in enumerate(names):
            p = params[name]
            got_outer = _full(outer[name])
            want_outer = ref_wrapper.outer_parameters[i]
            out["params"][name] = {
                "dtensor": isinstance(p, DTensor),
                "local_numel": local(p).numel(), "global_numel": p.numel(),
                "local_shape": list(local(p).shape),
                "outer_shape": list(wrapper.outer_parameters[i].shape),
                "outer_diff": (got_outer - want_outer).abs().max().item(),
                "param_diff": (_full(p).detach() - dict(ref.named_parameters())[name]
                               .detach()).abs().max().item(),
                "moved": (want_outer - initial[i]).abs().max().item(),
            }
        return out


def writes_reach_forward(kind, seed):
    """The wrapper's writes into the model reach its forward: after a forward without
    backward (FSDP2 then keeps the root unsharded), new outer parameters are put in the
    shared state (this worker's shards of seeded full tensors), ``_load_outer()`` copies
    them into the model, and the model's loss is compared with the unsharded model's
    holding the full tensors; then the same through ``model.load_state_dict(
    wrapper.outer_state_dict(), strict=False)``. Returns the losses and element counts."""
    with _FakeGroups():
        model, ref, dims = _sharded(kind, seed)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapper, _ = _wrap("diloco", model, inner, seed)
        x, y = _batches(seed + 1, dims, 1)[0]
        g = torch.Generator().manual_seed(seed + 2)
        out = {"outer_numels": [o.numel() for o in wrapper.outer_parameters],
               "local_numels": [local(p).numel() for p in model.parameters()],
               "global_numels": [p.numel() for p in model.parameters()]}
        sharded = list(model.named_parameters())       # the DTensors, before any forward
        for how in ("load_outer", "load_state_dict"):
            model(x)                     # no backward: FSDP2 leaves the root unsharded
            state = wrapper.state()
            full = {}
            for name, p in sharded:
                full[name] = torch.randn(p.shape, generator=g, dtype=torch.float64)
                state[f"outer/{name}"].copy_(_shard_of(full[name], p))
            if how == "load_outer":
                wrapper._load_outer()
            else:
                model.load_state_dict(wrapper.outer_state_dict(), strict=False)
            with torch.no_grad():
                ref.load_state_dict(full)
                out[how] = {"loss": F.mse_loss(_full(model(x)), y).item(),
                            "want": F.mse_loss(ref(x), y).item()}
        return out


def layouts(seed):
    """``replica_layout`` ((digest, description)) of the same MLP (TP_DIMS) as FSDP2 over 2
    shards (and claimed over 4), FSDP2 after a forward without backward, tensor parallel
    over 2, and unsharded (claimed over 2): every shard must compute the same."""
    out = {}
    for kind in ("fsdp", "tp"):
        model = _mlp(seed, TP_DIMS)
        if kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=_mesh())
        else:
            from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                           parallelize_module)

            parallelize_module(model, _mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        out[kind] = tuple(replica_layout(model, 2))
        if kind == "fsdp":
            out["fsdp_4_shards"] = tuple(replica_layout(model, 4))
            model(torch.zeros(1, TP_DIMS[0], dtype=torch.float64))
            out["fsdp_after_forward"] = tuple(replica_layout(model, 2))
    out["plain"] = tuple(replica_layout(_mlp(seed, TP_DIMS), 2))
    return out
