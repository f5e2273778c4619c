"""torchrun (torch.distributed.elastic) restarts a pccl job whose worker failed.

Attempt 0: both workers form the pccl group and all_reduce once, then rank 1 raises
(once: a marker file records the attempt it failed in). torchrun, allowed one
restart, must restart both workers; attempt 1 forms the group again from the
agent's store and all_reduces to the right sum, and the job exits 0.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = """
    import datetime, os, sys
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    out = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("pccl", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1001,), float(rank + 1 + 10 * attempt))
    dist.all_reduce(t)
    with open(os.path.join(out, f"attempt{attempt}-rank{rank}.txt"), "w") as f:
        f.write(f"rank {rank}/{world} backend {dist.get_backend()} sum {t[0].item()} "
                f"same {bool((t == t[0]).all())}")
    marker = os.path.join(out, "rank1-failed")
    if rank == 1 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
        raise RuntimeError("injected failure in the first attempt")
    # Rank 0 of attempt 0 blocks here until rank 1's failure ends it (pccl error or torchrun's kill).
    dist.barrier()
    dist.destroy_process_group()
"""


@pytest.mark.pccl_only
def test_torchrun_restarts_after_worker_failure(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    log = f"torchrun exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, log
    assert (out / "rank1-failed").read_text() == "0", log
    assert "injected failure in the first attempt" in proc.stderr, log
    first = [(out / f"attempt0-rank{r}.txt").read_text() for r in range(2)]
    assert first == [f"rank {r}/2 backend pccl sum 3.0 same True" for r in range(2)], log
    second = [(out / f"attempt1-rank{r}.txt").read_text() for r in range(2)]
    assert second == [f"rank {r}/2 backend pccl sum 23.0 same True" for r in range(2)], log
    assert not any(p.name.startswith("attempt2") for p in out.iterdir()), log
