// Paged attention's prefill tiles on AVX2 + FMA (AttnIsa::avx2; attention.cpp's attend_tile calls
// these for its scores and its P·V where the build targets AVX2 without AVX-512BW). Bitwise the
// generic code's results (attention.cpp's score_pairs / pv_pairs): each score one FMA chain over
// d ascending from 0, then times scale; each output element one FMA chain over t ascending,
// accumulators loaded and stored back exactly between chunks. Only the grouping of independent
// chains differs: the generic code's 16-lane vectors are two ymm registers here, so its tiles
// (8 pairs × 32 keys, 8 pairs × 32 dimensions: 32 ymm of accumulators) spill; these keep
// 12 ymm of accumulators, the operands they share and one broadcast in the 16 registers:
// - scores: 6 (query, head) pairs × 16 keys (two ymm each) per pass over d, the 16 keys' dimension
//   d one load (f32) or one zero-extension and shift (bf16: exact, in the keys' order);
// - P·V: 6 pairs × 16 dimensions (two ymm each) per pass over the chunk's rows.
#include "attention_avx2.h"
#include "scratch.h"

#if FD_ATTN_AVX2
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace fd::kernels {
namespace {

constexpr int kPairs = 6;  // (query, head) pairs per register tile

/// 8 consecutive pool values widened exactly to f32, in order.
inline __m256 load8(const float * p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16 * p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/// s[m][l] = (FMA chain over d ascending of q[m][d] * key(l)[d], from 0) * scale for M pairs and
/// the 16 keys l whose dimension d is at k + d * ld. Not inlined: its loop keeps the pointers and
/// the 2M accumulators in registers.
template <int M, typename T>
__attribute__((noinline)) void score16(float * const * s, const float * const * q, const T * k, int64_t ld, int64_t hd,
                                       float scale) {
    __m256        a[M][2];
    const float * qp[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
        a[m][0] = a[m][1] = _mm256_setzero_ps();
        qp[m] = q[m];
    }
    for (int64_t d = 0; d < hd; ++d, k += ld) {
        const __m256 k0 = load8(k), k1 = load8(k + 8);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const __m256 qd = _mm256_broadcast_ss(qp[m] + d);
            a[m][0] = _mm256_fmadd_ps(qd, k0, a[m][0]);
            a[m][1] = _mm256_fmadd_ps(qd, k1, a[m][1]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
        _mm256_storeu_ps(s[m], _mm256_mul_ps(a[m][0], sc));
        _mm256_storeu_ps(s[m] + 8, _mm256_mul_ps(a[m][1], sc));
    }
}

template <typename T>
void score16_n(int m, float * const * s, const float * const * q, const T * k, int64_t ld, int64_t hd, float scale) {
    switch (m) {
        case 6: score16<6>(s, q, k, ld, hd, scale); break;
        case 5: score16<5>(s, q, k, ld, hd, scale); break;
        case 4: score16<4>(s, q, k, ld, hd, scale); break;
        case 3: score16<3>(s, q, k, ld, hd, scale); break;
        case 2: score16<2>(s, q, k, ld, hd, scale); break;
        default: score16<1>(s, q, k, ld, hd, scale); break;
    }
}

/// o[m][d0 + i] += p[m][j] * V[j][d0 + i] for j < nt[m] ascending (one FMA per element and j),
/// i < 8 ND, M pairs sharing every V load; V row j at vr[j]. Not inlined (as score16).
template <int M, int ND, typename T>
__attribute__((noinline)) void pv_tile(float * const * o, const float * const * p, const int64_t * nt,
                                       const T * const * vr, int64_t d0) {
    __m256        a[M][ND];
    const float * pp[M];
    int64_t       j_all = nt[0];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
        pp[m] = p[m];
        j_all = std::min(j_all, nt[m]);
#pragma GCC unroll 2
        for (int e = 0; e < ND; ++e) { a[m][e] = _mm256_loadu_ps(o[m] + d0 + 8 * e); }
    }
    for (int64_t j = 0; j < j_all; ++j) {
        const T * v = vr[j] + d0;
        __m256    x[ND];
#pragma GCC unroll 2
        for (int e = 0; e < ND; ++e) { x[e] = load8(v + 8 * e); }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const __m256 pj = _mm256_broadcast_ss(pp[m] + j);
#pragma GCC unroll 2
            for (int e = 0; e < ND; ++e) { a[m][e] = _mm256_fmadd_ps(pj, x[e], a[m][e]); }
        }
    }
    // Pairs whose context ends inside the chunk past j_all: their own rows, still in order.
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
        for (int64_t j = j_all; j < nt[m]; ++j) {
            const __m256 pj = _mm256_broadcast_ss(pp[m] + j);
#pragma GCC unroll 2
            for (int e = 0; e < ND; ++e) { a[m][e] = _mm256_fmadd_ps(pj, load8(vr[j] + d0 + 8 * e), a[m][e]); }
        }
#pragma GCC unroll 2
        for (int e = 0; e < ND; ++e) { _mm256_storeu_ps(o[m] + d0 + 8 * e, a[m][e]); }
    }
}

template <int ND, typename T>
void pv_tile_n(int m, float * const * o, const float * const * p, const int64_t * nt, const T * const * vr,
               int64_t d0) {
    switch (m) {
        case 6: pv_tile<6, ND>(o, p, nt, vr, d0); break;
        case 5: pv_tile<5, ND>(o, p, nt, vr, d0); break;
        case 4: pv_tile<4, ND>(o, p, nt, vr, d0); break;
        case 3: pv_tile<3, ND>(o, p, nt, vr, d0); break;
        case 2: pv_tile<2, ND>(o, p, nt, vr, d0); break;
        default: pv_tile<1, ND>(o, p, nt, vr, d0); break;
    }
}

}  // namespace

template <typename T>
void score_pairs_avx2(float * const * s, const float * const * qh, int n, const T * k0, const T * k1, int64_t ld,
                      int64_t hd, float scale) {
    thread_local detail::ScratchVec<float *> s1;  // the pairs' scores of keys 16..31
    if (s1.size() < static_cast<size_t>(n)) { s1.resize(static_cast<size_t>(n)); }
    for (int i = 0; i < n; ++i) { s1[i] = s[i] + kLanes; }
    for (int i = 0; i < n; i += kPairs) {
        const int m = std::min(kPairs, n - i);
        score16_n(m, s + i, qh + i, k0, ld, hd, scale);
        score16_n(m, s1.data() + i, qh + i, k1, ld, hd, scale);
    }
}

template <typename T>
void pv_pairs_avx2(float * const * o, const float * const * p, const int64_t * nt, int n, const T * const * vr,
                   int64_t hd) {
    for (int i = 0; i < n; i += kPairs) {
        const int m = std::min(kPairs, n - i);
        int64_t   d = 0;
        for (; d + 16 <= hd; d += 16) { pv_tile_n<2>(m, o + i, p + i, nt + i, vr, d); }
        if (d + 8 <= hd) {
            pv_tile_n<1>(m, o + i, p + i, nt + i, vr, d);
            d += 8;
        }
        for (int mm = i; mm < i + m && d < hd; ++mm) {  // head_dim % 8 dimensions: scalar chains
            for (int64_t j = 0; j < nt[mm]; ++j) {
                for (int64_t e = d; e < hd; ++e) { o[mm][e] = __builtin_fmaf(p[mm][j], to_f32(vr[j][e]), o[mm][e]); }
            }
        }
    }
}

template void score_pairs_avx2<float>(float * const *, const float * const *, int, const float *, const float *,
                                      int64_t, int64_t, float);
template void score_pairs_avx2<Bf16>(float * const *, const float * const *, int, const Bf16 *, const Bf16 *, int64_t,
                                     int64_t, float);
template void pv_pairs_avx2<float>(float * const *, const float * const *, const int64_t *, int, const float * const *,
                                   int64_t);
template void pv_pairs_avx2<Bf16>(float * const *, const float * const *, const int64_t *, int, const Bf16 * const *,
                                  int64_t);

}  // namespace fd::kernels
#endif
