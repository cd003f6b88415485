// Batch-invariant linear layer over weights in the checkpoint's own layout (see ops.h).
//
// The weight stays [n_out, n_in] in its stored dtype (f32 or bf16), exactly as the checkpoint
// holds it, so loading or updating weights is a plain copy. Each output element is a dot
// product computed the same way everywhere: 16 lane-wise partial sums, each lane accumulating
// its own k's in ascending order with one fused multiply-add each (the last, partial block
// zero-padded), then one fixed pairwise reduction of the 16 lanes, then the bias.
//   f32 weights:  lane l takes k = l, l + 16, l + 32, ...
//   bf16 weights: 32 k's per step, widened by interleaving with zeros (one unpack per 16
//                 weights); lane l of the "lo" vector takes k = 8*(l/4) + l%4 of each block of
//                 32, of the "hi" vector k = 8*(l/4) + 4 + l%4, lo first. x is permuted into the
//                 same order once per call, so the weights need no further shuffling.
// Tiles only decide how many rows and outputs share a load, never the arithmetic, so a row's
// result is bitwise the same for any batch size, batch position, tiling or thread count.
#include "fd/kernels/ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace fd::kernels {
namespace {

typedef float    f32x16 __attribute__((vector_size(64)));
typedef float    f32x8  __attribute__((vector_size(32)));
typedef float    f32x4  __attribute__((vector_size(16)));

constexpr int kLanes = 16;

inline f32x16 load16(const float * p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

/// Fixed pairwise reduction: halves, then quarters, ... (the same for every output).
inline float reduce16(f32x16 v) {
    f32x8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char *>(&v) + sizeof lo, sizeof hi);
    const f32x8 s8 = lo + hi;
    f32x4 l4, h4;
    std::memcpy(&l4, &s8, sizeof l4);
    std::memcpy(&h4, reinterpret_cast<const char *>(&s8) + sizeof l4, sizeof h4);
    const f32x4 s4 = l4 + h4;
    const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
    return s2a + s2b;
}

/// Position (within a block of 32) of the k that bf16 step lane `m` (0..31: lo 0..15, hi 16..31) holds.
constexpr int bf16_lane_k(int m) { return 8 * ((m % 16) / 4) + (m >= 16 ? 4 : 0) + m % 4; }

/// Weights k..k+31 of a bf16 row as f32, in bf16_lane_k order: one load, two unpacks.
inline void load_bf16_step(const uint16_t * p, f32x16 & lo, f32x16 & hi) {
#if defined(__AVX512BW__)
    const __m512i v = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
    const __m512i l = _mm512_unpacklo_epi16(z, v), h = _mm512_unpackhi_epi16(z, v);
    std::memcpy(&lo, &l, sizeof lo);
    std::memcpy(&hi, &h, sizeof hi);
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

/// out[r, c] for MR rows of x (row stride ldx) and NR weight rows. Rows past n_rows / outputs
/// past n_cols repeat the last valid one (results not stored), so one instantiation covers
/// every edge. kPrefetch: one streaming row, keep ~512 bytes of each weight row in flight.
template <WType T, int MR, int NR, bool kPrefetch>
void tile(float * out, int64_t ldo, const float * x, int64_t ldx, int64_t n_in, int n_rows, const char * w,
          int n_cols, const float * bias) {
    using S = Step<T>;
    const size_t row_bytes = static_cast<size_t>(n_in) * S::kElemBytes;
    const float * xr[MR];
    const char *  wr[NR];
    for (int r = 0; r < MR; ++r) { xr[r] = x + std::min(r, n_rows - 1) * ldx; }
    for (int c = 0; c < NR; ++c) { wr[c] = w + std::min(c, n_cols - 1) * row_bytes; }
    f32x16 acc[MR][NR];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NR; ++c) { acc[r][c] = f32x16{}; }
    }
    auto step = [&](int64_t k, int n) {
        f32x16 wv[NR][S::V];
        for (int c = 0; c < NR; ++c) {
            if (kPrefetch) { __builtin_prefetch(wr[c] + k * S::kElemBytes + 512, 0, 3); }
            load_w<T>(wr[c], k, n, wv[c]);
        }
        for (int r = 0; r < MR; ++r) {
            f32x16 xv[S::V];
            load_x<T>(xr[r], k, n, xv);
            for (int v = 0; v < S::V; ++v) {
                for (int c = 0; c < NR; ++c) { acc[r][c] += xv[v] * wv[c][v]; }
            }
        }
    };
    int64_t k = 0;
    for (; k + S::K <= n_in; k += S::K) { step(k, S::K); }
    if (k < n_in) { step(k, static_cast<int>(n_in - k)); }
    for (int r = 0; r < std::min(MR, n_rows); ++r) {
        for (int c = 0; c < std::min(NR, n_cols); ++c) {
            float v = reduce16(acc[r][c]);
            if (bias) { v += bias[c]; }
            out[r * ldo + c] = v;
        }
    }
}

/// All rows x outputs [o0, o1) (x row stride ldx): one row streams weights in 8-row strips;
/// batches use 4-row tiles (4 x 6 outputs for f32; 4 x 4 for bf16, whose steps need twice the
/// registers), the x rows staying in L1 while the task's weight strips stream past them.
template <WType T>
void block(float * out, const float * x, int64_t ldx, const char * w, const float * bias, int64_t n_rows,
           int64_t n_out, int64_t n_in, int64_t o0, int64_t o1) {
    const size_t row_bytes = static_cast<size_t>(n_in) * Step<T>::kElemBytes;
    if (n_rows == 1) {
        constexpr int NR = 8;
        for (int64_t o = o0; o < o1; o += NR) {
            tile<T, 1, NR, true>(out + o, n_out, x, ldx, n_in, 1, w + o * row_bytes,
                                 static_cast<int>(std::min<int64_t>(NR, o1 - o)), bias ? bias + o : nullptr);
        }
        return;
    }
    constexpr int MR = 4, NR = T == WType::f32 ? 6 : 4;
    for (int64_t r = 0; r < n_rows; r += MR) {
        const int nr = static_cast<int>(std::min<int64_t>(MR, n_rows - r));
        for (int64_t o = o0; o < o1; o += NR) {
            tile<T, MR, NR, false>(out + r * n_out + o, n_out, x + r * ldx, ldx, n_in, nr, w + o * row_bytes,
                                   static_cast<int>(std::min<int64_t>(NR, o1 - o)), bias ? bias + o : nullptr);
        }
    }
}

/// x [n_rows, n_in] → [n_rows, ceil(n_in / 32) * 32] in bf16_lane_k order, zero-padded.
void permute_for_bf16(std::vector<float> & xp, const float * x, int64_t n_rows, int64_t n_in) {
    const int64_t n_blocks = (n_in + 31) / 32, ld = n_blocks * 32;
    xp.assign(static_cast<size_t>(n_rows * ld), 0.0f);
    for (int64_t t = 0; t < n_rows; ++t) {
        for (int64_t b = 0; b < n_blocks; ++b) {
            float * dst = &xp[t * ld + b * 32];
            for (int m = 0; m < 32; ++m) {
                const int64_t k = b * 32 + bf16_lane_k(m);
                dst[m] = k < n_in ? x[t * n_in + k] : 0.0f;
            }
        }
    }
}

}  // namespace

void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, ThreadPool * pool) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    // Tasks of whole strips (24 = every strip width) holding ~32 KiB of weights per batch row
    // (at most 4), at least 24 rows: enough work to wake a thread for.
    const int64_t row_bytes = n_in * static_cast<int64_t>(wtype == WType::f32 ? 4 : 2);
    const int64_t per_task  = std::max<int64_t>(24, ((32 << 10) * 4 / std::max<int64_t>(1, row_bytes * std::min<int64_t>(n_rows, 4))) / 24 * 24);
    const int64_t n_tasks   = (n_out + per_task - 1) / per_task;
    const char *  wb        = static_cast<const char *>(w);
    thread_local std::vector<float> xp;  // the caller's thread only: tasks read it
    const float * xs  = x;
    int64_t       ldx = n_in;
    if (wtype == WType::bf16) {
        permute_for_bf16(xp, x, n_rows, n_in);
        xs  = xp.data();
        ldx = (n_in + 31) / 32 * 32;
    }
    auto run = [&](int64_t t) {
        const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
        if (wtype == WType::f32) {
            block<WType::f32>(out, xs, ldx, wb, bias, n_rows, n_out, n_in, o0, o1);
        } else {
            block<WType::bf16>(out, xs, ldx, wb, bias, n_rows, n_out, n_in, o0, o1);
        }
    };
    if (pool && n_tasks > 1) {
        pool->parallel_for(n_tasks, run);
    } else {
        for (int64_t t = 0; t < n_tasks; ++t) { run(t); }
    }
}

}  // namespace fd::kernels
