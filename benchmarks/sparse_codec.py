"""The sparse exchange's CPU cost and bytes: encode + decode of a 16 M-parameter model at world 4.

    python benchmarks/sparse_codec.py                 # 16 M parameters, world 4, TopK()
    python benchmarks/sparse_codec.py --params 4194304 --world 8 --bits 1 --reps 5

One process, one torch thread (the cost one peer pays per outer step): ``compress`` of a
``SparseExchange`` (the error feedback ``e <- beta e + delta``, chunk-wise top-k, quantize,
pack, and the subtraction of what was sent) followed by ``finish`` over ``--world`` payloads
(unpack, dequantize and add every peer's payload in rank order, divide): what a peer does
between the all-gather's input and the outer optimizer's gradient. The payloads of the other
"peers" are encodings of their own random pseudo-gradients, made outside the timed region.
Reports the median of ``--reps`` timed repetitions (after one warm-up), against the time
float32 pseudo-gradients take over a 1 Gbit/s link (the issue's budget), and the bytes one
peer sends per exchange as the world grows: the sparse all-gather ((W - 1) payloads) vs a
ring all-reduce of float32 and of int4 (``all_reduce_quantized``, block 256), with the world
size from which the dense int4 ring sends fewer bytes. Writes ``results.json`` to ``--out``
(default runs/bench_sparse_codec).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine, write_json  # noqa: E402


def ring_all_reduce_bytes(numel: int, world: int, bytes_per_value: float) -> float:
    """Bytes one peer sends in a ring all-reduce: 2 (W - 1) / W of the tensor."""
    return 2.0 * (world - 1) / world * numel * bytes_per_value


def all_gather_bytes(payload: int, world: int) -> int:
    """Bytes one peer sends in a ring all-gather of one payload per peer: W - 1 payloads."""
    return (world - 1) * payload


def int4_crossover(numel: int, payload: int, block: int = 256) -> int:
    """The smallest world size at which a dense int4 ring all-reduce (4 bits per value plus a
    float32 scale per ``block``) sends fewer bytes per peer than the sparse all-gather."""
    per_value = 0.5 + 4.0 / block
    world = 2
    while all_gather_bytes(payload, world) <= ring_all_reduce_bytes(numel, world, per_value):
        world += 1
    return world


def main(argv=None) -> int:
    from torch_pccl.algorithms.diloco.compressed import SparseExchange
    from torch_pccl.algorithms.topk import TopK, encode

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=16 * (1 << 20), help="parameters (16 Mi)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--density", type=float, default=1 / 64)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--link-gbit", type=float, default=1.0,
                   help="the budget: float32 pseudo-gradients over this link (Gbit/s)")
    p.add_argument("--out", default=os.path.join("runs", "bench_sparse_codec"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = TopK(density=args.density, bits=args.bits, chunk=args.chunk)
    n = args.params
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(n, generator=gen) * 1e-3 for _ in range(args.world)]
    others = [encode(d, cfg) for d in deltas[1:]]

    class Gathered:
        """The all-gather's result, made up front: this peer's payload, then the others'."""

        def world_size(self):
            return args.world

        def all_gather(self, out, inp, async_op=False):
            out.view(args.world, -1)[0].copy_(inp)
            for r, payload in enumerate(others, start=1):
                out.view(args.world, -1)[r].copy_(payload)

    ex = SparseExchange(n, cfg)
    out = torch.empty(n)
    encode_s, decode_s = [], []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        ex.compress(deltas[0])
        t1 = time.perf_counter()
        ex.start(Gathered(), async_op=False)          # copies only: not timed
        t2 = time.perf_counter()
        ex.finish(out)
        t3 = time.perf_counter()
        if rep:                                       # rep 0 warms the allocator up
            encode_s.append(t1 - t0)
            decode_s.append(t3 - t2)
    enc, dec = statistics.median(encode_s), statistics.median(decode_s)
    # The bound: 0.5 s, about what float32 pseudo-gradients take over 1 Gbit/s.
    budget = min(0.5, n * 4 * 8 / (args.link_gbit * 1e9))
    payload = cfg.payload_bytes(n)
    print(f"# sparse codec: {n:,} parameters, world {args.world}, {cfg}, 1 torch thread")
    print(f"payload {payload:,} bytes ({cfg.bits_per_parameter(n):.3f} bits per parameter, "
          f"{n * 4 / payload:.1f}x fewer than float32)")
    print(f"encode (error feedback, top-k, quantize, pack) {enc:.3f} s; decode and average "
          f"{args.world} payloads {dec:.3f} s; total {enc + dec:.3f} s "
          f"(goal <= {budget:.3f} s: 0.5 s or float32 over {args.link_gbit:g} Gbit/s) -> "
          f"{'met' if enc + dec <= budget else 'NOT met'}")
    rows = []
    print("\n| world | sparse all-gather | float32 ring | int4 ring | sparse / int4 |")
    print("|---|---|---|---|---|")
    for world in (2, 4, 8, 16, 32, 64, 128):
        sparse = all_gather_bytes(payload, world)
        dense = ring_all_reduce_bytes(n, world, 4.0)
        int4 = ring_all_reduce_bytes(n, world, 0.5 + 4.0 / 256)
        rows.append({"world": world, "sparse": sparse, "float32": dense, "int4": int4})
        print(f"| {world} | {sparse / 1e6:.2f} MB | {dense / 1e6:.1f} MB | {int4 / 1e6:.1f} MB "
              f"| {sparse / int4:.2f} |")
    cross = int4_crossover(n, payload)
    print(f"\nthe dense int4 ring sends fewer bytes per peer from world size {cross} on")
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "results.json"), {"machine": machine(),
        "params": n, "world": args.world, "topk": vars(args), "payload_bytes": payload,
        "encode_s": enc, "decode_s": dec, "total_s": enc + dec, "budget_s": budget,
        "encode_samples": encode_s, "decode_samples": decode_s, "bytes_per_peer": rows,
        "int4_crossover_world": cross})
    return 0


if __name__ == "__main__":
    sys.exit(main())
