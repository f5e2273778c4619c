"""Train the KJV character transformer with DiLoCo across sharded replicas: 2 replicas x 2 shards.

The main job (``examples/train_diloco.py``: ``CharTransformer`` on the King James Bible, AdamW
inside, Nesterov outer steps every H inner steps), with each DiLoCo peer replaced by a *replica*
of several processes that together hold one copy of the model (docs/sharded-replicas.md):

- inside a replica, one ``torchrun --nproc_per_node=2``: an inner gloo group of its processes and
  the model sharded with FSDP2 ``fully_shard`` over a 1-D CPU mesh of them (DTensor
  parameters); each process trains on its own batches, FSDP averages the gradients;
- across replicas, ``DiLoCo(model, inner_opt, sync_every=H, group=init_replica_group(...))``:
  shard i of every replica exchanges its shard's pseudo-gradients over the ring of shard index
  i, and the master admits and drops whole replicas.

Run it alone::

    python examples/train_sharded_diloco.py                           # 2 replicas x 2 shards
    python examples/train_sharded_diloco.py --late-join-replica 100 --kill-shard 220

With no ``--master`` the script is the launcher: it starts a master in a thread, one torchrun
per replica on this machine, waits for them (at most ``--run-timeout`` seconds), and stops
everything it started whatever happens. ``--late-join-replica N`` starts a third replica once
the group passed inner step N; it is admitted at the next outer step and receives its shards'
outer parameters, outer-optimizer state and step from the members. ``--kill-shard N``
SIGKILLs shard 1 of replica 1 at step N: torchrun stops the replica's other process, the
master drops the replica whole, and the other replicas train on.

Two sites (any machines; a master in common)::

    python -m torch_pccl.master --port 29600 --world-size 4           # 4 processes = 2 replicas
    python examples/train_sharded_diloco.py --master HOST:29600 --replica-id site-a   # site A
    python examples/train_sharded_diloco.py --master HOST:29600 --replica-id site-b   # site B

With ``--master`` and ``--replica-id`` the script runs one replica: it starts its own
``torchrun --standalone --nproc_per_node=--shards`` of itself and waits for it (under
torchrun, it is one shard of that replica; running ``torchrun --standalone --nproc_per_node=2
examples/train_sharded_diloco.py --pccl-master HOST:29600 --replica-id site-a`` directly does
the same: torchrun's parser takes ``--master`` for an abbreviation of its own options). A
third site started later is a late joiner; ``--kill-shard N`` there SIGKILLs that replica's
shard 1 at step N. A replica is admitted at the first outer step after all its processes
registered: on 2 busy cores a torchrun takes about 20-30 s to get there, so start a late
replica at least that long before the end.

``--no-fsdp`` keeps every process's model whole (DDP over the replica's inner group instead of
FSDP; each shard ring then carries the whole model): the launch, membership and churn logic
without DTensor parameters.

``--device cuda`` puts each process's model and batches on a GPU (``LOCAL_RANK`` modulo the
GPUs there) and makes the inner group NCCL; pccl still carries the exchange across replicas
(it stages CUDA tensors through host memory). NCCL refuses two ranks of one group on the same
GPU, so a replica needs as many GPUs as shards: on a one-GPU machine run ``--shards 1``.

Outputs, written by shard 0 of the replica that is rank 0 of the shard rings at the end, to
``--out-dir`` (default ``runs/train_sharded_diloco``): ``summary.json`` (``bit_identical``:
every shard's outer state has the same content digest on every surviving replica; the digests;
``replicas_history``: [inner step, replicas] at each change; eval losses; tokens; bytes per
replica) and ``loss.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

import torch_pccl
from _data import build_corpus, load_kjv_text, sample_batch, training_generator, validation_batches
from _launch import ring_digests
from _model import CharTransformer, add_training_arguments, lr_at
from _report import Record, write_run

log = logging.getLogger("train_sharded_diloco")

LATE_JOIN_KEY = "late_join_go"  # set in the launcher's store once the group passed the step
VICTIM_SHARD = 1  # --kill-shard kills this shard of its replica (the last one if fewer)
VICTIM_REPLICA = 1  # ... and, from the launcher, of this replica (by launch order)
LATE_GRACE_S = 60.0  # how long the late replica may outlast the others (seconds)

# The options a launcher hands on to every replica's processes (dest names).
FORWARDED = ("steps", "batch_size", "block_size", "dim", "layers", "heads", "lr", "warmup",
             "eval_every", "eval_batches", "seed", "sync_every", "outer_lr", "outer_momentum",
             "op_timeout", "join_timeout", "out_dir", "no_fsdp", "no_progress", "device")


# --------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See docs/sharded-replicas.md for how it works and the measured results.")
    g = p.add_argument_group("algorithm")
    g.add_argument("--sync-every", type=int, default=20, metavar="H",
                   help="inner steps per outer step (default 20)")
    g.add_argument("--outer-lr", type=float, default=0.7, help="Nesterov outer lr (default 0.7)")
    g.add_argument("--outer-momentum", type=float, default=0.7,
                   help="Nesterov momentum (default 0.7, as examples/train_diloco.py)")
    g = p.add_argument_group("training")
    add_training_arguments(g, 400, "inner steps", "peak inner AdamW learning rate")
    g = p.add_argument_group("replicas")
    g.add_argument("--replicas", type=int, default=2,
                   help="launcher: replicas started at once (default 2)")
    g.add_argument("--shards", type=int, default=2,
                   help="processes per replica, each holding one shard (default 2)")
    g.add_argument("--no-fsdp", action="store_true",
                   help="keep each process's model whole (DDP inside the replica, not FSDP2)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where each process trains: cpu (inner group gloo, the default) or "
                        "cuda (inner group NCCL; one GPU per shard of a replica)")
    # --pccl-master: the spelling to use after torchrun, whose own parser rejects
    # "--master" as an ambiguous abbreviation of its --master-addr/--master-port even
    # among the script's arguments.
    g.add_argument("--master", "--pccl-master", metavar="HOST:PORT",
                   help="run one replica (--replica-id) against this master; default: "
                        "launch a master and every replica on this machine. Under torchrun "
                        "spell it --pccl-master")
    g.add_argument("--replica-id", metavar="NAME", help="with --master: this replica's name")
    g.add_argument("--late-join-replica", type=int, metavar="N",
                   help="launcher: one more replica starts once the group passed step N")
    g.add_argument("--kill-shard", type=int, metavar="N",
                   help=f"SIGKILL shard {VICTIM_SHARD} of replica {VICTIM_REPLICA} (launcher) "
                        f"or of this replica (--master) at step N")
    g.add_argument("--op-timeout", type=float, default=60.0, metavar="S",
                   help="deadline of the master's rounds and of the inner group's collectives "
                        "(default 60)")
    g.add_argument("--join-timeout", type=float, default=300.0, metavar="S",
                   help="how long a replica may wait for admission, and the shard rings' op "
                        "deadline (default 300)")
    g.add_argument("--run-timeout", type=float, default=1200.0, metavar="S",
                   help="launcher: stop everything after this many seconds (default 1200)")
    # The launcher's store (late joiner's go); set by the launcher only.
    g.add_argument("--launcher-store", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default="runs/train_sharded_diloco",
                   help="where loss.png and summary.json go (default runs/train_sharded_diloco)")
    p.add_argument("--no-progress", action="store_true", help="no per-eval progress lines")
    args = p.parse_args(argv)
    for name in ("steps", "sync_every", "batch_size", "eval_every", "eval_batches", "replicas",
                 "shards"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    # Evaluations read the model right after an outer step, when it holds the outer parameters.
    if args.eval_every % args.sync_every or args.steps % args.sync_every:
        p.error("--eval-every and --steps must be multiples of --sync-every")
    for name in ("late_join_replica", "kill_shard"):
        value = getattr(args, name)
        if value is not None and not 0 < value < args.steps:
            p.error(f"--{name.replace('_', '-')} must be in 1 .. --steps - 1")
    if bool(args.master) != bool(args.replica_id):
        p.error("--master and --replica-id go together")
    if args.master and args.late_join_replica is not None and not args.launcher_store:
        p.error("--late-join-replica is for the launcher; with --master start a replica later")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU here")
    if args.kill_shard is not None and not args.master and args.replicas <= VICTIM_REPLICA:
        p.error(f"--kill-shard needs --replicas > {VICTIM_REPLICA} (the others train on)")
    return args


# --------------------------------------------------------------------------- one shard


def victim_shard(shards: int) -> int:
    """The shard index ``--kill-shard`` kills: ``VICTIM_SHARD``, or the last of fewer."""
    return min(VICTIM_SHARD, shards - 1)


def shard_model(model: nn.Module, fsdp: bool, device: torch.device) -> nn.Module:
    """The module this process trains: ``model`` (already on ``device``) sharded in place with
    FSDP2 over a 1-D mesh of the replica's processes (one ``fully_shard`` per block, then the
    root, so that a block's parameters are gathered only while it runs), or, without ``fsdp``,
    ``model`` whole inside a DDP over the replica's inner group. Either way the replica's
    processes train one copy of the model on different batches, with gradients averaged over
    the replica."""
    if not fsdp:
        ids = [device] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def replica_names(peer_ids) -> list[str]:
    """The replicas of master peer ids (``init_replica_group``'s ``<replica>/<shard>-...``)."""
    return sorted({peer.split("/")[0] for peer in peer_ids})


@torch.no_grad()
def evaluate(model: nn.Module, val_batches: list) -> float:
    """Mean validation loss of ``model`` as it is, nats / character. A collective of the replica
    under FSDP (every block's parameters are gathered), so every shard calls it; called right
    after an outer step, when the model holds the outer parameters. ``model``: the module
    itself, not a DDP wrapper (whose forward would take part in its gradient sync)."""
    model.eval()
    loss = sum(model(x, y).item() for x, y in val_batches) / len(val_batches)
    model.train()
    return loss


def train_shard(args: argparse.Namespace) -> dict | None:
    """Run this process (one shard of replica ``--replica-id``, under torchrun) to the end.

    Returns the run's summary in the process that writes it (shard 0 of ring rank 0 at the
    end), else None; returns None early, after logging why, when the master dropped this
    replica (``ReplicaLostError``: another of its processes died).
    """
    start = time.perf_counter()
    timeout = datetime.timedelta(seconds=args.op_timeout)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    # The replica's inner group, from torchrun's environment.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    shard, shards = dist.get_rank(), dist.get_world_size()
    name = f"{args.replica_id}/{shard}"
    corpus = build_corpus(load_kjv_text())
    torch.manual_seed(args.seed)  # the same initial model everywhere (DiLoCo syncs it anyway)
    module = CharTransformer(corpus.vocab_size, args.block_size, args.dim, args.layers,
                             args.heads)
    module = module.to(device)
    n_params = sum(p.numel() for p in module.parameters())
    model = shard_model(module, fsdp=not args.no_fsdp, device=device)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)
    val_batches = [(x.to(device), y.to(device)) for x, y in validation_batches(
        corpus.val, args.batch_size, args.block_size, args.eval_batches)]
    train_gen = training_generator(args.seed, zlib.crc32(name.encode()))  # own text per process
    store = None
    if args.launcher_store and args.late_join_replica is not None:
        host, port = args.launcher_store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)

    # Blocks until the master admitted the whole replica (a late one: at an outer step).
    pg = torch_pccl.init_replica_group(args.master, args.replica_id, module,
                                       timeout=args.join_timeout)
    wrapper = torch_pccl.DiLoCo(
        module, opt, sync_every=args.sync_every, group=pg, timeout=args.op_timeout,
        outer_optimizer=lambda params: torch.optim.SGD(
            params, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True))
    first = wrapper.step_count * args.sync_every + 1  # a joiner: the group's step
    log.info("%s: admitted to ring %d as rank %d of %d replicas, from step %d", name, shard,
             pg.rank(), pg.size(), first)
    rec = Record()
    rec.world(first - 1, pg.size())
    if first > 1:
        rec.events.append((first - 1, f"{args.replica_id} joined"))
    else:
        rec.eval_curve.append((0, evaluate(module, val_batches)))
    shows_progress = shard == 0 and pg.rank() == 0 and not args.no_progress
    tokens_per_step = shards * args.batch_size * args.block_size  # one replica's
    round_world, round_left = pg.size(), 0
    sent = 0
    train_start = time.perf_counter()
    try:
        for step in range(first, args.steps + 1):
            if args.kill_shard == step and shard == victim_shard(shards):
                log.warning("%s: SIGKILLing myself at step %d (--kill-shard)", name, step)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
            for group in opt.param_groups:
                group["lr"] = lr_at(step - 1, args)
            x, y = sample_batch(corpus.train, args.batch_size, args.block_size, train_gen)
            x, y = x.to(device), y.to(device)
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            rec.train_curve.append((step, loss.item()))
            out = wrapper.step()
            if out is not None:
                sent += out.bytes_sent or 0
                round_left += len(replica_names(out.left))  # a replica leaves whole
                rec.events.extend((step, f"{r} left") for r in replica_names(out.left))
                rec.events.extend((step, f"{r} joined") for r in replica_names(out.joined))
            rec.world(step, pg.size())
            if step % args.sync_every == 0:
                # A round's tokens count for the replicas whose work reached the outer
                # parameters: the round's replicas less those lost in it.
                rec.tokens += (round_world - round_left) * args.sync_every * tokens_per_step
                round_world, round_left = pg.size(), 0
            if store is not None and step == args.late_join_replica and shard == 0 \
                    and pg.rank() == 0:
                store.set(LATE_JOIN_KEY, "1")
            if step % args.eval_every == 0:
                if step == args.steps:
                    wrapper.finish()  # the final shared-state sync: parity at the end
                rec.eval_curve.append((step, evaluate(module, val_batches)))
                if shows_progress:
                    log.info("step %4d  replicas %d  eval loss of the outer parameters %.4f",
                             step, pg.size(), rec.eval_curve[-1][1])
    except torch_pccl.ReplicaLostError as exc:
        log.warning("%s: the master dropped this replica, exiting: %s", name, exc)
        return None
    except RuntimeError as exc:
        if isinstance(exc, torch_pccl.PcclError):
            raise
        # The inner group failed (gloo: a process of this replica died). The master's word on
        # it may come a moment later; wait for it up to a heartbeat's worth.
        why = torch_pccl.replica_error(pg, timeout=10.0)
        if isinstance(why, torch_pccl.ReplicaLostError):
            log.warning("%s: the inner group failed and the master dropped this replica, "
                        "exiting: %s", name, why)
            return None
        raise
    train_seconds = time.perf_counter() - train_start

    # Parity: this shard's outer state (outer parameters, outer-optimizer state, step) on
    # every replica of its ring, then every shard's verdict gathered inside the replica.
    state = wrapper.state()
    digests = ring_digests(state, group=pg)
    mine = {"shard": shard, "digest": torch_pccl.content_digest(state),
            "identical_across_replicas": len(set(digests)) == 1, "replicas": len(digests),
            "bytes_sent": sent, "numel": sum(t.numel() for t in state.values())}
    shard_infos: list = [None] * shards
    dist.all_gather_object(shard_infos, mine)
    writes = shard == 0 and pg.rank() == 0
    pg.shutdown()  # leaves the master cleanly
    dist.destroy_process_group()
    if not writes:
        return None
    return build_summary(args, rec, shard_infos, n_params, train_seconds,
                         time.perf_counter() - start)


def build_summary(args, rec: Record, shard_infos: list[dict], n_params: int,
                  train_seconds: float, wall_seconds: float) -> dict:
    """The run's summary (written by one process) and its files."""
    summary = {
        "bit_identical": all(s["identical_across_replicas"] for s in shard_infos),
        "sharding": "none (DDP inside the replica)" if args.no_fsdp else "FSDP2 fully_shard",
        "device": args.device,
        "inner_backend": "nccl" if args.device == "cuda" else "gloo",
        "shards": len(shard_infos),
        "sync_every": args.sync_every,
        "steps": args.steps,
        "params": n_params,
        "replicas_start": rec.world_curve[0][1],
        "replicas_end": rec.world_curve[-1][1],
        "replicas_history": [[s, w] for s, w in rec.world_curve],
        "events": [[s, e] for s, e in rec.events],
        "tokens": rec.tokens,
        "initial_eval_loss": rec.eval_curve[0][1],
        "final_eval_loss": rec.eval_curve[-1][1],
        "eval_curve": [[s, round(v, 4)] for s, v in rec.eval_curve],
        "eval_loss_is_of": "the outer parameters (the model right after an outer step)",
        "shard_digests": shard_infos,
        "bytes_sent_per_replica": sum(s["bytes_sent"] for s in shard_infos),
        "train_seconds": round(train_seconds, 2),
        "wall_seconds": round(wall_seconds, 2),
        "bytes_note": "data-plane bytes the writing replica's processes sent over their shard "
                      "rings (payload plus headers), summed over its shards; numel: elements "
                      "of each shard's outer state (parameters, outer momentum, step).",
    }
    title = (f"KJV char transformer: DiLoCo H={args.sync_every} over {len(shard_infos)}-shard "
             "replicas, replicas: " + " -> ".join(str(w) for _, w in rec.world_curve))
    write_run(args.out_dir, summary, rec, title, "eval loss, outer parameters", "inner step",
              world_label="replicas")
    return summary


# --------------------------------------------------------------------------- launching


def replica_command(args: argparse.Namespace, master: str, replica_id: str,
                    extra: list[str] = ()) -> list[str]:
    """The torchrun command line of one replica: ``--shards`` processes of this script."""
    argv = ["--pccl-master", master, "--replica-id", replica_id, "--shards", str(args.shards)]
    for dest in FORWARDED:
        value = getattr(args, dest)
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.shards}", os.path.abspath(__file__), *argv, *extra]


def start(command: list[str]) -> subprocess.Popen:
    # One thread per process (several replicas share few cores); torchrun would warn and
    # set it to 1 anyway.
    return subprocess.Popen(command, env=dict(os.environ, OMP_NUM_THREADS="1"))


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop one torchrun we started: SIGTERM (it stops its workers), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_replica(args: argparse.Namespace) -> int:
    """``--master`` and ``--replica-id`` outside torchrun: one replica as its own torchrun;
    returns its exit status. SIGTERM/SIGINT stop it."""
    proc = start(replica_command(args, args.master, args.replica_id,
                                 [] if args.kill_shard is None else
                                 ["--kill-shard", str(args.kill_shard)]))
    signal.signal(signal.SIGTERM, lambda *_: stop(proc))
    try:
        return proc.wait()
    finally:
        stop(proc)


def wait_for_late_go(store: dist.TCPStore, procs: dict, deadline: float) -> None:
    """Block until a member set the late joiner's go in ``store``; raise if every replica
    ended first or ``deadline`` (monotonic seconds) passed."""

    def watch() -> None:
        # Wakes the wait below when every replica ended without giving the go.
        for proc in list(procs.values()):
            proc.wait()
        host, port = "127.0.0.1", store.port
        dist.TCPStore(host, port, is_master=False).set(LATE_JOIN_KEY, "ended")

    threading.Thread(target=watch, daemon=True, name="late-join-watch").start()
    try:
        store.wait([LATE_JOIN_KEY],
                   datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except dist.DistStoreError:
        raise TimeoutError("the group did not reach --late-join-replica in time") from None
    if store.get(LATE_JOIN_KEY) != b"1":
        raise RuntimeError("every replica ended before the late joiner's step")


def launch_all(args: argparse.Namespace) -> int:
    """No ``--master``: a master in a thread and one torchrun per replica on this machine;
    waits for them (bounded by ``--run-timeout``), stops whatever is left, reports."""
    from torch_pccl.master import start_in_thread

    started = time.monotonic()
    deadline = started + args.run_timeout
    # The first group forms once every process of the first --replicas replicas registered.
    master = start_in_thread("127.0.0.1", 0, world_size=args.replicas * args.shards)
    store = None
    extra: list[str] = []
    if args.late_join_replica is not None:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        extra = ["--launcher-store", f"127.0.0.1:{store.port}",
                 "--late-join-replica", str(args.late_join_replica)]
    summary_path = os.path.join(args.out_dir, "summary.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)  # never report an earlier run's
    procs: dict[str, subprocess.Popen] = {}
    victim = f"r{VICTIM_REPLICA}" if args.kill_shard is not None else None
    late = f"r{args.replicas}" if args.late_join_replica is not None else None
    try:
        for i in range(args.replicas):
            rid = f"r{i}"
            kill = ["--kill-shard", str(args.kill_shard)] if rid == victim else []
            procs[rid] = start(replica_command(args, master.address, rid, extra + kill))
        log.info("master %s; replicas %s started (%d processes each)", master.address,
                 ", ".join(procs), args.shards)
        if store is not None:
            wait_for_late_go(store, procs, deadline)
            log.info("the group passed step %d: starting replica %s", args.late_join_replica,
                     late)
            procs[late] = start(replica_command(args, master.address, late))
        codes = {}
        for rid, proc in procs.items():
            if rid == late and all(c is not None for c in codes.values()):
                # The group ended: the late replica ends with it once admitted, or never
                # will be (the group ended before its processes registered).
                try:
                    codes[rid] = proc.wait(min(LATE_GRACE_S, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.error("replica %s was never admitted: the group ended first (start it "
                              "earlier: --late-join-replica)", rid)
                    codes[rid] = None
                continue
            codes[rid] = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            stop(proc)
        master.stop()
    wall = time.monotonic() - started
    failed = {rid: c for rid, c in codes.items() if c != 0 and rid != victim}
    if failed:
        log.error("replicas failed: %s", failed)
        return 1
    with open(summary_path) as f:
        summary = json.load(f)
    summary["launcher_wall_seconds"] = round(wall, 1)
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    log.info("done in %.0f s: bit_identical=%s, replicas %s, eval loss %.4f -> %.4f, %d tokens; "
             "wrote %s", wall, summary["bit_identical"], summary["replicas_history"],
             summary["initial_eval_loss"], summary["final_eval_loss"], summary["tokens"],
             args.out_dir)
    return 0 if summary["bit_identical"] else 1


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # several processes share few cores
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # The master's INFO log (every round) would drown the progress; the shards log changes.
    logging.getLogger("torch_pccl.master").setLevel(logging.WARNING)
    if "RANK" in os.environ:
        if not args.master:
            raise SystemExit("under torchrun give --master HOST:PORT and --replica-id NAME")
        train_shard(args)
        return 0
    if args.master:
        return run_replica(args)
    return launch_all(args)


if __name__ == "__main__":
    sys.exit(main())
