"""The shared state's identity: named tensors (``SharedState``), their hashes, and the
*manifest* (name, dtype, shape, xxh3-128 per entry, sorted by name) whose xxh3-128 is the
*content digest* a sync votes with (docs/shared-state.md). Pure: no I/O, no group."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import xxhash

from ..core.native import byte_view
from ..errors import InvalidArgumentError, ProtocolError

# The elected manifest is read from the network: bounded before it is allocated.
# 64 MiB holds the manifest of ~500 000 entries.
MAX_MANIFEST_BYTES = 64 << 20


class SharedState:
    """Named CPU tensors synchronised as one unit by ``sync_shared_state``.

    Args:
        tensors: name -> contiguous CPU tensor (any dtype, any shape). Kept by
            reference: a sync overwrites them in place.
        allow_divergence: names of entries that may differ between peers
            (per-peer RNG state, data-loader position): never hashed,
            compared or transferred.

    Raises:
        TypeError: a name is not a ``str`` or a value is not a tensor.
        InvalidArgumentError: a name in ``allow_divergence`` is not in ``tensors``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], allow_divergence: Iterable[str] = ()):
        self.tensors = dict(tensors)
        self.allow_divergence = frozenset(allow_divergence)
        _check_names(self.tensors, self.allow_divergence)


def state_hashes(state, allow_divergence: Iterable[str] = ()) -> dict[str, str]:
    """The xxh3-128 of each entry's bytes, as 32 hex characters, by name.

    Entries in ``allow_divergence`` are left out. Two peers hold bit-identical
    entries exactly when these agree (up to 128-bit collisions).

    Raises:
        TypeError, InvalidArgumentError: as ``sync_shared_state``'s checks.
    """
    tensors, _ = entries_of(state, allow_divergence)
    return {name: hash_tensor(t) for name, t in tensors.items()}


def content_digest(state, allow_divergence: Iterable[str] = ()) -> str:
    """The content digest ``sync_shared_state`` votes with: xxh3-128 of the manifest, 32 hex."""
    tensors, _ = entries_of(state, allow_divergence)
    return digest(manifest_of(tensors, {n: hash_tensor(t) for n, t in tensors.items()}))


def hash_tensor(tensor: torch.Tensor) -> str:
    """The xxh3-128 of ``tensor``'s bytes, 32 lowercase hex characters."""
    return xxhash.xxh3_128_hexdigest(byte_view(bytes_of(tensor)))


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s memory: hashed, sent and overwritten in place."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, as the manifest names dtypes."""
    return str(dtype).removeprefix("torch.")


def manifest_of(tensors: Mapping[str, torch.Tensor], hashes: Mapping[str, str]) -> bytes:
    """The manifest of ``tensors`` with their ``hashes``: compact ASCII JSON rows
    ``[name, dtype, shape, hash]`` sorted by name."""
    rows = [[name, dtype_name(t.dtype), list(t.shape), hashes[name]]
            for name, t in sorted(tensors.items())]
    return json.dumps(rows, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def digest(manifest: bytes) -> str:
    """The content digest of a manifest: its xxh3-128, 32 lowercase hex characters."""
    return xxhash.xxh3_128_hexdigest(manifest)


@dataclass(frozen=True)
class Entry:
    """One row of a parsed manifest, with the entry's size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    nbytes: int


def parse_manifest(raw: bytes) -> list[Entry]:
    """The entries of a manifest received from the network (bounded by the caller).

    Raises:
        ProtocolError: it is not a well-formed manifest.
    """
    try:
        rows = json.loads(raw.decode("ascii"))
        entries = []
        for name, dtype, shape, row_hash in rows:
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype) or not isinstance(name, str):
                raise ValueError(f"bad entry {name!r}")
            shape = tuple(int(s) for s in shape)
            nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            entries.append(Entry(name, dtype, shape, str(row_hash), nbytes))
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the elected shared-state manifest is malformed: {e}") from None
    return entries


def layout_problem(tensors: Mapping[str, torch.Tensor], entries: list[Entry],
                   rank: int) -> str:
    """The first difference in names, dtypes or shapes from the elected manifest, or ''."""
    elected = {e.name: e for e in entries}
    for e in entries:
        t = tensors.get(e.name)
        if t is None:
            return f"entry {e.name!r} is in the elected state but missing on rank {rank}"
        if dtype_name(t.dtype) != e.dtype:
            return (f"entry {e.name!r} has dtype {dtype_name(t.dtype)} on rank {rank}, "
                    f"{e.dtype} in the elected state")
        if tuple(t.shape) != e.shape:
            return (f"entry {e.name!r} has shape {tuple(t.shape)} on rank {rank}, "
                    f"{e.shape} in the elected state")
    for name in sorted(tensors):
        if name not in elected:
            return f"entry {name!r} exists on rank {rank} but not in the elected state"
    return ""


def entries_of(state, allow_divergence: Iterable[str]):
    """(name -> tensor without the opted-out entries, opted-out names); checks every entry.

    Raises:
        TypeError, InvalidArgumentError: as ``sync_shared_state``'s checks.
    """
    if isinstance(state, SharedState):
        tensors, skip = state.tensors, state.allow_divergence | frozenset(allow_divergence)
    elif isinstance(state, Mapping):
        tensors, skip = dict(state), frozenset(allow_divergence)
    else:
        raise TypeError(f"state must be a SharedState or a mapping of names to tensors, "
                        f"got {type(state).__name__}")
    _check_names(tensors, skip)
    kept = {}
    for name, t in tensors.items():
        if name in skip:
            continue
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"shared-state entry {name!r} is on {t.device}; "
                                       "only CPU tensors are supported")
        if t.layout != torch.strided or not t.is_contiguous():
            raise InvalidArgumentError(f"shared-state entry {name!r} must be a contiguous, "
                                       "strided tensor")
        kept[name] = t
    return kept, skip


def _check_names(tensors: Mapping, skip: frozenset) -> None:
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"shared-state names must be str, got {type(name).__name__} {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shared-state entry {name!r} is a {type(t).__name__}, not a tensor")
    unknown = sorted(set(skip) - set(tensors))
    if unknown:
        raise InvalidArgumentError(f"allow_divergence names entries not in the state: {unknown}")
