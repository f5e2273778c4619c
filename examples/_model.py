"""The model the examples train and what goes with it: ``CharTransformer``, its flags, its schedule.

``examples/train_lm.py`` (DDP) and ``examples/train_diloco.py`` (DiLoCo) train the same
GPT-style character model on the King James Bible (``examples/_data.py``); so does
``benchmarks/diloco_quality.py``. The model, its command-line flags, the learning-rate schedule,
the evaluation of a given set of parameters and Streaming DiLoCo's fragments of the model live
here, so that no script imports another.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """A GPT-style next-character model (token + position embeddings, blocks, linear head)."""

    def __init__(self, vocab_size: int, block_size: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the mean cross-entropy of predicting ``targets`` from ``idx``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(positions))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def add_model_arguments(parser) -> None:
    """Add the model's shape flags to ``parser`` (a parser or an argument group).

    ``--block-size`` (characters per sequence, default 64), ``--dim`` (width, 96), ``--layers``
    (transformer blocks, 3) and ``--heads`` (attention heads, 4): about 0.35 M parameters.
    """
    parser.add_argument("--block-size", type=int, default=64, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=96)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--heads", type=int, default=4)


def add_training_arguments(parser, steps: int, steps_help: str, lr_help: str) -> None:
    """Add the training flags to ``parser`` (a parser or an argument group): ``--steps``
    (default ``steps``), ``--batch-size`` (sequences per peer per step, 16), the model's shape
    (``add_model_arguments``), ``--lr`` (peak AdamW rate, 3e-3), ``--warmup`` (steps, 50),
    ``--eval-every`` (steps, 100), ``--eval-batches`` (32) and ``--seed`` (0)."""
    parser.add_argument("--steps", type=int, default=steps, help=f"{steps_help} (default {steps})")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per peer per step")
    add_model_arguments(parser)
    parser.add_argument("--lr", type=float, default=3e-3, help=lr_help)
    parser.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--eval-batches", type=int, default=32, help="validation batches per eval")
    parser.add_argument("--seed", type=int, default=0)


# --------------------------------------------------------------------------- training helpers


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak.

    ``step`` counts from 0; ``args`` supplies ``lr`` (the peak), ``warmup`` and ``steps``
    (both in steps).
    """
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate_params(model: nn.Module, params, val_batches: list) -> float:
    """Mean validation loss of ``model`` with its parameters replaced by ``params``, nats / char.

    ``params``: tensors in ``model.parameters()`` order (the outer parameters). Runs on this
    peer alone: the outer parameters are bit-identical on every peer, so is the result.
    """
    for dst, src in zip(model.parameters(), params):
        dst.copy_(src)
    model.eval()
    total = sum(model(x, y).item() for x, y in val_batches)
    return total / len(val_batches)


def balanced_fragments(model: nn.Module, num_fragments: int) -> list[list[nn.Parameter]]:
    """Streaming DiLoCo's strided assignment for ``CharTransformer``, with equal-sized fragments.

    Transformer block j (parameters ``blocks.<j>.*``) goes to fragment ``j % P`` (the paper's
    strided assignment, as ``torch_pccl.algorithms.diloco.strided_fragments``); the parameters
    outside the blocks (embeddings, final norm, head) are then spread largest first onto the
    smallest fragment, so that no fragment, and so no exchange, is much larger than 1/P of the
    model. Raises ValueError when there are fewer blocks than fragments.
    """
    fragments: list[list[nn.Parameter]] = [[] for _ in range(num_fragments)]
    rest = []
    blocks = set()
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            j = int(name.split(".")[1])
            blocks.add(j)
            fragments[j % num_fragments].append(p)
        else:
            rest.append(p)
    if len(blocks) < num_fragments:
        raise ValueError(f"{len(blocks)} blocks cannot fill {num_fragments} fragments")
    for p in sorted(rest, key=lambda q: -q.numel()):
        min(fragments, key=lambda f: sum(q.numel() for q in f)).append(p)
    return fragments
