#include "quantize.hpp"

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <limits>

#include "dtype.hpp"
#include "wire.hpp"

// The rounding trick below needs float arithmetic carried out in float.
static_assert(FLT_EVAL_METHOD == 0, "quantize.cpp needs FLT_EVAL_METHOD == 0");

namespace pccl {
namespace quant {

namespace {

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b ? 1 : 0); }

uint64_t code_bytes(uint64_t n, pcclQuantType_t q) { return q == pcclQuantInt8 ? n : (n + 1) / 2; }

void put_scale(uint8_t *p, float s) {
    uint32_t u = float_to_bits(s);
    for (int i = 0; i < 4; ++i) p[i] = uint8_t(u >> (8 * i));
}

float get_scale(const uint8_t *p) {
    uint32_t u = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
    return bits_to_float(u);
}

// absmax / qmax over x[0..n); NaN if the block holds an infinity or NaN. The
// maximum is taken over the bit patterns of |x|, which order like the values
// (NaN above infinity above every finite float), so the loop vectorises.
float block_scale(const float *x, size_t n, float qmax) {
    uint32_t m = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t u = float_to_bits(x[i]) & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    if (m >= 0x7F800000u) return std::numeric_limits<float>::quiet_NaN();
    float s = bits_to_float(m) / qmax;
    // For absmax = FLT_MAX and qmax 127 the quotient rounds up and qmax * s, the
    // largest code's value, overflows to infinity (found by native/fuzz/fuzz_quant.cpp).
    // One step down keeps it finite; the largest elements' codes still round to qmax.
    if (s * qmax > std::numeric_limits<float>::max()) s = bits_to_float(float_to_bits(s) - 1);
    return s;
}

// codes[i] = round_half_even(x[i] / scale) clamped to [-qmax, qmax]; all zero
// when the scale is 0 (an all-zero block, or absmax / qmax underflowed) or NaN
// (a non-finite block). The clamp only bites for subnormal scales, whose
// rounding can leave x / scale above qmax.
void quantize_block(const float *x, size_t n, float scale, float qmax, int8_t *codes) {
    if (!(scale > 0.0f)) {
        std::memset(codes, 0, n);
        return;
    }
    // Adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to an integer, half to
    // even, in the default rounding mode (the FPU's own rounding, no libm call).
    const float magic = 12582912.0f;
    for (size_t i = 0; i < n; ++i) {
        float v = x[i] / scale;
        float r = (v + magic) - magic;
        r = r > qmax ? qmax : r;
        r = r < -qmax ? -qmax : r;
        codes[i] = int8_t(r);
    }
}

// The signed value of a 4-bit two's complement code v (0 .. 15).
int sext4(int v) { return (v ^ 8) - 8; }

// Code of element i of an int4 message: low nibble for even i, high for odd.
int nibble(const uint8_t *codes, uint64_t i) {
    uint8_t b = codes[i / 2];
    return sext4((i & 1) ? b >> 4 : b & 0xF);
}

// d[i] = (or +=) code of element first + i times s, for i < len.
void decode_block(const uint8_t *codes, pcclQuantType_t q, uint64_t first, size_t len, float s,
                  float *d, bool add) {
    if (q == pcclQuantInt8) {
        const int8_t *c = (const int8_t *)codes + first;
        if (add)
            for (size_t i = 0; i < len; ++i) d[i] += float(c[i]) * s;
        else
            for (size_t i = 0; i < len; ++i) d[i] = float(c[i]) * s;
        return;
    }
    size_t i = 0;
    if (first & 1) {  // an odd block size: this block starts in a high nibble
        float v = float(nibble(codes, first)) * s;
        d[0] = add ? d[0] + v : v;
        i = 1;
    }
    // Whole bytes: two codes each (vectorised); then a last low nibble, if any.
    const uint8_t *b = codes + (first + i) / 2;
    float *e = d + i;
    const size_t pairs = (len - i) / 2;
    if (add) {
        for (size_t k = 0; k < pairs; ++k) {
            e[2 * k] += float(sext4(b[k] & 0xF)) * s;
            e[2 * k + 1] += float(sext4(b[k] >> 4)) * s;
        }
    } else {
        for (size_t k = 0; k < pairs; ++k) {
            e[2 * k] = float(sext4(b[k] & 0xF)) * s;
            e[2 * k + 1] = float(sext4(b[k] >> 4)) * s;
        }
    }
    if (i + 2 * pairs < len) {
        float v = float(sext4(b[pairs] & 0xF)) * s;
        size_t last = len - 1;
        d[last] = add ? d[last] + v : v;
    }
}

// Calls f(first, n, values) for each block of the float32 view of src: the
// input itself for float32, converted block by block for 16-bit types.
template <typename F>
void for_each_block(const void *src, pcclDataType_t dtype, uint64_t n, uint32_t block, F f) {
    std::vector<float> tmp;
    if (dtype != pcclFloat32) tmp.resize(std::min<uint64_t>(block, n));
    for (uint64_t first = 0; first < n; first += block) {
        size_t len = size_t(std::min<uint64_t>(block, n - first));
        const float *x;
        if (dtype == pcclFloat32) {
            x = (const float *)src + first;
        } else {
            const uint16_t *h = (const uint16_t *)src + first;
            for (size_t i = 0; i < len; ++i)
                tmp[i] = dtype == pcclFloat16 ? half_to_float(h[i]) : bf16_to_float(h[i]);
            x = tmp.data();
        }
        f(first, len, x);
    }
}

// Loads n elements of src as float32 into dst (dst = v, or dst += v when add).
void load_f32(const void *src, pcclDataType_t dtype, uint64_t n, float *dst, bool add) {
    for_each_block(src, dtype, n, 4096, [&](uint64_t first, size_t len, const float *x) {
        float *d = dst + first;
        if (add) {
            for (size_t i = 0; i < len; ++i) d[i] += x[i];
        } else {
            std::memcpy(d, x, len * sizeof(float));
        }
    });
}

}  // namespace

int qmax(pcclQuantType_t q) { return q == pcclQuantInt8 ? 127 : 7; }

uint8_t coll_of(pcclQuantType_t q) {
    return q == pcclQuantInt8 ? wire::kCollAllReduceInt8 : wire::kCollAllReduceInt4;
}

uint64_t message_bytes(uint64_t n, pcclQuantType_t q, uint32_t block) {
    return ceil_div(n, block) * 4 + code_bytes(n, q);
}

void encode(const void *src, pcclDataType_t dtype, uint64_t n, pcclQuantType_t q, uint32_t block,
            uint8_t *dst) {
    const float qm = float(qmax(q));
    uint8_t *codes = dst + ceil_div(n, block) * 4;
    std::vector<int8_t> packed;  // int4: one block's codes before packing
    if (q == pcclQuantInt4) packed.resize(std::min<uint64_t>(block, n));
    for_each_block(src, dtype, n, block, [&](uint64_t first, size_t len, const float *x) {
        float scale = block_scale(x, len, qm);
        put_scale(dst + (first / block) * 4, scale);
        if (q == pcclQuantInt8) {
            quantize_block(x, len, scale, qm, (int8_t *)codes + first);
            return;
        }
        const int8_t *c = packed.data();
        quantize_block(x, len, scale, qm, packed.data());
        size_t i = 0;
        if (first & 1) {  // an odd block size: the previous block left the low nibble
            codes[first / 2] = uint8_t(codes[first / 2] | ((uint8_t(c[0]) & 0xF) << 4));
            i = 1;
        }
        uint8_t *b = codes + (first + i) / 2;
        const size_t pairs = (len - i) / 2;
        for (size_t k = 0; k < pairs; ++k)
            b[k] = uint8_t((uint8_t(c[i + 2 * k]) & 0xF) | (uint8_t(c[i + 2 * k + 1]) << 4));
        if (i + 2 * pairs < len) b[pairs] = uint8_t(c[len - 1]) & 0xF;  // high nibble: next block
    });
}

void decode_f32(const uint8_t *msg, uint64_t n, pcclQuantType_t q, uint32_t block, float *dst,
                bool add) {
    const uint8_t *codes = msg + ceil_div(n, block) * 4;
    for (uint64_t first = 0; first < n; first += block)
        decode_block(codes, q, first, size_t(std::min<uint64_t>(block, n - first)),
                     get_scale(msg + (first / block) * 4), dst + first, add);
}

void decode(const uint8_t *msg, uint64_t n, pcclQuantType_t q, uint32_t block, void *dst,
            pcclDataType_t dtype) {
    if (dtype == pcclFloat32) {
        decode_f32(msg, n, q, block, (float *)dst, false);
        return;
    }
    // 16-bit outputs: decode a block at a time into float32, then round once.
    std::vector<float> tmp(size_t(std::min<uint64_t>(block, n)));
    const uint8_t *codes = msg + ceil_div(n, block) * 4;
    for (uint64_t first = 0; first < n; first += block) {
        size_t len = size_t(std::min<uint64_t>(block, n - first));
        decode_block(codes, q, first, len, get_scale(msg + (first / block) * 4), tmp.data(), false);
        uint16_t *out = (uint16_t *)dst + first;
        for (size_t i = 0; i < len; ++i)
            out[i] = dtype == pcclFloat16 ? float_to_half(tmp[i]) : float_to_bf16(tmp[i]);
    }
}

AllReducePlan::AllReducePlan(const OpInfo &info, pcclQuantType_t q, uint32_t block)
    : info_(info), q_(q), block_(block), es_(type_size(info.dtype)) {
    const int n = info.world_size, me = info.rank;
    const uint64_t blocks = ceil_div(info.count, block);
    begin_.resize(size_t(n));
    size_.resize(size_t(n));
    msg_.resize(size_t(n));
    peer_off_.assign(size_t(n), 0);
    contrib_off_.assign(size_t(n), 0);
    for (int r = 0; r < n; ++r) {
        // Blocks split as evenly as possible, the first (blocks % n) ranks taking one more.
        uint64_t base = blocks / uint64_t(n), rem = blocks % uint64_t(n);
        uint64_t b0 = uint64_t(r) * base + std::min<uint64_t>(uint64_t(r), rem);
        uint64_t nb = base + (uint64_t(r) < rem ? 1 : 0);
        begin_[size_t(r)] = std::min(info.count, b0 * block);
        size_[size_t(r)] = std::min(info.count, (b0 + nb) * block) - begin_[size_t(r)];
        msg_[size_t(r)] = message_bytes(size_[size_t(r)], q, block);
    }
    uint64_t off = size_[size_t(me)] * sizeof(float);  // the accumulator comes first
    for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        peer_off_[size_t(r)] = off;
        off += msg_[size_t(r)];
    }
    for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        contrib_off_[size_t(r)] = off;
        off += msg_[size_t(me)];
    }
    result_off_ = off;
    total_ = size_t(off + msg_[size_t(me)]);
}

Schedule AllReducePlan::messages(uint8_t *work, uint64_t send_bytes, const uint64_t *sdispls,
                                 bool second_phase) const {
    const int n = info_.world_size, me = info_.rank;
    // Phase 1 sends each rank its slice's message and receives the own slice's;
    // phase 2 the other way round.
    std::vector<uint64_t> scounts(size_t(n), 0), rcounts(size_t(n), 0);
    for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        scounts[size_t(r)] = second_phase ? send_bytes : msg_[size_t(r)];
        rcounts[size_t(r)] = second_phase ? msg_[size_t(r)] : msg_[size_t(me)];
    }
    // Bytes on the wire: an all-to-all of uint8 messages, re-stamped with the
    // op's dtype and element count so that the headers still name the op, and
    // with phase-2 frames numbered after phase-1 frames on each link (frames per
    // message: one per chunk, at least one, as schedule.cpp cuts them).
    OpInfo bytes = info_;
    bytes.dtype = pcclUInt8;
    Schedule s = pairwise_alltoallv(bytes, work, scounts.data(), sdispls, work, rcounts.data(),
                                    second_phase ? peer_off_.data() : contrib_off_.data());
    auto frames = [&](uint64_t len) -> uint32_t { return uint32_t(chunk_count(bytes, len)); };
    for (SendItem &it : s.sends) {
        it.hdr.dtype = uint8_t(info_.dtype);
        it.hdr.count = info_.count;
        if (second_phase) it.hdr.step += frames(msg_[size_t(it.peer)]);
    }
    for (RecvItem &it : s.recvs) {
        it.expect.dtype = uint8_t(info_.dtype);
        it.expect.count = info_.count;
        if (second_phase) it.expect.step += frames(msg_[size_t(me)]);
    }
    s.continued = !second_phase;  // phase 2's frames may arrive during phase 1
    return s;
}

Schedule AllReducePlan::exchange(const void *input, uint8_t *work) const {
    for (int r = 0; r < info_.world_size; ++r)
        if (r != info_.rank)
            encode((const uint8_t *)input + begin_[size_t(r)] * es_, info_.dtype,
                   size_[size_t(r)], q_, block_, work + peer_off_[size_t(r)]);
    return messages(work, 0, peer_off_.data(), false);
}

Schedule AllReducePlan::reduce_and_share(const void *input, uint8_t *work) const {
    const int n = info_.world_size, me = info_.rank;
    const uint64_t len = size_[size_t(me)];
    float *acc = (float *)work;  // offset 0 of malloc'ed memory: aligned for float
    for (int r = 0; r < n; ++r) {
        if (r == me)
            load_f32((const uint8_t *)input + begin_[size_t(me)] * es_, info_.dtype, len, acc, r > 0);
        else
            decode_f32(work + contrib_off_[size_t(r)], len, q_, block_, acc, r > 0);
    }
    if (info_.op == pcclAvg)
        for (uint64_t i = 0; i < len; ++i) acc[i] /= float(n);
    encode(acc, pcclFloat32, len, q_, block_, work + result_off_);
    std::vector<uint64_t> sdispls(size_t(n), result_off_);
    return messages(work, msg_[size_t(me)], sdispls.data(), true);
}

void AllReducePlan::decode_result(const uint8_t *work, void *output) const {
    const int n = info_.world_size, me = info_.rank;
    for (int r = 0; r < n; ++r) {
        const uint8_t *msg = work + (r == me ? result_off_ : peer_off_[size_t(r)]);
        decode(msg, size_[size_t(r)], q_, block_, (uint8_t *)output + begin_[size_t(r)] * es_,
               info_.dtype);
    }
}

}  // namespace quant
}  // namespace pccl
