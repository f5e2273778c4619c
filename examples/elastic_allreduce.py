"""Elastic all-reduce loop: processes started and killed by hand join and leave a running group.

Terminal 1, the master (control plane only; it forms the first group once 2 peers are there):

    pccl-master --port 29600 --world-size 2

Terminals 2 .. n, one peer each (start 2, then more whenever you like):

    python examples/elastic_allreduce.py --master 127.0.0.1:29600

Then stop any peer with Ctrl-C or ``kill PID`` (a clean departure: ``destroy_process_group``
tells the master) or ``kill -9 PID`` (a crash): the others notice on their next collective,
shrink the group and go on. A peer started later waits *pending* until the members reach the
end of an outer step, where ``peers_pending()`` is true on every rank and ``update_topology()``
admits it.

Each outer step, on every member:
1. ``all_reduce_with_retry`` of a tensor in which every rank puts 1.0, so the sum is the world
   size. If a peer died, the failed op leaves the tensor unchanged; the call runs
   ``update_topology()`` (which also admits anyone pending) and repeats the op on the new world.
2. A short pause (pacing for a human watching the log, not synchronisation: the collectives line
   the ranks up, whatever the pause).
3. ``peers_pending()``: if anyone waits, ``update_topology()`` admits them.

A newly admitted process starts at step 1 of its loop, which is where the members are once the
update returns (whether it happened in step 3 or inside a retry of step 1), so every rank issues
the same collectives in the same order. Step numbers are per process (a new peer counts from 1);
the epoch and world size are the group's. In a real job the new peer would now receive the model
from the others (e.g. a broadcast from rank 0); here the state is the constant 1.0.

Options: ``--steps N`` stops after N steps (default: run until Ctrl-C), ``--pause S`` sets the
pause, ``--op-timeout S`` the per-op deadline after which a silent peer counts as lost (env
``PCCL_TIMEOUT`` wins if set), ``--join-timeout S`` how long to stay pending. A peer exits with
status 1 when the master goes away (membership cannot change without it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_pccl
from torch_pccl.elastic.topology import RETRYABLE_ERRORS

log = logging.getLogger("elastic_allreduce")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--master", default="127.0.0.1:29600",
                   help="the master's host:port (default 127.0.0.1:29600)")
    p.add_argument("--steps", type=int, default=0, help="outer steps to run; 0 = until Ctrl-C")
    p.add_argument("--numel", type=int, default=1 << 16,
                   help="float32 elements all-reduced per step (default 65536)")
    p.add_argument("--pause", type=float, default=1.0, metavar="S",
                   help="seconds between steps, for pacing only (default 1)")
    p.add_argument("--op-timeout", type=float, default=5.0, metavar="S",
                   help="per-op deadline in seconds (default 5; env PCCL_TIMEOUT overrides)")
    p.add_argument("--join-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait pending for admission (default 600)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    args = p.parse_args(argv)
    if args.steps < 0 or args.numel < 1 or args.pause < 0:
        p.error("--steps >= 0, --numel >= 1 and --pause >= 0 are required")
    if not (args.op_timeout > 0 and args.join_timeout > 0):
        p.error("--op-timeout and --join-timeout must be positive")
    return args


def log_change(change: torch_pccl.TopologyChange, why: str) -> None:
    log.info("%s: epoch %d, world size %d, rank %d, joined %s, left %s", why, change.epoch,
             change.world_size, change.rank, list(change.joined) or "-",
             list(change.left) or "-")


def admit_pending() -> None:
    """End of an outer step: admit waiting peers, if any (a collective of the members)."""
    try:
        pending = torch_pccl.peers_pending()
    except RETRYABLE_ERRORS as e:
        # A peer died during the query's 8-byte all-reduce: the group's error is sticky until
        # update_topology(), which also removes the dead peer.
        log.warning("peers_pending failed (%s: %s); updating the topology",
                    type(e).__name__, e)
        log_change(torch_pccl.update_topology(), "dropped the lost peer")
        return
    if pending:
        log_change(torch_pccl.update_topology(), "admitted pending peers")


def run(args: argparse.Namespace) -> None:
    tensor = torch.empty(args.numel, dtype=torch.float32)
    step = 0
    while args.steps == 0 or step < args.steps:
        step += 1
        tensor.fill_(1.0)
        for change in torch_pccl.all_reduce_with_retry(tensor):
            log_change(change, "all_reduce failed, retried on a new world")
        world = dist.get_world_size()
        ok = bool((tensor == world).all())
        log.info("step %d: epoch %d, world size %d, rank %d, sum %g (%s)", step,
                 torch_pccl.epoch(), world, dist.get_rank(), tensor[0].item(),
                 "= world size" if ok else "WRONG, expected the world size")
        if not ok:
            raise RuntimeError(f"step {step}: all_reduce gave {tensor[0].item()}, "
                               f"expected {world}")
        # Pacing only, so a human can follow the log and start or kill peers between steps;
        # the ranks are kept in step by the collectives, not by this wait.
        time.sleep(args.pause)
        admit_pending()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several peers may share the machine's cores
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format=f"%(asctime)s pid {os.getpid()} %(levelname)s: %(message)s")
    os.environ.setdefault("PCCL_TIMEOUT", str(args.op_timeout))
    log.info("joining through the master at %s (pending until admitted) ...", args.master)
    dist.init_process_group(backend="pccl", init_method=f"pccl://{args.master}",
                            timeout=timedelta(seconds=args.join_timeout))
    log.info("admitted: epoch %d, world size %d, rank %d", torch_pccl.epoch(),
             dist.get_world_size(), dist.get_rank())
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` leaves cleanly, as Ctrl-C does
    status = 0
    try:
        run(args)
    except KeyboardInterrupt:
        log.info("interrupted: leaving the group")
    except torch_pccl.PcclError as e:
        # Not a lost peer (all_reduce_with_retry handles those) but, e.g., the master gone or
        # this peer dropped by it: nothing left to retry with.
        log.error("giving up: %s: %s", type(e).__name__, e)
        status = 1
    finally:
        dist.destroy_process_group()  # tells the master: a clean departure, not an error
    return status


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
