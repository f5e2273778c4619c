"""torch_pccl.algorithms.topk (the sparse codec) and diloco.compressed (its error feedback).

The codec on hand-made tensors (where every index, code and scale is known) and with
Hypothesis (any size, chunk, density and bit width round-trips within its bound); the
error feedback on a known sequence (what was not sent stays in the accumulator, a
retried exchange re-sends the same payload and subtracts it once); non-finite input
poisons the payload's scale and nothing else. The wrappers with ``compression`` are in
tests/algorithms/test_diloco.py.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_pccl.algorithms.diloco.compressed import SparseExchange
from torch_pccl.algorithms.topk import (
    CLIP_SIGMAS,
    TopK,
    decode_add,
    encode,
    pack_bits,
    unpack_bits,
)
from torch_pccl.errors import NonFiniteError


def decoded(x, cfg):
    out = torch.zeros_like(x)
    assert decode_add(out, encode(x, cfg), cfg)
    return out


# -- bit fields ------------------------------------------------------------------------


def test_pack_bits_by_hand():
    # 3-bit fields 5, 1, 7 little-endian: 101 | 001 | 111 -> bits 1,0,1, 1,0,0, 1,1,1
    # byte 0 = bits 0..7 = 1,0,1,1,0,0,1,1 = 0b11001101; byte 1 = bit 8 = 1.
    packed = pack_bits(torch.tensor([5, 1, 7]), 3)
    assert packed.tolist() == [0b11001101, 0b00000001]
    assert unpack_bits(packed, 3, 3).tolist() == [5, 1, 7]
    with pytest.raises(ValueError, match="fewer than"):
        unpack_bits(packed, 6, 3)          # 18 bits from 16


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 16), data=st.data())
def test_pack_bits_round_trips(width, data):
    values = data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=0, max_size=200))
    t = torch.tensor(values, dtype=torch.int64)
    packed = pack_bits(t, width)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-len(values) * width // 8)
    assert torch.equal(unpack_bits(packed, len(values), width), t)


# -- the codec on hand-made tensors ----------------------------------------------------


def test_payload_layout_and_size():
    cfg = TopK()
    assert (cfg.k, cfg.index_bits) == (64, 12)
    # 16 M parameters: 4096 chunks x (4 scale bytes + 64 x (12 + 2) bits / 8), and the
    # 4-bin lookup table
    assert cfg.payload_bytes(1 << 24) == 4096 * (4 + 64 * 14 // 8) + 4 * 4
    assert 32 / cfg.bits_per_parameter(1 << 24) > 140       # SparseLoCo's ~146x
    # 2 scales, 4 lookup entries, 4 x 3 bits of indices, 4 x 2 bits of codes
    assert TopK(chunk=8, density=0.25).payload_bytes(10) == 2 * 4 + 4 * 4 + 2 + 1
    assert TopK(chunk=8, density=0.25, bits=1).payload_bytes(10) == 2 * 4 + 2 + 1
    for bad in (dict(chunk=1), dict(chunk=70000), dict(density=0.0), dict(density=1.5),
                dict(bits=3), dict(beta=-0.1), dict(beta=1.01)):
        with pytest.raises(ValueError):
            TopK(**bad)


def test_one_bit_keeps_the_top_k_signs_and_the_chunks_mean_magnitude():
    cfg = TopK(chunk=4, density=0.5, bits=1)          # k = 2 per chunk
    x = torch.tensor([0.1, -3.0, 2.0, 0.5,           # chunk 0: keeps -3 and 2
                      4.0, 0.0, 0.0, -1.0,           # chunk 1: keeps 4 and -1
                      0.2, -0.3])                    # chunk 2 (short): keeps both
    out = decoded(x, cfg)
    assert out.tolist() == [0.0, -2.5, 2.5, 0.0, 2.5, 0.0, 0.0, -2.5,
                            pytest.approx(0.25), pytest.approx(-0.25)]
    payload = encode(x, cfg)
    assert payload[:12].view(torch.float32).tolist() == [2.5, 2.5, pytest.approx(0.25)]
    # indices of chunk 0 (1, 2), chunk 1 (0, 3), chunk 2 (0, 1), 2 bits each, ascending
    assert unpack_bits(payload[12:14], 6, 2).tolist() == [1, 2, 0, 3, 0, 1]
    assert unpack_bits(payload[14:], 6, 1).tolist() == [0, 1, 1, 0, 1, 0]


def test_two_bits_bin_over_three_sigma_and_decode_to_each_bins_mean():
    cfg = TopK(chunk=4, density=1.0, bits=2)          # every entry kept
    # Both chunks have sigma (RMS) 1, so the bins are [-3, -1.5), [-1.5, 0), [0, 1.5),
    # [1.5, 3]: 1 -> code 2, -1 -> code 1, 2 -> code 3, 0 -> code 2. Bin 2 holds 1, 1, 0, 0,
    # 0 (mean 0.4), bin 1 holds -1, -1, bin 3 holds 2; bin 0 is empty (its centre, -2.25).
    x = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, 0.0, 0.0, 0.0])
    payload = encode(x, cfg)
    assert payload[:8].view(torch.float32).tolist() == [1.0, 1.0]             # scales
    assert payload[8:24].view(torch.float32).tolist() == [-2.25, -1.0, pytest.approx(0.4),
                                                          2.0]                  # lookup
    assert unpack_bits(payload[24:26], 8, 2).tolist() == [0, 1, 2, 3] * 2      # positions
    assert unpack_bits(payload[26:28], 8, 2).tolist() == [2, 1, 2, 1, 3, 2, 2, 2]
    assert decoded(x, cfg).tolist() == pytest.approx([0.4, -1.0, 0.4, -1.0, 2.0, 0.4, 0.4,
                                                      0.4])
    y = torch.tensor([10.0, 0.0, 0.0, 0.0])          # sigma 5: +10 is 2 sigma, alone in bin 3
    assert decoded(y, cfg)[0].item() == pytest.approx(10.0)


@settings(max_examples=80, deadline=None)
@given(numel=st.integers(1, 600), chunk=st.sampled_from([2, 3, 16, 64, 100, 256]),
       density=st.sampled_from([1.0, 0.5, 0.1, 1 / 64]), bits=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_keeps_the_top_k_of_each_chunk_within_the_bin(numel, chunk, density, bits,
                                                                 seed):
    cfg = TopK(chunk=chunk, density=density, bits=bits)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    payload = encode(x, cfg)
    assert payload.numel() == cfg.payload_bytes(numel)
    out = decoded(x, cfg)
    padded = torch.cat([x, x.new_zeros(cfg.chunks(numel) * chunk - numel)])
    for c in range(cfg.chunks(numel)):
        row = padded[c * chunk:(c + 1) * chunk]
        got = out[c * chunk:min(numel, (c + 1) * chunk)]
        kept = got != 0
        # At most k entries come back, and each is one of the chunk's k largest.
        assert int(kept.sum()) <= cfg.k
        threshold = row.abs().topk(cfg.k).values.min()
        assert bool((x[c * chunk:c * chunk + got.numel()][kept].abs() >= threshold).all())
        values = row.abs().topk(cfg.k).values
        sent = x[c * chunk:c * chunk + got.numel()][kept]
        back = got[kept]
        assert bool((torch.sign(back) == torch.sign(sent)).all())
        if bits == 1:
            assert torch.allclose(back.abs(), values.mean().expand_as(back), rtol=1e-5)
        else:
            # A bin decodes to the mean of what it holds, so within its width of any value
            # in it; the outer bins also hold the values clipped past +-3 sigma, so only
            # the inner bins are bounded.
            sigma = values.square().mean().sqrt()     # the kept values' RMS
            width = 2 * CLIP_SIGMAS * sigma / (1 << bits)
            inside = sent.abs() < CLIP_SIGMAS * sigma - width
            assert bool(((back - sent).abs()[inside] <= width * (1 + 1e-5) + 1e-7).all())


def test_decode_adds_in_place_and_checks_its_arguments():
    cfg = TopK(chunk=8, density=0.25)
    x = torch.randn(20)
    payload = encode(x, cfg)
    acc = torch.ones(20)
    assert decode_add(acc, payload, cfg, alpha=-1.0)
    assert torch.allclose(acc, 1.0 - decoded(x, cfg))
    with pytest.raises(ValueError, match="uint8 bytes"):
        decode_add(torch.zeros(25), payload, cfg)       # 4 chunks, not 3
    with pytest.raises(ValueError, match="uint8 bytes"):
        decode_add(torch.zeros(20), payload[:-1], cfg)
    with pytest.raises(ValueError):
        encode(x.double(), cfg)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_value_poisons_its_chunks_scale_and_is_never_decoded(bad):
    cfg = TopK(chunk=4, density=0.5)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5, bad, 0.1, 0.2])
    payload = encode(x, cfg)
    scales = payload[:8].view(torch.float32)
    assert torch.isfinite(scales[0]) and torch.isnan(scales[1])
    out = torch.full((8,), 7.0)
    assert not decode_add(out, payload, cfg)
    assert bool((out == 7.0).all())                   # untouched


# -- error feedback ------------------------------------------------------------------


class Recorder:
    """A one-peer transport that records what each all-gather sent."""

    def __init__(self):
        self.sent = []

    def world_size(self):
        return 1

    def all_gather(self, out, inp, async_op=False):
        self.sent.append(inp.clone())
        out.copy_(inp)


def test_error_feedback_keeps_what_was_not_sent():
    # 1 bit with k = 1 sends the kept value exactly (its magnitude is the chunk's scale),
    # so the accumulator can be followed by hand: e <- beta e + delta; e <- e - sent.
    ef = SparseExchange(4, TopK(chunk=4, density=0.25, bits=1, beta=0.5))
    out = torch.zeros(4)
    t = Recorder()
    steps = [([1.0, 3.0, -2.0, 0.5], [0.0, 3.0, 0.0, 0.0], [1.0, 0.0, -2.0, 0.5]),
             ([1.0, 0.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0], [0.0, 0.0, -1.0, 0.25]),
             ([0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.125])]
    for delta, mean, left in steps:
        ef.compress(torch.tensor(delta))
        ef.start(t, async_op=False)
        assert ef.finish(out) == []
        assert out.tolist() == mean
        assert ef.accumulator.tolist() == left


def test_a_retried_exchange_resends_the_same_payload_and_subtracts_it_once():
    ef = SparseExchange(64, TopK(chunk=16, density=0.25))
    t = Recorder()
    ef.compress(torch.randn(64, generator=torch.Generator().manual_seed(3)))
    after = ef.accumulator.clone()
    for _ in range(3):                                # the first try, then two retries
        ef.start(t, async_op=False)
    assert all(torch.equal(s, t.sent[0]) for s in t.sent)
    assert torch.equal(ef.accumulator, after)


def test_a_non_finite_accumulator_is_reset_and_every_payload_rejected_raises():
    ef = SparseExchange(8, TopK(chunk=4, density=0.5))
    delta = torch.ones(8)
    delta[2] = float("nan")
    ef.compress(delta)
    assert bool((ef.accumulator == 0).all())          # one bad round does not stay
    ef.start(Recorder(), async_op=False)
    out = torch.zeros(8)
    with pytest.raises(NonFiniteError, match="rank 0"):
        ef.finish(out)
    ef.compress(torch.ones(8))                        # and the next round is clean
    ef.start(Recorder(), async_op=False)
    assert ef.finish(out) == [] and bool(torch.isfinite(out).all())
