"""``TopK``: chunk-wise top-k sparsification with low-bit values, and its payload codec.

The compressed exchange of the DiLoCo wrappers (``compression=TopK(...)``;
``torch_pccl.algorithms.diloco.compressed`` adds the error feedback and the
all-gather). A flat float32 tensor of ``n`` elements is cut into chunks of
``chunk`` elements (the last one padded with zeros); each chunk keeps its
``k = max(1, round(chunk * density))`` entries of largest magnitude, their
positions in the chunk as ``ceil(log2(chunk))``-bit indices and their values
quantized to ``bits`` bits against one float32 scale per chunk:

- ``bits = 1``: the sign, and the chunk's mean magnitude of the kept values
  (ComPEFT, Yadav et al., arXiv 2311.13171: signs of the top-k and one
  magnitude);
- ``bits = 2`` or ``4``: ``2**bits`` uniform bins over +-``CLIP_SIGMAS``
  standard deviations (the kept values' root mean square) of the chunk
  (SparseLoCo, Sarfi et al., arXiv 2508.15706: chunks of 4096, top-64, 2-bit
  values over +-3 sigma, 12-bit indices); each bin decodes to the mean of the
  values it holds (in units of their chunk's scale), one float32 per bin for
  the whole payload, as templar's SparseLoCo compressor does.

The payload has a fixed size for a given ``n`` and ``TopK`` (``payload_bytes``),
so every peer's fits one all-gather, and it is self-describing given those two:
``[scales: nchunks float32][lookup: 2**bits float32, 2- and 4-bit only]
[indices: nchunks*k*index_bits bits][codes: nchunks*k*bits bits]``, bit fields
little-endian, padding bits zero. A chunk whose kept values hold an inf or NaN
gets a NaN scale: ``decode`` reports the payload as non-finite (as for any
non-finite float in its head) instead of producing values from it. Decoding never
trusts the payload beyond its size: an index out of a short last chunk lands
in the padding, which is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CLIP_SIGMAS", "TopK", "decode_add", "encode", "pack_bits", "unpack_bits"]

CLIP_SIGMAS = 3.0
"""2- and 4-bit values: the bins span +-this many standard deviations of the chunk's kept
values (SparseLoCo's setting); larger values are clipped to the outer bins."""


@dataclass(frozen=True)
class TopK:
    """The sparse exchange with error feedback (SparseLoCo, arXiv 2508.15706), as the
    ``compression`` option of ``DiLoCo``, ``StreamingDiLoCo`` and ``AsyncDiLoCo``.

    Per peer and fragment, at each outer step: ``e <- beta * e + delta`` (``delta``:
    the pseudo-gradient, float32), ``p = encode(e)`` (chunk-wise top-k, values to
    ``bits`` bits), ``e <- e - decode(p)``; the peers all-gather their payloads and
    the outer optimizer steps with the mean of the decoded payloads. The defaults are
    SparseLoCo's: 1/64 of each chunk of 4096, 2-bit values, beta 0.95, about 0.23
    bits per parameter (140x fewer than float32).

    Args:
        density: fraction of each chunk sent, in (0, 1]; ``k = max(1, round(chunk *
            density))`` entries per chunk.
        bits: bits per value: 1 (sign and per-chunk mean magnitude, ComPEFT), 2 or 4
            (uniform bins over +-3 sigma of the chunk).
        chunk: elements per chunk, 2 .. 65536 (indices take ``ceil(log2(chunk))``
            bits); chunks run over the flat buffer of a fragment's parameters.
        beta: decay of the error-feedback accumulator, in [0, 1] (0: no memory of
            what was not sent; 1: all of it).

    Raises:
        ValueError: an argument out of range.
    """

    density: float = 1.0 / 64
    bits: int = 2
    chunk: int = 4096
    beta: float = 0.95

    def __post_init__(self):
        if not isinstance(self.chunk, int) or not 2 <= self.chunk <= 1 << 16:
            raise ValueError(f"chunk must be an int in 2 .. 65536, got {self.chunk!r}")
        if not isinstance(self.density, (int, float)) or not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if self.bits not in (1, 2, 4):
            raise ValueError(f"bits must be 1, 2 or 4, got {self.bits!r}")
        if not isinstance(self.beta, (int, float)) or not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta!r}")

    @property
    def k(self) -> int:
        """Entries kept per chunk."""
        return max(1, min(self.chunk, round(self.chunk * self.density)))

    @property
    def index_bits(self) -> int:
        """Bits per index: enough for 0 .. chunk - 1."""
        return (self.chunk - 1).bit_length()

    def chunks(self, numel: int) -> int:
        """Chunks of a tensor of ``numel`` elements."""
        return max(1, -(-numel // self.chunk))

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the payload of a tensor of ``numel`` elements: 4 per chunk (its scale),
        4 per bin (the lookup table; 2- and 4-bit values) and the packed indices and codes."""
        kept = self.chunks(numel) * self.k
        lookup = 0 if self.bits == 1 else 1 << self.bits
        return (4 * (self.chunks(numel) + lookup) + -(-kept * self.index_bits // 8)
                + -(-kept * self.bits // 8))

    def bits_per_parameter(self, numel: int) -> float:
        """Payload bits per element of a tensor of ``numel`` elements."""
        return 8.0 * self.payload_bytes(numel) / max(1, numel)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """The low ``width`` bits (1 .. 16) of each of ``values`` (int64, 1-D, each in 0 ..
    2**width - 1), concatenated little-endian into ``ceil(len * width / 8)`` uint8 (padding
    bits 0).

    Field i starts at bit ``i * width``; shifted into place it spans at most 3 bytes, and
    no two fields share a bit, so adding every field's bytes into place is an OR (integer
    additions: the result does not depend on their order).

    Raises:
        ValueError: ``width`` is not 1 .. 16.
    """
    if not 1 <= width <= 16:
        raise ValueError(f"width must be 1 .. 16 bits, got {width}")
    n = values.numel()
    nbytes = -(-n * width // 8)
    offsets = torch.arange(n, dtype=torch.int64) * width
    shifted = values.reshape(-1).to(torch.int64) << (offsets & 7)
    first = offsets >> 3
    out = torch.zeros(nbytes + 2, dtype=torch.int64)
    for j in range(3):
        out.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    return out[:nbytes].to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """``count`` ``width``-bit fields (1 .. 16) of ``packed`` (uint8, 1-D, from ``pack_bits``),
    as int64.

    Raises:
        ValueError: ``width`` is not 1 .. 16, or ``packed`` holds fewer than ``count * width``
            bits.
    """
    if not 1 <= width <= 16:
        raise ValueError(f"width must be 1 .. 16 bits, got {width}")
    if packed.numel() * 8 < count * width:
        raise ValueError(f"{packed.numel()} bytes hold fewer than {count} x {width} bits")
    offsets = torch.arange(count, dtype=torch.int64) * width
    first = offsets >> 3
    b = torch.cat([packed.reshape(-1), packed.new_zeros(2)]).to(torch.int64)
    word = b[first] | (b[first + 1] << 8) | (b[first + 2] << 16)
    return (word >> (offsets & 7)) & ((1 << width) - 1)


def _levels(cfg: TopK) -> int:
    return 1 << cfg.bits


def _lookup_size(cfg: TopK) -> int:
    """float32 entries of the payload's lookup table: one per bin (2- and 4-bit values)."""
    return 0 if cfg.bits == 1 else _levels(cfg)


def _quantize(values: torch.Tensor, cfg: TopK):
    """(codes int64, scales float32 per chunk, lookup float32 per bin or None) of the kept
    values (nchunks x k)."""
    bad = ~torch.isfinite(values).all(1)
    if cfg.bits == 1:
        scales = values.abs().mean(1)
        codes = (values > 0).to(torch.int64)
        lookup = None
    else:
        scales = values.square().mean(1).sqrt_()
        units = values / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
        levels = _levels(cfg)
        codes = ((units / CLIP_SIGMAS + 1.0) * (levels / 2)).floor_().clamp_(0, levels - 1)
        codes = codes.to(torch.int64)
        # Each bin decodes to the mean of the values it holds (in units of their chunk's
        # scale), as templar's SparseLoCo compressor does (tplr-ai/templar,
        # TopKCompressor._quantize_values): kept top-k values crowd the inner bins, whose
        # centres would be far from them. An empty bin keeps its centre.
        flat, ok = codes.reshape(-1), (~bad).unsqueeze(1).expand_as(codes).reshape(-1)
        sums = torch.zeros(levels, dtype=torch.float32).index_add_(
            0, flat[ok], units.reshape(-1)[ok])
        counts = torch.zeros(levels, dtype=torch.float32).index_add_(
            0, flat[ok], torch.ones(int(ok.sum()), dtype=torch.float32))
        centres = (torch.arange(levels, dtype=torch.float32) + 0.5) * (2.0 / levels) - 1.0
        lookup = torch.where(counts > 0, sums / counts.clamp_min(1.0), centres * CLIP_SIGMAS)
    # A kept inf or NaN poisons its chunk's scale on purpose (decode reports it); an
    # all-zero chunk's stays 0, as do its decoded values.
    scales = scales.masked_fill(bad, float("nan"))
    return codes, scales, lookup


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, lookup, cfg: TopK) -> torch.Tensor:
    """Values (nchunks x k, float32) of ``codes`` against ``scales`` (nchunks) and ``lookup``."""
    if cfg.bits == 1:
        return (codes.to(torch.float32) * 2.0 - 1.0) * scales.unsqueeze(1)
    return lookup[codes] * scales.unsqueeze(1)


def _split(payload: torch.Tensor, numel: int, cfg: TopK):
    """(float32 head: scales then lookup, index bytes, code bytes) of a payload."""
    nchunks, k = cfg.chunks(numel), cfg.k
    kept = nchunks * k
    floats = nchunks + _lookup_size(cfg)
    index_bytes = -(-kept * cfg.index_bits // 8)
    # A payload sliced out of an all-gather may start at any byte: copy to align.
    head = payload[:4 * floats]
    head = head.view(torch.float32) if head.storage_offset() % 4 == 0 else \
        head.clone().view(torch.float32)
    indices = payload[4 * floats:4 * floats + index_bytes]
    codes = payload[4 * floats + index_bytes:]
    return head, indices, codes


def encode(x: torch.Tensor, cfg: TopK) -> torch.Tensor:
    """The payload of ``x`` (float32, contiguous, 1-D): ``cfg.payload_bytes(x.numel())`` uint8.

    Raises:
        ValueError: ``x`` is not a contiguous 1-D float32 tensor on the CPU.
    """
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or x.is_cuda:
        raise ValueError("encode takes a contiguous 1-D float32 CPU tensor")
    n, nchunks, k = x.numel(), cfg.chunks(x.numel()), cfg.k
    padded = x if n == nchunks * cfg.chunk else torch.cat([x, x.new_zeros(nchunks * cfg.chunk - n)])
    rows = padded.view(nchunks, cfg.chunk)
    idx = rows.abs().topk(k, dim=1, sorted=False).indices
    # Sorted positions make the payload a function of the selection alone (topk's order
    # within a chunk is an implementation detail); decoding does not depend on it.
    idx = idx.sort(dim=1).values
    codes, scales, lookup = _quantize(rows.gather(1, idx), cfg)
    out = torch.empty(cfg.payload_bytes(n), dtype=torch.uint8)
    head, index_field, code_field = _split(out, n, cfg)
    # (out is fresh, so its head is aligned: a view, written in place)
    head[:nchunks].copy_(scales)
    if lookup is not None:
        head[nchunks:].copy_(lookup)
    index_field.copy_(pack_bits(idx.reshape(-1), cfg.index_bits))
    code_field.copy_(pack_bits(codes.reshape(-1), cfg.bits))
    return out


def decode_add(out: torch.Tensor, payload: torch.Tensor, cfg: TopK, alpha: float = 1.0) -> bool:
    """``out += alpha * decode(payload)`` unless the payload is non-finite; whether it was added.

    ``out`` (float32, contiguous, 1-D, ``n`` elements) defines ``n``. The kept
    positions of one payload are distinct, so the additions of one call are
    element-wise and in-order: adding the payloads of several peers one call at a
    time, in the same order, gives bit-identical sums on every peer.

    Raises:
        ValueError: ``payload`` is not ``cfg.payload_bytes(n)`` uint8 bytes, or ``out``
            not a contiguous 1-D float32 tensor.
    """
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("decode_add writes into a contiguous 1-D float32 tensor")
    n = out.numel()
    if payload.dtype != torch.uint8 or payload.numel() != cfg.payload_bytes(n):
        raise ValueError(f"a payload of {n} elements is {cfg.payload_bytes(n)} uint8 bytes, "
                         f"got {payload.numel()} {payload.dtype}")
    nchunks, k = cfg.chunks(n), cfg.k
    head, index_field, code_field = _split(payload.contiguous(), n, cfg)
    head = head.clone()
    if not bool(torch.isfinite(head).all()):
        return False
    scales, lookup = head[:nchunks], head[nchunks:]
    idx = unpack_bits(index_field, nchunks * k, cfg.index_bits).view(nchunks, k)
    # An index past the chunk (only possible in a hostile payload when chunk is not a
    # power of two) is clamped into it: the value lands somewhere finite, never out of bounds.
    idx.clamp_(max=cfg.chunk - 1)
    codes = unpack_bits(code_field, nchunks * k, cfg.bits).view(nchunks, k)
    values = _dequantize(codes, scales, lookup, cfg)
    if alpha != 1.0:
        values.mul_(alpha)
    full = n // cfg.chunk
    if full:
        out[:full * cfg.chunk].view(full, cfg.chunk).scatter_add_(1, idx[:full], values[:full])
    if full < nchunks:
        # Only the short last chunk goes through a padded copy; its padding is dropped.
        rest = n - full * cfg.chunk
        tail = torch.zeros(1, cfg.chunk, dtype=torch.float32)
        tail[0, :rest].copy_(out[full * cfg.chunk:])
        tail.scatter_add_(1, idx[full:], values[full:])
        out[full * cfg.chunk:].copy_(tail[0, :rest])
    return True

