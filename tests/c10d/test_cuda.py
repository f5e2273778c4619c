"""CUDA tensors through backend="pccl": staged through host memory by the process
group, results land back on the GPU. Skipped where torch sees no GPU (CI, CPU builds)."""

import textwrap

import pytest
import torch

from harness.tcp_ranks import run_tcp_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WORKER = textwrap.dedent("""
    import json, sys, datetime, torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("pccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    dev = torch.device("cuda", 0)
    x = torch.arange(1001, dtype=torch.float32, device=dev) * (rank + 1)
    dist.all_reduce(x)
    b = torch.full((17,), float(rank), device=dev, dtype=torch.bfloat16)
    dist.broadcast(b, src=world - 1)
    g = torch.empty(world * 5, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(g, torch.full((5,), rank, dtype=torch.int64, device=dev))
    print(json.dumps({"devices": [str(t.device) for t in (x, b, g)],
                      "sum": x.cpu().tolist()[:3], "bcast": b.float().cpu().tolist()[0],
                      "gather": g.cpu().tolist()}))
    dist.destroy_process_group()
""")


def test_cuda_tensors_are_staged_and_come_back_on_the_gpu():
    world = 2
    for res in run_tcp_ranks(WORKER, world, timeout_s=120):
        assert all(d.startswith("cuda") for d in res["devices"])
        assert res["sum"] == [0.0, 3.0, 6.0]  # 1 + 2 times arange
        assert res["bcast"] == float(world - 1)
        assert res["gather"] == [r for r in range(world) for _ in range(5)]
