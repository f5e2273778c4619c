"""How an example peer is launched: under torchrun or against a master, and its role in churn.

Shared by ``train_diloco.py`` and ``elastic_ddp.py`` (``ring_digests`` also by
``train_sharded_diloco.py``). Under torchrun, rank 0 starts a
torch_pccl master in a thread and hands its address to the others through torchrun's own
store; ``--late-join-step`` holds the last rank back until the group passes that step, and
``--kill-step`` makes rank 1 SIGKILL itself (it runs as a child of its torchrun worker, which
reports the kill and exits 0, because torchrun stops every worker when one dies). With
``--master`` every process is a separately launched peer of an existing master.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import torch_pccl
from torch_pccl import config

log = logging.getLogger("examples.launch")

# Env of the child process that runs the peer torchrun's worker wraps for --kill-step.
CHILD_ENV = "TORCH_PCCL_EXAMPLE_CHILD"


def add_membership_arguments(p: argparse.ArgumentParser) -> None:
    """The options every example shares: ``--master``, ``--late-join-step``, ``--kill-step``,
    ``--op-timeout`` and ``--join-timeout`` (seconds)."""
    g = p.add_argument_group("membership")
    g.add_argument("--master", metavar="HOST:PORT",
                   help="join through this pccl-master (separate launches); default under "
                        "torchrun: a master started by torchrun rank 0")
    g.add_argument("--late-join-step", type=int, metavar="N",
                   help="torchrun: one peer joins once the group passed step N")
    g.add_argument("--kill-step", type=int, metavar="N",
                   help="one peer SIGKILLs itself at step N (torchrun: rank 1; "
                        "--master: this process)")
    g.add_argument("--op-timeout", type=float, default=60.0, metavar="S",
                   help="per-collective deadline (default 60; env PCCL_TIMEOUT wins)")
    g.add_argument("--join-timeout", type=float, default=600.0, metavar="S",
                   help="how long a peer may wait pending for admission (default 600)")


def check_membership_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits (``p.error``) unless ``--late-join-step`` and ``--kill-step`` lie in
    1 .. ``--steps`` - 1."""
    for name in ("late_join_step", "kill_step"):
        value = getattr(args, name)
        if value is not None and not 0 < value < args.steps:
            p.error(f"--{name.replace('_', '-')} must be in 1 .. --steps - 1")


def is_victim_worker(args: argparse.Namespace) -> bool:
    """True in the torchrun worker (rank 1) that must run its peer as a child (--kill-step)."""
    return (args.kill_step is not None and not args.master and os.environ.get("RANK") == "1"
            and os.environ.get(CHILD_ENV) != "1")


@dataclass
class Launch:
    """How this process takes part: torchrun worker or separately launched peer, and its role."""

    torchrun: bool
    torchrun_rank: int | None = None  # RANK under torchrun (fixed; the pccl rank may differ)
    torchrun_world: int | None = None
    store: dist.Store | None = None  # torchrun's rendezvous store (addresses and a flag)
    master_addr: str = ""
    master: object = None  # the MasterThread this process hosts, if any
    late: bool = False  # hold back until the group passes --late-join-step
    victim: bool = False  # SIGKILL self at --kill-step
    keys: str = ""  # prefix of this example's keys in torchrun's store

    def key(self, name: str) -> str:
        """This example's key ``name`` in torchrun's store."""
        return f"{self.keys}/{name}"

    def hold_back(self, args: argparse.Namespace) -> None:
        """The late joiner: wait (on torchrun's store, no polling) for the group's go."""
        log.info("%s: holding back until the group passes step %d", self.name,
                 args.late_join_step)
        self.store.wait([self.key("late_join_go")],
                        datetime.timedelta(seconds=args.join_timeout))

    def let_late_joiner_in(self) -> None:
        """Rank 0 of the group, once it passed --late-join-step: the late peer may join."""
        self.store.set(self.key("late_join_go"), "1")

    @property
    def name(self) -> str:
        return f"rank{self.torchrun_rank}" if self.torchrun else f"pid{os.getpid()}"


def torchrun_roles(world: int, args: argparse.Namespace) -> tuple[int | None, int | None]:
    """The torchrun ranks of the late joiner and of the peer to kill (None: no such role).

    Rank 0 hosts the master, so it is neither. The late joiner is the last rank, the victim
    rank 1. Raises ``SystemExit`` when the world is too small for the roles asked for.
    """
    late = world - 1 if args.late_join_step is not None else None
    victim = 1 if args.kill_step is not None else None
    needed = 1 + (late is not None) + (victim is not None)
    if world < max(needed, 2 if late is not None or victim is not None else 1) or (
            late is not None and late == victim):
        raise SystemExit(f"--late-join-step/--kill-step need {needed + 1} or more torchrun "
                         f"processes with both, 2 or more with one (got {world})")
    return late, victim


def wrap_victim_in_child(script: str, argv: list[str]) -> int:
    """Torchrun worker of the peer to be killed: run the peer as a child and outlive its SIGKILL.

    torchrun stops every worker as soon as one exits abnormally, which would end the job that
    is meant to survive the kill. The child inherits torchrun's environment (RANK, the store),
    so it is the peer; this process only waits for it, forwards SIGTERM/SIGINT, and turns the
    expected SIGKILL into a clean exit. Returns the exit status for torchrun.
    """
    env = dict(os.environ, **{CHILD_ENV: "1"})
    child = subprocess.Popen([sys.executable, os.path.abspath(script), *argv], env=env)

    def forward(signum, frame):
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        status = child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if status == -signal.SIGKILL:
        log.info(
            "torchrun rank %s: the peer (pid %d) was SIGKILLed as asked by --kill-step; "
            "exiting 0 so torchrun keeps the others running", os.environ.get("RANK"), child.pid)
        return 0
    return status if status >= 0 else 128 - status


def prepare_launch(args: argparse.Namespace, script: str) -> Launch:
    """Find the master (start it on torchrun rank 0) and this process's role; no group yet.

    ``script``: the example's file name (``train_diloco.py``), for the usage message and
    the names of its keys in torchrun's store.
    """
    if args.master:
        if args.late_join_step is not None:
            raise SystemExit("--late-join-step is for torchrun; with --master start the "
                             "process later instead")
        return Launch(torchrun=False, master_addr=args.master, victim=args.kill_step is not None)
    if "RANK" not in os.environ:
        raise SystemExit(
            f"{script} runs under torchrun or with --master, e.g.\n"
            f"  torchrun --standalone --nproc_per_node=4 examples/{script}\n"
            "  pccl-master --port 29600 --world-size 2   # then, in several shells:\n"
            f"  python examples/{script} --master 127.0.0.1:29600")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    late, victim = torchrun_roles(world, args)
    host = os.environ["MASTER_ADDR"]
    store = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=args.join_timeout))
    launch = Launch(torchrun=True, torchrun_rank=rank, torchrun_world=world, store=store,
                    late=rank == late, victim=rank == victim, keys=script)
    if rank == 0:
        from torch_pccl.core.address import advertised_host
        from torch_pccl.master import start_in_thread

        # The first group: every rank but the late joiner (the master's bootstrap waits for it).
        initial = world - (late is not None)
        # PCCL_STATUS_PORT: the master's live status page on loopback (docs/status-page.md).
        launch.master = start_in_thread(advertised_host(target=host), 0, world_size=initial,
                                        http_port=config.status_port())
        store.set(launch.key("master_addr"), launch.master.address)
    launch.master_addr = store.get(launch.key("master_addr")).decode("ascii")
    return launch


def join_group(launch: Launch, args: argparse.Namespace) -> None:
    """``init_process_group`` through the master; blocks while pending."""
    os.environ.setdefault("PCCL_TIMEOUT", str(args.op_timeout))
    url = f"pccl://{launch.master_addr}"
    if launch.torchrun:
        url += f"?peer_id=torchrun-rank{launch.torchrun_rank}"  # readable master logs
    dist.init_process_group(backend="pccl", init_method=url,
                            timeout=datetime.timedelta(seconds=args.join_timeout))


def run_peer(script: str, argv: list[str], args: argparse.Namespace,
             train: Callable[[argparse.Namespace, Launch], dict | None]) -> tuple[int, dict | None]:
    """An example's ``main``: one thread per process, logging, the launch, ``train(args,
    launch)``, then the group and the master closed whatever happened.

    Returns ``(exit code, train's summary)``; in the torchrun worker of a ``--kill-step``
    victim, the exit code of its child peer and None (``wrap_victim_in_child``).
    """
    torch.set_num_threads(1)  # several peers share few cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # The master's INFO log (every sync round) would drown the progress; joins, departures
    # and parity are logged by the peers themselves.
    logging.getLogger("torch_pccl.master").setLevel(logging.WARNING)
    if is_victim_worker(args):
        return wrap_victim_in_child(script, argv), None
    launch = prepare_launch(args, os.path.basename(script))
    try:
        return 0, train(args, launch)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if launch.master is not None:
            launch.master.stop()


def ring_digests(state: dict[str, torch.Tensor], group=None) -> list[str]:
    """The content digest (``torch_pccl.content_digest``, first 15 hex digits) of ``state``
    on every rank of ``group`` (None: the default group), in rank order; a collective."""
    digest = torch_pccl.content_digest(state)
    mine = torch.tensor([int(digest[:15], 16)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [f"{int(t.item()):015x}" for t in gathered]


def check_parity(state: dict[str, torch.Tensor], what: str, group=None) -> str:
    """All-gathers the content digest of ``state`` (``torch_pccl.content_digest``) from every
    peer of ``group`` (None: the default group); returns it, or raises RuntimeError naming
    ``what`` if any peer's differs."""
    digest = torch_pccl.content_digest(state)
    values = ring_digests(state, group)
    if len(set(values)) != 1:
        raise RuntimeError(f"{what} differ between peers: {sorted(set(values))}")
    if dist.get_rank(group) == 0:
        log.info("%s bit-identical on all %d peers (digest %s)", what,
                 dist.get_world_size(group), digest)
    return digest
