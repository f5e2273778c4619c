// Quantized all-reduce: block-wise int8/int4 codecs and the plan of one
// pcclAllReduceQuantized call. Pure functions over memory (no I/O), unit-tested
// in native/tests/test_native.cpp; api_coll.cpp runs the two schedules.
//
// Codec: symmetric absmax quantization per block of `block` elements, one
// float32 scale per block (scale = absmax / qmax, code = round_half_even(x /
// scale) clamped to [-qmax, qmax], decoded value = code * scale), qmax = 127
// for int8 and 7 for int4. A message of n elements is laid out as
// ceil(n / block) little-endian float32 scales followed by the codes: one byte
// each for int8, two per byte for int4 (element i in byte i / 2, the low nibble
// for even i, two's complement). A block holding an infinity or NaN gets a NaN
// scale and decodes to NaN in every element; an all-zero block has scale 0.
// Decoding never trusts the bytes: any scale bits and any code decode without
// undefined behaviour.
//
// Algorithm of the all-reduce (no re-quantization of partial sums):
//   1. rank r owns a block-aligned slice of the elements (the blocks split as
//      evenly as possible, lower ranks taking the remainder);
//   2. each rank quantizes its input's slice of every other owner once and
//      sends it there (a pairwise all-to-all);
//   3. each owner dequantizes the W-1 contributions and adds them and its own
//      exact slice in float32 in rank order, divides by W for AVG, and
//      quantizes the result once;
//   4. the owners' result messages are all-gathered (pairwise), and every rank,
//      the owner included, decodes the same bytes with the same code, so every
//      rank ends with bit-identical results.
// Per element, |result - exact| <= sum over ranks r != owner of scale_r / 2
// (divided by W for AVG) + scale_out / 2, plus float32 rounding of the sum.
// Bytes sent per rank: about 2 (W-1)/W * count * (bits/8 + 4/block).
// Sources: block-wise absmax quantization as in Dettmers et al., "8-bit
// Optimizers via Block-wise Quantization" (ICLR 2022); quantizing each value
// once before an all-to-all reduce-scatter instead of at every ring hop as in
// the qgZ scheme of Wang et al., "ZeRO++: Extremely Efficient Collective
// Communication for Giant Model Training" (arXiv 2306.10209).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "pccl.h"
#include "schedule.hpp"

namespace pccl {
namespace quant {

// The block size travels in the frame header's 16-bit `root` field (OpInfo::root).
static_assert(PCCL_MAX_QUANT_BLOCK <= std::numeric_limits<decltype(OpInfo::root)>::max(),
              "PCCL_MAX_QUANT_BLOCK must fit the frame header's root field");

// Largest code magnitude of a quantization type (127 or 7).
int qmax(pcclQuantType_t q);

// Bytes of one message of n elements: the scales then the codes.
uint64_t message_bytes(uint64_t n, pcclQuantType_t q, uint32_t block);

// Encodes n elements of `src` (float32, float16 or bfloat16) into `dst`
// (message_bytes(n) bytes).
void encode(const void *src, pcclDataType_t dtype, uint64_t n, pcclQuantType_t q, uint32_t block,
            uint8_t *dst);

// Decodes a message of n elements into float32: dst = decoded, or dst += decoded
// when `add`.
void decode_f32(const uint8_t *msg, uint64_t n, pcclQuantType_t q, uint32_t block, float *dst,
                bool add);

// Decodes a message of n elements into `dst` of dtype (float32/float16/bfloat16;
// 16-bit types round the float32 value once, to nearest even).
void decode(const uint8_t *msg, uint64_t n, pcclQuantType_t q, uint32_t block, void *dst,
            pcclDataType_t dtype);

// The wire collective code of a quantization type (frames of int8 and int4
// all-reduces differ in their `coll`, so a mismatch is named).
uint8_t coll_of(pcclQuantType_t q);

// One rank's plan of a quantized all-reduce. `info` is the op's header data:
// info.coll = coll_of(q), info.dtype the element type, info.op pcclSum or
// pcclAvg, info.root the block size, info.count the element count.
//
// Working memory (staging_bytes(), one buffer): the float32 accumulator of the
// own slice, the messages for / from the other owners (phase 1 sends them,
// phase 2 receives the owners' results into the same places), the W-1
// contributions to the own slice, and the own result message.
class AllReducePlan {
public:
    AllReducePlan(const OpInfo &info, pcclQuantType_t q, uint32_t block);

    size_t staging_bytes() const { return total_; }

    // Owner slice of rank r, in elements.
    uint64_t slice_begin(int r) const { return begin_[size_t(r)]; }
    uint64_t slice_size(int r) const { return size_[size_t(r)]; }

    // Phase 1: quantizes the input's slice of every other owner into `work` and
    // returns the schedule that sends them and receives the contributions to
    // this rank's slice. Reads `input` (info.count elements of info.dtype).
    Schedule exchange(const void *input, uint8_t *work) const;

    // Between the phases: sums the own exact slice and the received
    // contributions in rank order, applies AVG, quantizes the result once, and
    // returns the schedule that sends it to every rank and receives every other
    // owner's result.
    Schedule reduce_and_share(const void *input, uint8_t *work) const;

    // After phase 2: decodes every owner's result message into `output`
    // (info.count elements of info.dtype). Writes nothing else; may alias input.
    void decode_result(const uint8_t *work, void *output) const;

private:
    // The schedule of one phase: phase 1 sends every other owner its slice's
    // message (at peer_off_) and receives the contributions (at contrib_off_);
    // phase 2 sends the own result (send_bytes at sdispls) to every rank and
    // receives the other owners' results (at peer_off_).
    Schedule messages(uint8_t *work, uint64_t send_bytes, const uint64_t *sdispls,
                      bool second_phase) const;

    OpInfo info_;
    pcclQuantType_t q_;
    uint32_t block_;
    size_t es_;
    std::vector<uint64_t> begin_, size_, msg_;  // per rank: slice and its message bytes
    std::vector<uint64_t> peer_off_;   // per rank: its message (phase 1 out, phase 2 in)
    std::vector<uint64_t> contrib_off_;  // per rank: its contribution to the own slice
    uint64_t result_off_ = 0;          // the own result message
    size_t total_ = 0;                 // the accumulator sits at offset 0
};

}  // namespace quant
}  // namespace pccl
