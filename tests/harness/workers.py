"""Code that runs inside the worker processes of tests/harness/pool.py.

A worker joins the group under test (the default process group, backend
chosen by the test session) and a gloo group over the same ranks for
reference, then serves commands from the parent: the name of a module-level
function in this module (or ``"module.function"`` for one in another
``harness`` module) and its arguments. The function's return value goes
back over the pipe; an exception goes back as a description (type, the names
of its classes, message, traceback) that the parent turns into a failure.

Commands that expect an error catch it themselves and return `error_record`,
so a test can assert the exact exception class and how long it took.
"""

import importlib
import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from harness import data


class _State:
    rank = -1
    world_size = 0
    backend = ""
    gloo = None  # reference group over the same ranks
    conn = None  # pipe to the parent, for commands that talk mid-way


STATE = _State()


# --- process entry point ------------------------------------------------------------------------


def worker_main(rank, world_size, backend, store_port, timeout_s, conn, with_gloo=True):
    """Entry point of one worker process (multiprocessing spawn target)."""
    torch.set_num_threads(1)
    STATE.rank, STATE.world_size, STATE.backend, STATE.conn = rank, world_size, backend, conn
    try:
        init_group(backend, rank, world_size, store_port, timeout_s, with_gloo)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit
        conn.send(("err", describe(e)))
        return
    conn.send(("ok", os.getpid()))
    serve(conn)


def init_group(backend, rank, world_size, store_port, timeout_s, with_gloo=True, prefix="pool"):
    store = dist.TCPStore(
        "127.0.0.1", store_port, world_size, is_master=False, timeout=timedelta(seconds=60)
    )
    store = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    if with_gloo:
        STATE.gloo = dist.new_group(backend="gloo")


def serve(conn):
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        name, args, kwargs = msg
        if name == "exit":
            conn.send(("ok", None))
            return
        try:
            result = command(name)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            conn.send(("err", describe(e)))
        else:
            conn.send(("ok", result))


def command(name):
    """The function a command names: ``f`` in this module, or ``"module.f"`` in ``harness.module``."""
    if "." not in name:
        return globals()[name]
    module, _, fn = name.rpartition(".")
    return getattr(importlib.import_module(f"harness.{module}"), fn)


def describe(e):
    return {
        "type": type(e).__name__,
        "mro": [c.__name__ for c in type(e).__mro__],
        "message": str(e),
        "traceback": traceback.format_exc(),
    }


def error_record(e, elapsed):
    rec = describe(e)
    rec["elapsed"] = elapsed
    rec["code"] = getattr(e, "code", None)
    return rec


def call_expecting_error(fn):
    """Runs fn(); returns None if it returned, else the error record with the time it took
    and ``started``, when it began (``time.monotonic()``: one clock for every process of a
    Linux host, so ranks' records can be compared)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the record
        return dict(error_record(e, time.monotonic() - start), started=start)
    return None


# --- helpers ------------------------------------------------------------------------------------


def _op(name):
    return getattr(dist.ReduceOp, name)


def _group(which):
    return STATE.gloo if which == "gloo" else None


def _pack(t, full):
    return data.pack(t, raw=full or STATE.rank == 0)


def ping():
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "pid": os.getpid()}


# --- collectives (each returns packed results; the parent checks them) -------------------------


def all_reduce(seed, numel, dtype, op, full=False, async_op=False):
    t = data.make_input(seed, STATE.rank, numel, dtype, op)
    work = dist.all_reduce(t, op=_op(op), async_op=async_op)
    if async_op:
        assert work.wait() is not False
    return _pack(t, full)


def all_reduce_on_view(seed, numel, dtype, op):
    """all_reduce on a contiguous view into the middle of a larger buffer: the rest is untouched."""
    buf = data.make_input(seed + 1, STATE.rank, numel + 10, dtype, op)
    before = buf.clone()
    view = buf[5 : 5 + numel]
    view.copy_(data.make_input(seed, STATE.rank, numel, dtype, op))
    dist.all_reduce(view, op=_op(op))
    untouched = torch.equal(buf[:5], before[:5]) and torch.equal(buf[5 + numel :], before[5 + numel :])
    return {"result": _pack(view, True), "untouched": untouched}


def all_reduce_coalesced(seed, sizes, dtype, op):
    ts = [data.make_input(seed + i, STATE.rank, n, dtype, op) for i, n in enumerate(sizes)]
    dist.all_reduce_coalesced(ts, op=_op(op))
    return [_pack(t, True) for t in ts]


def all_reduce_coalescing_manager(seed, sizes, dtype, op):
    ts = [data.make_input(seed + i, STATE.rank, n, dtype, op) for i, n in enumerate(sizes)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, op=_op(op))
    cm.wait()
    return [_pack(t, True) for t in ts]


def broadcast(seed, numel, dtype, root, full=False, async_op=False):
    t = data.make_input(seed, STATE.rank, numel, dtype)
    work = dist.broadcast(t, src=root, async_op=async_op)
    if async_op:
        work.wait()
    return _pack(t, full)


def all_gather_list(seed, numel, dtype):
    t = data.make_input(seed, STATE.rank, numel, dtype)
    out = [torch.full((numel,), 3, dtype=t.dtype) for _ in range(STATE.world_size)]
    dist.all_gather(out, t)
    return _pack(torch.cat(out), True)


def all_gather_into_tensor(seed, numel, dtype, shape2d=False):
    t = data.make_input(seed, STATE.rank, numel, dtype)
    ws = STATE.world_size
    if shape2d:
        # Input (1, numel), output (world_size, numel): rank r's input lands in row r.
        t = t.reshape(1, numel)
        out = torch.full((ws, numel), 3, dtype=t.dtype)
    else:
        out = torch.full((ws * numel,), 3, dtype=t.dtype)
    dist.all_gather_into_tensor(out, t)
    return _pack(out.reshape(-1), True)


def all_gather_coalesced_manager(seed, sizes, dtype):
    ins = [data.make_input(seed + i, STATE.rank, n, dtype) for i, n in enumerate(sizes)]
    outs = [torch.full((STATE.world_size * n,), 3, dtype=ins[0].dtype) for n in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    return [_pack(o, True) for o in outs]


def all_gather_coalesced_legacy(seed, sizes, dtype):
    ins = [data.make_input(seed + i, STATE.rank, n, dtype) for i, n in enumerate(sizes)]
    # outs[r][i]: rank r's tensor i.
    outs = [[torch.full((n,), 3, dtype=ins[0].dtype) for n in sizes] for _ in range(STATE.world_size)]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.all_gather_coalesced(outs, ins)
    return [_pack(torch.cat([outs[r][i] for r in range(STATE.world_size)]), True)
            for i in range(len(sizes))]


def reduce_scatter_list(seed, numel, dtype, op):
    ws = STATE.world_size
    inputs = [data.make_input(seed + p, STATE.rank, numel, dtype, op) for p in range(ws)]
    out = torch.full((numel,), 3, dtype=inputs[0].dtype)
    dist.reduce_scatter(out, inputs, op=_op(op))
    return _pack(out, True)


def reduce_scatter_tensor(seed, numel, dtype, op):
    ws = STATE.world_size
    t = torch.cat([data.make_input(seed + p, STATE.rank, numel, dtype, op) for p in range(ws)])
    out = torch.full((numel,), 3, dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, op=_op(op))
    return _pack(out, True)


def reduce_scatter_coalesced_manager(seed, sizes, dtype, op):
    ws = STATE.world_size
    ins, outs = [], []
    for i, n in enumerate(sizes):
        ins.append(torch.cat([
            data.make_input(seed + 100 * i + p, STATE.rank, n, dtype, op) for p in range(ws)
        ]))
        outs.append(torch.full((n,), 3, dtype=ins[-1].dtype))
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i, op=_op(op))
    cm.wait()
    return [_pack(o, True) for o in outs]


def all_to_all_single(seed, dtype, splits):
    """splits[s][d]: elements rank s sends to rank d (uneven, zeros allowed)."""
    me = STATE.rank
    send_counts = splits[me]
    recv_counts = [splits[s][me] for s in range(STATE.world_size)]
    t = data.make_input(seed, me, sum(send_counts), dtype)
    out = torch.full((sum(recv_counts),), 3, dtype=t.dtype)
    dist.all_to_all_single(out, t, output_split_sizes=recv_counts, input_split_sizes=send_counts)
    return _pack(out, True)


def all_to_all_single_even(seed, dtype, per_peer):
    ws = STATE.world_size
    t = data.make_input(seed, STATE.rank, per_peer * ws, dtype)
    out = torch.full((per_peer * ws,), 3, dtype=t.dtype)
    dist.all_to_all_single(out, t)
    return _pack(out, True)


def all_to_all_list(seed, dtype, per_peer):
    ws = STATE.world_size
    ins = list(data.make_input(seed, STATE.rank, per_peer * ws, dtype).split(per_peer))
    outs = [torch.full((per_peer,), 3, dtype=ins[0].dtype) for _ in range(ws)]
    dist.all_to_all(outs, ins)
    return _pack(torch.cat(outs), True)


def reduce(seed, numel, dtype, op, dst):
    t = data.make_input(seed, STATE.rank, numel, dtype, op)
    before = t.clone()
    dist.reduce(t, dst=dst, op=_op(op))
    # Non-destination ranks: c10d leaves their buffer's content unspecified; only dst is checked.
    return {"result": _pack(t, True), "input": _pack(before, True)}


def gather(seed, numel, dtype, dst):
    t = data.make_input(seed, STATE.rank, numel, dtype)
    if STATE.rank == dst:
        out = [torch.full((numel,), 3, dtype=t.dtype) for _ in range(STATE.world_size)]
        dist.gather(t, gather_list=out, dst=dst)
        return _pack(torch.cat(out), True)
    dist.gather(t, gather_list=None, dst=dst)
    return None


def scatter(seed, numel, dtype, src):
    out = torch.full((numel,), 3, dtype=data.DTYPES[dtype])
    if STATE.rank == src:
        ins = [data.make_input(seed + p, src, numel, dtype) for p in range(STATE.world_size)]
        dist.scatter(out, scatter_list=ins, src=src)
    else:
        dist.scatter(out, scatter_list=None, src=src)
    return _pack(out, True)


def send_recv_pairs(seed, numel, dtype):
    """Even rank r sends to r+1 (blocking send/recv); returns what each receiver got."""
    me, ws = STATE.rank, STATE.world_size
    t = data.make_input(seed, me, numel, dtype)
    if me % 2 == 0 and me + 1 < ws:
        dist.send(t, dst=me + 1)
        return None
    if me % 2 == 1:
        out = torch.full((numel,), 3, dtype=t.dtype)
        src = dist.recv(out, src=me - 1)
        return {"result": _pack(out, True), "src": src}
    return None


def send_recv_ring(seed, numel, dtype, tagged=False):
    """isend to the right, irecv from the left, all at once (a blocking ring would deadlock)."""
    me, ws = STATE.rank, STATE.world_size
    t = data.make_input(seed, me, numel, dtype)
    out = torch.full((numel,), 3, dtype=t.dtype)
    tag = 7 if tagged else 0
    reqs = [dist.irecv(out, src=(me - 1) % ws, tag=tag), dist.isend(t, dst=(me + 1) % ws, tag=tag)]
    for r in reqs:
        r.wait()
    return _pack(out, True)


def send_recv_batch(seed, numel, dtype):
    me, ws = STATE.rank, STATE.world_size
    t = data.make_input(seed, me, numel, dtype)
    left = torch.full((numel,), 3, dtype=t.dtype)
    right = torch.full((numel,), 3, dtype=t.dtype)
    ops = [
        dist.P2POp(dist.isend, t, (me + 1) % ws),
        dist.P2POp(dist.isend, t, (me - 1) % ws),
        dist.P2POp(dist.irecv, left, (me - 1) % ws),
        dist.P2POp(dist.irecv, right, (me + 1) % ws),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return {"left": _pack(left, True), "right": _pack(right, True)}


def transfer_batch_all_pairs(seed, numel):
    """Communicator.transfer_batch: every rank sends its input, cut in two pieces, to every other
    rank and receives the pieces of each in place (no staging); returns what arrived by source."""
    me, ws = STATE.rank, STATE.world_size
    comm = dist.group.WORLD.communicator  # the default group is a ProcessGroupPCCL
    t = data.make_input(seed, me, numel, "float32")
    half = numel // 2
    got = {p: torch.full((numel,), -1.0) for p in range(ws) if p != me}
    ops = []
    for p in range(ws):
        if p != me:     # messages to and from one peer are matched in list order
            ops += [(True, t[:half], p, 5), (True, t[half:], p, 5),
                    (False, got[p][:half], p, 5), (False, got[p][half:], p, 5)]
    comm.transfer_batch(ops)
    return {str(p): _pack(v, True) for p, v in got.items()}


def barrier_ordered(flag_dir):
    """The last rank waits for the parent's 'go' before it writes its flag and enters the barrier.

    Every rank writes its flag file before the barrier and, after it, checks
    that every rank's flag exists: a barrier that returns early fails that check.
    """
    me, ws = STATE.rank, STATE.world_size
    if me == ws - 1:
        STATE.conn.send(("waiting", me))
        assert STATE.conn.recv() == "go"
    else:
        STATE.conn.send(("entering", me))
    open(os.path.join(flag_dir, f"rank{me}"), "w").close()
    dist.barrier()
    return sorted(os.listdir(flag_dir))


# --- async work ---------------------------------------------------------------------------------


def all_reduce_future(seed, numel, dtype, op):
    t = data.make_input(seed, STATE.rank, numel, dtype, op)
    work = dist.all_reduce(t, op=_op(op), async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 1 if isinstance(f.value(), list) else f.value())
    value = fut.wait()
    chained_value = chained.wait()
    result_tensor = value[0] if isinstance(value, (list, tuple)) else value
    return {
        "inplace": _pack(t, True),
        "future_value": _pack(result_tensor, True),
        "chained": _pack(chained_value, True),
        "completed": work.is_completed(),
        "future_done": fut.done(),
    }


def many_async_all_reduces(seed, numel, count):
    """`count` async all_reduces in flight at once, waited in reverse order."""
    ts = [data.make_input(seed + i, STATE.rank, numel, "float32") for i in range(count)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
    return [_pack(t, True) for t in ts]


def async_tensor_lifetime(seed, numel):
    """Async all_reduces queued behind big ones (one per lane), whose tensors the caller
    drops (``del``) or resizes right after the call, on every rank alike."""
    import gc

    import torch_pccl

    lanes = torch_pccl.c10d.process_group.pccl_group(None).num_lanes
    big = [torch.full(((16 << 20) // 4,), float(STATE.rank + 1)) for _ in range(lanes)]
    works = [dist.all_reduce(b, async_op=True) for b in big]
    dropped = data.make_input(seed, STATE.rank, numel, "float32")
    w_dropped = dist.all_reduce(dropped, async_op=True)       # queued on lane 0
    del dropped
    resized = torch.ones(numel)
    w_resized = dist.all_reduce(resized, async_op=True)       # queued on lane 1
    resized.resize_(0)
    gc.collect()
    for w in works:
        w.wait()
    w_dropped.wait()
    out = {"dropped": _pack(w_dropped.result()[0], True), "resize_error": None}
    try:
        w_resized.wait()
    except torch_pccl.InvalidUsageError as exc:
        out["resize_error"] = str(exc)
    t = torch.ones(numel)
    dist.all_reduce(t)                                         # the group still works
    out["after"] = _pack(t, True)
    return out


def storage_swapped_during_op(numel):
    """Rank 0 gives its tensor other storage, frees the old one and fills new allocations
    while its all-reduce is inside the native call (rank 1 holds its own call back until
    then, on the gloo group). The op must complete on both ranks without touching freed
    memory: rank 0's Work raises InvalidUsageError (its tensor does not hold the result),
    rank 1 gets the sum, and the group goes on."""
    import gc

    import torch_pccl

    lanes = torch_pccl.c10d.process_group.pccl_group(None).communicator.lanes
    t = torch.full((numel,), float(STATE.rank + 1))
    fills = []
    if STATE.rank == 0:
        w = dist.all_reduce(t, async_op=True)
        deadline, tick = time.monotonic() + 30, threading.Event()
        while not any(lane.current_op for lane in lanes):      # in the native call
            assert time.monotonic() < deadline, "the all-reduce never started"
            tick.wait(0.001)
        t.set_(torch.empty(0))
        del t
        gc.collect()
        fills = [torch.full((numel,), -1.0) for _ in range(4)]  # may reuse the freed memory
        dist.barrier(group=STATE.gloo)                          # now rank 1 sends
    else:
        dist.barrier(group=STATE.gloo)
        w = dist.all_reduce(t, async_op=True)
    out = {"error": None}
    try:
        w.wait()
    except torch_pccl.InvalidUsageError as exc:
        out["error"] = str(exc)
    if STATE.rank != 0:
        out["value"] = t[0].item()
        out["uniform"] = bool((t == t[0]).all())
    out["fills_intact"] = all(bool((f == -1.0).all()) for f in fills)
    after = torch.ones(8)
    dist.all_reduce(after)                                      # the group still works
    out["after"] = after[0].item()
    return out


# --- bad input: only the ranks in `bad_ranks` call the bad op ------------------------------------


def bad_call(case, bad_ranks):
    me = STATE.rank
    if me not in bad_ranks:
        return None
    f32 = torch.ones(8)
    ws = STATE.world_size
    cases = {
        "dtype_int16": lambda: dist.all_reduce(torch.ones(8, dtype=torch.int16)),
        "dtype_bool": lambda: dist.all_reduce(torch.ones(8, dtype=torch.bool)),
        "dtype_uint16_all_gather": lambda: dist.all_gather_into_tensor(
            torch.ones(8 * ws, dtype=torch.uint16), torch.ones(8, dtype=torch.uint16)),
        "non_contiguous_all_reduce": lambda: dist.all_reduce(torch.ones(16)[::2]),
        "non_contiguous_broadcast": lambda: dist.broadcast(torch.ones(4, 4).t(), src=0),
        "non_contiguous_all_gather": lambda: dist.all_gather_into_tensor(
            torch.ones(16 * ws)[::2], f32),
        "op_band": lambda: dist.all_reduce(torch.ones(8, dtype=torch.int32), op=dist.ReduceOp.BAND),
        "op_bxor": lambda: dist.all_reduce(torch.ones(8, dtype=torch.int64), op=dist.ReduceOp.BXOR),
        "op_band_reduce_scatter": lambda: dist.reduce_scatter_tensor(
            torch.ones(8, dtype=torch.int32), torch.ones(8 * ws, dtype=torch.int32),
            op=dist.ReduceOp.BAND),
        "size_all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.ones(8 * ws + 1), f32),
        "size_reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.ones(8), torch.ones(8 * ws - 1)),
        "size_all_gather_list_len": lambda: dist.all_gather(
            [torch.ones(8) for _ in range(ws + 1)], f32),
        "size_all_gather_list_elem": lambda: dist.all_gather(
            [torch.ones(9) for _ in range(ws)], f32),
        "size_reduce_scatter_list": lambda: dist.reduce_scatter(
            torch.ones(8), [torch.ones(7) for _ in range(ws)]),
        "size_all_to_all_splits": lambda: dist.all_to_all_single(
            torch.ones(8 * ws), torch.ones(8 * ws),
            output_split_sizes=[8] * ws, input_split_sizes=[8] * (ws - 1) + [9]),
        "dtype_mixed_all_gather": lambda: dist.all_gather_into_tensor(
            torch.ones(8 * ws, dtype=torch.float64), f32),
    }
    return call_expecting_error(cases[case])


# --- failures (fresh process groups) -------------------------------------------------------------


def report_and_all_reduce(numel, mode="sync"):
    """Tells the parent it is about to call all_reduce, then calls it expecting an error.

    mode: "sync" (blocking call), "wait" (async_op=True, Work.wait()) or
    "future" (async_op=True, get_future().wait()). Returns the error record
    and whether the tensor still holds its input (no half-written results).
    """
    t = torch.full((numel,), float(STATE.rank + 1))
    before = t.clone()
    STATE.conn.send(("entering", STATE.rank))
    if mode == "sync":
        fn = lambda: dist.all_reduce(t)  # noqa: E731
    elif mode == "wait":
        fn = lambda: dist.all_reduce(t, async_op=True).wait()  # noqa: E731
    elif mode == "future":
        fn = lambda: dist.all_reduce(t, async_op=True).get_future().wait()  # noqa: E731
    else:
        raise AssertionError(mode)
    rec = call_expecting_error(fn)
    return {"error": rec, "unchanged": torch.equal(t, before)}


def ddp_backward_expecting_error(victim):
    """DDP over the default group: one good step, then a backward in which ``victim``
    SIGKILLs itself (a hook on the first layer's gradient, which comes last, so the later
    layers' buckets are already on the wire). A survivor returns its backward's error record
    and whether its process is still healthy enough to run a local op after it."""
    import signal

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.01)  # several buckets
    x = torch.randn(8, 64)
    ddp(x).sum().backward()
    if STATE.rank == victim:
        net[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
    STATE.conn.send(("entering", STATE.rank))
    rec = call_expecting_error(lambda: ddp(x).sum().backward())
    return {"error": rec, "alive": float(torch.ones(3).sum()) == 3.0}


def wait_for_parent():
    """Blocks until the parent sends anything (this rank 'hangs' without calling collectives)."""
    STATE.conn.send(("waiting", STATE.rank))
    return STATE.conn.recv()


def all_reduce_expecting_error(numel):
    t = torch.ones(numel)
    return call_expecting_error(lambda: dist.all_reduce(t))


def same_lane_expecting_error(numel):
    """All-reduces until the one on the lane of the previous collective; its error record.

    With K lanes the next K-1 collectives run on the other lanes (they must succeed).
    """
    lanes = dist.group.WORLD.num_lanes
    t = torch.ones(numel)
    for _ in range(lanes - 1):
        dist.all_reduce(t)
    return call_expecting_error(lambda: dist.all_reduce(t))


def mismatched_call(kind):
    me = STATE.rank
    if kind == "size":
        fn = lambda: dist.all_reduce(torch.ones(7 + me))  # noqa: E731
    elif kind == "dtype":
        fn = lambda: dist.all_reduce(torch.ones(8, dtype=torch.float32 if me == 0 else torch.int32))  # noqa: E731
    elif kind == "op":
        fn = lambda: dist.all_reduce(torch.ones(8), op=dist.ReduceOp.SUM if me == 0 else dist.ReduceOp.MAX)  # noqa: E731
    elif kind == "collective":
        fn = (lambda: dist.all_reduce(torch.ones(8))) if me == 0 else (lambda: dist.broadcast(torch.ones(8), src=0))  # noqa: E731
    elif kind == "broadcast_root":
        fn = lambda: dist.broadcast(torch.ones(8), src=me)  # noqa: E731
    elif kind == "all_gather_size":
        ws = STATE.world_size
        fn = lambda: dist.all_gather_into_tensor(torch.ones(ws * (4 + me)), torch.ones(4 + me))  # noqa: E731
    else:
        raise AssertionError(kind)
    return call_expecting_error(fn)


def rebuild_and_all_reduce(new_rank, new_world_size, store_port, timeout_s, value):
    """Destroys the broken default group and joins a fresh one; returns an all_reduce result."""
    dist.destroy_process_group()
    STATE.gloo = None
    STATE.rank, STATE.world_size = new_rank, new_world_size
    init_group(STATE.backend, new_rank, new_world_size, store_port, timeout_s, with_gloo=False,
               prefix="rebuilt")
    t = torch.full((5,), float(value))
    dist.all_reduce(t)
    return t.tolist()


# --- subgroups and functional collectives ---------------------------------------------------------


def subgroup_all_reduce(ranks, seed, numel, dtype, op):
    sub = dist.new_group(ranks=ranks, backend=STATE.backend)
    try:
        if STATE.rank not in ranks:
            assert sub == dist.GroupMember.NON_GROUP_MEMBER
            return None
        backend = str(dist.get_backend(sub))
        t = data.make_input(seed, STATE.rank, numel, dtype, op)
        dist.all_reduce(t, op=_op(op), group=sub)
        # The subgroup's rank numbering is the position in `ranks` (sorted).
        info = (dist.get_rank(sub), dist.get_world_size(sub))
        g = torch.arange(4, dtype=torch.float32) + STATE.rank
        out = torch.zeros(4 * len(ranks))
        dist.all_gather_into_tensor(out, g, group=sub)
        return {"result": _pack(t, True), "backend": backend, "info": info,
                "gathered": _pack(out, True)}
    finally:
        if sub != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(sub)


def functional_collectives(seed, numel):
    import torch.distributed._functional_collectives as funcol

    me, ws = STATE.rank, STATE.world_size
    group = dist.group.WORLD
    x = data.make_input(seed, me, numel, "float32")
    out = {}
    out["all_reduce"] = _pack(funcol.all_reduce(x, "sum", group).wait(), True)
    out["all_reduce_max"] = _pack(funcol.all_reduce(x, "max", group).wait(), True)
    out["all_gather_tensor"] = _pack(funcol.all_gather_tensor(x, 0, group).wait(), True)
    big = torch.cat([data.make_input(seed + p, me, numel, "float32") for p in range(ws)])
    out["reduce_scatter_tensor"] = _pack(funcol.reduce_scatter_tensor(big, "sum", 0, group).wait(), True)
    out["all_to_all_single"] = _pack(funcol.all_to_all_single(big, None, None, group).wait(), True)
    out["broadcast"] = _pack(funcol.broadcast(x, 0, group).wait(), True)
    # Result used directly (AsyncCollectiveTensor waits on first use).
    out["all_reduce_used"] = _pack(funcol.all_reduce(x, "sum", group) * 2, True)
    return out


# --- training parity -------------------------------------------------------------------------------


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(13, 32), torch.nn.ReLU(), torch.nn.Linear(32, 29), torch.nn.ReLU(),
        torch.nn.Linear(29, 3),
    )


def _batches(seed, steps):
    g = torch.Generator().manual_seed(seed * 31 + STATE.rank)
    return [(torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def _train(model, opt, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_ddp(seed, steps, which):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(seed), process_group=_group(which), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = _train(model, opt, _batches(seed, steps))
    params = [_pack(p.detach(), True) for p in model.module.parameters()]
    return {"params": params, "losses": losses}


def train_fsdp2(seed, steps, which):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if which == "gloo":
        mesh = DeviceMesh.from_group(STATE.gloo, "cpu")
    else:
        mesh = init_device_mesh("cpu", (STATE.world_size,))
    model = _model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = _train(model, opt, _batches(seed, steps))
    params = [_pack(p.full_tensor().detach(), True) for p in model.parameters()]
    return {"params": params, "losses": losses}


def train_fsdp1(seed, steps, which):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(seed), process_group=_group(which), device_id=torch.device("cpu"),
                 use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = _train(model, opt, _batches(seed, steps))
    with FSDP.summon_full_params(model):
        params = [_pack(p.detach().clone(), True) for p in model.parameters()]
    return {"params": params, "losses": losses}


# --- concurrent collectives: lanes (tests/core/test_concurrent.py) -----------------------------------


def lanes_info():
    """The default group's lane count and the number of its communicator's lanes."""
    group = dist.group.WORLD
    return {"num_lanes": group.num_lanes, "comm_lanes": len(group.communicator.lanes)}


def async_all_reduces(seed, sizes, op="SUM", dtype="float32"):
    """One async all_reduce per entry of `sizes`, issued back to back, waited in reverse order.

    Returns the packed results and the op indexes in the order the ops completed.
    """
    ts = [data.make_input(seed + i, STATE.rank, n, dtype, op) for i, n in enumerate(sizes)]
    order, works, noted = [], [], []
    for i, t in enumerate(ts):
        work = dist.all_reduce(t, op=_op(op), async_op=True)
        # then() runs when the op completes; waiting on its future waits for the note too.
        noted.append(work.get_future().then(lambda _, i=i: order.append(i)))
        works.append(work)
    for work in reversed(works):
        work.wait()
    for fut in noted:
        fut.wait()
    return {"results": [_pack(t, True) for t in ts], "order": order}


def held_lane_out_of_order(seed, numel):
    """Shows two lanes finishing out of issue order, and a barrier waiting for both.

    Every rank issues A, B (the next lane) and a barrier, all async. Rank 1 first
    parks a blocker on A's lane (released when the parent says "go"), so A cannot
    finish on any rank before then, while B can. Each rank reports ("b_done", state)
    once B finished; the parent answers "go" after hearing from every rank.
    """
    from torch_pccl.c10d.work import PcclWork

    group = dist.group.WORLD
    assert group.num_lanes >= 2, group.num_lanes
    release = threading.Event()
    if STATE.rank == 1:
        lane_a = group.collectives_issued % group.num_lanes  # the lane of the next collective
        group.scheduler.executors[lane_a].submit(release.wait, PcclWork([]), inline=False)
    a = data.make_input(seed, STATE.rank, numel, "float32")
    b = data.make_input(seed + 1, STATE.rank, numel, "float32")
    work_a = dist.all_reduce(a, async_op=True)
    work_b = dist.all_reduce(b, async_op=True)
    work_barrier = dist.barrier(async_op=True)
    work_b.wait()
    state = {"a_pending": not work_a.is_completed(),
             "barrier_pending": not work_barrier.is_completed()}
    STATE.conn.send(("b_done", state))
    assert STATE.conn.recv() == "go"
    release.set()
    work_barrier.wait()
    state["a_done_at_barrier"] = work_a.is_completed()
    work_a.wait()
    state["a"], state["b"] = _pack(a, True), _pack(b, True)
    return state


def async_all_reduces_expecting_errors(sizes):
    """Async all_reduces of `sizes` that cannot finish (a peer never calls them); waits for each.

    Tells the parent ("entering") once all are issued. Returns each op's error
    record (elapsed from that message) and whether each tensor still holds its input.
    """
    ts = [torch.full((n,), float(STATE.rank + 1)) for n in sizes]
    before = [t.clone() for t in ts]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    STATE.conn.send(("entering", STATE.rank))
    start = time.monotonic()
    errors = []
    for work in works:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - the test asserts on the record
            errors.append(error_record(e, time.monotonic() - start))
        else:
            errors.append(None)
    return {"errors": errors, "unchanged": [torch.equal(t, b) for t, b in zip(ts, before)]}


def mismatch_on_one_lane(seed, numel):
    """A mismatched all_reduce, the next K-1 collectives (the other lanes), then one on its lane.

    All async. Returns the first and last ops' error records and the packed
    results of the K-1 in between (they must succeed: a lane's error stays on it).
    """
    lanes = dist.group.WORLD.num_lanes
    bad = torch.ones(numel + STATE.rank)
    bad_work = dist.all_reduce(bad, async_op=True)
    goods = [data.make_input(seed + i, STATE.rank, numel, "float32") for i in range(lanes - 1)]
    good_works = [dist.all_reduce(t, async_op=True) for t in goods]
    again = dist.all_reduce(torch.ones(numel), async_op=True)
    for work in good_works:
        work.wait()
    return {"bad": call_expecting_error(bad_work.wait),
            "again": call_expecting_error(again.wait),
            "goods": [_pack(t, True) for t in goods]}


# --- abort -----------------------------------------------------------------------------------------


def abort_blocked_all_reduce(numel):
    """Starts an async all_reduce that cannot complete (a peer is silent), then aborts the group.

    Returns the error record of work.wait(), timed from the abort call, and
    whether the tensor still holds its input.
    """
    t = torch.full((numel,), float(STATE.rank + 1))
    before = t.clone()
    work = dist.all_reduce(t, async_op=True)
    STATE.conn.send(("entering", STATE.rank))
    assert STATE.conn.recv() == "abort"
    start = time.monotonic()
    dist.distributed_c10d._get_default_group().abort()
    try:
        work.wait()
    except Exception as e:  # noqa: BLE001 - the test asserts on the record
        rec = error_record(e, time.monotonic() - start)
    else:
        rec = None
    return {"error": rec, "unchanged": torch.equal(t, before)}


# --- striping: several TCP streams per peer (tests/core/test_streams.py) -------------------------


def streams_info():
    """The default group's streams per peer and lane, and this rank's data-plane port."""
    comm = dist.group.WORLD.communicator
    return {"streams": comm.streams, "port": comm.port}


def _data_sockets_to(port):
    # This process's TCP sockets whose far end is `port` (the peer's data-plane
    # listener: this higher rank connected to it, once per lane and stream).
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM \
                    and s.getpeername()[1] == port:
                found.append(fd)
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only
    return sorted(found)


def all_reduce_after_cutting_a_stream(numel, peer_port):
    """Shuts down ONE of this rank's TCP streams to the peer listening on `peer_port` (as a
    middlebox reset would), then all_reduces; the error record and whether the tensor kept
    its input."""
    fds = _data_sockets_to(peer_port)
    cut = socket.socket(fileno=os.dup(fds[-1]))
    cut.shutdown(socket.SHUT_RDWR)
    cut.close()
    t = torch.full((numel,), float(STATE.rank + 1))
    before = t.clone()
    rec = call_expecting_error(lambda: dist.all_reduce(t))
    return {"error": rec, "unchanged": torch.equal(t, before), "streams_to_peer": len(fds)}


def all_reduce_recording_error(numel):
    """An all_reduce expected to fail; its error record and whether the tensor kept its input."""
    t = torch.full((numel,), float(STATE.rank + 1))
    before = t.clone()
    rec = call_expecting_error(lambda: dist.all_reduce(t))
    return {"error": rec, "unchanged": torch.equal(t, before)}


def optimize_ring(bandwidth=None, probe_bytes=1 << 16):
    """torch_pccl.optimize_topology, then an exact all_reduce on the new ring."""
    import torch_pccl

    choice = torch_pccl.optimize_topology(probe_bytes=probe_bytes, bandwidth=bandwidth)
    x = torch.arange(1001, dtype=torch.float32) * (STATE.rank + 1)
    dist.all_reduce(x)
    return {"order": list(choice.order), "previous": list(choice.previous),
            "bottleneck": choice.bottleneck, "previous_bottleneck": choice.previous_bottleneck,
            "bandwidth": [list(r) for r in choice.bandwidth],
            "rtt": [list(r) for r in choice.rtt_s],
            "applied": list(dist.group.WORLD.ring_order), "sum": data.pack(x, raw=True)}
