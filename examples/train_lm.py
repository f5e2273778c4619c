"""Train a small character-level transformer on the King James Bible with DDP over torch_pccl.

The main job of this repository on real input. Run it with::

    torchrun --standalone --nproc_per_node=4 examples/train_lm.py

The only line that names the collective backend is ``dist.init_process_group(backend=...)``;
``--backend gloo`` runs the very same job on PyTorch's built-in backend for comparison.

What it does, per rank: load the KJV text (``examples/_data.py``), build the same model
(``examples/_model.py``) from the same seed, wrap it in ``DistributedDataParallel`` (gradients
averaged by the backend every step), and train on batches drawn with a rank-specific seed, so
each rank sees different text. Every ``--eval-every`` steps all ranks evaluate a fixed
validation set (each rank a disjoint share of the same batches, reduced with
``dist.all_reduce``), so the number logged does not depend on the world size. At the end rank 0
writes ``loss.png`` and ``summary.json`` to ``--out-dir`` and every rank checks that its
parameters are bit-identical to everyone else's.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _data import (CharCorpus, build_corpus, load_kjv_text, sample_batch, training_generator,
                   validation_batches)
from _model import CharTransformer, add_model_arguments, lr_at

log = logging.getLogger("train_lm")


# --------------------------------------------------------------------------- distributed helpers


@torch.no_grad()
def evaluate(model: nn.Module, val_batches: list, rank: int, world: int) -> float:
    """Mean validation loss over ``val_batches``, identical on every rank.

    Every rank holds the same list; rank r evaluates batches r, r+world, ... and one
    ``all_reduce(SUM)`` of (loss sum, batch count) combines them, so the result equals a
    single-process evaluation of the whole list whatever the world size.
    """
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    for x, y in val_batches[rank::world]:
        totals[0] += model(x, y).item()
        totals[1] += 1
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def parameter_digest(model: nn.Module) -> int:
    """A 63-bit fingerprint of every parameter's exact bytes (for the cross-rank check)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1  # fits a signed int64 tensor


def check_replicas_identical(model: nn.Module, world: int) -> list[int]:
    """All-gather every rank's parameter digest; raise if any rank's parameters differ."""
    mine = torch.tensor([parameter_digest(model)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    digests = [int(t.item()) for t in gathered]
    if len(set(digests)) != 1:
        raise RuntimeError(f"replicas diverged: parameter digests per rank {digests}")
    return digests


# --------------------------------------------------------------------------- outputs


def write_outputs(out_dir: str, summary: dict, train_curve: list, eval_curve: list) -> None:
    """Rank 0: write ``summary.json`` and a loss-curve ``loss.png`` into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")  # no display: CI and ssh sessions
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps, losses = zip(*train_curve)
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="train loss (rank 0 batches)")
    window = 25  # running mean: single batches are noisy
    if len(losses) >= window:
        smooth = [sum(losses[i - window : i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(steps[window - 1 :], smooth, lw=1.2, label=f"train loss, mean of {window}")
    ev_steps, ev_losses = zip(*eval_curve)
    ax.plot(ev_steps, ev_losses, "o-", lw=1.5, label="validation loss (all ranks)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title(
        f"char transformer on KJV: {summary['world_size']} ranks, backend={summary['backend']}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="pccl", help="torch.distributed backend (default: pccl)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: 1000)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--eval-batches", type=int, default=32, help="validation batches per eval")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    add_model_arguments(p)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--out-dir", default="runs/train_lm", help="where loss.png and summary.json go")
    args = p.parse_args(argv)
    for name in ("steps", "eval_every", "eval_batches", "batch_size", "block_size", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def train(args: argparse.Namespace) -> dict | None:
    """Run the job in this process (one rank); return the summary on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()

    corpus: CharCorpus = build_corpus(load_kjv_text())
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    model = CharTransformer(corpus.vocab_size, args.block_size, args.dim, args.layers, args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)

    # Validation batches come from one fixed seed, so every rank holds the same list; training
    # batches from a per-rank seed, so the ranks' gradients come from different text.
    val_batches = validation_batches(corpus.val, args.batch_size, args.block_size,
                                     args.eval_batches)
    train_gen = training_generator(args.seed, rank)

    if rank == 0:
        log.info(
            "backend=%s world=%d params=%d vocab=%d train=%d val=%d chars, %d steps x %d x %d",
            args.backend, world, n_params, corpus.vocab_size, len(corpus.train),
            len(corpus.val), args.steps, args.batch_size, args.block_size,
        )  # fmt: skip

    eval_curve = [(0, evaluate(model, val_batches, rank, world))]
    train_curve = []
    if rank == 0:
        log.info("step %5d  val loss %.4f", 0, eval_curve[0][1])

    progress = None
    if rank == 0:
        from tqdm import tqdm

        # Off a terminal (CI logs) every redraw is a new chunk of text: redraw rarely there.
        interval = 0.5 if sys.stderr.isatty() else 15.0
        progress = tqdm(
            total=args.steps, desc=f"train [{args.backend} x{world}]", unit="step",
            mininterval=interval,
        )  # fmt: skip
    train_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, args)
        x, y = sample_batch(corpus.train, args.batch_size, args.block_size, train_gen)
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradient buckets through the backend here
        opt.step()
        train_curve.append((step, loss.item()))
        if progress is not None:
            progress.set_postfix(loss=f"{train_curve[-1][1]:.3f}", refresh=False)
            progress.update()

        if step % args.eval_every == 0 or step == args.steps:
            eval_curve.append((step, evaluate(model, val_batches, rank, world)))
            if progress is not None:
                progress.write(f"step {step:5d}  val loss {eval_curve[-1][1]:.4f}")
    if progress is not None:
        progress.close()
    train_seconds = time.perf_counter() - train_start

    digests = check_replicas_identical(model, world)
    if rank != 0:
        return None
    log.info("parameters identical on all %d ranks (digest %016x)", world, digests[0])

    tokens = args.steps * args.batch_size * args.block_size * world
    summary = {
        "backend": args.backend,
        "world_size": world,
        "steps": args.steps,
        "tokens": tokens,
        "params": n_params,
        "batch_size_per_rank": args.batch_size,
        "block_size": args.block_size,
        "initial_eval_loss": eval_curve[0][1],
        "final_eval_loss": eval_curve[-1][1],
        "eval_curve": [{"step": s, "loss": round(v, 4)} for s, v in eval_curve],
        "train_seconds": round(train_seconds, 3),
        "ms_per_step": round(1000 * train_seconds / args.steps, 2),
        "tokens_per_second": round(tokens / train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - start, 3),
        "replicas_identical": True,
        "parameter_digest": f"{digests[0]:016x}",
    }
    write_outputs(args.out_dir, summary, train_curve, eval_curve)
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    # Several ranks share few cores: one intra-op thread each avoids oversubscription, which
    # otherwise makes every rank (and so every collective) wait on the slowest one.
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if "RANK" not in os.environ:
        raise SystemExit(
            "train_lm.py is meant to run under torchrun, e.g.\n"
            "  torchrun --standalone --nproc_per_node=4 examples/train_lm.py"
        )
    dist.init_process_group(
        backend=args.backend, timeout=datetime.timedelta(seconds=args.timeout)
    )
    try:
        summary = train(args)
    finally:
        dist.destroy_process_group()
    if summary is not None:
        log.info(
            "done: val loss %.3f -> %.3f, %d steps, %.1f ms/step, %.0f s wall; wrote %s",
            summary["initial_eval_loss"], summary["final_eval_loss"], summary["steps"],
            summary["ms_per_step"], summary["wall_seconds"], args.out_dir,
        )  # fmt: skip


if __name__ == "__main__":
    main()
