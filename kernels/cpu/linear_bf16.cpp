// Batch-invariant linear in bf16 compute (--compute-dtype bfloat16): x rounded to bf16
// (round-to-nearest-even), weights bf16 (f32 weights rounded the same way as they are read),
// products exact in f32, accumulated in f32 — the numerics of vdpbf16ps (AVX512_BF16).
//
// The arithmetic of one output (the contract; cpu_ops.h linear_bf16):
//   x and w are taken in steps of 32 k's (the last one zero-padded). 16 lanes; lane l of step s
//   holds k = 32 s + 2 l (even) and 32 s + 2 l + 1 (odd) and runs, s ascending,
//     acc = FTZ(fma(DAZ(x_odd), DAZ(w_odd), DAZ(acc)));  acc = FTZ(fma(DAZ(x_even), DAZ(w_even), acc))
//   (DAZ: a denormal input reads as zero of its sign; FTZ: a denormal result becomes zero of its
//   sign; fma: one rounding, RNE; a NaN input propagates the first NaN of x, w, acc, quieted).
//   Then lanes.h's fixed reduction of the 16 lanes, then the bias.
// That is exactly one vdpbf16ps per step per lane (Intel SDM pseudo-code; checked bitwise on this
// machine's AMD Zen 4 by tests/unit/kernels/test_linear_bf16.cpp). Three paths give these bits,
// chosen at run time by bf16_best_isa() (__builtin_cpu_supports; each compiled with a target
// attribute, so a build for another CPU still has it), best first:
//   avx512_bf16: vcvtne2ps2bf16 for x, vdpbf16ps for the steps (this file);
//   avx2:        two f32 FMAs per pair step on widened bf16 under MXCSR.DAZ, the last lanes
//                flushed, NaN outputs redone portably (linear_bf16_avx2.cpp);
//   portable:    the same steps lane by lane with std::fma and explicit DAZ/FTZ (bf16_portable.h).
// The weights need no packing and no widening: a stored bf16 row IS the instruction's operand
// (32 k's per 64-byte load), unlike the f32 mode, which widens each weight (two unpacks per 32).
// Tiles (1 x 8 for one row, up to 4 x 6 for more) and the split over threads only decide which
// loads feed a step, so a row's result does not depend on the batch or the thread count. Each
// tile's steps run register-only (tile_steps_avx: whole steps, then the tail step; inlined into
// the 4 x 6 tile so its accumulators go from the steps to the epilogue in registers), and
// the first row tile of each output strip prefetches its weights (issue 28 "bf16 GEMM pass" in
// docs/benchmarks.md: where the time went, and what was measured not to matter).
#include "fd/kernels/cpu_ops.h"
#include "fd/status.h"

#include "bf16_portable.h"
#include "lanes.h"
#include "linear_bf16_avx2.h"
#include "linear_step.h"
#include "scratch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FD_HAVE_BF16_TARGET 1
#define FD_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace fd::kernels {
namespace {

/// Elements from one rounded x row to the next: the padded k plus one cache line, so that the
/// rows of a tile do not all fall in the same L1 sets (4 KiB apart when n_in = 2048).
inline int64_t x_stride(int64_t n_in) { return padded_k(n_in) + kStepK; }

/// x [n_rows, n_in] f32 → xb [n_rows, kp] bf16 (kp = padded_k(n_in), zero tail), portable.
void round_rows_portable(uint16_t * xb, const float * x, int64_t r0, int64_t r1, int64_t n_in) {
    const int64_t kp = padded_k(n_in), ldx = x_stride(n_in);
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t k = 0; k < kp; ++k) { xb[r * ldx + k] = k < n_in ? round_one(x[r * n_in + k]) : uint16_t{0}; }
    }
}

/// Outputs [o0, o1) of rows [r0, r1), portable: each output's 16 lanes step by step.
void outputs_portable(float * out, const uint16_t * xb, const char * w, WType wtype, const float * bias, int64_t r0,
                      int64_t r1, int64_t n_out, int64_t n_in, int64_t o0, int64_t o1) {
    const int64_t kp = padded_k(n_in), ldx = x_stride(n_in), row_bytes = n_in * (wtype == WType::bf16 ? 2 : 4);
    for (int64_t o = o0; o < o1; ++o) {
        for (int64_t r = r0; r < r1; ++r) {
            alignas(64) float acc[kLanes] = {};
            for (int64_t k = 0; k < kp; k += kStepK) {
                uint16_t ws[kStepK];
                weight_step_portable(ws, w + o * row_bytes, wtype, k, n_in);
                const uint16_t * xs = xb + r * ldx + k;
                for (int l = 0; l < kLanes; ++l) { acc[l] = dp_lane(acc[l], xs[2 * l], xs[2 * l + 1], ws[2 * l], ws[2 * l + 1]); }
            }
            float v = reduce16(load16(acc));
            if (bias) { v += bias[o]; }
            out[r * n_out + o] = v;
        }
    }
}

#if defined(FD_HAVE_BF16_TARGET)
FD_BF16_TARGET void round_rows_avx(uint16_t * xb, const float * x, int64_t r0, int64_t r1, int64_t n_in, int64_t ldx) {
    const int64_t kp = padded_k(n_in);
    for (int64_t r = r0; r < r1; ++r) {
        const float * src = x + r * n_in;
        for (int64_t k = 0; k < kp; k += kStepK) {
            const int64_t left = n_in - k;
            __m512 lo, hi;
            if (left >= kStepK) {
                lo = _mm512_loadu_ps(src + k), hi = _mm512_loadu_ps(src + k + 16);
            } else {
                const __mmask16 m0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
                const __mmask16 m1 = left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
                lo = _mm512_maskz_loadu_ps(m0, src + k), hi = _mm512_maskz_loadu_ps(m1, src + k + 16);
            }
            const __m512bh b = _mm512_cvtne2ps_pbh(hi, lo);  // element j < 16 from lo
            _mm512_storeu_si512(xb + r * ldx + k, (__m512i)b);
        }
    }
}

/// The 32 bf16 weights of a step (tail: `left` < 32 valid, the rest zero; f32 rounded).
template <WType T>
FD_BF16_TARGET inline __m512bh weight_step_avx(const char * row, int64_t k, int64_t left) {
    if constexpr (T == WType::bf16) {
        const uint16_t * p = reinterpret_cast<const uint16_t *>(row) + k;
        const __m512i    v = left >= kStepK ? _mm512_loadu_si512(p)
                                            : _mm512_maskz_loadu_epi16(__mmask32((uint64_t{1} << left) - 1), p);
        return (__m512bh)v;
    } else {
        const float * p = reinterpret_cast<const float *>(row) + k;
        __m512        lo, hi;
        if (left >= kStepK) {
            lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
        } else {
            const __mmask16 m0 = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
            const __mmask16 m1 = left <= 16 ? __mmask16(0) : __mmask16((1u << (left - 16)) - 1);
            lo = _mm512_maskz_loadu_ps(m0, p), hi = _mm512_maskz_loadu_ps(m1, p + 16);
        }
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
}

/// One MR x NR tile over the whole k: rows xr (bf16, padded), weight rows wr; rows past n_rows
/// and outputs past n_cols repeat the last valid one (not stored).
struct TileB {
    const uint16_t * x;       ///< xb [n_rows, ldx] at the tile's first row
    int64_t          ldx;     ///< elements between x rows (x_stride)
    int64_t          kp;
    const char *     w;       ///< weight rows [n_cols, row_bytes] at the tile's first output
    int64_t          row_bytes;
    int64_t          n_in;
    int              n_rows;  ///< 1..MR
    int              n_cols;  ///< 1..NR
    float *          out;     ///< out [n_rows, ldo] at the tile's first output
    int64_t          ldo;
    const float *    bias;    ///< [n_cols] or nullptr
    const char *     pf = nullptr;  ///< one-row tiles with short bf16 rows: the weights of the tile after next (outputs_avx)
};

/// Every step of an MR x NR tile, lanes [MR * NR] written: the whole steps with plain loads (f32
/// weights rounded as read) and no tail test in the loop, then the zero-padded tail step. The
/// accumulators live in registers from zero to the one store of `lanes` (written as one loop
/// with the tail's masked loads inside it, GCC kept a stack copy of all MR x NR accumulators up
/// to date every step: 24 stores of 64 bytes per 24 vdpbf16ps at 4 x 6, a quarter of the
/// instruction's rate).
/// kPrefetch (one streaming row): `pf` non-null streams the weights of the tile after next, NR lines per
/// step (short rows: matmul.cpp's TileArgs::pf); else each row's own line 512 bytes ahead.
template <WType T, int MR, int NR, bool kPrefetch>
FD_BF16_TARGET __attribute__((always_inline)) inline void tile_steps_avx(f32x16 * lanes,
                                                                         const uint16_t * const (&xr)[MR],
                                                                         const char * const (&wr)[NR], int64_t n_in,
                                                                         const char * pf) {
    constexpr int64_t kElem = T == WType::bf16 ? 2 : 4;
    const int64_t     n_steps = n_in / kStepK;
    __m512            a[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { a[r][c] = _mm512_setzero_ps(); }
    }
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t k = s * kStepK;
        __m512bh      wv[NR];
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
            if (kPrefetch) { _mm_prefetch(pf ? pf + (s * NR + c) * 64 : wr[c] + k * kElem + 512, _MM_HINT_T0); }
            if constexpr (T == WType::bf16) {
                wv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const uint16_t *>(wr[c]) + k);
            } else {  // f32 weights rounded as read (the tail's weight_step_avx, whole)
                const float * p = reinterpret_cast<const float *>(wr[c]) + k;
                if (kPrefetch) { _mm_prefetch(reinterpret_cast<const char *>(p) + 576, _MM_HINT_T0); }
                wv[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512i xi = _mm512_loadu_si512(xr[r] + k);
#pragma GCC unroll 8
            for (int c = 0; c < NR; ++c) { a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)xi, wv[c]); }
        }
    }
    if (const int64_t k = n_steps * kStepK; k < n_in) {  // the tail step (zero-padded), after the loop
        const int64_t left = n_in - k;
        __m512bh      wv[NR];
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { wv[c] = weight_step_avx<T>(wr[c], k, left); }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512i xi = _mm512_loadu_si512(xr[r] + k);
#pragma GCC unroll 8
            for (int c = 0; c < NR; ++c) { a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)xi, wv[c]); }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { _mm512_store_ps(reinterpret_cast<float *>(&lanes[r * NR + c]), a[r][c]); }
    }
}

/// tile_steps_avx as its own function (the one-row tile: inlined, B=1 ran 10-20 % slower).
template <WType T, int MR, int NR, bool kPrefetch>
FD_BF16_TARGET __attribute__((noinline)) void tile_steps_call(f32x16 * lanes, const uint16_t * const (&xr)[MR],
                                                              const char * const (&wr)[NR], int64_t n_in, const char * pf) {
    tile_steps_avx<T, MR, NR, kPrefetch>(lanes, xr, wr, n_in, pf);
}

template <WType T, int MR, int NR, bool kPrefetch>
FD_BF16_TARGET __attribute__((noinline)) void tile_avx(const TileB & t) {
    const uint16_t * xr[MR];
    const char *     wr[NR];
    for (int r = 0; r < MR; ++r) { xr[r] = t.x + std::min(r, t.n_rows - 1) * t.ldx; }
    for (int c = 0; c < NR; ++c) { wr[c] = t.w + std::min(c, t.n_cols - 1) * t.row_bytes; }
    alignas(64) f32x16 acc[MR * NR];
#if defined(__AVX512BW__)
    // The many-row tile: its steps inlined, so the accumulators reach its epilogue in registers,
    // and the epilogue in registers too (lanes.h: the scalar loop below reads the sums back from
    // a masked store, which stalls store forwarding). The one-row (B=1) tile keeps both apart:
    // there the weight stream hides them (docs/benchmarks.md "Stop 41", "Stop 42").
    if constexpr (MR == 4 && NR == 6) {
        tile_steps_avx<T, MR, NR, kPrefetch>(acc, xr, wr, t.n_in, T == WType::bf16 ? t.pf : nullptr);
        __m512 v[MR * NR];
        std::memcpy(v, acc, sizeof v);
        store_4x6(t.out, t.ldo, t.bias, v, t.n_rows, t.n_cols);
        return;
    }
#endif
    tile_steps_call<T, MR, NR, kPrefetch>(acc, xr, wr, t.n_in, T == WType::bf16 ? t.pf : nullptr);
    float sums[MR * NR];
    reduce_all(acc, MR * NR, sums);
    for (int r = 0; r < t.n_rows; ++r) {
        for (int c = 0; c < t.n_cols; ++c) {
            float v = sums[r * NR + c];
            if (t.bias) { v += t.bias[c]; }
            t.out[r * t.ldo + c] = v;
        }
    }
}

/// Outputs [o0, o1) of rows [r0, r1) with MR x NR tiles: rows in blocks whose bf16 x fits
/// ~256 KiB (L2), each output strip meeting every tile of the block while its rows sit in L1/L2.
template <WType T, int MR, int NR>
void outputs_avx(float * out, const uint16_t * xb, const char * w, const float * bias, int64_t r0, int64_t r1,
                 int64_t n_out, int64_t n_in, int64_t o0, int64_t o1) {
    const int64_t kp = padded_k(n_in), ldx = x_stride(n_in), row_bytes = n_in * (T == WType::bf16 ? 2 : 4);
    const int64_t mc = std::max<int64_t>(MR, (256 << 10) / (ldx * 2) / MR * MR);
    // The first row tile of each strip streams its weights from memory, prefetched: bf16 rows
    // under 4 KiB stream the strip after next (512 bytes ahead would land in the tile's own next
    // row: matmul.cpp's kShortRowBytes, issue 23; the next strip, one tile ahead, kept too few
    // misses in flight: B=1 on a 268 MB model read 22 GB/s, two tiles ahead 26-35, docs/benchmarks.md
    // "Stop 42"), longer ones each row's line 512 bytes ahead.
    const bool short_rows = T == WType::bf16 && row_bytes < 4096;
    for (int64_t b0 = r0; b0 < r1; b0 += mc) {
        const int64_t b1 = std::min(r1, b0 + mc);
        for (int64_t o = o0; o < o1; o += NR) {
            const int n_cols = static_cast<int>(std::min<int64_t>(NR, o1 - o));
            for (int64_t r = b0; r < b1; r += MR) {
                const TileB tb{.x = xb + r * ldx, .ldx = ldx, .kp = kp, .w = w + o * row_bytes, .row_bytes = row_bytes,
                               .n_in = n_in, .n_rows = static_cast<int>(std::min<int64_t>(MR, b1 - r)),
                               .n_cols = n_cols, .out = out + r * n_out + o, .ldo = n_out,
                               .bias = bias ? bias + o : nullptr, .pf = short_rows ? w + (o + 2 * NR) * row_bytes : nullptr};
                if (r == r0) {  // the strip's first meeting: its weights come from memory, prefetched
                    tile_avx<T, MR, NR, true>(tb);
                } else {        // later row tiles find the strip in L1
                    tile_avx<T, MR, NR, false>(tb);
                }
            }
        }
    }
}

template <WType T>
void outputs_avx_any(float * out, const uint16_t * xb, const char * w, const float * bias, int64_t n_rows,
                     int64_t n_out, int64_t n_in, int64_t o0, int64_t o1) {
    if (n_rows == 1) {
        outputs_avx<T, 1, 8>(out, xb, w, bias, 0, 1, n_out, n_in, o0, o1);
    } else if (n_rows == 2) {
        outputs_avx<T, 2, 8>(out, xb, w, bias, 0, 2, n_out, n_in, o0, o1);
    } else if (n_rows == 3) {
        outputs_avx<T, 3, 6>(out, xb, w, bias, 0, 3, n_out, n_in, o0, o1);
    } else {
        outputs_avx<T, 4, 6>(out, xb, w, bias, 0, n_rows, n_out, n_in, o0, o1);
    }
}

FD_BF16_TARGET void dp_step_avx(float * acc, const uint16_t * a, const uint16_t * b) {
    const __m512i ai = _mm512_loadu_si512(a), bi = _mm512_loadu_si512(b);
    _mm512_storeu_ps(acc, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)ai, (__m512bh)bi));
}
#endif

bool cpu_has_avx512_bf16() {
#if defined(FD_HAVE_BF16_TARGET)
    static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    return has;
#else
    return false;
#endif
}

void require(Bf16Isa isa) {
    if (isa == Bf16Isa::avx512_bf16 && !cpu_has_avx512_bf16()) {
        fail(Errc::invalid_argument, "bf16 compute: this CPU has no AVX512_BF16 (use the avx2 or portable path)");
    }
    if (isa == Bf16Isa::avx2 && !detail::cpu_has_avx2_fma()) {
        fail(Errc::invalid_argument, "bf16 compute: this CPU has no AVX2 + FMA (use the portable path)");
    }
}

}  // namespace

const char * bf16_isa_name(Bf16Isa isa) {
    return isa == Bf16Isa::avx512_bf16 ? "avx512_bf16" : isa == Bf16Isa::avx2 ? "avx2" : "portable";
}

Bf16Isa bf16_best_isa() {
    return cpu_has_avx512_bf16() ? Bf16Isa::avx512_bf16 : detail::cpu_has_avx2_fma() ? Bf16Isa::avx2 : Bf16Isa::portable;
}

void round_to_bf16(uint16_t * out, const float * x, int64_t n, Bf16Isa isa) {
    require(isa);
    if (isa == Bf16Isa::avx2) {
        detail::round_to_bf16_avx2(out, x, n);
        return;
    }
#if defined(FD_HAVE_BF16_TARGET)
    if (isa == Bf16Isa::avx512_bf16) {
        const int64_t whole = n / kStepK * kStepK;
        if (whole > 0) { round_rows_avx(out, x, 0, 1, whole, whole); }
        if (whole < n) {  // the tail through the instruction too, as a zero-padded step
            alignas(64) float    src[kStepK] = {};
            alignas(64) uint16_t dst[kStepK];
            std::memcpy(src, x + whole, sizeof(float) * (n - whole));
            round_rows_avx(dst, src, 0, 1, kStepK, kStepK);
            std::memcpy(out + whole, dst, sizeof(uint16_t) * (n - whole));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) { out[i] = round_one(x[i]); }
}

void dpbf16_step(float * acc, const uint16_t * a, const uint16_t * b, Bf16Isa isa) {
    require(isa);
    if (isa == Bf16Isa::avx2) {
        detail::dpbf16_step_avx2(acc, a, b);
        return;
    }
#if defined(FD_HAVE_BF16_TARGET)
    if (isa == Bf16Isa::avx512_bf16) {
        dp_step_avx(acc, a, b);
        return;
    }
#endif
    for (int l = 0; l < kLanes; ++l) { acc[l] = dp_lane(acc[l], a[2 * l], a[2 * l + 1], b[2 * l], b[2 * l + 1]); }
}

void linear_bf16(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                 int64_t n_out, int64_t n_in, ThreadPool * pool, Bf16Isa isa) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    require(isa);
    if (isa == Bf16Isa::avx2) {
        detail::linear_bf16_avx2(out, x, w, wtype, bias, n_rows, n_out, n_in, pool);
        return;
    }
    const char *  wb = static_cast<const char *>(w);
    const int64_t ldx = x_stride(n_in);
    // x rounded once per call (the caller's thread-local buffer; tasks only read it).
    thread_local detail::ScratchVec<uint16_t> xb_buf;
    xb_buf.resize(static_cast<size_t>(n_rows * ldx));
    uint16_t *    xb    = xb_buf.data();
    const int64_t n_thr = pool ? pool->n_threads() : 1;
    const int64_t n_xt  = n_rows * ldx < (64 << 10) ? 1 : std::min(n_rows, n_thr);
    for_tasks(pool, n_xt, [&](int64_t t) {
        const int64_t r0 = n_rows * t / n_xt, r1 = n_rows * (t + 1) / n_xt;
#if defined(FD_HAVE_BF16_TARGET)
        if (isa == Bf16Isa::avx512_bf16) {
            round_rows_avx(xb, x, r0, r1, n_in, x_stride(n_in));
            return;
        }
#endif
        round_rows_portable(xb, x, r0, r1, n_in);
    });
    // Tasks: ranges of whole 24-output groups. One row: as the f32 mode's decode split
    // (decode_task_outputs: ~128 KiB each on one thread, 4 per thread on more); more rows: one range
    // per thread, each covering every row.
    const int64_t row_bytes = n_in * (wtype == WType::bf16 ? 2 : 4);
    int64_t       per_task;
    if (n_rows == 1) {
        per_task = decode_task_outputs(n_out, row_bytes, n_thr, false);
    } else {
        const int64_t groups = (n_out + 23) / 24;
        per_task = (groups + n_thr - 1) / n_thr * 24;
    }
    for_tasks(pool, (n_out + per_task - 1) / per_task, [&](int64_t t) {
        const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
#if defined(FD_HAVE_BF16_TARGET)
        if (isa == Bf16Isa::avx512_bf16) {
            if (wtype == WType::bf16) {
                outputs_avx_any<WType::bf16>(out, xb, wb, bias, n_rows, n_out, n_in, o0, o1);
            } else {
                outputs_avx_any<WType::f32>(out, xb, wb, bias, n_rows, n_out, n_in, o0, o1);
            }
            return;
        }
#endif
        outputs_portable(out, xb, wb, wtype, bias, 0, n_rows, n_out, n_in, o0, o1);
    });
}

}  // namespace fd::kernels
