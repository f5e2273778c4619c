"""How a shared-state sync moves bytes: the plan that spreads each outdated peer's entries
over every source (``plan_pieces``), and the memory a receiver may stage them in
(docs/shared-state.md). No I/O but reading the kernel's memory counters."""

from __future__ import annotations

import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import config

PIECE_BYTES = config.PIECE_BYTES


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of entry ``entry`` from byte ``offset``, sent by ``source`` to ``receiver``."""

    receiver: int
    source: int
    entry: int
    offset: int
    length: int


def plan_pieces(wanted: Mapping[int, Sequence[int]], nbytes: Sequence[int],
                sources: Sequence[int], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Cuts each receiver's wanted entries into pieces and spreads them over the sources.

    Pure and deterministic: every peer computes the same plan from the same
    all-gathered statuses. Each entry is cut into pieces of at most
    ``piece_bytes``; each piece goes to the source that has been given the
    fewest of this receiver's bytes so far (ties: the next source after the
    receiver's own rotation), so a receiver's download is shared by all
    sources within one piece of even, and different receivers start on
    different sources.

    Args:
        wanted: receiver rank -> entry indices it needs, in manifest order.
        nbytes: size in bytes of each manifest entry.
        sources: ranks that hold the elected content (ascending).
        piece_bytes: the longest piece, bytes (> 0).

    Returns:
        Pieces ordered by receiver, entry order, offset; the order in which
        both ends post their messages.

    Raises:
        ValueError: no sources, a receiver that is also a source, a bad index,
            or ``piece_bytes`` <= 0.
    """
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
    if not sources and any(wanted.values()):
        raise ValueError("pieces wanted but no source holds the elected state")
    pieces = []
    for k, receiver in enumerate(sorted(wanted)):
        if receiver in sources:
            raise ValueError(f"rank {receiver} is both a receiver and a source")
        load = [0] * len(sources)
        order = [(k + i) % len(sources) for i in range(len(sources))] if sources else []
        for entry in wanted[receiver]:
            if not 0 <= entry < len(nbytes):
                raise ValueError(f"entry index {entry} outside 0 .. {len(nbytes) - 1}")
            for offset in range(0, nbytes[entry], piece_bytes):
                s = min(order, key=lambda i: load[i])
                length = min(piece_bytes, nbytes[entry] - offset)
                load[s] += length
                pieces.append(Piece(receiver, sources[s], entry, offset, length))
    return pieces


def memory_headroom() -> int | None:
    """Bytes this process can still allocate, or None when nothing says.

    The least of: the kernel's ``MemAvailable``, the cgroup's ``memory.max``
    minus ``memory.current``, and ``RLIMIT_AS`` minus this process's virtual
    size (Linux; None elsewhere).
    """
    limits = []
    meminfo = _read_kib("/proc/meminfo", "MemAvailable:")
    if meminfo is not None:
        limits.append(meminfo)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if cap != "max":
            limits.append(int(cap) - used)
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    vm = _read_kib("/proc/self/status", "VmSize:")
    if soft != resource.RLIM_INFINITY and vm is not None:
        limits.append(soft - vm)
    return max(0, min(limits)) if limits else None


def _read_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def allocate(nbytes: int) -> torch.Tensor | None:
    """A staging buffer of ``nbytes`` bytes (uint8), or None when it would not fit in
    ``memory_headroom()`` or the allocator refuses."""
    headroom = memory_headroom()
    if headroom is not None and nbytes > headroom:
        return None
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except RuntimeError:        # the allocator's "can't allocate memory"
        return None
