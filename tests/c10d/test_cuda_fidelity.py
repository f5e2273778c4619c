"""The drop-in fidelity items with CUDA tensors: backend "cuda:pccl", recv from any source
into a GPU tensor, a sparse all-reduce on the GPU and profiler events of GPU ops. Skipped, with the reason
printed, where torch sees no GPU (CI and CPU builds); the same items run on the CPU in
test_recv_any_source.py, test_sparse.py, test_profiler.py and test_backend_view.py."""

import textwrap

import pytest
import torch

from harness.tcp_ranks import run_tcp_ranks

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU: CUDA tensors through backend 'cuda:pccl'")]

WORKER = textwrap.dedent("""
    import json, sys, datetime, torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("cuda:pccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))
    dev = torch.device("cuda", 0)
    pg = dist.group.WORLD
    backend = type(pg._get_backend(dev)).__name__
    # recv from any source into a GPU tensor
    got = None
    if rank == 0:
        t = torch.zeros(8, device=dev)
        got = [dist.recv(t), t.cpu().tolist()[0]]
    else:
        dist.send(torch.full((8,), float(rank), device=dev), 0)
    # sparse all-reduce on the GPU
    sp = torch.sparse_coo_tensor(torch.tensor([[rank], [0]]), torch.tensor([1.0]), (world, 2),
                                 device=dev)
    dist.all_reduce(sp)
    # profiler events of a GPU all-reduce
    x = torch.ones(3, 4, device=dev)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(x)
    events = [[e.name, e.is_async, e.input_shapes] for e in prof.function_events
              if e.name.startswith("pccl:")]
    print(json.dumps({"backend": backend, "got": got, "sparse_device": str(sp.device),
                      "sparse": sp.to_dense().cpu().tolist(), "events": events}))
    dist.destroy_process_group()
""")


def test_cuda_pccl_fidelity():
    results = run_tcp_ranks(WORKER, 2, timeout_s=150)
    assert results[0]["got"] == [1, 1.0]
    for res in results:
        assert res["backend"] == "ProcessGroupPCCL"
        assert res["sparse_device"].startswith("cuda")
        assert res["sparse"] == [[1.0, 0.0], [1.0, 0.0]]
    if torch.__version__ < (2, 13) and not any(res["events"] for res in results):
        # Seen on torch 2.11.0+cu130 (the GPU machine's; torch_pccl needs >= 2.13): its
        # profiler drops a record function ended on another thread than the one that began
        # it, as pccl ends its ops' events (on the lane's executor), for CPU tensors too.
        pytest.xfail(f"torch {torch.__version__} drops events ended on another thread")
    for res in results:
        assert res["events"] == [["pccl:all_reduce", True, [[3, 4]]]]

