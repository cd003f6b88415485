// kernels/cpu/attention_avx2.h — the AVX2 + FMA pieces both AttnIsa::avx2 attention paths share
// (attention_decode_avx2.cpp: one decode query; attention_prefill_avx2.cpp: a prefill's tiles):
// exp16 and softmax_row on 8-lane registers, bitwise the generic code's results (attention_lanes.h).
// Included only where FD_ATTN_AVX2 (the compiler targets AVX2 and FMA). Internal to kernels/cpu.
#pragma once

#include "attention_lanes.h"

#if FD_ATTN_AVX2
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace fd::kernels {
namespace {

/// exp16 on 8 lanes: the same operations (the contractions GCC makes of exp16's expressions:
/// fma where a product feeds a sum, the clamp as max) in the same order, so bitwise exp16.
inline __m256 exp8(__m256 x) {
    const __m256 round = _mm256_set1_ps(12582912.0f);
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // x < -87 ? -87 : x
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), round), round);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);   // x - n * 0.693359375
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);           // r - n * -2.12194440e-4
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));  // p r r + r + 1
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/// softmax_row on 8-lane registers, bitwise its result: the max as 16 lane-wise maxima (v > m ?
/// v : m, maxps's rule) then lanes 0..15 in order and the tail; exp8 of s - max; the sum as 16
/// lane-wise chains (two registers: lanes 0-7, 8-15) then reduce16's pairing; times 0 + 1 / sum.
inline void softmax_row_avx2(float * s, int64_t n) {
    __m256  m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t t = 0;
    for (; t + kLanes <= n; t += kLanes) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(s + t), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(s + t + 8), m1);
    }
    alignas(32) float m[kLanes];
    _mm256_store_ps(m, m0);
    _mm256_store_ps(m + 8, m1);
    float mx = -INFINITY;
    for (int j = 0; j < kLanes; ++j) { mx = m[j] > mx ? m[j] : mx; }
    for (; t < n; ++t) { mx = s[t] > mx ? s[t] : mx; }
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256       s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t      t1 = 0;
    for (; t1 + kLanes <= n; t1 += kLanes) {
        const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t1), mxv));
        const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t1 + 8), mxv));
        _mm256_storeu_ps(s + t1, e0);
        _mm256_storeu_ps(s + t1 + 8, e1);
        s0 = _mm256_add_ps(s0, e0);
        s1 = _mm256_add_ps(s1, e1);
    }
    if (t1 < n) {  // lanes past n become 0
        const __m256 left = _mm256_set1_ps(static_cast<float>(n - t1));
        const __m256 i0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
        const __m256 z0 = _mm256_and_ps(_mm256_cmp_ps(i0, left, _CMP_LT_OQ), exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t1), mxv)));
        const __m256 z1 = _mm256_and_ps(_mm256_cmp_ps(i1, left, _CMP_LT_OQ), exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t1 + 8), mxv)));
        _mm256_storeu_ps(s + t1, z0);
        _mm256_storeu_ps(s + t1 + 8, z1);
        s0 = _mm256_add_ps(s0, z0);
        s1 = _mm256_add_ps(s1, z1);
    }
    // reduce16: lanes i + (i + 8), then i + (i + 4), then (0 + 2) + (1 + 3).
    const __m128 s8 = _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(s0, s1)), _mm256_extractf128_ps(_mm256_add_ps(s0, s1), 1));
    alignas(16) float s4[4];
    _mm_store_ps(s4, s8);
    const float  sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    const __m256 inv = _mm256_set1_ps(0.0f + 1.0f / sum);
    for (int64_t t2 = 0; t2 < n; t2 += kLanes) {
        _mm256_storeu_ps(s + t2, _mm256_mul_ps(_mm256_loadu_ps(s + t2), inv));
        _mm256_storeu_ps(s + t2 + 8, _mm256_mul_ps(_mm256_loadu_ps(s + t2 + 8), inv));
    }
}

}  // namespace
}  // namespace fd::kernels
#endif
