"""c10d code that asks a group for its backend by device (dist.recv without src, FSDP2,
DeviceMesh, object collectives) gets one for cpu and cuda; backend strings that would
give a device to another backend are refused at init_process_group, "cuda:pccl" works."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world_size", (1, 2))
def test_get_backend_by_device(pools, backend, world_size):
    views = pools.get(world_size).run("fidelity.backend_view", deadline_s=60)
    expected = "ProcessGroupPCCL" if backend == "pccl" else "ProcessGroupGloo"
    for view in views:
        for name in ("world", "sub"):
            v = view[name]
            assert (v["cpu"], v["cuda"]) == (expected, expected), view
            assert v["devices"] == ["cpu", "cuda"], view
            assert v["object_device"] == "cpu", view
            if backend == "pccl":
                assert v["cpu_is_group"], "the pccl group is its own backend"


def _run_world_of_one(backend_string, body=""):
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        try:
            dist.init_process_group({backend_string!r}, store=dist.HashStore(), rank=0,
                                    world_size=1)
        except Exception as e:
            print("REFUSED", type(e).__name__, e)
            print("INITIALIZED", dist.is_initialized())
            raise SystemExit(0)
        print("BACKEND", dist.get_backend())
    """) + textwrap.dedent(body) + "\ndist.destroy_process_group()\n"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=90, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.pccl_only
@pytest.mark.parametrize("spec", ("cpu:pccl,cuda:nccl", "cuda:gloo,cpu:pccl", "cpu:gloo,cuda:pccl"))
def test_mixed_backend_string_is_refused(spec):
    out = _run_world_of_one(spec)
    assert "REFUSED InvalidArgumentError" in out, out
    assert "new_group(backend='pccl')" in out and "mixes pccl with" in out, out
    assert "INITIALIZED False" in out, "a refused init left a default group behind"


@pytest.mark.pccl_only
def test_cuda_only_pccl_string_works():
    """"cuda:pccl" gives the whole group to pccl, which serves CPU tensors too."""
    out = _run_world_of_one("cuda:pccl", """
        t = torch.full((5,), 2.0)
        dist.all_reduce(t)
        print("SUM", t.tolist())
    """)
    assert "BACKEND cuda:pccl" in out or "BACKEND pccl" in out, out
    assert "SUM [2.0, 2.0, 2.0, 2.0, 2.0]" in out, out
