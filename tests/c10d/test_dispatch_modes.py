"""TorchDispatchModes see a pccl group's collectives as they see gloo's: the same c10d ops
with the same arguments, so CommDebugMode (tensor-parallel users count communication
with it) counts plain ``dist.*`` calls on pccl as on gloo, with unchanged results."""

import textwrap

import pytest

from harness.tcp_ranks import run_tcp_ranks

pytestmark = pytest.mark.timeout(180)

WORKER = textwrap.dedent("""
    import contextlib, json, sys, datetime, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.set_num_threads(1)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    groups = {"gloo": dist.group.WORLD, "pccl": dist.new_group(backend="pccl")}

    class Seen(TorchDispatchMode):
        # Every c10d op a mode sees, with its scalar arguments and reduce op.
        def __init__(self):
            super().__init__()
            self.ops = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                shown = []
                for a in args:
                    if isinstance(a, (bool, int)):
                        shown.append(a)
                    elif isinstance(a, torch.ScriptObject) and "ReduceOp" in str(a._type()):
                        shown.append("op%d" % int(a.op()))
                    elif isinstance(a, torch.Tensor):
                        shown.append(list(a.shape))
                self.ops.append([str(func), shown])
            return func(*args, **(kwargs or {}))

    def calls(group):
        out = {}
        x = torch.arange(6, dtype=torch.float32) + rank
        dist.all_reduce(x, group=group)
        y = torch.arange(6, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
        w = dist.all_reduce(x, group=group, async_op=True)
        w.wait()
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=1, group=group)
        r = torch.ones(4) * (rank + 2)
        dist.reduce(r, dst=0, op=dist.ReduceOp.PRODUCT, group=group)
        lst = [torch.empty(2) for _ in range(world)]
        dist.all_gather(lst, torch.full((2,), float(rank)), group=group)
        g = torch.empty(2 * world)
        dist.all_gather_into_tensor(g, torch.full((2,), float(rank + 1)), group=group)
        rs = torch.empty(2)
        dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) + rank, group=group)
        gl = [torch.empty(3) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((3,), float(rank)), gl, dst=0, group=group)
        sc = torch.empty(3)
        sl = [torch.full((3,), float(i)) for i in range(world)] if rank == 0 else None
        dist.scatter(sc, sl, src=0, group=group)
        a2a = torch.empty(world)
        dist.all_to_all_single(a2a, torch.arange(float(world)) + 10 * rank, group=group)
        p = torch.full((2,), float(rank))
        if rank == 0:
            dist.send(p, dst=1, group=group)
        else:
            dist.recv(p, src=0, group=group)
        dist.barrier(group=group)
        f = funcol.all_reduce(torch.ones(2) * rank, "sum", group)
        out["values"] = [t.tolist() for t in (x, y, b, g, rs, sc, a2a, p, f * 1)]
        out["values"].append(r.tolist() if rank == 0 else None)  # gloo's other ranks: undefined
        out["values"] += [[t.tolist() for t in lst], gl and [t.tolist() for t in gl]]
        return out

    res = {}
    for name, group in groups.items():
        with CommDebugMode() as comm:
            with Seen() as seen:
                out = calls(group)
        out["counts"] = {str(k): v for k, v in comm.get_comm_counts().items()}
        out["seen"] = seen.ops
        out["plain"] = calls(group)["values"]        # no mode: the same results
        # An op refused under a mode raises what it raises without one.
        out["errors"] = []
        opts = dist.BroadcastOptions()
        opts.rootRank = world                   # no such rank
        for mode in (None, CommDebugMode()):
            try:
                with mode or contextlib.nullcontext():
                    group.broadcast([torch.ones(2)], opts).wait()
            except Exception as e:
                out["errors"].append(repr(e))
        res[name] = out
    print(json.dumps(res))
    dist.destroy_process_group()
""")


def test_dispatch_modes_see_pccl_ops_as_gloo_ones():
    for res in run_tcp_ranks(WORKER, 2, timeout_s=150):
        gloo, pccl = res["gloo"], res["pccl"]
        assert pccl["counts"] == gloo["counts"]
        # The list covers the ops CommDebugMode counts (and the ones it does not).
        assert sum(gloo["counts"].values()) >= 11, gloo["counts"]
        assert pccl["seen"] == gloo["seen"]
        seen = {op for op, _ in pccl["seen"]}
        assert {"c10d.barrier.default", "c10d.allreduce_.default"} <= seen, seen
        assert {"c10d.send.default", "c10d.recv_.default"} & seen, seen
        assert pccl["values"] == gloo["values"] == pccl["plain"]
        for errors in (gloo["errors"], pccl["errors"]):
            assert len(errors) == 2 and errors[0] == errors[1], errors
