// The AVX2 + FMA path of the bf16 compute mode for three rows and more (linear_bf16_avx2.cpp's
// header has the arithmetic: the same lanes, DAZ / FTZ and NaN rules, the same bits as the
// portable path; it calls outputs_many from linear_bf16_avx2).
// Tiles (issue 28 "bf16 tiles on AVX2" in docs/benchmarks.md): an output's lanes
// 0-7 and 8-15 never meet before the reduction, so a tile runs half 0 over all k, then half 1
// (half_steps): 5 x 2 or 4 x 2 outputs, 10 / 8 accumulators plus the 2 columns' widened weights
// in the 16 ymm, each row's x loaded once per half step (2 x 2 both halves was FMA-latency bound
// with 8 chains of 2 dependent FMAs a step, and x became memory operands, one load per FMA).
// Outputs go in blocks of ~192 KiB of bf16 weights (L2; f32 weights rounded, and bf16 rows with
// a partial last step zero-padded, into scratch a block at a time, so the steps never meet a
// tail); each row tile (its x in L1) meets every 24-output group of the block, the group's steps
// under one MXCSR setting (per tile it cost as much as the steps at n_in = 512), and the next
// block is prefetched into L2 meanwhile. Half 1 adds half 0's lanes (reduce16's first level) and
// the epilogue reduces 8 outputs of a row at once.
#include "linear_bf16_avx2_shared.h"

#include "bf16_portable.h"
#include "lanes.h"
#include "scratch.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace fd::kernels::detail {

#if defined(FD_HAVE_AVX2_TARGET)
namespace {

constexpr int64_t  kWBlockBytes = 192 << 10;     ///< bf16 weights of an output block, many rows (L2;
                                                  ///< 96 and 384 KiB measured the same)

/// Lanes 8h .. 8h + 7 of every output of an MR x NR tile over n_steps steps (DAZ set by the
/// caller): the half-pass form for many rows. A lane's chain never meets another lane's before
/// the reduction, so half 0 over all k then half 1 runs each lane's very FMAs in the very order
/// while only MR x NR accumulators are live (not 2 x MR x NR). Per step: the NR columns' odd
/// weights widened (AND), each row's odd x against them, then the even ones (shift) likewise
/// (MR x NR + NR + 1 ymm and the mask). wr: whole steps only (n_steps; the caller pads a tail).
/// lanes: row r's output c at lanes + r * ldl + 16 c: half 0 stores its 8 last lanes (the passes
/// start from zero; denormals flushed to zeros of their sign), half 1 stores lanes i + (i + 8). kPrefetch: each step prefetches its line
/// of wr[c] + pf_ahead (the next strip's rows).
template <int MR, int NR, int h, bool kPrefetch>
FD_AVX2_TARGET __attribute__((noinline)) void half_steps(float * lanes, int64_t ldl, const float * const (&xr)[MR],
                                                         const uint16_t * const (&wr)[NR], int64_t n_steps, int64_t hk,
                                                         int64_t pf_ahead) {
    __m256 a[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { a[r][c] = _mm256_setzero_ps(); }
    }
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t off = s * 16 + h * hk, k = s * kStepK + 16 * h;
#pragma GCC unroll 2
        for (int e = 0; e < 2; ++e) {  // the odd pair (e = 0) first, then the even one
            __m256 w[NR];
#pragma GCC unroll 8
            for (int c = 0; c < NR; ++c) {
                if (kPrefetch && h == 0 && e == 0) { _mm_prefetch(reinterpret_cast<const char *>(wr[c] + pf_ahead + k), _MM_HINT_T0); }
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wr[c] + k));
                w[c] = _mm256_castsi256_ps(e == 0 ? _mm256_and_si256(v, top) : _mm256_slli_epi32(v, 16));
            }
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
                __m256 xv = _mm256_loadu_ps(xr[r] + off + 8 * e);
                __asm__("" : "+x"(xv));  // loaded once for the NR columns (not an FMA memory operand per column)
#pragma GCC unroll 8
                for (int c = 0; c < NR; ++c) { a[r][c] = _mm256_fmadd_ps(xv, w[c], a[r][c]); }
            }
        }
    }
    const __m256i expo = _mm256_set1_epi32(0x7F800000), mag = _mm256_set1_epi32(0x7FFFFFFF);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {  // the last lanes: denormal → zero of its sign (integer ops, as flush_lanes)
            const __m256i v = _mm256_castps_si256(a[r][c]);
            const __m256i z = _mm256_cmpeq_epi32(_mm256_and_si256(v, expo), _mm256_setzero_si256());
            const __m256  f = _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_and_si256(z, mag), v));
            float *       l = lanes + r * ldl + c * 16;
            // half 1 adds half 0's stored lanes: reduce16's first level (lane i + lane i + 8,
            // both flushed, so DAZ plays no part; FTZ is clear)
            _mm256_storeu_ps(l, h == 0 ? f : _mm256_add_ps(_mm256_loadu_ps(l), f));
        }
    }
}

constexpr int kGroup = 24;  ///< outputs per group_steps_daz call (many rows)

/// reduce16 (lanes.h) of one output from its first level s8[i] = lane i + lane i + 8: the same
/// adds in the same order (then i + (i + 4), then (0 + 2) and (1 + 3), then those two).
inline float reduce8(const float * s8) {
    f32x4 l4, h4;
    std::memcpy(&l4, s8, sizeof l4);
    std::memcpy(&h4, s8 + 4, sizeof h4);
    const f32x4 s4  = l4 + h4;
    const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
    return s2a + s2b;
}

/// reduce8 of 8 outputs at once, transposed as lanes.h's reduce16_x8_avx2 after its first level:
/// output j's s8 at s8 + 16 j → out[j], bitwise reduce8 (and so reduce16 of its 16 lanes).
FD_AVX2_TARGET inline void reduce8_x8(const float * s8, float * out) {
    __m256 v[8], q[4], t[2];
    for (int i = 0; i < 8; ++i) { v[i] = _mm256_loadu_ps(s8 + 16 * i); }
    for (int i = 0; i < 4; ++i) {  // [a: i + (i+4) | b: i + (i+4)], (a, b) = outputs 2i, 2i + 1
        q[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20), _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    }
    for (int i = 0; i < 2; ++i) {  // per 128 bits [p0+p2, p1+p3, q0+q2, q1+q3]
        t[i] = _mm256_add_ps(_mm256_shuffle_ps(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(q[2 * i], q[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/// Many rows: the steps of an MR-row tile against n_o <= kGroup outputs, NR at a time, half 0
/// over every (padded) step then half 1, under one MXCSR.DAZ setting for the group (restored
/// before returning: setting it costs as much as a 512-k tile's steps). lanes [MR][kGroup][16]
/// written (outputs [0, ceil(n_o / NR) * NR) of each row); ww: the group's widened weight rows,
/// ldww floats apart.
template <int MR, int NR, bool kPrefetch>
__attribute__((noinline)) void group_steps_daz(float * lanes, const float * const (&xr)[MR], const uint16_t * wb, int64_t ldw,
                                               int n_o, int64_t n_steps, int64_t hk) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr | kDaz) & ~kFtz);
    for (int s = 0; s * NR < n_o; ++s) {
        const uint16_t * wr[NR];
        for (int c = 0; c < NR; ++c) { wr[c] = wb + std::min(s * NR + c, n_o - 1) * ldw; }  // past n_o: the last output again (not stored)
        float *       ls  = lanes + s * NR * kLanes;  // row r's output j at lanes + (r * kGroup + j) * 16
        const int64_t ldl = kGroup * kLanes;
        // kPrefetch (the weights' first meeting, from memory): a step's line of each row of the
        // next strip (NR rows on), a strip ahead of its use
        half_steps<MR, NR, 0, kPrefetch>(ls, ldl, xr, wr, n_steps, hk, NR * ldw);
        half_steps<MR, NR, 1, false>(ls, ldl, xr, wr, n_steps, hk, 0);
    }
    _mm_setcsr(csr);
}

/// Rows [r, r + n_r) (n_r <= MR) x outputs [o, o + n_o) (n_o <= kGroup) over the whole k: the
/// steps (group_steps_daz: its half passes flush the last lanes), reduced, the NaN fallback, the
/// bias. ww: output o's widened weight row (ldww floats apart).
template <int MR, int NR, bool kPrefetch>
FD_AVX2_TARGET void tile_group(const Problem & p, int64_t r, int n_r, int64_t o, int n_o, const uint16_t * wb, int64_t ldw) {
    const float * xr[MR];
    for (int i = 0; i < MR; ++i) { xr[i] = p.xw + (r + std::min(i, n_r - 1)) * p.ldxw; }
    alignas(64) f32x16 lanes[MR * kGroup];  // [row][output]: a row's sums reduce in order
    float * lf = reinterpret_cast<float *>(lanes);
    group_steps_daz<MR, NR, kPrefetch>(lf, xr, wb, ldw, n_o, padded_k(p.n_in) / kStepK, padded_k(p.n_in) / 2);
    const int64_t row_bytes = p.n_in * (p.wtype == WType::f32 ? 4 : 2);
    for (int i = 0; i < n_r; ++i) {
        alignas(32) float sums[kGroup];
        const float *     s8 = lf + i * kGroup * kLanes;  // output j's lanes i + (i + 8) at s8 + 16 j
        int               j8 = 0;
        for (; j8 + 8 <= n_o; j8 += 8) { reduce8_x8(s8 + j8 * kLanes, sums + j8); }
        for (; j8 < n_o; ++j8) { sums[j8] = reduce8(s8 + j8 * kLanes); }
        float * out = p.out + (r + i) * p.n_out + o;
        int     j   = 0;
        for (; j + 8 <= n_o; j += 8) {  // 8 outputs: no NaN (the usual case), then + bias, as the scalar code
            const __m256 v = _mm256_load_ps(sums + j);
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0) { break; }
            _mm256_storeu_ps(out + j, p.bias ? _mm256_add_ps(v, _mm256_loadu_ps(p.bias + o + j)) : v);
        }
        for (; j < n_o; ++j) {  // the rest and any 8 with a NaN: one by one
            float v = sums[j];
            if (std::isnan(v)) { v = dot_portable(p.x + (r + i) * p.n_in, p.w + (o + j) * row_bytes, p.wtype, p.n_in); }
            if (p.bias) { v += p.bias[o + j]; }
            out[j] = v;
        }
    }
}

}  // namespace

/// Outputs [o0, o1) of every row, many rows: outputs in blocks of ~kWBlockBytes of widened
/// weights (L2), each block widened once (odd / even f32, as x) and met by every MR-row tile in
/// turn, so a tile reads x from L1 and its weights from L2, with no widening in the steps.
template <int MR, int NR>
void outputs_many(const Problem & p, int64_t o0, int64_t o1) {
    const int64_t kp = padded_k(p.n_in);
    const int64_t ob = std::max<int64_t>(kGroup, kWBlockBytes / (kp * 2) / kGroup * kGroup);
    // n_rows = MR a + (MR - 1) b with b = -n_rows mod MR (below MR (MR - 2) rows, tiles of MR - 1
    // only when that does not fit): MR-row tiles are the faster, MR - 1 ones fill the rest
    // without idle rows.
    int64_t rs = (MR - p.n_rows % MR) % MR * (MR - 1);
    if (rs > p.n_rows) { rs = p.n_rows; }
    // bf16 rows of a whole number of steps are read in place; f32 ones (rounded) and others
    // (zero-padded) are copied into scratch a block at a time, so the steps never meet a tail.
    const bool in_place = p.wtype == WType::bf16 && p.n_in % kStepK == 0;
    thread_local detail::ScratchVec<uint16_t> scratch;
    for (int64_t c0 = o0; c0 < o1; c0 += ob) {
        const int64_t    c1  = std::min(o1, c0 + ob);
        const uint16_t * wb  = reinterpret_cast<const uint16_t *>(p.w) + c0 * p.n_in;
        int64_t          ldw = p.n_in;
        if (!in_place) {
            scratch.resize(static_cast<size_t>((c1 - c0) * kp));
            for (int64_t c = c0; c < c1; ++c) {
                uint16_t * d = scratch.data() + (c - c0) * kp;
                if (p.wtype == WType::f32) {
                    round_row(d, reinterpret_cast<const float *>(p.w) + c * p.n_in, p.n_in, kp);
                } else {
                    std::memcpy(d, wb + (c - c0) * p.n_in, sizeof(uint16_t) * p.n_in);
                    std::memset(d + p.n_in, 0, sizeof(uint16_t) * (kp - p.n_in));
                }
            }
            wb = scratch.data(), ldw = kp;
        }
        // The next block's weights (in place: read from memory by its first row tile) are
        // prefetched into L2 a slice per (row tile, group) of this block, so that tile does not
        // wait on memory latency line by line.
        const char *  nb      = c1 < o1 && in_place ? p.w + c1 * p.n_in * 2 : nullptr;
        const int64_t nb_ln   = nb ? (std::min(o1, c1 + ob) - c1) * p.n_in * 2 / 64 : 0;
        const int64_t n_slice = ((p.n_rows + MR - 1) / MR + 1) * ((c1 - c0 + kGroup - 1) / kGroup);
        const int64_t per     = (nb_ln + n_slice - 1) / n_slice;
        int64_t       ln      = 0;
        for (int64_t r = 0; r < p.n_rows;) {
            const bool small = r < rs;  // rows [0, rs) in tiles of MR - 1, the rest in tiles of MR
            const int  n_r   = static_cast<int>(std::min<int64_t>(small ? MR - 1 : MR, (small ? rs : p.n_rows) - r));
            const bool pf    = r == 0 && in_place;  // the block's first meeting: from memory, prefetched
            for (int64_t o = c0; o < c1; o += kGroup) {
                for (int64_t e = std::min(nb_ln, ln + per); ln < e; ++ln) { _mm_prefetch(nb + ln * 64, _MM_HINT_T1); }
                const int        n_o = static_cast<int>(std::min<int64_t>(kGroup, c1 - o));
                const uint16_t * ws  = wb + (o - c0) * ldw;
                if (small) {
                    pf ? tile_group<MR - 1, NR, true>(p, r, n_r, o, n_o, ws, ldw) : tile_group<MR - 1, NR, false>(p, r, n_r, o, n_o, ws, ldw);
                } else {
                    pf ? tile_group<MR, NR, true>(p, r, n_r, o, n_o, ws, ldw) : tile_group<MR, NR, false>(p, r, n_r, o, n_o, ws, ldw);
                }
            }
            r += n_r;
        }
    }
}

template void outputs_many<5, 2>(const Problem & p, int64_t o0, int64_t o1);

#endif  // FD_HAVE_AVX2_TARGET

}  // namespace fd::kernels::detail
