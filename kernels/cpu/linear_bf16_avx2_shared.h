// kernels/cpu/linear_bf16_avx2_shared.h — what the two files of the AVX2 + FMA bf16 path share
// (linear_bf16_avx2.cpp: one and two rows, the entry points; linear_bf16_avx2_many.cpp: three
// rows and more): the target attribute, the MXCSR bits, rounding f32 to bf16 on 8 / 16 lanes
// (round8: round_one's bits, bf16_portable.h) and a weight row at a time, the Problem a call's
// tiles read, and outputs_many. Included only by those two files. Internal to kernels/cpu.
#pragma once

#include "fd/kernels/ops.h"

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FD_HAVE_AVX2_TARGET 1
#define FD_AVX2_TARGET __attribute__((target("avx2,fma")))
#endif

namespace fd::kernels::detail {

#if defined(FD_HAVE_AVX2_TARGET)
namespace {

constexpr unsigned kDaz = 0x0040, kFtz = 0x8000;  ///< MXCSR bits

/// 8 f32 bit patterns from p (`left` valid, the rest zero).
FD_AVX2_TARGET inline __m256i load8(const float * p, int64_t left) {
    if (left >= 8) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)); }
    if (left <= 0) { return _mm256_setzero_si256(); }
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castps_si256(_mm256_maskload_ps(p, m));
}

/// round_one of 8 values, left as f32 bit patterns (the bf16 in the top 16 bits, low bits zero).
FD_AVX2_TARGET inline __m256i round8(__m256i u) {
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    const __m256i den = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i       r   = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), top);
    r = _mm256_blendv_epi8(r, _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), top), nan);
    return _mm256_blendv_epi8(r, _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))), den);
}

/// 16 values from p (`left` valid, the rest zero) rounded to bf16, in order.
FD_AVX2_TARGET inline __m256i round16(const float * p, int64_t left) {
    const __m256i a = round8(load8(p, left)), b = round8(load8(p + 8, left - 8));
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16));  // a0-3 b0-3 a4-7 b4-7
    return _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0));
}

/// One f32 weight row rounded to bf16, zero-padded to kp (a multiple of 32).
FD_AVX2_TARGET void round_row(uint16_t * dst, const float * src, int64_t n_in, int64_t kp) {
    for (int64_t k = 0; k < kp; k += 16) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + k), round16(src + k, n_in - k)); }
}

}  // namespace

struct Problem {
    float *       out;
    const float * xw;    ///< widened x [n_rows, ldxw]
    int64_t       ldxw;
    const float * x;     ///< x [n_rows, n_in] as given (the NaN fallback)
    const char *  w;
    WType         wtype;
    const float * bias;
    int64_t       n_rows, n_out, n_in;
};

/// Outputs [o0, o1) of every row, three rows and more (linear_bf16_avx2_many.cpp; instantiated
/// there for the tiles linear_bf16_avx2 uses: MR x NR = 5 x 2).
template <int MR, int NR>
void outputs_many(const Problem & p, int64_t o0, int64_t o1);

#endif  // FD_HAVE_AVX2_TARGET

}  // namespace fd::kernels::detail
