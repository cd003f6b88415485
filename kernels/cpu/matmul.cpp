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
#include "fd/kernels/cpu_ops.h"
#include "lanes.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
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

/// One MR x NR register tile over a chunk of k: MR rows of x and NR weight rows, both already
/// at the chunk's first k. Rows past n_rows / outputs past n_cols repeat the last valid one
/// (results not stored), so one instantiation covers every edge.
struct TileArgs {
    const float * x;       ///< x [n_rows, ldx] at the chunk's first k
    int64_t       ldx;     ///< floats
    const char *  w;       ///< weight rows [n_cols, ldw] at the chunk's first k
    int64_t       ldw;     ///< bytes
    int           n_rows;  ///< 1..MR
    int           n_cols;  ///< 1..NR
    int64_t       n_k;     ///< k's in the chunk (a multiple of the step unless `last`)
    bool          first;   ///< lanes start at zero (else from carry)
    bool          last;    ///< reduce, add the bias, store to out (else lanes to carry)
    f32x16 *      carry;   ///< [MR * NR] lanes between chunks (exact, so a split k loop runs
                           ///< the very same FMA chain as an unsplit one)
    float *       out;     ///< out [n_rows, ldo] at the tile's first output
    int64_t       ldo;
    const float * bias;    ///< [n_cols] or nullptr
};

#if defined(__AVX512BW__)
/// `n_steps` whole steps of a tile with AVX-512 intrinsics. The weights of a step are loaded
/// once into registers (left to itself the compiler folds each load into every row's FMA:
/// MR x NR loads per step instead of MR + NR). The same FMAs in the same order as the generic
/// step in tile(): acc = x * w + acc, one rounding each, rows' x vectors lo before hi.
/// kPrefetch: one streaming row, keep ~512 bytes of each weight row in flight.
template <WType T, int MR, int NR, bool kPrefetch>
__attribute__((noinline)) void whole_steps(f32x16 (&acc)[MR][NR], const float * const (&xr)[MR],
                                           const char * const (&wr)[NR], int64_t n_steps) {
    using S = Step<T>;
    __m512 a[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { std::memcpy(&a[r][c], &acc[r][c], sizeof(__m512)); }
    }
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t k = s * S::K;
        __m512        w[NR][S::V];
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
            if (kPrefetch) { __builtin_prefetch(wr[c] + k * S::kElemBytes + 512, 0, 3); }
            if constexpr (T == WType::f32) {
                w[c][0] = _mm512_loadu_ps(reinterpret_cast<const float *>(wr[c]) + k);
            } else {
                const __m512i v = _mm512_loadu_si512(reinterpret_cast<const uint16_t *>(wr[c]) + k);
                const __m512i z = _mm512_setzero_si512();
                w[c][0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
                w[c][1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
            }
#pragma GCC unroll 2
            for (int v = 0; v < S::V; ++v) { __asm__("" : "+v"(w[c][v])); }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
            for (int v = 0; v < S::V; ++v) {
                const __m512 xv = _mm512_loadu_ps(xr[r] + k + v * kLanes);
#pragma GCC unroll 8
                for (int c = 0; c < NR; ++c) { a[r][c] = _mm512_fmadd_ps(xv, w[c][v], a[r][c]); }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { std::memcpy(&acc[r][c], &a[r][c], sizeof(__m512)); }
    }
}
#endif

template <WType T, int MR, int NR, bool kPrefetch>
void tile(const TileArgs & t) {
    using S = Step<T>;
    const float * xr[MR];
    const char *  wr[NR];
    for (int r = 0; r < MR; ++r) { xr[r] = t.x + std::min(r, t.n_rows - 1) * t.ldx; }
    for (int c = 0; c < NR; ++c) { wr[c] = t.w + std::min(c, t.n_cols - 1) * t.ldw; }
    f32x16 acc[MR][NR];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NR; ++c) { acc[r][c] = t.first ? f32x16{} : t.carry[r * NR + c]; }
    }
    int64_t k = 0;
#if defined(__AVX512BW__)
    whole_steps<T, MR, NR, kPrefetch>(acc, xr, wr, t.n_k / S::K);
    k = t.n_k / S::K * S::K;
#endif
    auto step = [&](int64_t kk, int n) {
        f32x16 wv[NR][S::V];
        for (int c = 0; c < NR; ++c) {
            if (kPrefetch) { __builtin_prefetch(wr[c] + kk * S::kElemBytes + 512, 0, 3); }
            load_w<T>(wr[c], kk, n, wv[c]);
        }
        for (int r = 0; r < MR; ++r) {
            f32x16 xv[S::V];
            load_x<T>(xr[r], kk, n, xv);
            for (int v = 0; v < S::V; ++v) {
                for (int c = 0; c < NR; ++c) { acc[r][c] += xv[v] * wv[c][v]; }
            }
        }
    };
    for (; k + S::K <= t.n_k; k += S::K) { step(k, S::K); }
    if (k < t.n_k) { step(k, static_cast<int>(t.n_k - k)); }
    if (!t.last) {
        for (int r = 0; r < MR; ++r) {
            for (int c = 0; c < NR; ++c) { t.carry[r * NR + c] = acc[r][c]; }
        }
        return;
    }
    float sums[MR * NR];
    reduce_all(&acc[0][0], MR * NR, sums);
    for (int r = 0; r < std::min(MR, t.n_rows); ++r) {
        for (int c = 0; c < std::min(NR, t.n_cols); ++c) {
            float v = sums[r * NR + c];
            if (t.bias) { v += t.bias[c]; }
            t.out[r * t.ldo + c] = v;
        }
    }
}

/// Cache blocking of the many-row path. A task owns up to kSuperRows rows x kNc outputs (its
/// weights stay in L2) and runs a panel per block of `mc` rows. A panel walks k in chunks of kKc: for each chunk, each 6-output weight strip (6 x kKc, in L1) meets every
/// 4-row x tile of the block (mc x kKc, in L2), the lanes of every (row, output) parking in a
/// per-thread carry buffer between chunks. bf16 strips are widened once per chunk into an f32
/// strip in the bf16 lane order (x is permuted to match), so the f32 tile runs the very FMAs
/// of the bf16 step: lo vector, then hi vector. The tiling never touches the arithmetic.
constexpr int     kMR          = 4, kNR = 6;
constexpr int64_t kKc          = 1024;       ///< k per chunk (a multiple of both steps)
constexpr int64_t kNc          = 48;         ///< outputs per task (a multiple of kNR)
constexpr int64_t kXBlockBytes = 96 << 10;   ///< x rows of one panel (whole k) kept within this
constexpr int64_t kSuperRows   = 256;        ///< rows of one task: weights stream once per this many

int64_t rows_per_block(int64_t n_rows, int64_t ldx) {
    const int64_t mc = std::clamp<int64_t>(kXBlockBytes / (ldx * 4) / kMR * kMR, 16, 128);
    return std::min(mc, (n_rows + kMR - 1) / kMR * kMR);
}

/// bf16 weights [k0, k0 + n) of a row as f32 in bf16_lane_k order, zero-padded to whole 32s.
void widen_bf16(float * dst, const uint16_t * src, int64_t n) {
    for (int64_t k = 0; k < n; k += 32) {
        f32x16 w[2];
        load_w<WType::bf16>(reinterpret_cast<const char *>(src), k, static_cast<int>(std::min<int64_t>(32, n - k)), w);
        std::memcpy(dst + k, &w[0], sizeof w[0]);
        std::memcpy(dst + k + kLanes, &w[1], sizeof w[1]);
    }
}

/// One task of the many-row path: rows [r0, r1) x outputs [o0, o1). x [n_rows, ldx] is f32 x
/// (ldx = n_in) or the permuted bf16 copy (ldx = n_in rounded up to 32).
template <WType T>
void panel(float * out, const float * x, int64_t ldx, const char * w, const float * bias, int64_t r0, int64_t r1,
           int64_t n_out, int64_t n_in, int64_t o0, int64_t o1) {
    const int64_t row_bytes = n_in * Step<T>::kElemBytes;
    const int64_t n_k       = T == WType::f32 ? n_in : ldx;
    const int64_t n_rt = (r1 - r0 + kMR - 1) / kMR, n_ot = (o1 - o0 + kNR - 1) / kNR;
    thread_local std::vector<f32x16> carry;
    thread_local std::vector<float>  wide;  // bf16: one strip of one chunk, widened
    if (static_cast<int64_t>(carry.size()) < n_rt * n_ot * kMR * kNR) {
        carry.resize(static_cast<size_t>(n_rt * n_ot * kMR * kNR));
    }
    if (T == WType::bf16 && wide.size() < static_cast<size_t>(kNR * kKc)) { wide.resize(kNR * kKc); }
    for (int64_t k0 = 0; k0 < n_k; k0 += kKc) {
        const int64_t nk = std::min(kKc, n_k - k0);
        for (int64_t ot = 0; ot < n_ot; ++ot) {
            const int64_t o  = o0 + ot * kNR;
            const int     nc = static_cast<int>(std::min<int64_t>(kNR, o1 - o));
            const char *  ws = w + o * row_bytes + k0 * Step<T>::kElemBytes;
            int64_t       ldw = row_bytes;
            if constexpr (T == WType::bf16) {
                for (int c = 0; c < nc; ++c) {
                    widen_bf16(wide.data() + c * nk, reinterpret_cast<const uint16_t *>(ws + c * row_bytes),
                               std::min(nk, n_in - k0));
                }
                ws  = reinterpret_cast<const char *>(wide.data());
                ldw = nk * 4;
            }
            for (int64_t rt = 0; rt < n_rt; ++rt) {
                const int64_t r = r0 + rt * kMR;
                tile<WType::f32, kMR, kNR, false>({.x = x + r * ldx + k0, .ldx = ldx, .w = ws, .ldw = ldw,
                                                   .n_rows = static_cast<int>(std::min<int64_t>(kMR, r1 - r)),
                                                   .n_cols = nc, .n_k = nk, .first = k0 == 0, .last = k0 + nk == n_k,
                                                   .carry = carry.data() + (ot * n_rt + rt) * kMR * kNR,
                                                   .out = out + r * n_out + o, .ldo = n_out,
                                                   .bias = bias ? bias + o : nullptr});
            }
        }
    }
}

/// One row x outputs [o0, o1): streams the weights in their stored dtype, 8 rows at a time.
template <WType T>
void strip(float * out, const float * x, const char * w, const float * bias, int64_t n_in, int64_t o0,
           int64_t o1) {
    const int64_t row_bytes = n_in * Step<T>::kElemBytes;
    constexpr int NR = 8;
    for (int64_t o = o0; o < o1; o += NR) {
        tile<T, 1, NR, true>({.x = x, .ldx = 0, .w = w + o * row_bytes, .ldw = row_bytes, .n_rows = 1,
                              .n_cols = static_cast<int>(std::min<int64_t>(NR, o1 - o)), .n_k = n_in,
                              .first = true, .last = true, .carry = nullptr, .out = out + o, .ldo = 1,
                              .bias = bias ? bias + o : nullptr});
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
    const char *  wb = static_cast<const char *>(w);
    thread_local std::vector<float> xp;  // the caller's thread only: tasks read it
    const float * xs  = x;
    int64_t       ldx = n_in;
    if (wtype == WType::bf16) {
        permute_for_bf16(xp, x, n_rows, n_in);
        xs  = xp.data();
        ldx = (n_in + 31) / 32 * 32;
    }
    auto for_tasks = [&](int64_t n_tasks, const std::function<void(int64_t)> & run) {
        if (pool && n_tasks > 1) {
            pool->parallel_for(n_tasks, run);
        } else {
            for (int64_t t = 0; t < n_tasks; ++t) { run(t); }
        }
    };
    if (n_rows == 1) {
        // Decode: tasks of ~128 KiB of weights (whole 8-row strips, at least 24 rows), as before
        // issue #14.
        const int64_t row_bytes = n_in * static_cast<int64_t>(wtype == WType::f32 ? 4 : 2);
        const int64_t per_task  = std::max<int64_t>(24, ((128 << 10) / std::max<int64_t>(1, row_bytes)) / 24 * 24);
        for_tasks((n_out + per_task - 1) / per_task, [&](int64_t t) {
            const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
            if (wtype == WType::f32) {
                strip<WType::f32>(out, xs, wb, bias, n_in, o0, o1);
            } else {
                strip<WType::bf16>(out, xs, wb, bias, n_in, o0, o1);
            }
        });
        return;
    }
    // Many rows: tasks of up to kSuperRows rows x kNc outputs, output-block major so that the
    // weights stream from memory once per kSuperRows rows. A task's weight block (kNc x n_in)
    // stays in L2 while its row blocks of mc rows pass through the panel.
    const int64_t mc   = rows_per_block(n_rows, ldx);
    const int64_t sb   = std::max<int64_t>(mc, kSuperRows / mc * mc);
    const int64_t n_sb = (n_rows + sb - 1) / sb, n_ob = (n_out + kNc - 1) / kNc;
    for_tasks(n_sb * n_ob, [&](int64_t t) {
        const int64_t s0 = (t / n_ob) * sb, s1 = std::min(n_rows, s0 + sb);
        const int64_t o0 = (t % n_ob) * kNc, o1 = std::min(n_out, o0 + kNc);
        for (int64_t r0 = s0; r0 < s1; r0 += mc) {
            const int64_t r1 = std::min(s1, r0 + mc);
            if (wtype == WType::f32) {
                panel<WType::f32>(out, xs, ldx, wb, bias, r0, r1, n_out, n_in, o0, o1);
            } else {
                panel<WType::bf16>(out, xs, ldx, wb, bias, r0, r1, n_out, n_in, o0, o1);
            }
        }
    });
}

}  // namespace fd::kernels
