#include "reduce.hpp"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dtype.hpp"

namespace pccl {

namespace {

// Arithmetic on integers goes through the unsigned type so that overflow wraps
// instead of being undefined behaviour.
template <typename T>
struct Arith {
    static T add(T a, T b) {
        if constexpr (std::is_integral_v<T>) {
            using U = std::make_unsigned_t<T>;
            return T(U(a) + U(b));
        } else {
            return a + b;
        }
    }
    static T mul(T a, T b) {
        if constexpr (std::is_integral_v<T>) {
            using U = std::make_unsigned_t<T>;
            // uint8/uint16 promote to int: multiply as unsigned int to keep wrap-around defined.
            return T(U((unsigned long long)U(a) * (unsigned long long)U(b)));
        } else {
            return a * b;
        }
    }
    // min/max propagate NaN like torch.minimum / torch.maximum.
    static T min(T a, T b) {
        if constexpr (std::is_floating_point_v<T>) {
            if (std::isnan(a)) return a;
            if (std::isnan(b)) return b;
        }
        return b < a ? b : a;
    }
    static T max(T a, T b) {
        if constexpr (std::is_floating_point_v<T>) {
            if (std::isnan(a)) return a;
            if (std::isnan(b)) return b;
        }
        return b > a ? b : a;
    }
};

template <typename T, typename F>
void loop(T *d, const T *s, size_t n, F f) {
    for (size_t i = 0; i < n; ++i) d[i] = f(d[i], s[i]);
}

template <typename T>
void reduce_native(T *d, const T *s, size_t n, pcclRedOp_t op) {
    switch (op) {
        case pcclSum:
        case pcclAvg: loop(d, s, n, Arith<T>::add); break;
        case pcclProd: loop(d, s, n, Arith<T>::mul); break;
        case pcclMin: loop(d, s, n, Arith<T>::min); break;
        case pcclMax: loop(d, s, n, Arith<T>::max); break;
        default: break;
    }
}

// 16-bit floats: widen both operands, apply the op in float32, round once.
template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_half(uint16_t *d, const uint16_t *s, size_t n, pcclRedOp_t op) {
    for (size_t i = 0; i < n; ++i) {
        float a = Load(d[i]), b = Load(s[i]), r;
        switch (op) {
            case pcclSum:
            case pcclAvg: r = a + b; break;
            case pcclProd: r = a * b; break;
            case pcclMin: r = Arith<float>::min(a, b); break;
            case pcclMax: r = Arith<float>::max(a, b); break;
            default: r = a; break;
        }
        d[i] = Store(r);
    }
}

template <typename T>
void avg_native(T *d, size_t n, int world) {
    // Divide by the int: T(world) would overflow int8 for worlds above 127.
    for (size_t i = 0; i < n; ++i) d[i] = T(d[i] / world);
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void avg_half(uint16_t *d, size_t n, int world) {
    for (size_t i = 0; i < n; ++i) d[i] = Store(Load(d[i]) / float(world));
}

}  // namespace

void reduce_into(void *dst, const void *src, size_t n, pcclDataType_t dtype, pcclRedOp_t op) {
    switch (dtype) {
        case pcclFloat32: reduce_native((float *)dst, (const float *)src, n, op); break;
        case pcclFloat64: reduce_native((double *)dst, (const double *)src, n, op); break;
        case pcclInt8: reduce_native((int8_t *)dst, (const int8_t *)src, n, op); break;
        case pcclUInt8: reduce_native((uint8_t *)dst, (const uint8_t *)src, n, op); break;
        case pcclInt32: reduce_native((int32_t *)dst, (const int32_t *)src, n, op); break;
        case pcclInt64: reduce_native((int64_t *)dst, (const int64_t *)src, n, op); break;
        case pcclFloat16:
            reduce_half<half_to_float, float_to_half>((uint16_t *)dst, (const uint16_t *)src, n, op);
            break;
        case pcclBFloat16:
            reduce_half<bf16_to_float, float_to_bf16>((uint16_t *)dst, (const uint16_t *)src, n, op);
            break;
        default: break;
    }
}

void finalize_avg(void *dst, size_t n, pcclDataType_t dtype, int world) {
    switch (dtype) {
        case pcclFloat32: avg_native((float *)dst, n, world); break;
        case pcclFloat64: avg_native((double *)dst, n, world); break;
        case pcclInt8: avg_native((int8_t *)dst, n, world); break;
        case pcclUInt8: avg_native((uint8_t *)dst, n, world); break;
        case pcclInt32: avg_native((int32_t *)dst, n, world); break;
        case pcclInt64: avg_native((int64_t *)dst, n, world); break;
        case pcclFloat16: avg_half<half_to_float, float_to_half>((uint16_t *)dst, n, world); break;
        case pcclBFloat16: avg_half<bf16_to_float, float_to_bf16>((uint16_t *)dst, n, world); break;
        default: break;
    }
}

}  // namespace pccl
