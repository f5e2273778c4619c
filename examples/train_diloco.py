"""Train the KJV character transformer with DiLoCo over torch_pccl: 4 peers that may come and go.

The main job of this repository. Run it with::

    torchrun --standalone --nproc_per_node=4 examples/train_diloco.py

Each peer trains its own replica of ``CharTransformer`` (``examples/_model.py``, the model of
``examples/train_lm.py``) with AdamW on its own text (a per-peer seed) for ``--sync-every`` (H)
inner steps; then the peers all-reduce the *pseudo-gradients* (outer parameters minus local
parameters) and apply them to the shared *outer parameters* with Nesterov SGD (lr 0.7, momentum
0.7), which every peer holds bit-identically (``torch_pccl.algorithms.diloco``; Douillard et al.,
"DiLoCo", arXiv 2311.08105). The peers talk once every H steps instead of every step.
``--algo streaming`` syncs the model in fragments at staggered steps, overlapped with training
(arXiv 2501.18512), ``--algo async`` overlaps the whole exchange with the next round (eager
updates, arXiv 2502.12996), ``--quantization int8|int4`` sends 8/4-bit values, ``--compression
topk`` sends the sparse top-k of an error-feedback accumulator (SparseLoCo, arXiv 2508.15706;
``torch_pccl.TopK``, about 0.23 bits per parameter), and ``--algo ddp``
averages gradients every step (the baseline the byte counts are compared with).

Churn, under torchrun: ``--late-join-step N`` holds one peer (torchrun rank WORLD_SIZE-1) back
until the group passes inner step N, then it joins through the master and receives the outer
parameters, outer-optimizer buffers and step from the others; ``--kill-step N`` makes another peer
(torchrun rank 1) SIGKILL itself at step N, and the survivors retry the outer all-reduce on the
smaller world. Training goes on through both::

    torchrun --standalone --nproc_per_node=4 examples/train_diloco.py \\
        --late-join-step 200 --kill-step 500

How that fits torchrun's fixed world: the job forms its group through a torch_pccl master
(``init_method="pccl://..."``) that torchrun rank 0 starts in a thread; its address reaches the
other ranks through torchrun's own store. A torchrun worker that dies makes torchrun stop every
other worker, so the peer that is to be killed runs as a child process of its torchrun worker; the
worker reports the SIGKILL and exits 0, and torchrun lets the others finish.

Separate launches (any machines; nothing but a master in common)::

    pccl-master --port 29600 --world-size 2                               # shell 1
    python examples/train_diloco.py --master 127.0.0.1:29600              # shells 2 and 3
    python examples/train_diloco.py --master 127.0.0.1:29600              # shell 4, any time later
    python examples/train_diloco.py --master 127.0.0.1:29600 --kill-step 300   # or kill -9 one

The master forms the group once ``--world-size`` peers wait; a peer started later waits *pending*
and is admitted at the next outer step; ``kill -9`` (or ``--kill-step``) of a peer shrinks the
group at the next outer step. Every peer stops when the group reaches ``--steps``.

Outputs, written by the peer that is rank 0 at the end, to ``--out-dir`` (default
``runs/train_diloco``): ``loss.png`` (train loss, eval loss of the outer parameters, world size
over the steps) and ``summary.json`` (tokens, bytes exchanged per peer, peak bytes per sync, the
bytes DDP would have sent, eval losses, world size over time, the outer-parameter digest that
every surviving peer checked to be equal).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import torch_pccl
from _data import (CharCorpus, build_corpus, load_kjv_text, sample_batch, training_generator,
                   validation_batches)
from _launch import (Launch, add_membership_arguments, check_membership_arguments, check_parity,
                     join_group, run_peer)
from _model import (CharTransformer, add_training_arguments, balanced_fragments, evaluate_params,
                    lr_at)
from _report import Record, write_run
from torch_pccl.c10d.process_group import pccl_group
from torch_pccl.elastic.topology import RETRYABLE_ERRORS

log = logging.getLogger("train_diloco")

ALGOS = ("diloco", "streaming", "async", "ddp")


# --------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See docs/diloco.md for what each algorithm does and the measured results.")
    g = p.add_argument_group("algorithm")
    g.add_argument("--algo", default="diloco", choices=ALGOS,
                   help="diloco (default), streaming, async, or ddp (gradients every step)")
    g.add_argument("--sync-every", type=int, default=20, metavar="H",
                   help="inner steps per outer step (default 20)")
    g.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="how pseudo-gradients travel (default: float32)")
    g.add_argument("--compression", default="none", choices=["none", "topk", "topk-1bit"],
                   help="sparse exchange with error feedback: topk = torch_pccl.TopK() (top 1/64 "
                        "of each chunk of 4096, 2-bit values), topk-1bit = signs and one "
                        "magnitude per chunk (default: none, dense)")
    g.add_argument("--topk-density", type=float, default=1 / 64,
                   help="--compression: fraction of each chunk sent (default 1/64)")
    g.add_argument("--fragments", type=int, default=3, metavar="P",
                   help="streaming: number of fragments (default 3, one per block)")
    g.add_argument("--tau", type=int, default=None,
                   help="streaming: overlap in inner steps (default: sized from the measured "
                        "exchange time)")
    g.add_argument("--alpha", type=float, default=0.5, help="streaming: local/outer mixing")
    g.add_argument("--outer-lr", type=float, default=0.7, help="Nesterov outer lr (default 0.7)")
    g.add_argument("--outer-momentum", type=float, default=0.7,
                   help="Nesterov momentum (default 0.7; the papers' 0.9 is for H in the "
                        "hundreds and trails at H = 20 here, see docs/diloco.md)")
    g = p.add_argument_group("training")
    add_training_arguments(g, 800, "inner steps per peer", "peak inner AdamW learning rate")
    add_membership_arguments(p)
    p.add_argument("--out-dir", default="runs/train_diloco",
                   help="where loss.png and summary.json go (default runs/train_diloco)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    for name in ("steps", "sync_every", "batch_size", "block_size", "warmup", "eval_every",
                 "eval_batches", "fragments"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    check_membership_arguments(p, args)
    if (args.tau is not None and args.tau < 0) or not 0.0 <= args.alpha <= 1.0:
        p.error("--tau >= 0 and --alpha in [0, 1] are required")
    args.quantization = None if args.quantization == "none" else args.quantization
    if args.compression != "none" and (args.quantization or args.algo == "ddp"):
        p.error("--compression is for the DiLoCo algorithms, without --quantization")
    if not 0.0 < args.topk_density <= 1.0:
        p.error("--topk-density must be in (0, 1]")
    return args


# --------------------------------------------------------------------------- training helpers


def ring_allreduce_bytes(numel: int, world: int, element_bytes: int = 4) -> int:
    """Payload bytes one peer sends in a ring all-reduce of ``numel`` elements: 2(W-1)/W * size."""
    if world <= 1:
        return 0
    return 2 * (world - 1) * numel * element_bytes // world


class DDPBaseline:
    """``--algo ddp``: gradients averaged every step, membership every H steps (the baseline).

    Each step: ``all_reduce_with_retry`` (AVG) of all gradients flattened into one float32
    buffer, so a lost peer shrinks the world and the step is retried. Every ``sync_every``
    steps: admit pending peers, then ``sync_shared_state`` of the parameters, the AdamW state
    and the step, so a joiner starts from the group's exact state. Mirrors the DiLoCo wrapper's
    interface (``step``, ``outer_parameters``, ``step_count``, ``finish``). It is the byte
    baseline of docs/diloco.md's tables and stays as measured there; torch's own DDP on an
    elastic world is ``torch_pccl.ElasticDDP`` (examples/elastic_ddp.py).
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, sync_every: int):
        self.model, self.opt, self.sync_every = model, opt, sync_every
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params))
        self.inner_steps = 0
        self.step_tensor = torch.zeros((), dtype=torch.int64)
        # AdamW creates its state at the first step: make it now (zero gradients, lr 0), so a
        # joiner's state has the same entries as the incumbents'.
        for p in self.params:
            p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
        opt.step()
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        self._sync_state()

    @property
    def outer_parameters(self):
        return self.params

    @property
    def step_count(self) -> int:
        return self.inner_steps // self.sync_every

    def state(self) -> dict:
        state = {f"param/{i}": p.data for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):
            for k, v in self.opt.state[p].items():
                state[f"adam/{i}/{k}"] = v
        state["step"] = self.step_tensor
        return state

    def _sync_state(self) -> None:
        self.step_tensor.fill_(self.inner_steps)
        torch_pccl.sync_shared_state(self.state(), revision=self.inner_steps // self.sync_every)
        self.inner_steps = int(self.step_tensor.item())

    def reduce_gradients(self) -> dict:
        """Average the gradients over the group (call between backward and opt.step)."""
        offset = 0
        for p in self.params:
            n = p.numel()
            self.buffer[offset:offset + n].copy_(p.grad.view(-1))
            offset += n
        before = pccl_group().communicator.stats()
        changes = torch_pccl.all_reduce_with_retry(self.buffer, op=dist.ReduceOp.AVG)
        after = pccl_group().communicator.stats()  # a new one after a change of world
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.view(-1).copy_(self.buffer[offset:offset + n])
            offset += n
        sent = after[0] - before[0] if not changes else 0  # a new epoch restarts the counters
        recv = after[1] - before[1] if not changes else 0
        return {"bytes_sent": sent, "bytes_received": recv,
                "left": [x for c in changes for x in c.left]}

    def step(self) -> dict | None:
        """After ``opt.step()``: every H steps admit pending peers and sync the state."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return None
        joined = []
        try:
            if torch_pccl.peers_pending():
                joined = list(torch_pccl.update_topology().joined)
        except RETRYABLE_ERRORS:
            torch_pccl.update_topology()
        self._sync_state()
        return {"joined": joined}

    def finish(self) -> None:
        self._sync_state()


def make_wrapper(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer):
    """The algorithm's wrapper; constructing it syncs the shared state (joiners catch up)."""
    if args.algo == "ddp":
        return DDPBaseline(model, opt, args.sync_every)
    from torch_pccl.algorithms import diloco

    def outer(params):
        return torch.optim.SGD(params, lr=args.outer_lr, momentum=args.outer_momentum,
                               nesterov=True)

    common = dict(outer_optimizer=outer, sync_every=args.sync_every,
                  quantization=args.quantization, timeout=args.op_timeout)
    if args.compression != "none":
        from torch_pccl import TopK

        common["compression"] = TopK(density=args.topk_density,
                                     bits=1 if args.compression == "topk-1bit" else 2)
    if args.algo == "streaming":
        return diloco.StreamingDiLoCo(model, opt, fragments=balanced_fragments(
            model, args.fragments), tau=args.tau, alpha=args.alpha, **common)
    if args.algo == "async":
        return diloco.AsyncDiLoCo(model, opt, **common)
    return diloco.DiLoCo(model, opt, **common)


def outer_step_of(wrapper) -> int:
    """The group's outer step count as the wrapper holds it (a joiner: the group's)."""
    return int(wrapper.step_count)


# --------------------------------------------------------------------------- the run


def train(args: argparse.Namespace, launch: Launch) -> dict | None:
    """Run this peer to the end; return the summary if it is rank 0 at the end."""
    start = time.perf_counter()
    corpus: CharCorpus = build_corpus(load_kjv_text())
    torch.manual_seed(args.seed)  # same initial weights everywhere (the sync checks it anyway)
    model = CharTransformer(corpus.vocab_size, args.block_size, args.dim, args.layers, args.heads)
    eval_model = CharTransformer(corpus.vocab_size, args.block_size, args.dim, args.layers,
                                 args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    val_batches = validation_batches(corpus.val, args.batch_size, args.block_size,
                                     args.eval_batches)
    train_gen = training_generator(args.seed,
                                   launch.torchrun_rank if launch.torchrun else os.getpid())

    if launch.late:
        launch.hold_back(args)      # everything is loaded; wait for the group's go
    join_group(launch, args)
    rank, world = dist.get_rank(), dist.get_world_size()
    log.info("%s: admitted as rank %d of %d (epoch %d)", launch.name, rank, world,
             torch_pccl.epoch())
    wrapper = make_wrapper(args, model, opt)  # a joiner receives the group's state here
    first = outer_step_of(wrapper) * args.sync_every + 1
    rec = Record()
    rec.world(first - 1, dist.get_world_size())
    if first > 1:
        rec.events.append((first - 1, f"{launch.name} joined at world size "
                                      f"{dist.get_world_size()}"))
        log.info("%s: caught up with the group at step %d", launch.name, first - 1)
    else:
        rec.eval_curve.append((0, evaluate_params(eval_model, wrapper.outer_parameters,
                                                  val_batches)))
    shows_progress = dist.get_rank() == 0 and not args.no_progress and first == 1
    if dist.get_rank() == 0 and first == 1:
        log.info("algo=%s H=%d quantization=%s compression=%s world=%d params=%d, %d steps x %d "
                 "x %d per peer", args.algo, args.sync_every, args.quantization or "none",
                 args.compression, world, n_params, args.steps, args.batch_size,
                 args.block_size)
        log.info("step %5d  eval loss of the outer parameters %.4f", 0, rec.eval_curve[0][1])
    progress = None
    if shows_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=first - 1, unit="step", mininterval=(
            0.5 if sys.stderr.isatty() else 15.0), desc=f"{args.algo} x{world}")

    tokens_per_step = args.batch_size * args.block_size
    round_world, round_left = dist.get_world_size(), 0
    train_start = time.perf_counter()
    for step in range(first, args.steps + 1):
        if launch.victim and step == args.kill_step:
            log.warning("%s: SIGKILLing myself at step %d (--kill-step)", launch.name, step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, args)
        x, y = sample_batch(corpus.train, args.batch_size, args.block_size, train_gen)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.algo == "ddp":
            info = wrapper.reduce_gradients()
            size = dist.get_world_size()
            rec.syncs.append({"step": step, "world_size": size, "bytes_sent": info["bytes_sent"],
                              "bytes_received": info["bytes_received"]})
            rec.tokens += size * tokens_per_step
            rec.ddp_equivalent_bytes += ring_allreduce_bytes(n_params, size)
            for peer in info["left"]:
                rec.events.append((step, f"{peer} left"))
        opt.step()
        rec.train_curve.append((step, loss.item()))
        out = wrapper.step()
        size = dist.get_world_size()
        if args.algo != "ddp":
            rec.ddp_equivalent_bytes += ring_allreduce_bytes(n_params, size)
        if out is not None:
            info = out if isinstance(out, dict) else dataclasses.asdict(out)
            if args.algo != "ddp":
                rec.syncs.append({"step": step, **{k: info.get(k) for k in (
                    "world_size", "bytes_sent", "bytes_received", "seconds", "retries")}})
                round_left += len(info.get("left") or ())
            for peer in info.get("joined") or ():
                rec.events.append((step, f"{peer} joined"))
            for peer in info.get("left") or ():
                rec.events.append((step, f"{peer} left"))
        rec.world(step, size)
        if args.algo != "ddp" and step % args.sync_every == 0:
            # The round's tokens count for the peers whose work reached the outer parameters:
            # the world of the round, less the peers lost in it (joiners count from the next).
            rec.tokens += (round_world - round_left) * args.sync_every * tokens_per_step
            round_world, round_left = size, 0
        if launch.late is False and launch.torchrun and args.late_join_step == step \
                and dist.get_rank() == 0:
            launch.let_late_joiner_in()
        if step % args.eval_every == 0 or step == args.steps:
            if step == args.steps and hasattr(wrapper, "finish"):
                wrapper.finish()  # the final shared-state sync: parity at the end
            rec.eval_curve.append((step, evaluate_params(eval_model, wrapper.outer_parameters,
                                                         val_batches)))
            if progress is not None:
                progress.write(f"step {step:5d}  world {size}  eval loss of the outer "
                               f"parameters {rec.eval_curve[-1][1]:.4f}")
        if progress is not None:
            progress.set_postfix(loss=f"{loss.item():.3f}", world=size, refresh=False)
            progress.update()
    if progress is not None:
        progress.close()
    train_seconds = time.perf_counter() - train_start

    digest = check_outer_parity(wrapper)
    if dist.get_rank() != 0:
        return None
    return build_summary(args, launch, rec, n_params, digest, train_seconds,
                         time.perf_counter() - start)


def check_outer_parity(wrapper) -> str:
    """All-gather a digest of every peer's outer parameters; raise if any differs."""
    state = {f"outer/{i}": p.detach().contiguous() for i, p in enumerate(wrapper.outer_parameters)}
    return check_parity(state, "outer parameters")


def build_summary(args, launch: Launch, rec: Record, n_params: int, digest: str,
                  train_seconds: float, wall_seconds: float) -> dict:
    syncs = rec.syncs
    sent = sum(s["bytes_sent"] or 0 for s in syncs)
    received = sum(s["bytes_received"] or 0 for s in syncs)
    peak = max(((s["bytes_sent"] or 0) for s in syncs), default=0)
    summary = {
        "algo": args.algo,
        "sync_every": args.sync_every,
        "quantization": args.quantization or "none",
        "compression": args.compression if args.compression == "none" else
        f"{args.compression} (density {args.topk_density:g})",
        "fragments": args.fragments if args.algo == "streaming" else None,
        "launch": "torchrun" if launch.torchrun else "master",
        "world_size_start": rec.world_curve[0][1],
        "world_size_end": dist.get_world_size(),
        "world_size_over_time": [{"step": s, "world_size": w} for s, w in rec.world_curve],
        "events": [{"step": s, "event": e} for s, e in rec.events],
        "steps": args.steps,
        "params": n_params,
        "tokens": rec.tokens,
        "syncs": len(syncs),
        "bytes_sent_per_peer": sent,
        "bytes_received_per_peer": received,
        "peak_bytes_sent_per_sync": peak,
        "median_bytes_sent_per_sync": (sorted(s["bytes_sent"] or 0 for s in syncs)[len(syncs) // 2]
                                       if syncs else 0),
        "ddp_equivalent_bytes_sent_per_peer": rec.ddp_equivalent_bytes,
        "communication_reduction_vs_ddp": (
            round(rec.ddp_equivalent_bytes / sent, 1) if sent else None),
        "initial_eval_loss": rec.eval_curve[0][1],
        "final_eval_loss": rec.eval_curve[-1][1],
        "eval_loss_is_of": "the outer parameters",
        "eval_curve": [{"step": s, "loss": round(v, 4)} for s, v in rec.eval_curve],
        "train_seconds": round(train_seconds, 2),
        "wall_seconds": round(wall_seconds, 2),
        "outer_parameters_identical": True,
        "outer_parameters_digest": digest,
        "bytes_note": "data-plane bytes this peer (rank 0 at the end) sent and received, payload "
                      "plus headers. A sync is one OuterStep (DiLoCo: the outer all-reduce, the "
                      "membership check and the shared-state sync, which at a join carries the "
                      "state to the joiner; Streaming: one fragment's exchange) or one gradient "
                      "all-reduce (DDP). ddp_equivalent: a ring all-reduce of every parameter "
                      "(float32) per inner step at the world size of that step.",
    }
    write_outputs(args.out_dir, summary, rec)
    return summary


def write_outputs(out_dir: str, summary: dict, rec: Record) -> None:
    """Write ``summary.json`` and ``loss.png`` (losses on the left axis, world size right)."""
    q = summary["quantization"]
    c = summary["compression"]
    title = (f"KJV char transformer: {summary['algo']}, H={summary['sync_every']}"
             + ("" if q == "none" else f", {q}") + ("" if c == "none" else f", {c}")
             + ", peers: "
             + " -> ".join(str(w) for _, w in rec.world_curve))
    write_run(out_dir, summary, rec, title, "eval loss, outer parameters", "inner step")


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    code, summary = run_peer(__file__, argv, args, train)
    if code:
        return code
    if summary is not None:
        log.info("done: eval loss of the outer parameters %.3f -> %.3f, %d tokens, %.1f MB sent "
                 "per peer (DDP: %.1f MB, %sx less), world %d -> %d, %.0f s; wrote %s",
                 summary["initial_eval_loss"], summary["final_eval_loss"], summary["tokens"],
                 summary["bytes_sent_per_peer"] / 1e6,
                 summary["ddp_equivalent_bytes_sent_per_peer"] / 1e6,
                 summary["communication_reduction_vs_ddp"], summary["world_size_start"],
                 summary["world_size_end"], summary["wall_seconds"], args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
