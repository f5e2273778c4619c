"""Runs one script as every rank of a ``tcp://`` world, each in its own process.

For the tests that cannot use the worker pool (tests/c10d/test_cuda*.py: each rank needs a
fresh process that owns a GPU). The script gets ``rank world port`` as its arguments and
prints one JSON object on its last line; every process is bounded by ``timeout_s`` and
killed if still running.
"""

import json
import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tcp_ranks(script: str, world: int, timeout_s: float) -> list[dict]:
    """Each rank's last printed line, parsed as JSON, in rank order; asserts they exited 0."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results
