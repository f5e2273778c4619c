"""Worker-side code of the drop-in fidelity tests (tests/c10d/test_fidelity_*.py).

Each function runs on every rank of a pool (tests/harness/pool.py) as the
command ``"fidelity.<name>"``; ``group="gloo"`` runs it on the pool's gloo
group (the reference), anything else on the default group under test.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from harness import data
from harness.workers import STATE, call_expecting_error


def _group(which):
    return STATE.gloo if which == "gloo" else None


def _backend(which):
    return "gloo" if which == "gloo" else STATE.backend


# --- receive from any source --------------------------------------------------------------------


def recv_any_source(numel):
    """torch's _test_send_recv_any_source: each rank in turn receives twice from every other
    rank with no src (recv, then irecv), while the others send to it; returns the senders it
    saw and whether each received tensor held its sender's rank."""
    me, ws = STATE.rank, STATE.world_size
    senders, faithful = [], True
    for dst in range(ws):
        if dst != me:
            dist.send(torch.full((numel,), float(me)), dst)
            dist.send(torch.full((numel,), float(me)), dst)
            continue
        for _ in range(ws - 1):
            out = torch.full((numel,), -1.0)
            sender = dist.recv(out)
            faithful &= bool((out == sender).all())
            senders.append(sender)
            out = torch.full((numel,), -1.0)
            work = dist.irecv(out)
            work.wait()
            sender = work._source_rank()
            faithful &= bool((out == sender).all())
            senders.append(sender)
    return {"senders": senders, "faithful": faithful}


def recv_any_source_order(count):
    """Rank 1 sends rank 0 ``count`` messages 0, 1, ...; rank 0 receives them from any source.
    Returns rank 0's (sender, value) pairs, in arrival order."""
    if STATE.rank == 1:
        for i in range(count):
            dist.send(torch.tensor([float(i)]), 0)
    if STATE.rank != 0:
        return None
    got = []
    for _ in range(count):
        out = torch.zeros(1)
        got.append((dist.recv(out), out.item()))
    return got


def recv_any_source_tag():
    """World of 3: rank 1 sends rank 0 a message tagged 9, then (once rank 1's send is done)
    rank 2 one tagged 4. Rank 0 receives tag 4 from any source, then tag 9 from rank 1.
    Returns rank 0's (sender, value) pairs."""
    me = STATE.rank
    if me == 1:
        # isend: gloo's blocking send would wait for rank 0's matching receive. The query
        # starts it on pccl too, which holds p2p ops back until they are waited on or queried.
        work = dist.isend(torch.tensor([1.0]), 0, tag=9)
        work.is_completed()
    dist.barrier(group=STATE.gloo)  # rank 1 has sent before rank 2 starts
    if me == 2:
        dist.send(torch.tensor([2.0]), 0, tag=4)
    if me == 1:
        work.wait()
    if me != 0:
        return None
    first, second = torch.zeros(1), torch.zeros(1)
    src = dist.recv(first, tag=4)
    dist.recv(second, src=1, tag=9)
    return [(src, first.item()), (1, second.item())]


def recv_any_source_expecting_timeout():
    """Rank 0 receives from any source while nobody sends; returns the error record."""
    out = torch.full((4,), 7.0)
    rec = call_expecting_error(lambda: dist.recv(out))
    rec["unchanged"] = bool((out == 7.0).all())
    return rec


# --- sparse all-reduce --------------------------------------------------------------------------


def _sparse_input(seed, shape, sparse_dim, nnz, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + STATE.rank)
    nnz = nnz + STATE.rank  # ranks hold different numbers of entries
    indices = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dim)])
    values = torch.randint(-50, 50, (nnz, *shape[sparse_dim:]), generator=g).to(data.DTYPES[dtype])
    if values.is_floating_point():
        values = values + torch.rand(values.shape, generator=g, dtype=values.dtype)
    return torch.sparse_coo_tensor(indices, values, shape)  # uncoalesced: duplicates likely


def sparse_all_reduce(seed, shape, sparse_dim, nnz, dtype, which):
    """All-reduces (SUM, in place) a sparse COO tensor of ``shape``; returns its coalesced
    indices and values packed, and the dense result."""
    t = _sparse_input(seed, shape, sparse_dim, nnz, dtype)
    dist.all_reduce(t, group=_group(which))
    assert t.layout == torch.sparse_coo
    c = t.coalesce()
    return {"indices": data.pack(c.indices()), "values": data.pack(c.values()),
            "dense": data.pack(t.to_dense())}


def sparse_all_reduce_expecting_error(case):
    """A sparse all-reduce the backend must refuse: ``op`` (AVG) or ``shape`` (rank 1 passes
    another shape). Returns the error record, or None if it passed."""
    shape = (4, 3) if case != "shape" or STATE.rank != 1 else (5, 3)
    t = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), shape)
    op = dist.ReduceOp.AVG if case == "op" else dist.ReduceOp.SUM
    return call_expecting_error(lambda: dist.all_reduce(t, op=op))


# --- monitored barrier --------------------------------------------------------------------------


def _monitored(pg, timeout, wait_all_ranks):
    if STATE.backend == "gloo":
        dist.monitored_barrier(pg, timeout=timeout, wait_all_ranks=wait_all_ranks)
    else:
        import torch_pccl

        torch_pccl.monitored_barrier(pg, timeout=timeout, wait_all_ranks=wait_all_ranks)


def monitored_barrier(timeout_s, wait_all_ranks=False, subgroup=False):
    """Runs a monitored barrier (dist.monitored_barrier on gloo, torch_pccl's on pccl); returns
    None when it passed, else the error record."""
    pg = dist.new_group(backend=STATE.backend) if subgroup else None
    timeout = timedelta(seconds=timeout_s)
    return call_expecting_error(lambda: _monitored(pg, timeout, wait_all_ranks))


def monitored_barrier_method(timeout_s):
    """The group's own ``monitored_barrier(timeout)`` method (what torch's tests call on a
    group); None when it passed, else the error record."""
    pg = dist.distributed_c10d._get_default_group()
    return call_expecting_error(lambda: pg.monitored_barrier(timedelta(seconds=timeout_s)))


# --- barrier timeout wording --------------------------------------------------------------------


def lone_barrier(timeout_s):
    """Rank 0 alone calls barrier(timeout): torch's _test_barrier_timeout. Returns the error
    record (its message is what torch's tests match) with the time it took."""
    return call_expecting_error(lambda: dist.barrier(timeout=timedelta(seconds=timeout_s)))


# --- the group's backends, as c10d code asks for them -------------------------------------------


def backend_view():
    """What c10d's helpers see of the default group and of a new subgroup."""
    c10d = dist.distributed_c10d
    world = c10d._get_default_group()
    sub = dist.new_group(backend=STATE.backend)
    out = {}
    for name, pg in (("world", world), ("sub", sub)):
        backends = {d: pg._get_backend(torch.device(d)) for d in ("cpu", "cuda")}
        out[name] = {
            "cpu": type(backends["cpu"]).__name__,
            "cuda": type(backends["cuda"]).__name__,
            "cpu_is_group": backends["cpu"] is pg,
            "devices": sorted(d.type for d in pg._device_types),
            "object_device": c10d._get_object_coll_device(pg),
        }
    return out


# --- profiler events ----------------------------------------------------------------------------


def _profiled_ops(pg, async_op):
    me, ws = STATE.rank, STATE.world_size
    a = torch.arange(6.0).view(2, 3) + me
    outs = [torch.empty(2, 3) for _ in range(ws)]
    big = torch.empty(ws * 2, 3)
    works = [
        dist.all_reduce(a, group=pg, async_op=async_op),
        dist.broadcast(a, 0, group=pg, async_op=async_op),
        dist.all_gather(outs, a, group=pg, async_op=async_op),
        dist.all_gather_into_tensor(big, a, group=pg, async_op=async_op),
        dist.all_to_all_single(torch.empty(ws * 2, 3), big, group=pg, async_op=async_op),
        dist.reduce(a, 0, group=pg, async_op=async_op),
        dist.reduce_scatter_tensor(torch.empty(2, 3), big, group=pg, async_op=async_op),
        dist.all_reduce_coalesced([a, big], group=pg, async_op=async_op),
        dist.gather(a, outs if me == 0 else None, 0, group=pg, async_op=async_op),
        dist.scatter(a, outs if me == 0 else None, 0, group=pg, async_op=async_op),
        dist.all_to_all([torch.empty(2, 3) for _ in range(ws)], outs, group=pg, async_op=async_op),
        dist.barrier(group=pg, async_op=async_op),
    ]
    for w in works:
        if w is not None:
            w.wait()
    if ws > 1:  # one message around the ring
        right, left = (me + 1) % ws, (me - 1) % ws
        msg = torch.ones(4, dtype=torch.float64)
        reqs = [dist.isend(msg, right, group=pg), dist.irecv(torch.empty(4, dtype=torch.float64), left, group=pg)]
        for r in reqs:
            r.wait()


def profiled_ops(which, async_op, profiler="autograd"):
    """Runs a set of collectives and one p2p exchange under a profiler with record_shapes;
    returns the backend's events: (name after "<backend>:", is_async, input_shapes) in order."""
    pg = _group(which)
    prefix = _backend(which) + ":"
    if profiler == "autograd":
        ctx = torch.autograd.profiler.profile(record_shapes=True)
    else:
        ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                     record_shapes=True)
    with ctx as prof:
        _profiled_ops(pg, async_op)
    events = prof.function_events if profiler == "autograd" else prof.events()
    return [(e.name[len(prefix):], bool(e.is_async), [list(s) for s in e.input_shapes])
            for e in sorted(events, key=lambda e: e.time_range.start) if e.name.startswith(prefix)]

