"""User code run inside the pool's workers for tests/c10d/test_user_code.py.

Each function is what an ordinary torch.distributed user writes: object
collectives, ``new_subgroups``, ``DistributedSampler``, DDP communication
hooks, ``ZeroRedundancyOptimizer``, distributed checkpoint and a 2-D
``DeviceMesh``. ``which`` selects the group: ``"default"`` (the group under
test) or ``"gloo"`` (the reference group over the same ranks). Results go
back to the parent as plain data (tensors packed with `harness.data.pack`) so
the parent compares ranks with each other and with gloo's run.
"""

import torch
import torch.distributed as dist

from harness import data
from harness.workers import STATE, _batches, _group, _model, _train


def canonical(obj):
    """obj with every tensor replaced by its packed record (bytes included): plain, comparable."""
    if isinstance(obj, torch.Tensor):
        return {"tensor": data.pack(obj, raw=True)}
    if isinstance(obj, dict):
        return {k: canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(canonical(v) for v in obj)
    return obj


def make_object(seed, rank):
    """An object of rank-dependent type and size: dicts, strings, bytes, a tensor inside a dict."""
    kind = (seed + rank) % 3
    if kind == 0:
        return {
            "rank": rank,
            "name": "r" * (1 + 3000 * rank),
            "nested": {"tensor": data.make_input(seed, rank, 5 + 7 * rank, "float32"),
                       "ints": data.make_input(seed + 1, rank, 3, "int64")},
            "misc": [1, 2.5, None, ("t", rank), b"\x00\xff" * rank],
        }
    if kind == 1:
        return f"rank {rank} says " + "é" * (100 * seed % 17 + rank)
    return {"big": bytes(range(256)) * (40 + rank), "seed": seed, "empty": {}}


# --- 1. object collectives --------------------------------------------------------------------------


def object_collectives(seed, which):
    """all_gather_object, broadcast_object_list, scatter_object_list, gather_object on one group."""
    group = _group(which)
    me, ws = STATE.rank, STATE.world_size
    out = {}

    gathered = [None] * ws
    dist.all_gather_object(gathered, make_object(seed, me), group=group)
    out["all_gather_object"] = canonical(gathered)

    src = ws - 1
    objs = ([make_object(seed + 10, r) for r in range(3)] if me == src else [None, None, None])
    dist.broadcast_object_list(objs, src=src, group=group)
    out["broadcast_object_list"] = canonical(objs)

    received = [None]
    scatter_in = [make_object(seed + 20, r) for r in range(ws)] if me == 0 else None
    dist.scatter_object_list(received, scatter_in, src=0, group=group)
    out["scatter_object_list"] = canonical(received[0])

    dst = 1 % ws
    into = [None] * ws if me == dst else None
    dist.gather_object(make_object(seed + 30, me), into, dst=dst, group=group)
    out["gather_object"] = canonical(into)
    return out


# --- 2. new_subgroups -------------------------------------------------------------------------------


def subgroups_all_reduce(seed, numel, how, backend):
    """new_subgroups(group_size=2) or new_subgroups_by_enumeration; all_reduce in this rank's subgroup."""
    if how == "new_subgroups":
        mine, all_groups = dist.new_subgroups(group_size=2, backend=backend)
    else:
        mine, all_groups = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]], backend=backend)
    try:
        t = data.make_input(seed, STATE.rank, numel, "float32")
        dist.all_reduce(t, group=mine)
        return {
            "result": data.pack(t, raw=True),
            "backend": str(dist.get_backend(mine)),
            "members": dist.get_process_group_ranks(mine),
            "group_rank": dist.get_rank(mine),
            "group_size": dist.get_world_size(mine),
            "n_groups": len(all_groups),
        }
    finally:
        dist.destroy_process_group(mine)


# --- 3. DistributedSampler --------------------------------------------------------------------------


def sampler_shards(n_items, seed, epochs, batch_size):
    """Each epoch's shard from DistributedSampler on the default group and on gloo's numbering,
    and the all_reduced sum of the values this rank's DataLoader yielded."""
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dataset = TensorDataset(torch.arange(n_items, dtype=torch.float64) * 3 + 1)
    ours = DistributedSampler(dataset, shuffle=True, seed=seed)  # rank, size from the default group
    ref = DistributedSampler(dataset, num_replicas=dist.get_world_size(STATE.gloo),
                             rank=dist.get_rank(STATE.gloo), shuffle=True, seed=seed)
    out = {"num_replicas": ours.num_replicas, "rank": ours.rank, "epochs": []}
    for epoch in range(epochs):
        ours.set_epoch(epoch)
        ref.set_epoch(epoch)
        total = torch.zeros(1, dtype=torch.float64)
        for (x,) in DataLoader(dataset, batch_size=batch_size, sampler=ours):
            total += x.sum()
        dist.all_reduce(total)
        out["epochs"].append({"ours": list(ours), "gloo": list(ref),
                              "total": data.pack(total, raw=True)})
    return out


# --- 4. DDP communication hooks ---------------------------------------------------------------------


def train_ddp_hook(seed, steps, which, hook_name, bucket_cap_mb):
    """DDP with a communication hook registered on the chosen group; the hook counts its calls."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _group(which)
    model = DDP(_model(seed), process_group=group, bucket_cap_mb=bucket_cap_mb)
    if hook_name == "allreduce":
        state, hook = group, default_hooks.allreduce_hook
    elif hook_name == "fp16_compress":
        state, hook = group, default_hooks.fp16_compress_hook
    elif hook_name == "powerSGD":
        state = powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2)
        hook = powerSGD.powerSGD_hook
    else:
        raise ValueError(hook_name)
    calls = []

    def counted(state, bucket):
        calls.append(bucket.index())
        return hook(state, bucket)

    model.register_comm_hook(state, counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = _train(model, opt, _batches(seed, steps))
    params = [data.pack(p.detach(), raw=True) for p in model.module.parameters()]
    return {"params": params, "losses": losses, "hook_calls": len(calls)}


# --- 5. ZeroRedundancyOptimizer ---------------------------------------------------------------------


def train_zero(seed, steps, which):
    """DDP + ZeroRedundancyOptimizer(Adam) on the chosen group; the state consolidated on rank 0."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _group(which)
    model = DDP(_model(seed), process_group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  process_group=group, lr=0.01)
    losses = _train(model, opt, _batches(seed, steps))
    params = [data.pack(p.detach(), raw=True) for p in model.module.parameters()]
    opt.consolidate_state_dict(to=0)
    state = None
    if STATE.rank == 0:
        sd = opt.state_dict()
        state = {i: {k: data.pack(v, raw=True) for k, v in s.items() if isinstance(v, torch.Tensor)}
                 for i, s in sd["state"].items()}
    return {"params": params, "losses": losses, "state": state,
            "local_params": sum(len(g["params"]) for g in opt.optim.param_groups)}


# --- 6. distributed checkpoint ----------------------------------------------------------------------


def _differences(got, want, prefix=""):
    """Names (dotted) where two nested state dicts differ (tensors compared bit for bit)."""
    from torch.distributed.tensor import DTensor

    if isinstance(want, DTensor):
        want = want.full_tensor()
    if isinstance(got, DTensor):
        got = got.full_tensor()
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return [prefix]
        return [] if data._bits(got).equal(data._bits(want)) else [prefix]
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return [prefix + " (keys)"]
        return [d for k in want for d in _differences(got[k], want[k], f"{prefix}.{k}")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [prefix + " (len)"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{prefix}[{i}]")]
    return [] if got == want else [prefix]


def _count_tensors(sd):
    if isinstance(sd, torch.Tensor):
        return 1
    if isinstance(sd, dict):
        return sum(_count_tensors(v) for v in sd.values())
    if isinstance(sd, (list, tuple)):
        return sum(_count_tensors(v) for v in sd)
    return 0


def _snapshot(sd):
    """A deep copy of a state dict, DTensors made full (so later training cannot alter it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, DTensor):
        return sd.full_tensor().detach().clone()
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _snapshot(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_snapshot(v) for v in sd]
    return sd


def dcp_round_trip(seed, steps, directory, wrapper):
    """Train a few steps (DDP or FSDP2 over the default group), dcp.save model+optimizer state,
    then dcp.load it into a fresh, differently initialised model and optimizer, once over the
    default group and once with process_group=gloo; returns where the loaded state differs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(model_seed):
        model = _model(model_seed)
        if wrapper == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (STATE.world_size,))
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    model, opt = build(seed)
    _train(model, opt, _batches(seed, steps))
    msd, osd = get_state_dict(model, opt)
    saved = _snapshot({"model": msd, "optim": osd})
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)

    out = {"compared": _count_tensors(saved), "differences": {}, "changed_before_load": {}}
    for which in ("default", "gloo"):
        fresh, fresh_opt = build(seed + 1000)
        _train(fresh, fresh_opt, _batches(seed + 1000, 1))  # optimizer state exists, differs
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        out["changed_before_load"][which] = len(_differences(_snapshot({"model": fmsd, "optim": fosd}),
                                                             saved))
        target = {"model": fmsd, "optim": fosd}
        dcp.load(target, checkpoint_id=directory, process_group=_group(which))
        set_state_dict(fresh, fresh_opt, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        lmsd, losd = get_state_dict(fresh, fresh_opt)
        out["differences"][which] = _differences(_snapshot({"model": lmsd, "optim": losd}), saved)
    return out


# --- 7. two-dimensional DeviceMesh ------------------------------------------------------------------


def mesh_2d_all_reduce(seed, numel):
    """init_device_mesh("cpu", (2, 2), ("dp", "tp")); all_reduce over each dimension's group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = {dim: mesh.get_group(dim) for dim in ("dp", "tp")}
    try:
        out = {"mesh": mesh.mesh.tolist(), "coordinate": mesh.get_coordinate()}
        for dim, group in groups.items():
            t = data.make_input(seed, STATE.rank, numel, "float32")
            dist.all_reduce(t, group=group)
            out[dim] = {
                "result": data.pack(t, raw=True),
                "backend": str(dist.get_backend(group)),
                "members": dist.get_process_group_ranks(group),
                "local_rank": mesh.get_local_rank(dim),
            }
        return out
    finally:
        for group in groups.values():
            dist.destroy_process_group(group)
