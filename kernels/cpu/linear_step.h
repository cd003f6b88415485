// kernels/cpu/linear_step.h — what one k step of linear's dot products consumes, shared by its
// row-streaming path (matmul.cpp) and its packed many-row path (linear_packed.cpp). Internal to
// kernels/cpu. The lane order defined here is linear's arithmetic (see matmul.cpp's header):
// every path widens and permutes through these functions, so every path runs the same FMAs.
#pragma once

#include "fd/kernels/ops.h"
#include "fd/kernels/thread_pool.h"
#include "lanes.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// AVX2 + FMA without AVX-512 (16 ymm registers): linear's kernels keep each f32x16 lane vector as
// two __m256 halves (lanes 0-7, 8-15) and use smaller tiles; the lanes' arithmetic is unchanged.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define FD_LINEAR_AVX2 1
#endif

namespace fd::kernels {
namespace {

/// Position (within a block of 32) of the k that bf16 step lane `m` (0..31: lo 0..15, hi 16..31) holds.
constexpr int bf16_lane_k(int m) { return 8 * ((m % 16) / 4) + (m >= 16 ? 4 : 0) + m % 4; }

/// Weights k..k+31 of a bf16 row as f32, in bf16_lane_k order: one load, two unpacks.
inline void load_bf16_step(const uint16_t * p, f32x16 & lo, f32x16 & hi) {
#if defined(__AVX512BW__)
    const __m512i v = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
    const __m512i l = _mm512_unpacklo_epi16(z, v), h = _mm512_unpackhi_epi16(z, v);
    std::memcpy(&lo, &l, sizeof lo);
    std::memcpy(&hi, &h, sizeof hi);
#elif defined(FD_LINEAR_AVX2)
    // The 512-bit unpacks work per 128-bit group: lanes 0-7 come from k 0..15, lanes 8-15 from 16..31.
    const __m256i z = _mm256_setzero_si256();
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 16));
    const __m256i l[2] = {_mm256_unpacklo_epi16(z, v0), _mm256_unpacklo_epi16(z, v1)};
    const __m256i h[2] = {_mm256_unpackhi_epi16(z, v0), _mm256_unpackhi_epi16(z, v1)};
    std::memcpy(&lo, l, sizeof lo);
    std::memcpy(&hi, h, sizeof hi);
#else
    alignas(64) uint32_t l[kLanes], h[kLanes];
    for (int m = 0; m < kLanes; ++m) {
        l[m] = uint32_t(p[bf16_lane_k(m)]) << 16;
        h[m] = uint32_t(p[bf16_lane_k(m + 16)]) << 16;
    }
    std::memcpy(&lo, l, sizeof lo);
    std::memcpy(&hi, h, sizeof hi);
#endif
}

/// What one step of the k loop consumes: f32 16 k's (one vector), bf16 32 k's (two vectors).
template <WType T> struct Step;
template <> struct Step<WType::f32>  { static constexpr int K = 16, V = 1, kElemBytes = 4; };
template <> struct Step<WType::bf16> { static constexpr int K = 32, V = 2, kElemBytes = 2; };

/// Weights of one step from element k of a row (`n` < Step::K valid: zero-padded tail).
template <WType T>
inline void load_w(const char * row, int64_t k, int n, f32x16 (&w)[Step<T>::V]) {
    constexpr int K = Step<T>::K;
    if constexpr (T == WType::f32) {
        const float * p = reinterpret_cast<const float *>(row) + k;
        if (n == K) {
            w[0] = load16(p);
        } else {
            alignas(64) float buf[K] = {};
            std::memcpy(buf, p, sizeof(float) * n);
            w[0] = load16(buf);
        }
    } else {
        const uint16_t * p = reinterpret_cast<const uint16_t *>(row) + k;
        if (n == K) {
            load_bf16_step(p, w[0], w[1]);
        } else {
            alignas(64) uint16_t buf[K] = {};
            std::memcpy(buf, p, sizeof(uint16_t) * n);
            load_bf16_step(buf, w[0], w[1]);
        }
    }
}

/// x of one step. f32: x itself (`n` < 16: zero-padded tail); bf16: the permuted, zero-padded
/// copy (always whole steps).
template <WType T>
inline void load_x(const float * row, int64_t k, int n, f32x16 (&x)[Step<T>::V]) {
    if constexpr (T == WType::f32) {
        if (n == kLanes) {
            x[0] = load16(row + k);
        } else {
            alignas(64) float buf[kLanes] = {};
            std::memcpy(buf, row + k, sizeof(float) * n);
            x[0] = load16(buf);
        }
    } else {
        x[0] = load16(row + k);
        x[1] = load16(row + k + kLanes);
    }
}

/// x's side of one bf16 step: the 32 k's at `src` (`left` = k's left in the row from there; past
/// it zero) → lo [16] and hi [16] in bf16_lane_k order, so x meets each widened weight lane.
/// As eight groups of 4 k's, lo is groups 0, 2, 4, 6 and hi groups 1, 3, 5, 7: one 128-bit
/// shuffle each, and plain loads unless this is the row's tail (masked loads and two-source
/// permutes made the many-row pack 4x slower: 1.4 vs 0.35 ms at 2048 x 768).
inline void permute_bf16_step(const float * src, int64_t left, float * lo, float * hi) {
#if defined(__AVX512F__)
    __m512 a, b;
    if (left >= 32) {
        a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
    } else {
        const __mmask16 m0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
        const __mmask16 m1 = left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
        a = _mm512_maskz_loadu_ps(m0, src), b = _mm512_maskz_loadu_ps(m1, src + 16);
    }
    _mm512_storeu_ps(lo, _mm512_maskz_shuffle_f32x4(__mmask16(0xFFFF), a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_ps(hi, _mm512_maskz_shuffle_f32x4(__mmask16(0xFFFF), a, b, _MM_SHUFFLE(3, 1, 3, 1)));
#else
#if defined(FD_LINEAR_AVX2)
    if (left >= 32) {  // groups of 4 k's: lo takes the low 128 bits of each 8, hi the high
        const __m256 a = _mm256_loadu_ps(src), b = _mm256_loadu_ps(src + 8);
        const __m256 c = _mm256_loadu_ps(src + 16), d = _mm256_loadu_ps(src + 24);
        _mm256_storeu_ps(lo, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(lo + 8, _mm256_permute2f128_ps(c, d, 0x20));
        _mm256_storeu_ps(hi, _mm256_permute2f128_ps(a, b, 0x31));
        _mm256_storeu_ps(hi + 8, _mm256_permute2f128_ps(c, d, 0x31));
        return;
    }
#endif
    for (int l = 0; l < kLanes; ++l) {
        const int k = bf16_lane_k(l), kh = bf16_lane_k(kLanes + l);
        lo[l] = k < left ? src[k] : 0.0f;
        hi[l] = kh < left ? src[kh] : 0.0f;
    }
#endif
}

/// Outputs per task of a one-row (decode) linear over n_out weight rows of row_bytes each, on
/// n_threads threads: whole 24-output groups (at least 24). `streams` false: ~128 KiB of weights
/// per task on one thread (tiles of adjacent rows, the next tile prefetched: that prefetch runs on
/// into the next task, the adjacent one). `streams` true (the AVX2 one-row paths, whose tiles read
/// each column's part of the task as one sequential stream, so a longer task is a longer stream):
/// one task on one thread. On more than one thread, either way: 4 tasks per thread of at least
/// ~128 KiB each (some load balance between threads that other programs slow down) — with 128 KiB
/// tasks claimed in turn the next task is another thread's, and each thread's stream broke every
/// 128 KiB (BF16 B=1 decode at 2 threads: 0.75–0.87 → 0.90–0.98 of the two-thread read probe,
/// docs/benchmarks.md "Stop 48").
inline int64_t decode_task_outputs(int64_t n_out, int64_t row_bytes, int64_t n_threads, bool streams) {
    const int64_t base = std::max<int64_t>(24, ((128 << 10) / std::max<int64_t>(1, row_bytes)) / 24 * 24);
    if (n_threads <= 1) { return streams ? std::max<int64_t>(1, n_out) : base; }
    const int64_t per = (n_out + 4 * n_threads - 1) / (4 * n_threads);
    return std::max(base, (per + 23) / 24 * 24);
}

/// run(t) for t in [0, n_tasks): over `pool` when there is one and more than one task, else on
/// the caller.
inline void for_tasks(ThreadPool * pool, int64_t n_tasks, const std::function<void(int64_t)> & run) {
    if (pool && n_tasks > 1) {
        pool->parallel_for(n_tasks, run);
    } else {
        for (int64_t t = 0; t < n_tasks; ++t) { run(t); }
    }
}

}  // namespace
}  // namespace fd::kernels
