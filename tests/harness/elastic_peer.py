"""Test-side helpers for peers running tests/harness/elastic_worker.py as processes."""

import os
import sys

from harness import HARNESS
from harness.worker_process import WorkerProcess

WORKER = os.path.join(HARNESS, "elastic_worker.py")
START_S = 60.0          # seconds: a worker's start (imports torch) on a loaded machine


def start_peer(master_addr, tmp_path, name, op_timeout_s, mode="join", **env):
    """A worker joining ``pccl://master_addr`` as ``name`` (op deadline ``op_timeout_s``,
    admission wait 60 s), once it has started; ``mode`` "standby" or "retry" waits for a
    "join" command first (and "retry" retries a failed join, see elastic_worker.py);
    ``env`` adds or, with None, removes variables (e.g. ``PCCL_SECRET=None``: no secret
    even if the test's environment has one)."""
    full = dict(os.environ, PCCL_TIMEOUT=str(op_timeout_s), PCCL_PEER_ID=name)
    full.pop("PCCL_SECRET_FILE", None)
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    p = WorkerProcess(name, [sys.executable, WORKER, master_addr, "60", mode], full,
                      tmp_path / f"{name}.stderr")
    p.recv(START_S, "started")
    return p


def assert_sum(answers, n):
    """Every answer of the "all_reduce" command: the sum of 1..n, bit-identical, world n."""
    for a in answers:
        assert a["error"] is None, a["error"]
        assert a["result"] == n * (n + 1) / 2 and a["uniform"] and a["world_size"] == n, a
