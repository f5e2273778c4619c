"""How users reach the backend: entry-point registration, torchrun, subgroups, functional collectives."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.data import assert_equal, assert_identical_across_ranks, assert_reduced, make_input, unpack

pytestmark = pytest.mark.timeout(180)


def run_python(code, timeout=120, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.mark.pccl_only
def test_backend_pccl_attribute_without_import():
    out = run_python("import torch, torch.distributed as d; print(d.Backend.PCCL)")
    assert out.strip() == "pccl"


@pytest.mark.pccl_only
def test_init_process_group_without_import():
    out = run_python("""
        import torch, torch.distributed as dist
        dist.init_process_group("pccl", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.arange(5, dtype=torch.float32)
        dist.all_reduce(t)
        print(dist.get_backend(), t.tolist(), dist.is_backend_available("pccl"))
        dist.destroy_process_group()
    """)
    assert out.split("\n")[0] == "pccl [0.0, 1.0, 2.0, 3.0, 4.0] True"


@pytest.mark.pccl_only
@pytest.mark.parametrize("order", ("torch_pccl first", "torch first"))
def test_package_imports_in_any_order(order):
    first, second = ("torch_pccl", "torch") if order == "torch_pccl first" else ("torch", "torch_pccl")
    out = run_python(f"""
        import {first}, {second}
        import torch_pccl, torch.distributed as dist
        print(issubclass(torch_pccl.PcclError, RuntimeError), dist.Backend.PCCL)
    """)
    assert out.strip() == "True pccl"


@pytest.mark.pccl_only
def test_torchrun_two_processes(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent("""
        import datetime, os, sys
        import torch, torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("pccl", timeout=datetime.timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.full((1001,), float(rank + 1))
        dist.all_reduce(t)
        g = torch.zeros(world, dtype=torch.int64)
        dist.all_gather_into_tensor(g, torch.tensor([rank * 10]))
        dist.barrier()
        line = (f"rank {rank}/{world} backend {dist.get_backend()} sum {t[0].item()} "
                f"same {bool((t == t[0]).all())} gathered {g.tolist()}")
        with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
            f.write(line)
        dist.destroy_process_group()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, f"torchrun exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert lines == [
        "rank 0/2 backend pccl sum 3.0 same True gathered [0, 10]",
        "rank 1/2 backend pccl sum 3.0 same True gathered [0, 10]",
    ]


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_default_group_reports_backend(pools, backend, world_size):
    info = pools.get(world_size).run("ping")
    assert [i["rank"] for i in info] == list(range(world_size))
    assert all(i["world_size"] == world_size and i["backend"] == backend for i in info)


@pytest.mark.parametrize(
    "world_size,ranks", [(2, [1]), (3, [0, 2]), (4, [1, 2, 3]), (4, [0, 1, 2, 3]), (4, [3, 0])]
)
def test_new_group_subgroup(pools, backend, world_size, ranks):
    pool = pools.get(world_size)
    seed = 77 + world_size + len(ranks)
    members = sorted(ranks)
    results = pool.run("subgroup_all_reduce", ranks, seed, 1031, "float32", "SUM")
    for r in range(world_size):
        if r not in members:
            assert results[r] is None
    mine = [results[r] for r in members]
    assert all(m["backend"] == backend for m in mine)
    assert [m["info"] for m in mine] == [(i, len(members)) for i in range(len(members))]
    assert_identical_across_ranks([m["result"] for m in mine], "subgroup all_reduce")
    inputs = [make_input(seed, r, 1031, "float32", "SUM") for r in members]
    assert_reduced(unpack(mine[0]["result"]), inputs, "SUM", "float32", "subgroup all_reduce")
    expected = torch.cat([torch.arange(4, dtype=torch.float32) + r for r in members])
    for m in mine:
        assert_equal(unpack(m["gathered"]), expected, "subgroup all_gather")
    # The default group still works after the subgroup was destroyed.
    after = pool.run("all_reduce", seed, 5, "int64", "SUM", full=True)
    assert_reduced(unpack(after[0]), [make_input(seed, r, 5, "int64") for r in range(world_size)],
                   "SUM", "int64", "default group after subgroup")


@pytest.mark.parametrize("world_size", (1, 2, 3))
def test_functional_collectives(pools, world_size):
    pool = pools.get(world_size)
    seed, n = 5 + world_size, 12
    results = pool.run("functional_collectives", seed, n)
    x = [make_input(seed, r, n, "float32") for r in range(world_size)]
    big = {s: [make_input(seed + p, s, n, "float32") for p in range(world_size)] for s in range(world_size)}
    for key in ("all_reduce", "all_reduce_max", "all_gather_tensor", "broadcast", "all_reduce_used"):
        assert_identical_across_ranks([res[key] for res in results], f"funcol {key}")
    assert_reduced(unpack(results[0]["all_reduce"]), x, "SUM", "float32", "funcol all_reduce")
    assert_reduced(unpack(results[0]["all_reduce_max"]), x, "MAX", "float32", "funcol max")
    assert_equal(unpack(results[0]["all_gather_tensor"]), torch.cat(x), "funcol all_gather")
    assert_equal(unpack(results[0]["broadcast"]), x[0], "funcol broadcast")
    used = unpack(results[0]["all_reduce_used"]) / 2
    assert_reduced(used, x, "SUM", "float32", "funcol all_reduce used lazily")
    for r in range(world_size):
        assert_reduced(unpack(results[r]["reduce_scatter_tensor"]), [big[s][r] for s in range(world_size)],
                       "SUM", "float32", f"funcol reduce_scatter rank {r}")
        expected = torch.cat([big[s][r] for s in range(world_size)])
        assert_equal(unpack(results[r]["all_to_all_single"]), expected, f"funcol all_to_all rank {r}")
