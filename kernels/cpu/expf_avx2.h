// kernels/cpu/expf_avx2.h — std::exp(float) 8 lanes at a time with AVX2 + FMA (16 with
// AVX-512: exp16_avx512), giving glibc's bits: the algorithm of glibc's expf
// (sysdeps/ieee754/flt-32/e_expf.c, from ARM's optimized-routines: x / ln2 * 32 = k + r, 2^(k/32)
// from a 32-entry table, a cubic in r, all in double) as its FMA build __expf_fma runs it (glibc
// 2.36: the multiarch variant picked on CPUs with FMA; its contractions read off its disassembly),
// with the table and coefficients of __exp2f_data. Lanes outside the main path (|x| >= 88:
// overflow, underflow, inf, NaN) are reported so the caller uses std::exp for them. Because
// another libm could round differently, exp_avx2_matches_libm() compares against std::exp once
// per process and the caller uses this code only where it agrees. Internal to kernels/cpu
// (elementwise.cpp's silu_mul).
#pragma once

namespace fd::kernels::detail {
/// silu_mul's exp (elementwise.cpp): 0 = std::exp (the kernels are built without AVX2 + FMA),
/// 1 = std::exp (this code disagreed with the libm's exp), 2 = this code (it agreed).
int silu_exp_path();
}  // namespace fd::kernels::detail

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fd::kernels {
namespace {

/// __exp2f_data.tab: 2^(i/32) as double bits, minus i << 47 (the exponent added back from k).
alignas(64) constexpr uint64_t kExp2fTab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b, 0x3fef54873168b9aa,
    0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74,
    0x3feea11473eb0187, 0x3feea589994cce13, 0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
constexpr uint64_t kExpInvLn2N = 0x40471547652b82fe;  ///< 32 / ln 2
constexpr uint64_t kExpShift   = 0x4338000000000000;  ///< 0x1.8p52: round to integer by adding
constexpr uint64_t kExpC0 = 0x3ebc6af84b912394, kExpC1 = 0x3f2ebfce50fac4f3, kExpC2 = 0x3f962e42ff0c52d6;

inline __m256d exp_const(uint64_t bits) { return _mm256_castsi256_pd(_mm256_set1_epi64x(static_cast<long long>(bits))); }

/// exp of 4 floats (as doubles xd) on the main path, rounded to float.
inline __m128 exp4_main(__m256d xd) {
    const __m256d inv = exp_const(kExpInvLn2N), shift = exp_const(kExpShift);
    __m256d       kd  = _mm256_fmadd_pd(inv, xd, shift);  // k in the low bits
    const __m256i ki  = _mm256_castpd_si256(kd);
    kd                = _mm256_sub_pd(kd, shift);
    const __m256d r   = _mm256_fmsub_pd(inv, xd, kd);  // x / ln2 * 32 - k
    const __m256i t   = _mm256_add_epi64(_mm256_i64gather_epi64(reinterpret_cast<const long long *>(kExp2fTab),
                                                                 _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8),
                                         _mm256_slli_epi64(ki, 47));
    const __m256d z   = _mm256_fmadd_pd(exp_const(kExpC0), r, exp_const(kExpC1));
    const __m256d r2  = _mm256_mul_pd(r, r);
    __m256d       y   = _mm256_fmadd_pd(r, exp_const(kExpC2), _mm256_set1_pd(1.0));
    y                 = _mm256_fmadd_pd(z, r2, y);
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(t)));
}

/// out[0..8) = exp(x[0..8)) where every lane is on the main path; false (out untouched) when a
/// lane is not (bits 20-30 of its f32 pattern above 0x42a: |x| >= 88, inf, NaN).
inline bool exp8_avx2(float * out, __m256 x) {
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7ff));
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))) != 0) { return false; }
    const __m128 lo = exp4_main(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    const __m128 hi = exp4_main(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    _mm256_storeu_ps(out, _mm256_set_m128(hi, lo));
    return true;
}

#if defined(__AVX512F__)
/// exp4_main on 8 doubles (AVX-512): the same operations in the same order, so the same bits. The
/// 32-entry table is read by two two-source permutes (entries 0-15 and 16-31) and a blend on bit
/// 4 of the index, not a gather. (The maskz forms with every lane selected: GCC 12 flags the
/// _mm512_undefined inside the plain ones, as lanes.h notes.)
inline __m512d exp_const8(uint64_t bits) { return _mm512_castsi512_pd(_mm512_set1_epi64(static_cast<long long>(bits))); }

inline __m256 exp8_main(__m512d xd) {
    const __m512d inv = exp_const8(kExpInvLn2N), shift = exp_const8(kExpShift);
    __m512d       kd  = _mm512_fmadd_pd(inv, xd, shift);
    const __m512i ki  = _mm512_castpd_si512(kd);
    kd                = _mm512_sub_pd(kd, shift);
    const __m512d r   = _mm512_fmsub_pd(inv, xd, kd);
    const __m512i t0 = _mm512_load_si512(kExp2fTab), t1 = _mm512_load_si512(kExp2fTab + 8);
    const __m512i t2 = _mm512_load_si512(kExp2fTab + 16), t3 = _mm512_load_si512(kExp2fTab + 24);
    const __m512i lo = _mm512_permutex2var_epi64(t0, ki, t1), hi = _mm512_permutex2var_epi64(t2, ki, t3);
    const __m512i tab = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), lo, hi);
    const __m512i t   = _mm512_add_epi64(tab, _mm512_maskz_slli_epi64(__mmask8(0xFF), ki, 47));
    const __m512d z   = _mm512_fmadd_pd(exp_const8(kExpC0), r, exp_const8(kExpC1));
    const __m512d r2  = _mm512_mul_pd(r, r);
    __m512d       y   = _mm512_fmadd_pd(r, exp_const8(kExpC2), _mm512_set1_pd(1.0));
    y                 = _mm512_fmadd_pd(z, r2, y);
    return _mm512_maskz_cvtpd_ps(__mmask8(0xFF), _mm512_mul_pd(y, _mm512_castsi512_pd(t)));
}

/// exp8_avx2 for 16 lanes: out[0..16) = exp(x[0..16)), or false (out untouched) when a lane is off
/// the main path.
inline bool exp16_avx512(float * out, __m512 x) {
    constexpr __mmask8  k8  = 0xFF;
    constexpr __mmask16 k16 = 0xFFFF;
    const __m512i top = _mm512_and_si512(_mm512_maskz_srli_epi32(k16, _mm512_castps_si512(x), 20), _mm512_set1_epi32(0x7ff));
    if (_mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(0x42a)) != 0) { return false; }
    const __m512d xd = _mm512_castps_pd(x);  // bits only: each 256-bit half is 8 floats, widened below
    _mm256_storeu_ps(out, exp8_main(_mm512_maskz_cvtps_pd(k8, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(k8, xd, 0)))));
    _mm256_storeu_ps(out + 8, exp8_main(_mm512_maskz_cvtps_pd(k8, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(k8, xd, 1)))));
    return true;
}
#endif

/// Whether exp8_avx2 (and, built with AVX-512, exp16_avx512) gives std::exp's bits on this libm:
/// checked once per process over every 4099th f32 bit pattern of the main path (about a million
/// values, both signs) and the edges.
inline bool exp_avx2_matches_libm() {
    static const bool ok = [] {
        alignas(64) float in[16], got[16];
        int               n = 0;
        auto              check = [&]() {
            float ref[16];
            for (int i = 0; i < 16; ++i) { ref[i] = std::exp(in[i]); }
            for (int h = 0; h < 2; ++h) {
                if (exp8_avx2(got, _mm256_loadu_ps(in + 8 * h)) && std::memcmp(ref + 8 * h, got, 8 * sizeof(float)) != 0) {
                    return false;
                }
            }
#if defined(__AVX512F__)
            if (exp16_avx512(got, _mm512_loadu_ps(in)) && std::memcmp(ref, got, sizeof ref) != 0) { return false; }
#endif
            return true;
        };
        for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
            const uint32_t b = static_cast<uint32_t>(u);
            if (((b >> 20) & 0x7ff) > 0x42a) { continue; }
            std::memcpy(&in[n++], &b, sizeof b);
            if (n == 16) {
                if (!check()) { return false; }
                n = 0;
            }
        }
        const float edges[16] = {0.0f, -0.0f, 0x1.62e42ep6f, -0x1.62e42ep6f, 0x1p-149f, -0x1p-149f, 1.0f, -1.0f,
                                 0x1.5p6f, -0x1.5p6f, 0.5f, -0.5f, 0x1p-126f, -0x1p-126f, 3.0f, -3.0f};
        std::memcpy(in, edges, sizeof in);
        return check();
    }();
    return ok;
}

}  // namespace
}  // namespace fd::kernels
#endif
