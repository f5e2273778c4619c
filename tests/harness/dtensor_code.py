"""DTensor, tensor parallel and FSDP2 code run inside the pool's workers for tests/c10d/test_dtensor.py.

Each function builds a ``DeviceMesh`` on the default group (the backend under test), runs the
distributed code, and runs the one-process reference in the same worker from the same seed;
only the comparisons go back to the parent (`_compare`: shapes, exact equality, the largest
absolute difference and the reference's scale), so no tensor crosses a process boundary.
The meshes are made once per worker and kept (see `_mesh`).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from harness.workers import STATE


def _compare(got, want):
    """What the parent asserts on: got (a DTensor is gathered first) against want."""
    if isinstance(got, DTensor):
        got = got.full_tensor()
    got, want = got.detach(), want.detach()
    same_shape = got.shape == want.shape
    return {
        "shape": list(got.shape),
        "want_shape": list(want.shape),
        "exact": bool(same_shape and got.dtype == want.dtype and torch.equal(got, want)),
        "max_abs": (got - want).abs().max().item() if same_shape and got.numel() else float(not same_shape),
        "scale": want.abs().max().item() if want.numel() else 0.0,
    }


def _chunk(t, n, dim, i):
    """Piece i of torch.chunk(t, n, dim), empty where chunk gives fewer pieces: Shard's layout."""
    pieces = torch.chunk(t, n, dim)
    if i < len(pieces):
        return pieces[i]
    shape = list(t.shape)
    shape[dim] = 0
    return t.new_empty(shape)


_MESHES = {}


def _mesh(shape, names):
    """init_device_mesh on CPU, once per worker process: (mesh, {dim: backend of its group}).

    The mesh and its groups live as long as the worker. DTensor caches sharding decisions by
    mesh equality, which compares shape and names but not groups: a new, equal mesh after the
    first one's groups were destroyed would be handed the destroyed groups (over gloo too).
    """
    if (shape, names) not in _MESHES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        _MESHES[shape, names] = mesh, {n: str(dist.get_backend(mesh.get_group(n))) for n in names}
    return _MESHES[shape, names]


# --- 1. distribute_tensor and redistribute ----------------------------------------------------------


def distribute_and_redistribute(seed):
    """distribute_tensor with Shard(0), Shard(1), Replicate and redistribute between Shard,
    Replicate and Partial, on a 1-D mesh of every rank and on the (dp, tp) = (2, 2) mesh.

    ``x`` and the Partial contributions are integer-valued float64: a sum of them is exact in
    any order, so every comparison can be exact. ``x`` has 7 rows and 10 columns: uneven over
    2 and over 4 (torch.chunk's 4+3, 2+2+2+1, 3+3+3+1), so padding paths run too.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-50, 50, (7, 10), generator=g).double()
    y = torch.randn(8, 6, generator=g, dtype=torch.float64)
    parts = [torch.randint(-50, 50, (7, 10), generator=g).double() for _ in range(STATE.world_size)]
    total = sum(parts)
    most = torch.stack(parts).amax(0)
    r = STATE.rank
    checks = {}
    out = {"checks": checks}

    m1, backends = _mesh((STATE.world_size,), ("world",))
    out["backends_1d"] = backends
    n = STATE.world_size
    for name, t in (("x", x), ("y", y)):
        for placement, dim in ((Shard(0), 0), (Shard(1), 1)):
            dt = distribute_tensor(t, m1, [placement])
            checks[f"1d {name} {placement!r} local"] = _compare(dt.to_local(), _chunk(t, n, dim, r))
            checks[f"1d {name} {placement!r} full_tensor"] = _compare(dt, t)
        checks[f"1d {name} Replicate full_tensor"] = _compare(distribute_tensor(t, m1, [Replicate()]), t)

    s0 = distribute_tensor(x, m1, [Shard(0)])
    checks["1d Shard(0)->Replicate (all-gather)"] = _compare(
        s0.redistribute(m1, [Replicate()]).to_local(), x)
    # On CPU, DTensor (torch 2.13) does this with an all-gather and a chunk, not all-to-all.
    checks["1d Shard(0)->Shard(1)"] = _compare(
        s0.redistribute(m1, [Shard(1)]).to_local(), _chunk(x, n, 1, r))
    rep = distribute_tensor(x, m1, [Replicate()])
    checks["1d Replicate->Shard(1)"] = _compare(rep.redistribute(m1, [Shard(1)]).to_local(),
                                                _chunk(x, n, 1, r))
    p = DTensor.from_local(parts[r], m1, [Partial()])
    checks["1d Partial->Replicate (all-reduce)"] = _compare(
        p.redistribute(m1, [Replicate()]).to_local(), total)
    checks["1d Partial->Shard(0) (reduce-scatter)"] = _compare(
        p.redistribute(m1, [Shard(0)]).to_local(), _chunk(total, n, 0, r))
    checks["1d Partial full_tensor"] = _compare(p, total)
    pmax = DTensor.from_local(parts[r], m1, [Partial("max")])
    checks["1d Partial(max)->Replicate (all-reduce MAX)"] = _compare(
        pmax.redistribute(m1, [Replicate()]).to_local(), most)

    m2, backends = _mesh((2, 2), ("dp", "tp"))
    out["backends_2d"] = backends
    dp, tp = m2.get_local_rank("dp"), m2.get_local_rank("tp")
    layouts = {
        "[Shard(0), Shard(1)]": ([Shard(0), Shard(1)], lambda t: _chunk(_chunk(t, 2, 0, dp), 2, 1, tp)),
        "[Shard(0), Shard(0)]": ([Shard(0), Shard(0)], lambda t: _chunk(_chunk(t, 2, 0, dp), 2, 0, tp)),
        "[Replicate(), Shard(1)]": ([Replicate(), Shard(1)], lambda t: _chunk(t, 2, 1, tp)),
        "[Shard(1), Replicate()]": ([Shard(1), Replicate()], lambda t: _chunk(t, 2, 1, dp)),
    }
    for name, t in (("x", x), ("y", y)):
        for label, (placements, local) in layouts.items():
            dt = distribute_tensor(t, m2, placements)
            checks[f"2d {name} {label} local"] = _compare(dt.to_local(), local(t))
            checks[f"2d {name} {label} full_tensor"] = _compare(dt, t)

    s = distribute_tensor(x, m2, [Shard(0), Shard(1)])
    checks["2d [Shard(0), Shard(1)]->[Replicate(), Replicate()]"] = _compare(
        s.redistribute(m2, [Replicate(), Replicate()]).to_local(), x)
    checks["2d [Shard(0), Shard(1)]->[Shard(1), Shard(0)]"] = _compare(
        s.redistribute(m2, [Shard(1), Shard(0)]).to_local(), _chunk(_chunk(x, 2, 1, dp), 2, 0, tp))
    p = DTensor.from_local(parts[r], m2, [Partial(), Partial()])
    checks["2d [Partial(), Partial()]->[Replicate(), Replicate()]"] = _compare(
        p.redistribute(m2, [Replicate(), Replicate()]).to_local(), total)
    checks["2d [Partial(), Partial()]->[Shard(0), Replicate()]"] = _compare(
        p.redistribute(m2, [Shard(0), Replicate()]).to_local(), _chunk(total, 2, 0, dp))
    checks["2d [Partial(), Partial()]->[Shard(0), Shard(1)]"] = _compare(
        p.redistribute(m2, [Shard(0), Shard(1)]).to_local(),
        _chunk(_chunk(total, 2, 0, dp), 2, 1, tp))
    # Partial over dp only: the two tp ranks of a dp index hold the same contribution.
    q = DTensor.from_local(parts[dp], m2, [Partial(), Replicate()])
    checks["2d [Partial(), Replicate()] full_tensor"] = _compare(q, parts[0] + parts[1])
    return out


# --- 2. tensor parallel -----------------------------------------------------------------------------


class MLP(torch.nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.w1 = torch.nn.Linear(d_in, d_hidden)
        self.w2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


def _placements(model):
    """name -> (placements, local shape) of every parameter; a plain tensor shows as None."""
    return {n: ([repr(p) for p in q.placements], list(q.to_local().shape), q.device_mesh.ndim)
            if isinstance(q, DTensor) else None for n, q in model.named_parameters()}


def tensor_parallel_mlp(seed):
    """An MLP with w1 ColwiseParallel and w2 RowwiseParallel over "tp", forward and backward,
    against the same module (same seed, float64) in one process. Each dp index feeds its own
    input, so the two tp groups are independent."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    ref = MLP(12, 16, 6).double()
    model = copy.deepcopy(ref)
    mesh, backends = _mesh((2, 2), ("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    g = torch.Generator().manual_seed(seed + 1 + mesh.get_local_rank("dp"))
    x = torch.randn(5, 12, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 6, generator=g, dtype=torch.float64)  # a loss whose gradient varies
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_tp, out_ref = model(x_tp), ref(x_ref)
    (out_tp * weight).sum().backward()
    (out_ref * weight).sum().backward()
    checks = {"output": _compare(out_tp, out_ref), "input grad": _compare(x_tp.grad, x_ref.grad)}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        checks[f"{name} grad"] = _compare(p.grad, ref_params[name].grad)
        checks[name] = _compare(p, ref_params[name])
    return {"backends": backends, "checks": checks, "placements": _placements(model),
            "output_is_dtensor": isinstance(out_tp, DTensor)}


# --- 3. FSDP2 over dp with tensor parallel over tp --------------------------------------------------


class Net(torch.nn.Module):
    """Two residual MLP blocks: each block's w1 colwise, w2 rowwise, each block fully_shard."""

    def __init__(self, d, hidden):
        super().__init__()
        self.blocks = torch.nn.ModuleList(MLP(d, hidden, d) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def fsdp_tensor_parallel(seed, steps, lr):
    """fully_shard over "dp" on a module parallelised over "tp"; AdamW on a global batch of 8
    rows split 4 + 4 over dp, against one process training on all 8 rows. FSDP2 averages the
    gradients over dp and each dp half's loss is a mean over 4 rows, so the gradient is the
    8-row mean's, as in the reference."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    d, batch = 8, 8
    torch.manual_seed(seed)
    ref = Net(d, 16).double()
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    model = copy.deepcopy(ref)
    mesh, backends = _mesh((2, 2), ("dp", "tp"))
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.w1"] = ColwiseParallel()
        plan[f"blocks.{i}.w2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = _placements(model)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    dp = mesh.get_local_rank("dp")
    half = slice(dp * batch // 2, (dp + 1) * batch // 2)
    g = torch.Generator().manual_seed(seed + 1)
    losses, ref_losses = [], []
    for _ in range(steps):
        xs = torch.randn(batch, d, generator=g, dtype=torch.float64)
        ys = torch.randn(batch, d, generator=g, dtype=torch.float64)
        loss = F.mse_loss(model(xs[half]), ys[half])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out = ref(xs)
        ref_losses.append(F.mse_loss(out[half], ys[half]).item())
        F.mse_loss(out, ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())

    ref_params = dict(ref.named_parameters())
    checks = {name: _compare(p, ref_params[name]) for name, p in model.named_parameters()}
    moved = {name: (ref_params[name] - initial[name]).abs().max().item() for name in initial}
    return {"backends": backends, "checks": checks, "placements": placements,
            "losses": losses, "ref_losses": ref_losses, "moved": moved}
