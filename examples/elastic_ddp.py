"""Train the KJV character transformer with torch's DDP on an elastic world: ``ElasticDDP``.

Each step every peer computes the loss on its own batch, DDP averages the gradients over the
current world, and AdamW plus a warm-up/cosine LR schedule step on every peer alike
(``torch_pccl.ElasticDDP``, docs/elastic-ddp.md). Peers may join and die between steps::

    torchrun --standalone --nproc_per_node=4 examples/elastic_ddp.py \\
        --late-join-step 150 --kill-step 300

``--late-join-step N`` holds one peer (torchrun rank WORLD_SIZE-1) back until the group has
applied N steps; it then joins through the master and, at the next step boundary, receives the
model, the optimizer's moments, the scheduler and the step count from the others.
``--kill-step N`` makes torchrun rank 1 SIGKILL itself at step N; the survivors fail that step
alike, drop it at the boundary and go on with the smaller world (how this fits torchrun's fixed
world: examples/_launch.py). Separate launches, any machines, a master in common::

    pccl-master --port 29600 --world-size 2                            # shell 1
    python examples/elastic_ddp.py --master 127.0.0.1:29600            # shells 2 and 3
    python examples/elastic_ddp.py --master 127.0.0.1:29600            # shell 4, any time later

Every peer stops when the group has applied ``--steps`` steps. At the end the peers check that
parameters, buffers, optimizer and scheduler state and the step count are bit-identical on
every survivor (a digest of ``ElasticDDP.state()``, all-gathered), and the peer that is rank 0
writes ``summary.json`` (``bit_identical``, ``world_size_history``, ``final_eval_loss``...) and
``loss.png`` to ``--out-dir`` (default ``runs/elastic_ddp``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import torch_pccl
from _data import build_corpus, load_kjv_text, sample_batch, training_generator, validation_batches
from _launch import (Launch, add_membership_arguments, check_membership_arguments, check_parity,
                     join_group, run_peer)
from _model import CharTransformer, add_training_arguments, evaluate_params, lr_at
from _report import Record, write_run

log = logging.getLogger("elastic_ddp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See docs/elastic-ddp.md for the loop and what each boundary does.")
    g = p.add_argument_group("training")
    add_training_arguments(g, 400, "steps the group applies", "peak AdamW learning rate")
    add_membership_arguments(p)
    p.add_argument("--out-dir", default="runs/elastic_ddp",
                   help="where loss.png and summary.json go (default runs/elastic_ddp)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "warmup", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    check_membership_arguments(p, args)
    return args


def train(args: argparse.Namespace, launch: Launch) -> dict | None:
    """Run this peer to the end; return the summary if it is rank 0 at the end."""
    start = time.perf_counter()
    corpus = build_corpus(load_kjv_text())
    torch.manual_seed(args.seed)   # the same initial weights everywhere (the sync checks anyway)
    net = CharTransformer(corpus.vocab_size, args.block_size, args.dim, args.layers, args.heads)
    eval_net = CharTransformer(corpus.vocab_size, args.block_size, args.dim, args.layers,
                               args.heads)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, args) / args.lr)
    val = validation_batches(corpus.val, args.batch_size, args.block_size, args.eval_batches)
    batches = training_generator(args.seed,
                                 launch.torchrun_rank if launch.torchrun else os.getpid())
    if launch.late:
        launch.hold_back(args)
    join_group(launch, args)
    model = torch_pccl.ElasticDDP(net, opt, sched)   # a joiner gets the run's state here
    rec = Record()
    first = model.step_count
    rec.world(first, model.world_size)
    if first > 0:
        rec.events.append((first, f"{launch.name} joined at world size {model.world_size}"))
        log.info("%s: admitted at step %d, world size %d", launch.name, first, model.world_size)
    else:
        rec.eval_curve.append((0, evaluate_params(eval_net, net.parameters(), val)))
        if dist.get_rank() == 0:
            log.info("world %d, %d parameters, %d steps x %d x %d per peer; eval loss %.4f",
                     model.world_size, sum(p.numel() for p in net.parameters()), args.steps,
                     args.batch_size, args.block_size, rec.eval_curve[0][1])
    failures = 0
    while model.step_count < args.steps:
        step = model.step_count + 1            # the step this iteration applies
        if launch.victim and step == args.kill_step:
            log.warning("%s: SIGKILLing myself at step %d (--kill-step)", launch.name, step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = sample_batch(corpus.train, args.batch_size, args.block_size, batches)
        try:
            opt.zero_grad()
            loss = model(x, y)                 # the model returns its loss
            loss.backward()
            model.step()                       # everywhere or nowhere
            rec.train_curve.append((model.step_count, loss.item()))
            rec.tokens += model.world_size * args.batch_size * args.block_size
        except torch_pccl.PcclError as exc:
            failures += 1
            log.warning("%s: step %d not applied: %s", launch.name, step, exc)
        b = model.boundary()                   # admit, recover, rebuild DDP, sync the state
        rec.world(b.step, b.world_size)
        for peer in b.joined:
            rec.events.append((b.step, f"{peer} joined"))
        for peer in b.left:
            rec.events.append((b.step, f"{peer} left"))
        if b.recovered and dist.get_rank() == 0:
            log.info("step %d: recovered at world size %d (lost %s)%s", b.step, b.world_size,
                     ", ".join(b.left) or "nobody",
                     "; the failed step was applied here late" if b.applied_late else "")
        if launch.torchrun and args.late_join_step == b.step and dist.get_rank() == 0 \
                and not launch.late:
            launch.let_late_joiner_in()
        if b.step % args.eval_every == 0 or b.step == args.steps:
            if not rec.eval_curve or rec.eval_curve[-1][0] != b.step:
                rec.eval_curve.append((b.step, evaluate_params(eval_net, net.parameters(), val)))
                if dist.get_rank() == 0:
                    log.info("step %5d  world %d  eval loss %.4f", b.step, b.world_size,
                             rec.eval_curve[-1][1])
    # Parity as training left it: no sync after the last boundary.
    digest = check_parity(model.state(), "parameters, buffers, optimizer and scheduler state")
    if dist.get_rank() != 0:
        return None
    summary = {
        "bit_identical": True,
        "state_digest": digest,
        "world_size_history": [{"step": s, "world_size": w} for s, w in rec.world_curve],
        "events": [{"step": s, "event": e} for s, e in rec.events],
        "steps": args.steps,
        "tokens": rec.tokens,
        "failed_steps_here": failures,
        "initial_eval_loss": rec.eval_curve[0][1],
        "final_eval_loss": rec.eval_curve[-1][1],
        "eval_curve": [{"step": s, "loss": round(v, 4)} for s, v in rec.eval_curve],
        "wall_seconds": round(time.perf_counter() - start, 2),
        "launch": "torchrun" if launch.torchrun else "master",
    }
    write_run(args.out_dir, summary, rec,
              "KJV char transformer: elastic DDP, peers: "
              + " -> ".join(str(w) for _, w in rec.world_curve), "eval loss")
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    code, summary = run_peer(__file__, argv, args, train)
    if code:
        return code
    if summary is not None:
        log.info("done: eval loss %.3f -> %.3f, world %s, bit-identical on every survivor, "
                 "%.0f s; wrote %s", summary["initial_eval_loss"], summary["final_eval_loss"],
                 " -> ".join(str(w["world_size"]) for w in summary["world_size_history"]),
                 summary["wall_seconds"], args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
