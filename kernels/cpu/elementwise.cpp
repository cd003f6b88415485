// Row-wise and elementwise ops (see ops.h): rms_norm, silu_mul, add_inplace, rope, log_softmax.
#include "fd/kernels/ops.h"
#include "fd/half.h"
#include "expf_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace fd::kernels {

void rms_norm(float * out, const float * x, const float * weight, int64_t n_rows, int64_t n_embd,
              float eps) {
    for (int64_t t = 0; t < n_rows; ++t) {
        const float * xr = x + t * n_embd;
        float *       o  = out + t * n_embd;
        float         ss = 0.0f;
        for (int64_t i = 0; i < n_embd; ++i) { ss += xr[i] * xr[i]; }
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n_embd) + eps);
        for (int64_t i = 0; i < n_embd; ++i) { o[i] = weight[i] * (inv * xr[i]); }
    }
}

int detail::silu_exp_path() {
#if defined(__AVX2__) && defined(__FMA__)
    return exp_avx2_matches_libm() ? 2 : 1;
#else
    return 0;
#endif
}

void silu_mul(float * out, const float * gate, const float * up, int64_t n_elems) {
    // g / (1 + exp(-g)) * up per element. The exp calls first, a chunk at a time, then the
    // divisions and products in a loop the compiler vectorizes: each is one IEEE operation per
    // element, so the bits are the one-loop form's (the calls kept it scalar, division included).
    // With AVX2 + FMA, exp runs 8 lanes at a time (16 with AVX-512) with std::exp's bits
    // (expf_avx2.h: glibc's algorithm, checked against this libm once per process; lanes off its
    // main path, and any libm it disagrees with, take std::exp).
    constexpr int64_t kChunk = 256;
    alignas(64) float e[kChunk];
#if defined(__AVX2__) && defined(__FMA__)
    const bool vec = exp_avx2_matches_libm();
#endif
    for (int64_t i0 = 0; i0 < n_elems; i0 += kChunk) {
        const int64_t n = std::min(kChunk, n_elems - i0);
        int64_t       i = 0;
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
        for (; vec && i + 16 <= n; i += 16) {
            const __m512 ng = _mm512_castsi512_ps(
                _mm512_xor_si512(_mm512_castps_si512(_mm512_loadu_ps(gate + i0 + i)), _mm512_set1_epi32(INT32_MIN)));
            if (!exp16_avx512(e + i, ng)) {
                for (int64_t j = i; j < i + 16; ++j) { e[j] = std::exp(-gate[i0 + j]); }
            }
        }
#endif
        for (; vec && i + 8 <= n; i += 8) {
            const __m256 ng = _mm256_xor_ps(_mm256_loadu_ps(gate + i0 + i), _mm256_set1_ps(-0.0f));  // -g, exactly
            if (!exp8_avx2(e + i, ng)) {
                for (int64_t j = i; j < i + 8; ++j) { e[j] = std::exp(-gate[i0 + j]); }
            }
        }
#endif
        for (; i < n; ++i) { e[i] = std::exp(-gate[i0 + i]); }
        for (int64_t i = 0; i < n; ++i) { out[i0 + i] = gate[i0 + i] / (1.0f + e[i]) * up[i0 + i]; }
    }
}

void add_inplace(float * out, const float * x, int64_t n_elems) {
    for (int64_t i = 0; i < n_elems; ++i) { out[i] += x[i]; }
}

void rope_table(float * cos_sin, int64_t n_pos, int64_t head_dim, float theta) {
    std::vector<float> inv(static_cast<size_t>(head_dim / 2));
    for (int64_t j = 0; j < head_dim / 2; ++j) {
        inv[static_cast<size_t>(j)] = 1.0f / std::pow(theta, static_cast<float>(2 * j) / static_cast<float>(head_dim));
    }
    rope_table_inv_freq(cos_sin, n_pos, head_dim, inv.data());
}

void rope_table_inv_freq(float * cos_sin, int64_t n_pos, int64_t head_dim, const float * inv_freq) {
    const int64_t half = head_dim / 2;
    for (int64_t pos = 0; pos < n_pos; ++pos) {
        for (int64_t j = 0; j < half; ++j) {
            const float angle = static_cast<float>(pos) * inv_freq[j];
            cos_sin[pos * head_dim + j]        = std::cos(angle);
            cos_sin[pos * head_dim + half + j] = std::sin(angle);
        }
    }
}

void rope_rotate_half(float * x, const int32_t * positions, const float * cos_sin,
                      int64_t n_tokens, int64_t n_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float * cs = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
        for (int64_t h = 0; h < n_heads; ++h) {
            float * v = x + (t * n_heads + h) * head_dim;
            for (int64_t j = 0; j < half; ++j) {
                const float x1 = v[j], x2 = v[j + half];
                const float c = cs[j], s = cs[half + j];
                v[j]        = x1 * c - x2 * s;
                v[j + half] = x2 * c + x1 * s;
            }
        }
    }
}

void log_softmax(float * out, const float * x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; ++i) { mx = x[i] > mx ? x[i] : mx; }
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) { sum += std::exp(static_cast<double>(x[i] - mx)); }
    const float lse = static_cast<float>(std::log(sum));
    for (int64_t i = 0; i < n; ++i) { out[i] = x[i] - mx - lse; }
}

int64_t argmax(const float * x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
        if (x[i] > x[best]) { best = i; }
    }
    return best;
}

// One definition of the widening (fd/half.h, shared with the checkpoint code fdctl links).
void bf16_to_f32(float * out, const uint16_t * in, int64_t n) {
    for (int64_t i = 0; i < n; ++i) { out[i] = bf16_to_float(in[i]); }
}

void f16_to_f32(float * out, const uint16_t * in, int64_t n) {
    for (int64_t i = 0; i < n; ++i) { out[i] = f16_to_float(in[i]); }
}

namespace {

/// find_nonfinite over `n` words of type W whose exponent field is `exp_mask` (all ones = non-finite).
template <typename W>
int64_t find_nonfinite_bits(const W * x, int64_t n, W exp_mask) {
    constexpr int64_t kBlock = 1024;
    for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t e = std::min(n, b + kBlock);
        W any = 0;  // vectorizes: compare, mask, OR
        for (int64_t i = b; i < e; ++i) { any |= static_cast<W>((x[i] & exp_mask) == exp_mask); }
        if (!any) { continue; }
        for (int64_t i = b; i < e; ++i) {
            if ((x[i] & exp_mask) == exp_mask) { return i; }
        }
    }
    return -1;
}

}  // namespace

int64_t find_nonfinite_f32(const float * x, int64_t n) {
    return find_nonfinite_bits(reinterpret_cast<const uint32_t *>(x), n, uint32_t{0x7f800000u});
}

int64_t find_nonfinite_bf16(const uint16_t * x, int64_t n) { return find_nonfinite_bits(x, n, uint16_t{0x7f80u}); }

int64_t find_nonfinite_f16(const uint16_t * x, int64_t n) { return find_nonfinite_bits(x, n, uint16_t{0x7c00u}); }

}  // namespace fd::kernels
