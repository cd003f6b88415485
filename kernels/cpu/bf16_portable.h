// kernels/cpu/bf16_portable.h — linear_bf16's arithmetic written lane by lane in portable C++:
// the reference every vector path of the bf16 compute mode (linear_bf16.cpp, linear_bf16_avx2.cpp)
// must reproduce bit for bit, and the fallback those paths use for an output that met a NaN.
// Internal to kernels/cpu. The contract is cpu_ops.h's linear_bf16 / dpbf16_step.
#pragma once

#include "fd/kernels/ops.h"
#include "lanes.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fd::kernels {
namespace {

constexpr int64_t kStepK = 32;  ///< k's per step: one vdpbf16ps (16 lanes x a pair of k's)

inline int64_t padded_k(int64_t n_in) { return (n_in + kStepK - 1) / kStepK * kStepK; }

inline float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline uint32_t to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}
inline float bf16_value(uint16_t b) { return from_bits(uint32_t(b) << 16); }
/// Denormal → zero of its sign (the instruction's DAZ on inputs and FTZ on results).
inline float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

/// vcvtne2ps2bf16 of one value: NaN → quiet NaN (payload's top bits), denormal → zero of its
/// sign, else round to nearest even.
inline uint16_t round_one(float v) {
    const uint32_t u = to_bits(v);
    if (std::isnan(v)) { return static_cast<uint16_t>((u >> 16) | 0x0040u); }
    if (std::fpclassify(v) == FP_SUBNORMAL) { return static_cast<uint16_t>((u >> 16) & 0x8000u); }
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/// acc + x * w as the instruction computes it: DAZ on the inputs, one rounding, FTZ; a NaN input
/// gives the first NaN of x, w, acc made quiet (measured on Zen 4, the SDM's order for two-source
/// ops), an invalid operation (inf * 0, inf - inf) the x86 default NaN 0xFFC00000.
inline float fma_daz_ftz(float x, float w, float acc) {
    x = flush(x), w = flush(w), acc = flush(acc);
    if (std::isnan(x) || std::isnan(w) || std::isnan(acc)) {
        return from_bits(to_bits(std::isnan(x) ? x : std::isnan(w) ? w : acc) | 0x00400000u);
    }
    const float r = std::fma(x, w, acc);
    return std::isnan(r) ? from_bits(0xFFC00000u) : flush(r);
}

/// One lane of one step (portable): the odd pair first, then the even pair.
inline float dp_lane(float acc, uint16_t x_even, uint16_t x_odd, uint16_t w_even, uint16_t w_odd) {
    acc = fma_daz_ftz(bf16_value(x_odd), bf16_value(w_odd), acc);
    return fma_daz_ftz(bf16_value(x_even), bf16_value(w_even), acc);
}

/// Weights k .. k + 31 of a row as bf16 (f32 rounded; past n_in zero), portable.
inline void weight_step_portable(uint16_t (&w)[kStepK], const char * row, WType wtype, int64_t k, int64_t n_in) {
    for (int64_t j = 0; j < kStepK; ++j) {
        if (k + j >= n_in) {
            w[j] = 0;
        } else if (wtype == WType::bf16) {
            w[j] = reinterpret_cast<const uint16_t *>(row)[k + j];
        } else {
            w[j] = round_one(reinterpret_cast<const float *>(row)[k + j]);
        }
    }
}

/// One output of linear_bf16 without the bias, portable, from the f32 x row (rounded here) and
/// one weight row: the 16 lanes step by step, then reduce16. The vector paths' fallback for an
/// output whose lanes met a NaN (whose payload rules only this code states).
inline float dot_portable(const float * x, const char * w_row, WType wtype, int64_t n_in) {
    alignas(64) float acc[kLanes] = {};
    for (int64_t k = 0; k < padded_k(n_in); k += kStepK) {
        uint16_t ws[kStepK], xs[kStepK];
        weight_step_portable(ws, w_row, wtype, k, n_in);
        for (int64_t j = 0; j < kStepK; ++j) { xs[j] = k + j < n_in ? round_one(x[k + j]) : uint16_t{0}; }
        for (int l = 0; l < kLanes; ++l) { acc[l] = dp_lane(acc[l], xs[2 * l], xs[2 * l + 1], ws[2 * l], ws[2 * l + 1]); }
    }
    return reduce16(load16(acc));
}

}  // namespace
}  // namespace fd::kernels
