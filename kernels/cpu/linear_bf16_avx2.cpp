// The AVX2 + FMA path of the bf16 compute mode (Bf16Isa::avx2; issue 28 on CPUs without
// AVX512_BF16). Same arithmetic, same bits as the portable path (bf16_portable.h) and vdpbf16ps:
// per output 16 lanes, lane l of step s holding k = 32 s + 2 l (even) and 32 s + 2 l + 1 (odd),
//   acc = FTZ(fma(DAZ(x_odd), DAZ(w_odd), DAZ(acc)));  acc = FTZ(fma(DAZ(x_even), DAZ(w_even), acc))
// then lanes.h's reduction and the bias. How this file gets those bits:
// - A bf16 x bf16 product is exact in f32, so a pair step is two ordinary f32 FMAs on the
//   widened operands (odd pair first). A stored bf16 pair is one 32-bit lane: the odd element is
//   the lane AND 0xFFFF0000, the even one the lane shifted left by 16, both exact f32 values.
//   8 lanes per ymm, so an output's 16 lanes are two accumulators (half 0: lanes 0-7).
// - DAZ / FTZ: the steps run with MXCSR.DAZ set (and FTZ clear). DAZ reads a denormal input
//   (x, w, or the accumulator) as a zero of its sign, as the portable code's flush() does. A
//   denormal FMA result is kept (gradual underflow, as std::fma gives it) but every later reader
//   is a DAZ-mode FMA that reads it as that same signed zero; only the last value of each lane is
//   flushed, explicitly (integer ops), before the reduction, which runs with MXCSR restored.
//   MXCSR.FTZ itself is not used: it tests tininess after rounding with an unbounded exponent,
//   so a result just below 2^-126 that rounds up to 2^-126 in the denormal format is flushed by
//   FTZ and kept by the portable flush (tests/unit/kernels/test_linear_bf16.cpp has that case).
// - NaN: the FMA's NaN choice is not the portable path's (first NaN of x, w, acc). A NaN in a
//   lane's chain stays to the end, so an output whose sum is NaN is recomputed by the portable
//   code (dot_portable); every other output never met one and is already exact.
// Tiles: one row (decode) reads its outputs as 4 sequential streams, 4 parts of a task's outputs
// side by side, 8 outputs (2 rows of each part) per DAZ setting (outputs_one_row; issue 28 "B=1
// GEMV on AVX2" in docs/benchmarks.md); 2 x 2 for two rows (both halves in one loop, rows in
// blocks of ~256 KiB of widened x, weights prefetched). x is rounded once per call into
// a widened odd / even layout, half-major: per row, half 0 of every step, then half 1.
// Three rows and more: linear_bf16_avx2_many.cpp (half passes, 5 x 2 tiles, weight blocks in L2).
// The x buffer is cache-line aligned: a split 32-byte load costs two (issue 28 "bf16 prefill on
// AVX2": +10 % on the call).
#include "linear_bf16_avx2.h"

#include "bf16_portable.h"
#include "linear_bf16_avx2_shared.h"
#include "lanes.h"
#include "linear_step.h"
#include "scratch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace fd::kernels::detail {

#if defined(FD_HAVE_AVX2_TARGET)
namespace {

constexpr int64_t  kPrefetchAhead = 512;          ///< bytes ahead in a long weight row (two-row tiles)

/// Floats from one widened x row to the next: a float per k, plus one cache line (L1 sets).
inline int64_t xw_stride(int64_t n_in) { return padded_k(n_in) + 16; }

/// x rows [r0, r1) → xw [.., ldxw], half-major: step s's half h (the 8 odd then the 8 even k's
/// of pairs 8h .. 8h + 7, as f32: the bf16 values exactly; zero past n_in) at h * hk + 16 s,
/// hk = padded_k(n_in) / 2.
FD_AVX2_TARGET void widen_rows(float * xw, const float * x, int64_t r0, int64_t r1, int64_t n_in, int64_t ldxw) {
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t r = r0; r < r1; ++r) {
        const float * src = x + r * n_in;
        float *       dst = xw + r * ldxw;
        const int64_t hk = padded_k(n_in) / 2;
        for (int64_t k = 0; k < padded_k(n_in); k += 16) {
            const __m256i v = round16(src + k, n_in - k);
            float *       d = dst + (k % kStepK ? hk : 0) + k / kStepK * 16;
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(d), _mm256_and_si256(v, top));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(d + 8), _mm256_slli_epi32(v, 16));
        }
    }
}

/// n_steps steps of an MR x NR tile, lanes [MR * NR][16] read and written (DAZ set by the
/// caller). xr: widened x rows at the first step; wr: bf16 weight rows at the first step.
/// kPrefetch: `pf` non-null streams the next tile's weights (NR lines per step, short rows), else
/// each row's own line kPrefetchAhead bytes ahead.
/// kZero: the lanes start at zero (not read); kFlush: the lanes stored are flushed (denormal →
/// zero of its sign, integer ops as flush_lanes: the last call of a chain only).
template <int MR, int NR, bool kPrefetch, bool kZero = false, bool kFlush = false>
FD_AVX2_TARGET __attribute__((noinline)) void steps(float * lanes, const float * const (&xr)[MR],
                                                    const uint16_t * const (&wr)[NR], int64_t n_steps, int64_t hk, const char * pf) {
    __m256 a[MR][NR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
            a[r][c][0] = kZero ? _mm256_setzero_ps() : _mm256_loadu_ps(lanes + (r * NR + c) * 16);
            a[r][c][1] = kZero ? _mm256_setzero_ps() : _mm256_loadu_ps(lanes + (r * NR + c) * 16 + 8);
        }
    }
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t k = s * kStepK;
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            __m256 xo[MR], xe[MR];
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
                xo[r] = _mm256_loadu_ps(xr[r] + s * 16 + h * hk);
                xe[r] = _mm256_loadu_ps(xr[r] + s * 16 + h * hk + 8);
                // one row: x in registers, loaded once for the NR columns (GCC otherwise makes it
                // a memory operand of every FMA and loads each weight twice: 4 loads per column
                // and half, load-port bound at ~26 GB/s with the weights in L2; issue 28 gemv28)
                if constexpr (MR == 1) { __asm__("" : "+x"(xo[r]), "+x"(xe[r])); }
            }
#pragma GCC unroll 8
            for (int c = 0; c < NR; ++c) {
                if (kPrefetch && h == 0) {
                    _mm_prefetch(pf ? pf + (s * NR + c) * 64 : reinterpret_cast<const char *>(wr[c] + k) + kPrefetchAhead, _MM_HINT_T0);
                }
                __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wr[c] + k + 16 * h));
                if constexpr (MR == 1) { __asm__("" : "+x"(v)); }
                const __m256  wo = _mm256_castsi256_ps(_mm256_and_si256(v, top));
                const __m256  we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#pragma GCC unroll 8
                for (int r = 0; r < MR; ++r) {
                    a[r][c][h] = _mm256_fmadd_ps(xo[r], wo, a[r][c][h]);  // the odd pair first
                    a[r][c][h] = _mm256_fmadd_ps(xe[r], we, a[r][c][h]);
                }
            }
        }
    }
    const __m256i expo = _mm256_set1_epi32(0x7F800000), mag = _mm256_set1_epi32(0x7FFFFFFF);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
                __m256 v = a[r][c][h];
                if constexpr (kFlush) {
                    const __m256i u = _mm256_castps_si256(v);
                    const __m256i z = _mm256_cmpeq_epi32(_mm256_and_si256(u, expo), _mm256_setzero_si256());
                    v = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_and_si256(z, mag), u));
                }
                _mm256_storeu_ps(lanes + (r * NR + c) * 16 + 8 * h, v);
            }
        }
    }
}

/// Denormal lanes → zero of their sign (integer ops: MXCSR plays no part). n floats, n % 8 == 0.
FD_AVX2_TARGET void flush_lanes(float * lanes, int n) {
    const __m256i expo = _mm256_set1_epi32(0x7F800000), mag = _mm256_set1_epi32(0x7FFFFFFF);
    for (int i = 0; i < n; i += 8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(lanes + i));
        const __m256i z = _mm256_cmpeq_epi32(_mm256_and_si256(v, expo), _mm256_setzero_si256());
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(lanes + i), _mm256_andnot_si256(_mm256_and_si256(z, mag), v));
    }
}

/// The whole steps, then the zero-padded tail step (when `tail`), under MXCSR.DAZ; MXCSR is
/// restored before returning. Its own noinline function: no FP op of the caller can move inside.
template <int MR, int NR, bool kPrefetch>
__attribute__((noinline)) void steps_daz(float * lanes, const float * const (&xr)[MR], const uint16_t * const (&wr)[NR],
                                         int64_t n_steps, const uint16_t * const (&tail)[NR], bool has_tail, int64_t hk, const char * pf) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr | kDaz) & ~kFtz);
    const float * xt[MR];
    for (int r = 0; r < MR; ++r) { xt[r] = xr[r] + n_steps * 16; }
    steps<MR, NR, kPrefetch>(lanes, xr, wr, n_steps, hk, pf);
    if (has_tail) { steps<MR, NR, false>(lanes, xt, tail, 1, hk, nullptr); }
    _mm_setcsr(csr);
}

/// One MR x NR tile over the whole k: rows [r, r + n_r) x outputs [o, o + n_c); `wb` holds the
/// strip's bf16 rows (ldw elements apart: the stored rows, or f32 ones rounded into scratch).
template <int MR, int NR, bool kPrefetch>
void tile(const Problem & p, int64_t r, int n_r, int64_t o, int n_c, const uint16_t * wb, int64_t ldw, const char * pf) {
    const bool    rounded = p.wtype == WType::f32;  // wb is scratch of padded rows: no tail step
    const int64_t n_steps = rounded ? padded_k(p.n_in) / kStepK : p.n_in / kStepK;
    const int64_t left    = rounded ? 0 : p.n_in - n_steps * kStepK;
    const float *    xr[MR];
    const uint16_t * wr[NR];
    const uint16_t * wt[NR];
    alignas(32) uint16_t tail[NR][kStepK];
    for (int i = 0; i < MR; ++i) { xr[i] = p.xw + (r + std::min(i, n_r - 1)) * p.ldxw; }
    for (int c = 0; c < NR; ++c) {
        wr[c] = wb + std::min(c, n_c - 1) * ldw;
        wt[c] = tail[c];
        if (left > 0) {
            std::memset(tail[c], 0, sizeof tail[c]);
            std::memcpy(tail[c], wr[c] + n_steps * kStepK, sizeof(uint16_t) * left);
        }
    }
    alignas(64) f32x16 lanes[MR * NR] = {};
    float * lf = reinterpret_cast<float *>(lanes);
    steps_daz<MR, NR, kPrefetch>(lf, xr, wr, n_steps, wt, left > 0, padded_k(p.n_in) / 2, pf);
    flush_lanes(lf, MR * NR * kLanes);
    float sums[MR * NR];
    reduce_all(lanes, MR * NR, sums);
    const int64_t row_bytes = p.n_in * (rounded ? 4 : 2);
    for (int i = 0; i < n_r; ++i) {
        for (int c = 0; c < n_c; ++c) {
            float v = sums[i * NR + c];
            if (std::isnan(v)) { v = dot_portable(p.x + (r + i) * p.n_in, p.w + (o + c) * row_bytes, p.wtype, p.n_in); }
            if (p.bias) { v += p.bias[o + c]; }
            p.out[(r + i) * p.n_out + o + c] = v;
        }
    }
}

/// One-row blocks: groups of 4 outputs (one row of each part) per DAZ setting. 8 was about as
/// fast with the weights in L2 (42.7 vs 41.4 GB/s) and slower streaming them from memory (23-26
/// vs 26 GB/s at 8192 x 512, 5 of 5 interleaved runs): the parts' streams advance in bursts.
constexpr int kRowGroups = 2;

/// The whole steps of n_g groups of 4 one-row outputs (group g: columns 4g .. 4g + 3), group
/// after group, each followed by its zero-padded tail step (when `has_tail`), under one
/// MXCSR.DAZ setting, restored before returning: lanes [4 n_g][16] written, from zero, the last
/// values flushed (denormal → zero of its sign, as flush_lanes). Its own noinline function (as
/// steps_daz); n_g <= kRowGroups.
__attribute__((noinline)) void one_row_daz(float * lanes, const float * const (&xr)[1], const uint16_t * const * wr, int n_g,
                                           int64_t n_steps, const uint16_t * const * tail, bool has_tail, int64_t hk) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr | kDaz) & ~kFtz);
    const float * const xt[1] = {xr[0] + n_steps * 16};
    for (int g = 0; g < n_g; ++g) {
        const uint16_t * const w4[4] = {wr[4 * g], wr[4 * g + 1], wr[4 * g + 2], wr[4 * g + 3]};
        if (has_tail) {
            const uint16_t * const t4[4] = {tail[4 * g], tail[4 * g + 1], tail[4 * g + 2], tail[4 * g + 3]};
            steps<1, 4, false, true, false>(lanes + 4 * g * kLanes, xr, w4, n_steps, hk, nullptr);
            steps<1, 4, false, false, true>(lanes + 4 * g * kLanes, xt, t4, 1, hk, nullptr);
        } else {
            steps<1, 4, false, true, true>(lanes + 4 * g * kLanes, xr, w4, n_steps, hk, nullptr);
        }
    }
    _mm_setcsr(csr);
}

/// Outputs [o0, o1) of one row (decode): as matmul.cpp's one-row AVX2 strip, the outputs in 4
/// equal parts read as 4 sequential streams that the hardware prefetchers follow (no software
/// prefetch); a block is kRowGroups consecutive rows of each part (f32 weights rounded into
/// scratch a block at a time), one DAZ setting and a transposed reduction of 8. Tiles of
/// adjacent rows with the next tile prefetched read at 0.8 of a one-stream read probe here
/// (docs/benchmarks.md "B=1 GEMV on AVX2").
void outputs_one_row(const Problem & p, int64_t o0, int64_t o1) {
    const bool    rounded = p.wtype == WType::f32;  // rows rounded into scratch, zero-padded: no tail step
    const int64_t kp = padded_k(p.n_in), row_bytes = p.n_in * (rounded ? 4 : 2);
    const int64_t n_steps = rounded ? kp / kStepK : p.n_in / kStepK;
    const int64_t left    = rounded ? 0 : p.n_in - n_steps * kStepK;
    const int64_t n = o1 - o0, part = (n + 3) / 4;  // parts of part rows, the last one maybe shorter or empty
    const int     rows = kRowGroups;  // rows of each part per block
    thread_local detail::ScratchVec<uint16_t> scratch;
    if (rounded) { scratch.resize(static_cast<size_t>(4 * rows * kp)); }
    const float * const xr[1] = {p.xw};
    constexpr int kCols = 4 * kRowGroups;
    alignas(32) uint16_t tail[kCols][kStepK];
    for (int64_t i = 0; i < part; i += rows) {
        const int        n_g = static_cast<int>(std::min<int64_t>(rows, part - i));
        const uint16_t * wr[kCols];
        const uint16_t * wt[kCols];
        int64_t          oc[kCols];  // column c's output: part c % 4, row i + c / 4 of it; -1 past the end
        for (int c = 0; c < 4 * n_g; ++c) {
            const int64_t j = i + c / 4, o = (c % 4) * part + j;
            oc[c] = o < n ? o0 + o : -1;
            const int64_t row = oc[c] >= 0 ? oc[c] : o0 + j;  // past the end: a valid row again (not stored)
            if (rounded) {
                round_row(scratch.data() + c * kp, reinterpret_cast<const float *>(p.w + row * row_bytes), p.n_in, kp);
                wr[c] = scratch.data() + c * kp;
            } else {
                wr[c] = reinterpret_cast<const uint16_t *>(p.w + row * row_bytes);
            }
            wt[c] = tail[c];
            if (left > 0) {
                std::memset(tail[c], 0, sizeof tail[c]);
                std::memcpy(tail[c], wr[c] + n_steps * kStepK, sizeof(uint16_t) * left);
            }
        }
        alignas(64) f32x16 lanes[kCols];  // written by one_row_daz: from zero, the last lanes flushed
        float * lf = reinterpret_cast<float *>(lanes);
        one_row_daz(lf, xr, wr, n_g, n_steps, wt, left > 0, kp / 2);
        float sums[kCols];
        reduce_all(lanes, 4 * n_g, sums);
        for (int c = 0; c < 4 * n_g; ++c) {
            if (oc[c] < 0) { continue; }
            float v = sums[c];
            if (std::isnan(v)) { v = dot_portable(p.x, p.w + oc[c] * row_bytes, p.wtype, p.n_in); }
            if (p.bias) { v += p.bias[oc[c]]; }
            p.out[oc[c]] = v;
        }
    }
}

/// Outputs [o0, o1) of every row: rows in blocks of ~256 KiB of widened x, each NR-output strip
/// meeting every MR-row tile of the block; the first row tile of a strip streams its weights.
template <int MR, int NR>
void outputs(const Problem & p, int64_t o0, int64_t o1) {
    const int64_t kp = padded_k(p.n_in), row_bytes = p.n_in * (p.wtype == WType::bf16 ? 2 : 4);
    const int64_t mc = std::max<int64_t>(MR, (256 << 10) / (p.ldxw * 4) / MR * MR);
    const bool    short_rows = p.wtype == WType::bf16 && row_bytes < 4096;
    thread_local detail::ScratchVec<uint16_t> scratch;
    for (int64_t b0 = 0; b0 < p.n_rows; b0 += mc) {
        const int64_t b1 = std::min(p.n_rows, b0 + mc);
        for (int64_t o = o0; o < o1; o += NR) {
            const int        n_c = static_cast<int>(std::min<int64_t>(NR, o1 - o));
            const uint16_t * wb  = reinterpret_cast<const uint16_t *>(p.w + o * row_bytes);
            int64_t          ldw = p.n_in;
            if (p.wtype == WType::f32) {
                scratch.resize(static_cast<size_t>(NR * kp));
                for (int c = 0; c < n_c; ++c) {
                    round_row(scratch.data() + c * kp, reinterpret_cast<const float *>(p.w + (o + c) * row_bytes), p.n_in, kp);
                }
                wb = scratch.data(), ldw = kp;
            }
            const char * pf = short_rows ? p.w + (o + NR) * row_bytes : nullptr;
            for (int64_t r = b0; r < b1; r += MR) {
                const int n_r = static_cast<int>(std::min<int64_t>(MR, b1 - r));
                if (r == 0 && p.wtype == WType::bf16) {  // the strip's first meeting: from memory, prefetched
                    tile<MR, NR, true>(p, r, n_r, o, n_c, wb, ldw, pf);
                } else {
                    tile<MR, NR, false>(p, r, n_r, o, n_c, wb, ldw, nullptr);
                }
            }
        }
    }
}

FD_AVX2_TARGET __attribute__((noinline)) void dp_step_daz(float * acc, const uint16_t * a, const uint16_t * b) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr | kDaz) & ~kFtz);
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int h = 0; h < 2; ++h) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a + 16 * h));
        const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b + 16 * h));
        __m256        s  = _mm256_loadu_ps(acc + 8 * h);
        s = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(av, top)), _mm256_castsi256_ps(_mm256_and_si256(bv, top)), s);
        s = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(av, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(bv, 16)), s);
        _mm256_storeu_ps(acc + 8 * h, s);
    }
    _mm_setcsr(csr);
}

}  // namespace

bool cpu_has_avx2_fma() {
    static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return has;
}

FD_AVX2_TARGET void round_to_bf16_avx2(uint16_t * out, const float * x, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) { _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + i), round16(x + i, 16)); }
    if (i < n) {  // the tail through the same code, zero-padded
        alignas(32) uint16_t dst[16];
        _mm256_store_si256(reinterpret_cast<__m256i *>(dst), round16(x + i, n - i));
        std::memcpy(out + i, dst, sizeof(uint16_t) * (n - i));
    }
}

void dpbf16_step_avx2(float * acc, const uint16_t * a, const uint16_t * b) {
    float in[kLanes];
    std::memcpy(in, acc, sizeof in);
    dp_step_daz(acc, a, b);
    flush_lanes(acc, kLanes);
    for (int l = 0; l < kLanes; ++l) {  // a NaN lane: the portable code's NaN
        if (std::isnan(acc[l])) { acc[l] = dp_lane(in[l], a[2 * l], a[2 * l + 1], b[2 * l], b[2 * l + 1]); }
    }
}

void linear_bf16_avx2(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                      int64_t n_out, int64_t n_in, ThreadPool * pool) {
    const int64_t ldxw = xw_stride(n_in);
    thread_local detail::ScratchVec<float> xw_buf;  // the caller's; tasks only read it
    xw_buf.resize(static_cast<size_t>(n_rows * ldxw + 16));
    // a pointer (on a pool thread xw_buf names that thread's vector), cache-line aligned: the
    // steps' 32-byte x loads never split a line (a split load costs two)
    float * const xw = xw_buf.data() + (64 - reinterpret_cast<uintptr_t>(xw_buf.data()) % 64) % 64 / 4;
    const Problem p{.out = out, .xw = xw, .ldxw = ldxw, .x = x, .w = static_cast<const char *>(w),
                    .wtype = wtype, .bias = bias, .n_rows = n_rows, .n_out = n_out, .n_in = n_in};
    const int64_t n_thr = pool ? pool->n_threads() : 1;
    const int64_t n_xt  = n_rows * ldxw < (32 << 10) ? 1 : std::min(n_rows, n_thr);
    for_tasks(pool, n_xt, [&](int64_t t) {
        widen_rows(xw, x, n_rows * t / n_xt, n_rows * (t + 1) / n_xt, n_in, ldxw);
    });
    // Tasks: whole 24-output groups; one row as decode_task_outputs says for streams (long
    // tasks: long streams), more rows one range per thread.
    const int64_t row_bytes = n_in * (wtype == WType::bf16 ? 2 : 4);
    int64_t       per_task;
    if (n_rows == 1) {
        per_task = decode_task_outputs(n_out, row_bytes, n_thr, true);
    } else {
        per_task = ((n_out + 23) / 24 + n_thr - 1) / n_thr * 24;
    }
    for_tasks(pool, (n_out + per_task - 1) / per_task, [&](int64_t t) {
        const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
        if (n_rows == 1) {
            outputs_one_row(p, o0, o1);
        } else if (n_rows == 2) {
            outputs<2, 2>(p, o0, o1);
        } else {
            outputs_many<5, 2>(p, o0, o1);  // 5 x 2 tiles (6 x 2: GCC spills accumulators)
        }
    });
}

#else  // no AVX2 target: never chosen (cpu_has_avx2_fma() is false)

bool cpu_has_avx2_fma() { return false; }
void round_to_bf16_avx2(uint16_t *, const float *, int64_t) {}
void dpbf16_step_avx2(float *, const uint16_t *, const uint16_t *) {}
void linear_bf16_avx2(float *, const float *, const void *, WType, const float *, int64_t, int64_t, int64_t, ThreadPool *) {}

#endif

}  // namespace fd::kernels::detail
