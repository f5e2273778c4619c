// Element types: sizes and the float16 / bfloat16 <-> float32 conversions used
// by the reduce kernels. Conversions round to nearest even, as torch does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "pccl.h"

namespace pccl {

inline size_t type_size(pcclDataType_t t) {
    switch (t) {
        case pcclFloat32: return 4;
        case pcclFloat64: return 8;
        case pcclFloat16: return 2;
        case pcclBFloat16: return 2;
        case pcclInt8: return 1;
        case pcclUInt8: return 1;
        case pcclInt32: return 4;
        case pcclInt64: return 8;
        default: return 0;
    }
}

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

// IEEE binary16 -> binary32 (exact).
inline float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0) {
        // zero or subnormal: mant * 2^-24 is exact in float32
        float f = float(mant) * 5.9604644775390625e-8f;
        return bits_to_float(sign | float_to_bits(f));
    }
    if (exp == 31) return bits_to_float(sign | 0x7F800000u | (mant << 13));
    return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// binary32 -> binary16, round to nearest even; overflow gives inf, NaN stays NaN.
inline uint16_t float_to_half(float f) {
    uint32_t x = float_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) {
        if (ax == 0x7F800000u) return uint16_t(sign | 0x7C00u);
        return uint16_t(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    }
    if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {
        // Below the smallest normal half: adding 0.5f (ulp 2^-24) rounds the value to
        // the nearest multiple of 2^-24, the subnormal half step, in hardware.
        float r = bits_to_float(ax) + 0.5f;
        return uint16_t(sign | (float_to_bits(r) - 0x3F000000u));
    }
    uint32_t odd = (ax >> 13) & 1u;
    ax += 0xC8000FFFu + odd;  // rebias the exponent by -112 and round half to even
    return uint16_t(sign | (ax >> 13));
}

inline float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

inline uint16_t float_to_bf16(float f) {
    uint32_t x = float_to_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7FFFu + ((x >> 16) & 1u);
    return uint16_t(x >> 16);
}

}  // namespace pccl
