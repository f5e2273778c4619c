"""What tests/harness/replica_worker.py and replica_ddp_worker.py share: the arguments
of a replica's process, its inner gloo group, its JSON events, the word that lets a held
process go on, and the end of a run (a PcclError printed as an ``error`` event)."""

import argparse
import json
import os
import select
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import torch_pccl


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every replica process takes; a worker adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--master", required=True)
    ap.add_argument("--replica", required=True)
    ap.add_argument("--shard", type=int, required=True)
    ap.add_argument("--shards", type=int, required=True)
    ap.add_argument("--inner-port", type=int, required=True)
    ap.add_argument("--hold-at", type=int, action="append", default=[])
    ap.add_argument("--timeout", type=float, default=60.0)
    return ap


def init_inner(args) -> None:
    """The replica's inner group: gloo over 127.0.0.1, rank = shard index."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.inner_port}",
                            rank=args.shard, world_size=args.shards,
                            timeout=timedelta(seconds=args.timeout))


def emit(**msg):
    """One JSON event on stdout, with ``t``: the wall clock (seconds)."""
    print(json.dumps(dict(msg, t=round(time.time(), 2))), flush=True)


def inner_failed(pg, exc: BaseException):
    """Raises the master's reason when the replica was dropped (the inner group failed
    because a mate died), else ``exc``."""
    err = torch_pccl.replica_error(pg, timeout=10.0)
    if err is None:
        raise exc
    raise err from exc


def wait_word(args, pg) -> None:
    """Waits (bounded) for a line on stdin: ``go`` returns; ``probe`` prints
    ``{"event": "probe", "type", "message"}`` of ``torch_pccl.replica_error`` and exits."""
    ready, _, _ = select.select([sys.stdin], [], [], args.timeout)
    word = sys.stdin.readline().strip() if ready else ""
    if not word:
        raise TimeoutError("no word to go on within the timeout")
    if word == "probe":             # why the master dropped this process, if it did
        err = torch_pccl.replica_error(pg, timeout=10.0)
        emit(event="probe", type=None if err is None else type(err).__name__,
             message=str(err)[:2000])
        os._exit(0)


def run(body) -> None:
    """``body()``, then ``{"event": "done"}``; a PcclError becomes an ``error`` event and
    exit status 3."""
    try:
        body()
        emit(event="done")
    except torch_pccl.PcclError as exc:
        emit(event="error", type=type(exc).__name__, message=str(exc)[:2000])
        os._exit(3)
    dist.destroy_process_group()
    os._exit(0)
