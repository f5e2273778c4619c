// libFuzzer target for the quantized all-reduce's payload codec (native/src/quantize.cpp):
// the one place where bytes received from a peer are interpreted as numbers (block
// scales and int8/int4 codes) rather than copied or reduced as the local dtype.
//
// Input: byte 0 picks the mode and types (bit 0: int4, else int8; bit 3: round trip,
// else decode; bits 1-2: the output, float32 / float32 added to / float16 / bfloat16,
// or in a round trip the input, float32 / float16 / bfloat16 / float32), bytes 1-2 the
// block size (0 read as 1),
// bytes 3-4 the element count of a received message (modulo kMaxElements + 1), the
// rest is data.
// Mode "decode" (a received message): the data fills a message of exactly
// message_bytes(n) bytes (zero-padded); decode_f32 (set or add) or decode (float16,
// bfloat16) must read only those bytes, write only the n outputs, and give, for
// every element, code * scale read from the documented layout (docs/quantization.md),
// restated below independently of quantize.cpp: NaN and huge scales, code -128 and
// nibble -8 included, all without undefined behaviour.
// Mode "round trip" (a message this rank sends): the data are n float32, float16 or
// bfloat16 values; encode must define every byte of the message (two encodings into
// differently pre-filled buffers agree: no stale memory goes on the wire), codes stay
// within [-qmax, qmax], and decoding gives NaN for every element of a block holding
// an infinity or NaN and otherwise a finite value within scale / 2 of the input
// (scale = absmax / qmax; plus one subnormal step per unit of qmax when the scale is
// subnormal, where the clamp to qmax may bite).
// Any violation aborts, and libFuzzer saves the input. Built and run by
// benchmarks/fuzz_wire.py (in the suite, bounded, by tests/native/test_fuzz_wire.py);
// see docs/protocol.md#fuzzing.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dtype.hpp"
#include "quantize.hpp"
#include "check.hpp"

using namespace pccl;


namespace {

// Enough elements for many blocks and odd int4 boundaries; small enough for
// thousands of inputs a second under the sanitizers.
constexpr uint64_t kMaxElements = 2048;

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

float scale_of(const uint8_t *msg, uint64_t i, uint32_t block) {
    const uint8_t *p = msg + (i / block) * 4;
    return bits_to_float(uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 |
                         uint32_t(p[3]) << 24);
}

// Code of element i: one signed byte (int8), or the low (even i) / high (odd i)
// nibble of byte i / 2 in two's complement (int4).
int code_of(const uint8_t *msg, uint64_t n, uint64_t i, pcclQuantType_t q, uint32_t block) {
    const uint8_t *codes = msg + ceil_div(n, block) * 4;
    if (q == pcclQuantInt8) return int(int8_t(codes[i]));
    int v = (i & 1) ? codes[i / 2] >> 4 : codes[i / 2] & 0xF;
    return v >= 8 ? v - 16 : v;
}

// Same value, NaNs being equal to each other whatever their payload.
bool same_f32(float a, float b) {
    return (std::isnan(a) && std::isnan(b)) || float_to_bits(a) == float_to_bits(b);
}

bool half_is_nan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu); }
bool bf16_is_nan(uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu); }

void fuzz_decode(const uint8_t *data, size_t size, uint64_t n, pcclQuantType_t q,
                 uint32_t block, int out_kind) {
    std::vector<uint8_t> msg(quant::message_bytes(n, q, block), 0);
    if (!msg.empty()) memcpy(msg.data(), data, std::min(size, msg.size()));
    std::vector<float> ref(n);
    for (uint64_t i = 0; i < n; ++i)
        ref[i] = float(code_of(msg.data(), n, i, q, block)) * scale_of(msg.data(), i, block);

    // Exactly n outputs and exactly message_bytes(n) input bytes: AddressSanitizer
    // reports any access beyond either.
    if (out_kind == 0 || out_kind == 1) {
        const bool add = out_kind == 1;
        std::vector<float> out(n);
        for (uint64_t i = 0; i < n; ++i) out[i] = float(i % 7) - 3.25f;  // what `add` adds to
        std::vector<float> before = out;
        quant::decode_f32(msg.data(), n, q, block, out.data(), add);
        for (uint64_t i = 0; i < n; ++i)
            CHECK(same_f32(out[i], add ? before[i] + ref[i] : ref[i]));
        return;
    }
    const bool half = out_kind == 2;
    std::vector<uint16_t> out(n);
    quant::decode(msg.data(), n, q, block, out.data(), half ? pcclFloat16 : pcclBFloat16);
    for (uint64_t i = 0; i < n; ++i) {
        if (std::isnan(ref[i]))
            CHECK(half ? half_is_nan(out[i]) : bf16_is_nan(out[i]));
        else
            CHECK(out[i] == (half ? float_to_half(ref[i]) : float_to_bf16(ref[i])));
    }
}

void fuzz_round_trip(const uint8_t *data, size_t size, pcclQuantType_t q, uint32_t block,
                     int src_kind) {
    const pcclDataType_t dtype = src_kind == 1 ? pcclFloat16 : src_kind == 2 ? pcclBFloat16
                                                                             : pcclFloat32;
    const size_t es = type_size(dtype);
    const uint64_t n = std::min<uint64_t>(size / es, kMaxElements);
    std::vector<uint8_t> src(n * es);  // a copy: data may be unaligned
    if (!src.empty()) memcpy(src.data(), data, src.size());
    std::vector<float> x(n);
    for (uint64_t i = 0; i < n; ++i) {
        uint32_t u = 0;
        memcpy(&u, src.data() + i * es, es);
        x[i] = dtype == pcclFloat32 ? bits_to_float(u)
               : dtype == pcclFloat16 ? half_to_float(uint16_t(u))
                                      : bf16_to_float(uint16_t(u));
    }

    const size_t bytes = quant::message_bytes(n, q, block);
    std::vector<uint8_t> msg(bytes, 0x00), msg2(bytes, 0xFF);
    quant::encode(src.data(), dtype, n, q, block, msg.data());
    quant::encode(src.data(), dtype, n, q, block, msg2.data());
    CHECK(msg == msg2);

    std::vector<float> d(n);
    quant::decode_f32(msg.data(), n, q, block, d.data(), false);
    const int qm = quant::qmax(q);
    for (uint64_t first = 0; first < n; first += block) {
        const uint64_t end = std::min<uint64_t>(n, first + block);
        bool finite = true;
        float absmax = 0.0f;
        for (uint64_t i = first; i < end; ++i) {
            finite = finite && std::isfinite(x[i]);
            absmax = std::max(absmax, std::fabs(x[i]));
        }
        const float scale = absmax / float(qm);
        for (uint64_t i = first; i < end; ++i) {
            const int code = code_of(msg.data(), n, i, q, block);
            CHECK(code >= -qm && code <= qm);
            if (!finite) {
                CHECK(std::isnan(d[i]));
                continue;
            }
            CHECK(std::isfinite(d[i]));
            double bound = double(scale) * 0.5 * (1 + 1e-5);
            if (scale < FLT_MIN) bound += double(qm + 1) * std::ldexp(1.0, -149);
            CHECK(std::fabs(double(x[i]) - double(d[i])) <= bound);
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 5) return 0;
    const uint8_t mode = data[0];
    const pcclQuantType_t q = (mode & 1) ? pcclQuantInt4 : pcclQuantInt8;
    const uint32_t block = std::max<uint32_t>(1, uint32_t(data[1]) | uint32_t(data[2]) << 8);
    const uint64_t n = (uint64_t(data[3]) | uint64_t(data[4]) << 8) % (kMaxElements + 1);
    if (mode & 8)
        fuzz_round_trip(data + 5, size - 5, q, block, (mode >> 1) & 3);
    else
        fuzz_decode(data + 5, size - 5, n, q, block, (mode >> 1) & 3);
    return 0;
}
