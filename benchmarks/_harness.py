"""What the benchmarks share: message sizes, iteration counts, child processes, tables, results.

Every benchmark in this folder is a script (``python benchmarks/<name>.py``), so this folder is on
``sys.path`` and ``from _harness import ...`` finds this module. It imports only the standard
library at the top (torch where a function needs it), so a parent that never touches torch
(benchmarks/lanes.py) stays quick to start.

Sizes are in bytes, durations in seconds, unless a name says otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import re
import subprocess
import sys
import time
from typing import Callable

KIB, MIB = 1 << 10, 1 << 20
HOST = "127.0.0.1"  # every loopback benchmark's address: ranks, stores, masters
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root

# --------------------------------------------------------------------------- sizes and counts


def parse_size(text: str) -> int:
    """'4KiB' / '16MiB' / '4096' -> bytes (a whole number of float32 values).

    Units B, KiB, MiB and GiB, any case. Raises ``argparse.ArgumentTypeError`` (so it serves as
    an argparse ``type=``) for anything else, and for sizes that are not a positive multiple of 4.
    """
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB|B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64KiB, 16MiB)")
    scale = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": 1 << 30}[(m.group(2) or "").lower()]
    nbytes = int(m.group(1)) * scale
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: need a positive multiple of 4 bytes")
    return nbytes


def format_size(nbytes: int) -> str:
    """Bytes as a table shows them: '64 MiB', '4 KiB', or '100 B' when no unit divides them."""
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def iterations_for(nbytes: int, override: int | None, payload: int = 256 * MIB,
                   timed_range: tuple[int, int] = (5, 100),
                   min_warmup: int = 1) -> tuple[int, int]:
    """(warmup, timed) iterations for messages of ``nbytes`` bytes: many small ops, few big ones.

    ``timed`` is ``override`` if given, else about ``payload`` bytes' worth of ops, clamped to
    ``timed_range`` (fewest, most); ``warmup`` is a tenth of that, at least ``min_warmup``.
    The defaults (256 MiB, 5 .. 100, 1) are benchmarks/allreduce.py's: its default sweep
    (worlds 2 and 4) takes a minute or two on a 2-core machine.
    """
    fewest, most = timed_range
    timed = override or max(fewest, min(most, payload // nbytes))
    return max(min_warmup, timed // 10), timed


# --------------------------------------------------------------------------- child processes


def child_env(drop: tuple[str, ...] = (), **extra: str) -> dict:
    """The environment of a benchmark's child process.

    This process's environment without the variables named in ``drop``, with one OpenMP thread
    per process (``OMP_NUM_THREADS=1``: several ranks share few cores), this checkout first on
    ``PYTHONPATH`` (so the child imports the same torch_pccl), and ``extra`` on top.
    """
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p), **extra)
    return env


def stop(procs, grace: float = 5.0) -> None:
    """Terminate, then kill, whatever is still alive of ``procs`` (multiprocessing processes).

    Each join waits at most ``grace`` seconds.
    """
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(grace)


def kill_all(popens, wait_s: float | None) -> None:
    """SIGKILL every ``subprocess.Popen`` of ``popens`` still running and reap it.

    ``wait_s``: seconds to wait for each to be reaped (None: as long as it takes).
    """
    for p in popens:
        if p.poll() is None:
            p.kill()
            p.wait(wait_s)


def supervise(procs, conn, timeout_s: float, receive: Callable[[object], bool], label: str,
              running: str = "still running") -> None:
    """Waits until every process of ``procs`` has exited 0, handing ``conn``'s messages on.

    ``procs``: started multiprocessing processes. Whenever ``conn`` (a multiprocessing
    connection) has a message, ``receive(conn)`` reads it and returns whether to keep listening
    (False once the last message came, or the connection ended). Messages still queued when
    the last process exits are handed on too.

    Raises:
        TimeoutError: ``timeout_s`` seconds passed first (``"<label>: <running> after ..."``).
        RuntimeError: a process exited with a non-zero code; the others are left running (the
            caller stops them, with ``stop``, in its ``finally``).
    """
    deadline = time.monotonic() + timeout_s
    listening = True
    pending = {p.sentinel: p for p in procs}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{label}: {running} after {timeout_s} s")
        waitables = list(pending) + ([conn] if listening else [])
        for ready in mp.connection.wait(waitables, timeout=remaining):
            if ready is conn:
                listening = receive(conn)
                continue
            proc = pending.pop(ready)
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"{label}: {proc.name} exited with {proc.exitcode}")
    while listening and conn.poll():  # the last exit and the last message seen in one wait
        listening = receive(conn)


def run_world(world: int, cfg: dict, target, name: str) -> list[dict]:
    """Spawn ``world`` ranks, wait for them within ``cfg['timeout']`` seconds, return rank 0's rows.

    ``target(rank, world, store_port, cfg, conn)`` is each rank's body (a module-level function
    of the calling script); rank 0 sends its rows (a list of dicts) to ``conn``, the others get
    None. The processes are named ``<name>-rank<r>``.

    The parent hosts the rendezvous store on ``HOST`` (port 0, so no port race with other
    programs) and watches every child's exit: if one fails, the others are stopped at once
    instead of waiting for their collective timeout.
    """
    import torch.distributed as dist

    store = dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(
            target=target,
            args=(rank, world, store.port, cfg, sender if rank == 0 else None),
            name=f"{name}-rank{rank}",
        )
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    sender.close()  # the parent only reads; rank 0 holds the write end

    rows = None

    def receive(conn) -> bool:
        nonlocal rows
        try:
            rows = conn.recv()
        except EOFError:  # rank 0 exited without sending: its exit code says why
            rows = []
        return False

    try:
        supervise(procs, receiver, cfg["timeout"], receive, f"world {world}",
                  running="ranks still running")
    finally:
        stop(procs)
        receiver.close()
    if not rows:
        raise RuntimeError(f"world {world}: rank 0 sent no results")
    return rows


# --------------------------------------------------------------------------- reports


def print_header(header: str) -> None:
    """Print a table's header line and a rule of dashes as long as it."""
    print(header)
    print("-" * len(header))


def machine() -> dict:
    """This machine for results.json: CPU count, platform, Python and torch versions."""
    import torch

    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` as indented JSON with a final newline."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def write_results(out_dir: str, doc: dict, seconds: float) -> None:
    """Write ``doc`` to ``<out_dir>/results.json``, then print the run's last line.

    ``seconds``: the run's wall time, printed to the second (``"<seconds> s; wrote ..."``).
    """
    write_json(os.path.join(out_dir, "results.json"), doc)
    print(f"\n{seconds:.0f} s; wrote {out_dir}/results.json")


# --------------------------------------------------------------------------- namespaces


def netns_module():
    """tests/harness/netns.py (a dev benchmark: the tests' namespace helper is reused as is)."""
    tests = os.path.join(REPO, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from harness import netns

    return netns


def set_rate(hosts, rate_mbit: float) -> None:
    """Caps every host's eth0 egress at ``rate_mbit`` with a token bucket; 0 removes the cap."""
    for name in hosts.names:
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", "eth0",
                        "root"], capture_output=True, timeout=10)  # none yet is fine
        if rate_mbit <= 0:
            continue
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(128 * 1024, int(rate_bytes / 100))  # >= 10 ms at the rate, >= a GSO packet
        argv = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        if proc.returncode != 0:
            raise RuntimeError(f"'{' '.join(argv)}' failed: {proc.stderr.strip()}")
