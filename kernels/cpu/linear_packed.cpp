// Batch-invariant linear, many rows: packed x, weight strips (GotoBLAS-style blocking). The
// arithmetic, and the lane order both operands follow, are matmul.cpp's (see its header).
//
// x is packed once per call (tiles split over the threads) into "vector steps" of 16 k's in the
// weights' lane order (f32: k = 16v + lane; bf16: step s of 32 k's is vector steps 2s (lo) and
// 2s + 1 (hi), bf16_lane_k order), the tail zero-padded exactly as the one-row path pads it, in
// tiles of kMR rows, k chunk major ([chunk][tile][vstep][kMR][16], x_offset: one contiguous
// stream per chunk). Weights are packed in strips of kNR rows (bf16 widened, a partial last step
// zero-padded; [vstep][kNR][16]); the stored weights are never written. Vector step v of a (row,
// output) pair is then the very FMA the one-row path runs at its step v (bf16: lo before hi), so
// the packed kernel runs the one-row path's chain.
// Blocking for a 48 KiB L1 / 1 MiB L2 core (GotoBLAS loop order): a task owns a range of outputs
// and every row. It takes its outputs a chunk at a time (packed weights <= 1 MiB, kept in L3),
// and within a chunk the rows a block at a time (packed x <= 512 KiB, kept in L2); a strip's k
// chunk (<= 24 KiB) sits in L1 while every x tile of the block meets it. The first block of rows
// packs each strip chunk into the chunk's buffer as it reaches it; the later blocks read the
// packed copy, so the stored weights are read and packed once per call (they were once per
// block of rows: 12 times at 2048 rows of 768). The 4 x 6 kernel runs a whole column of tiles
// per call and keeps its 24 lane reductions in registers up to the store. Packed x, the weight
// chunk and the carry live in 2 MiB huge pages (scratch.h): a 480 KiB x block is one page, not
// 120, which alone took M=2048 from 0.92 to about 0.96 of OpenBLAS sgemm.
// Tried and dropped (measured no better here): software prefetch of the next packed strip (into
// L1 or L2, whole or over the column's last tiles: 2-5 % slower), weight chunks of 2-8 MiB, x
// blocks of 256-768 KiB, k chunks of 512 or 2048, unpacked x and weights read from their rows
// (f32: 5-8 % slower at M >= 512), unpacked weights with packed x (equal at M >= 512).
#include "linear_packed.h"

#include "lanes.h"
#include "linear_step.h"
#include "scratch.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fd::kernels {
namespace {

constexpr int     kMR      = 4, kNR = 6;  ///< register tile: 24 lane accumulators, 6 weights, 1 x
constexpr int64_t kKcSteps = 64;           ///< vector steps per k chunk (1024 k's): a strip chunk
                                          ///< (6 x 1024 x 4 B = 24 KiB) stays in L1
constexpr int64_t kXBlockBytes = 512 << 10;   ///< packed x of a block of rows within this (L2)
constexpr int64_t kWChunkBytes = 1024 << 10;  ///< packed weights of a chunk of outputs (L3)
constexpr int64_t kXPrefetchFloats = 512;  ///< the kernel prefetches packed x this far ahead (8 steps)

/// Vector steps of a row of n_in k's: f32 ceil(n_in / 16), bf16 2 ceil(n_in / 32).
int64_t n_vsteps(WType t, int64_t n_in) { return t == WType::f32 ? (n_in + 15) / 16 : 2 * ((n_in + 31) / 32); }

/// Where vector step v of x tile `tile` starts in packed x (floats): k chunk major, so the tiles'
/// steps of one chunk are one contiguous stream: [chunk][tile][step in chunk][kMR][16] (n_xt
/// tiles, nv steps; only the last chunk is shorter than kKcSteps).
inline int64_t x_offset(int64_t n_xt, int64_t nv, int64_t tile, int64_t v) {
    const int64_t c0 = v / kKcSteps * kKcSteps, nk = std::min(kKcSteps, nv - c0);
    return (c0 * n_xt + tile * nk + (v - c0)) * kMR * kLanes;
}

/// Tiles [t0, t1) of x [n_rows, n_in] → xp (x_offset layout, sized by the caller: n_xt * nv *
/// kMR * 16 floats), rows past n_rows zero.
void pack_x_tiles(float * xp, const float * x, int64_t n_rows, int64_t n_in, WType t, int64_t t0, int64_t t1) {
    const int64_t nv = n_vsteps(t, n_in), n_xt = (n_rows + kMR - 1) / kMR;
    for (int64_t tile = t0; tile < t1; ++tile) {
        for (int r = 0; r < kMR; ++r) {
            const int64_t row = tile * kMR + r;
            const float * src = row < n_rows ? x + row * n_in : nullptr;
            // f32: one vector step per pass; bf16: both of a 32-k step (lo, hi) from one load.
            const int64_t vs = t == WType::f32 ? 1 : 2;
            for (int64_t v = 0; v < nv; v += vs) {
                float * d = xp + x_offset(n_xt, nv, tile, v) + r * kLanes;
                float * dh = t == WType::f32 ? nullptr : xp + x_offset(n_xt, nv, tile, v + 1) + r * kLanes;
                if (row >= n_rows) {
                    std::memset(d, 0, sizeof(float) * kLanes);
                    if (dh) { std::memset(dh, 0, sizeof(float) * kLanes); }
                    continue;
                }
                if (t == WType::f32) {
                    const int64_t k0 = v * kLanes, n = std::min<int64_t>(kLanes, n_in - k0);
                    if (n == kLanes) {
                        std::memcpy(d, src + k0, sizeof(float) * kLanes);
                    } else {
                        std::memset(d, 0, sizeof(float) * kLanes);
                        std::memcpy(d, src + k0, sizeof(float) * n);
                    }
                } else {
                    const int64_t base = (v / 2) * 32;
                    permute_bf16_step(src + base, n_in - base, d, dh);
                }
            }
        }
    }
}

/// Weight rows [o, o + n) (n <= kNR), vector steps [v0, v0 + nk) → dst [nk][kNR][16] as f32 in
/// lane order (v0 and nk whole steps of T); outputs past n zero (results not stored).
template <WType T>
void pack_strip(float * dst, const char * w, int64_t n_in, int64_t o, int n, int64_t v0, int64_t nk) {
    const int64_t row_bytes = n_in * Step<T>::kElemBytes;
    for (int c = 0; c < kNR; ++c) {
        float * d = dst + c * kLanes;
        if (c >= n) {
            for (int64_t v = 0; v < nk; ++v) { std::memset(d + v * kNR * kLanes, 0, sizeof(float) * kLanes); }
            continue;
        }
        const char * row = w + (o + c) * row_bytes;
        for (int64_t v = 0; v < nk; v += Step<T>::V) {
            const int64_t k = (v0 + v) / Step<T>::V * Step<T>::K;
            f32x16        wv[Step<T>::V];
            load_w<T>(row, k, static_cast<int>(std::min<int64_t>(Step<T>::K, n_in - k)), wv);
            for (int u = 0; u < Step<T>::V; ++u) { std::memcpy(d + (v + u) * kNR * kLanes, &wv[u], sizeof(f32x16)); }
        }
    }
}

/// A column of kMR x kNR tiles (consecutive x tiles against one strip chunk) and where their
/// lanes start and end: from zero or the carry, to the carry or (reduced, plus the bias) to out.
struct Tiles {
    const float * xp;      ///< the first tile's packed x at the chunk's first step
    int64_t       xstride; ///< floats from one tile's packed x to the next's
    const void *  wp;      ///< packed: the strip chunk [n_steps][kNR][16] f32; rows: the first
                           ///< output's stored row at the chunk's first k
    int64_t       ldw;     ///< rows: elements from one output's row to the next (n_in)
    int64_t       n_steps; ///< vector steps in the chunk
    int64_t       n_tiles;
    f32x16 *      carry;   ///< [n_tiles][kMR * kNR] lanes between k chunks
    float *       out;     ///< out [n_rows, ldo] at the first tile's first output
    int64_t       ldo;
    const float * bias;    ///< [n_cols] or nullptr
    int           last_rows;  ///< rows of the last tile to store (1..kMR; the others kMR)
    int           n_cols;  ///< outputs of each tile to store (1..kNR)
};

/// Where packed_tiles takes its weights: the packed strip chunk, or each output's stored row
/// (f32 or bf16, widened in registers exactly as pack_strip widens it).
enum class WSrc { packed, f32_rows, bf16_rows };

/// Element bytes of WSrc K's weights.
constexpr int64_t wsrc_bytes(WSrc k) { return k == WSrc::bf16_rows ? 2 : 4; }

#if defined(FD_LINEAR_AVX2)
/// AVX2 (16 ymm registers) pass of packed_tiles over one tile: rows [R0, R0 + 2) x every column,
/// lanes 8h..8h+7 only, so 2 x kNR = 12 accumulators stay in registers (acc [kMR][kNR] in and out
/// as f32x16). Per lane the very FMA chain of the AVX-512 kernel: each lane is independent of the
/// others, so splitting lanes and rows into passes changes which loads feed an FMA, not its operands.
template <WSrc kW, int R0, int h>
__attribute__((noinline)) void tile_pass_avx2(f32x16 (&acc)[kMR][kNR], const float * xp, const char * const (&wr)[kNR],
                                              int64_t n) {
    constexpr int R = 2;
    __m256 a[R][kNR];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < kNR; ++c) { std::memcpy(&a[r][c], reinterpret_cast<const char *>(&acc[R0 + r][c]) + 32 * h, 32); }
    }
    const __m256i z = _mm256_setzero_si256();
    for (int64_t s = 0; s < n; ++s) {
        const float * xs = xp + s * kMR * kLanes + 8 * h;
        _mm_prefetch(reinterpret_cast<const char *>(xs + kXPrefetchFloats + R0 * kLanes), _MM_HINT_T0);
        __m256 xv[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) { xv[r] = _mm256_loadu_ps(xs + (R0 + r) * kLanes); }
#pragma GCC unroll 8
        for (int c = 0; c < kNR; ++c) {
            __m256 w;
            if constexpr (kW == WSrc::packed) {
                w = _mm256_loadu_ps(reinterpret_cast<const float *>(wr[0]) + (s * kNR + c) * kLanes + 8 * h);
            } else if constexpr (kW == WSrc::f32_rows) {
                w = _mm256_loadu_ps(reinterpret_cast<const float *>(wr[c]) + s * kLanes + 8 * h);
            } else {  // lanes 8h.. of vector step s: the unpack (lo even s, hi odd s) of bytes 32h.. of the 64
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wr[c] + s / 2 * 64 + 32 * h));
                w = _mm256_castsi256_ps(s % 2 ? _mm256_unpackhi_epi16(z, v) : _mm256_unpacklo_epi16(z, v));
            }
            __asm__("" : "+x"(w));  // loaded once, not folded into each row's FMA
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) { a[r][c] = _mm256_fmadd_ps(xv[r], w, a[r][c]); }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < kNR; ++c) { std::memcpy(reinterpret_cast<char *>(&acc[R0 + r][c]) + 32 * h, &a[r][c], 32); }
    }
}
#endif

/// Each tile of `t` in turn: t.n_steps vector steps on packed x, xp [n][kMR][16], and weights
/// packed, wp [n][kNR][16], or read from their rows (f32: vector step s of output c at row c's
/// element 16 s; bf16: steps 2 g and 2 g + 1 are the lo and hi unpack of row c's elements
/// 32 g .. 32 g + 31, as load_bf16_step): acc[r][c] = x * w + acc, one FMA per step, steps
/// ascending (the one-row path's chain; the same FMAs whichever way the weights arrive);
/// kFirst: lanes start at zero (else from the carry); kLast: reduce, add the bias, store (else
/// lanes to the carry). One call per column of tiles, so one tile's epilogue overlaps the next
/// one's start.
template <bool kFirst, bool kLast, WSrc kW>
__attribute__((noinline)) void packed_tiles(const Tiles & t) {
    const int64_t ldw = kW == WSrc::packed ? kLanes * 4 : t.ldw * wsrc_bytes(kW);  // bytes between outputs
    const char *  wr[kNR];  // output c's weights at the first step (past n_cols: the last one's)
    for (int c = 0; c < kNR; ++c) { wr[c] = static_cast<const char *>(t.wp) + std::min(c, t.n_cols - 1) * ldw; }
    for (int64_t tt = 0; tt < t.n_tiles; ++tt) {
        const float * xp = t.xp + tt * t.xstride;
        const int64_t n  = t.n_steps;
        f32x16 *      carry = t.carry ? t.carry + tt * kMR * kNR : nullptr;
        float *       out   = t.out + tt * kMR * t.ldo;
        const int     n_rows = tt + 1 == t.n_tiles ? t.last_rows : kMR;
#if defined(__AVX512F__)
        __m512 a[kMR][kNR];
#pragma GCC unroll 8
        for (int r = 0; r < kMR; ++r) {
#pragma GCC unroll 8
            for (int c = 0; c < kNR; ++c) {
                a[r][c] = kFirst ? _mm512_setzero_ps() : _mm512_loadu_ps(reinterpret_cast<const float *>(carry + r * kNR + c));
            }
        }
        // Weights from rows: two advancing row pointers and offsets from them ([p + L]), so the
        // loop keeps to the integer registers (an array of six row pointers spills to the stack).
        const char *  w0 = wr[0], * w3 = wr[3];
        const int64_t l1 = wr[1] - wr[0], l2 = wr[2] - wr[0], l4 = wr[4] - wr[3], l5 = wr[5] - wr[3];
        for (int64_t s = 0; s < n; ++s) {
            const float * xs = xp + s * kMR * kLanes;
#pragma GCC unroll 4
            for (int r = 0; r < kMR; ++r) {  // x streams from L2: ask for it 8 steps (2 KiB) ahead
                _mm_prefetch(reinterpret_cast<const char *>(xs + kXPrefetchFloats + r * kLanes), _MM_HINT_T0);
            }
            __m512 w[kNR];
            if constexpr (kW == WSrc::packed) {
                const float * ws = reinterpret_cast<const float *>(w0) + s * kNR * kLanes;
#pragma GCC unroll 8
                for (int c = 0; c < kNR; ++c) { w[c] = _mm512_loadu_ps(ws + c * kLanes); }
            } else if constexpr (kW == WSrc::f32_rows) {
                const float * p0 = reinterpret_cast<const float *>(w0) + s * kLanes;
                const float * p3 = reinterpret_cast<const float *>(w3) + s * kLanes;
                w[0] = _mm512_loadu_ps(p0), w[1] = _mm512_loadu_ps(p0 + l1 / 4), w[2] = _mm512_loadu_ps(p0 + l2 / 4);
                w[3] = _mm512_loadu_ps(p3), w[4] = _mm512_loadu_ps(p3 + l4 / 4), w[5] = _mm512_loadu_ps(p3 + l5 / 4);
            } else {
                // 32 bf16 per 64 bytes: even s the lo unpack (bf16 << 16 in lanes 0-3 of each
                // 128-bit group's k's, as load_bf16_step), odd s the hi unpack of the same bytes.
                const char *  p0 = w0 + s / 2 * 64, * p3 = w3 + s / 2 * 64;
                const __m512i z  = _mm512_setzero_si512();
                auto          wv = [&](const char * p) {
                    const __m512i v = _mm512_loadu_si512(p);
                    return _mm512_castsi512_ps(s % 2 ? _mm512_unpackhi_epi16(z, v) : _mm512_unpacklo_epi16(z, v));
                };
                w[0] = wv(p0), w[1] = wv(p0 + l1), w[2] = wv(p0 + l2), w[3] = wv(p3), w[4] = wv(p3 + l4), w[5] = wv(p3 + l5);
            }
            // Loaded once, not folded into each row's FMA.
            __asm__("" : "+v"(w[0]), "+v"(w[1]), "+v"(w[2]), "+v"(w[3]), "+v"(w[4]), "+v"(w[5]));
#pragma GCC unroll 8
            for (int r = 0; r < kMR; ++r) {
                __m512 xv = _mm512_loadu_ps(xs + r * kLanes);
                __asm__("" : "+v"(xv));
#pragma GCC unroll 8
                for (int c = 0; c < kNR; ++c) { a[r][c] = _mm512_fmadd_ps(xv, w[c], a[r][c]); }
            }
        }
#else
        f32x16 acc[kMR][kNR];
        for (int r = 0; r < kMR; ++r) {
            for (int c = 0; c < kNR; ++c) { acc[r][c] = kFirst ? f32x16{} : carry[r * kNR + c]; }
        }
#if defined(FD_LINEAR_AVX2)
        static_assert(kMR == 4, "two passes of 2 rows");
        tile_pass_avx2<kW, 0, 0>(acc, xp, wr, n);
        tile_pass_avx2<kW, 2, 0>(acc, xp, wr, n);
        tile_pass_avx2<kW, 0, 1>(acc, xp, wr, n);
        tile_pass_avx2<kW, 2, 1>(acc, xp, wr, n);
#else
        for (int64_t s = 0; s < n; ++s) {
            f32x16 wv[kNR];
            for (int c = 0; c < kNR; ++c) {
                if constexpr (kW == WSrc::packed) {
                    wv[c] = load16(reinterpret_cast<const float *>(wr[0]) + (s * kNR + c) * kLanes);
                } else if constexpr (kW == WSrc::f32_rows) {
                    wv[c] = load16(reinterpret_cast<const float *>(wr[c]) + s * kLanes);
                } else {
                    f32x16 two[2];
                    load_bf16_step(reinterpret_cast<const uint16_t *>(wr[c] + s / 2 * 64), two[0], two[1]);
                    wv[c] = two[s % 2];
                }
            }
            for (int r = 0; r < kMR; ++r) {
                const f32x16 xv = load16(xp + (s * kMR + r) * kLanes);
                for (int c = 0; c < kNR; ++c) { acc[r][c] += xv * wv[c]; }
            }
        }
#endif
#endif
#if defined(__AVX512F__)
        static_assert(kMR * kNR == 24 && kNR == 6, "the loads above name 6 weights; the epilogue places 16 + 8 sums");
        if constexpr (!kLast) {
#pragma GCC unroll 8
            for (int r = 0; r < kMR; ++r) {
#pragma GCC unroll 8
                for (int c = 0; c < kNR; ++c) { _mm512_storeu_ps(reinterpret_cast<float *>(carry + r * kNR + c), a[r][c]); }
            }
        } else {
            store_4x6(out, t.ldo, t.bias, &a[0][0], n_rows, t.n_cols);
        }
#else
        if constexpr (!kLast) {
            std::memcpy(carry, &acc[0][0], sizeof acc);
        } else {
            float sums[kMR * kNR];
            reduce_all(&acc[0][0], kMR * kNR, sums);
            for (int r = 0; r < n_rows; ++r) {
                for (int c = 0; c < t.n_cols; ++c) {
                    float v = sums[r * kNR + c];
                    if (t.bias) { v += t.bias[c]; }
                    out[r * t.ldo + c] = v;
                }
            }
        }
#endif
    }
}

/// Outputs per chunk of packed weights: whole strips whose packed f32 copy fits kWChunkBytes.
int64_t chunk_outputs(int64_t nv) {
    const int64_t strip_bytes = nv * kNR * kLanes * 4;
    return std::max<int64_t>(1, kWChunkBytes / strip_bytes) * kNR;
}

/// One task of the many-row path: every row x outputs [o0, o1) (o0 a multiple of kNR; xp from
/// pack_x_tiles, w the stored weights, rows cut into blocks of mc). Outputs are taken a chunk (packed
/// copy <= kWChunkBytes) at a time; within it, block of rows by block of rows (packed x in L2),
/// strip by strip and k chunk by k chunk: the strip chunk (in L1) meets every x tile of the
/// block, lane sums parked exactly in a per-tile carry between k chunks. The first block of rows
/// packs each strip chunk (bf16 widened) into the chunk's buffer just before it uses it; the
/// others read it from there (L3), so the stored weights are read, and packed, once per call.
/// kDirect (one block of rows, one k chunk, no partial step): nothing to reuse, so the strips
/// are read from the weights' own rows (bf16 widened in registers) instead of packed.
template <WType T, bool kDirect>
void packed_task(float * out, const float * xp, const char * w, const float * bias, int64_t n_in, int64_t nv,
                 int64_t n_rows, int64_t mc, int64_t n_out, int64_t o0, int64_t o1) {
    const int64_t n_chunks = (nv + kKcSteps - 1) / kKcSteps, strip_floats = nv * kNR * kLanes;
    const int64_t n_xt = (n_rows + kMR - 1) / kMR;
    const int64_t oc = chunk_outputs(nv);
    thread_local HugeScratch<f32x16> carry_buf;
    thread_local HugeScratch<float>  wbuf_buf;
    const int64_t max_tiles = (mc + kMR - 1) / kMR;
    f32x16 * const carry = n_chunks > 1 ? carry_buf.get(static_cast<size_t>(max_tiles * kMR * kNR)) : nullptr;
    constexpr WSrc kW    = !kDirect ? WSrc::packed : T == WType::f32 ? WSrc::f32_rows : WSrc::bf16_rows;
    float * const  wbuf  = kDirect ? nullptr : wbuf_buf.get(static_cast<size_t>((std::min(oc, o1 - o0) + kNR - 1) / kNR * strip_floats));
    for (int64_t c0 = o0; c0 < o1; c0 += oc) {
        const int64_t c1 = std::min(o1, c0 + oc);
        for (int64_t r0 = 0; r0 < n_rows; r0 += mc) {
            const int64_t r1 = std::min(n_rows, r0 + mc), n_tiles = (r1 - r0 + kMR - 1) / kMR;
            for (int64_t o = c0; o < c1; o += kNR) {
                const int n  = static_cast<int>(std::min<int64_t>(kNR, c1 - o));
                float *   ws = kDirect ? nullptr : wbuf + (o - c0) / kNR * strip_floats;
                for (int64_t v0 = 0; v0 < nv; v0 += kKcSteps) {
                    const int64_t nk = std::min(kKcSteps, nv - v0);
                    const bool    first = v0 == 0, last = v0 + nk == nv;
                    float *       wk = kDirect ? nullptr : ws + v0 * kNR * kLanes;
                    if (!kDirect && r0 == 0) { pack_strip<T>(wk, w, n_in, o, n, v0, nk); }
                    const void *  wd = kDirect ? static_cast<const void *>(w + (o * n_in + v0 * kLanes) * Step<T>::kElemBytes) : wk;
                    const Tiles t{.xp = xp + x_offset(n_xt, nv, r0 / kMR, v0), .xstride = nk * kMR * kLanes, .wp = wd, .ldw = n_in, .n_steps = nk,
                                  .n_tiles = n_tiles, .carry = carry,
                                  .out = out + r0 * n_out + o, .ldo = n_out, .bias = bias ? bias + o : nullptr,
                                  .last_rows = static_cast<int>(r1 - r0 - (n_tiles - 1) * kMR), .n_cols = n};
                    if (first && last) {
                        packed_tiles<true, true, kW>(t);
                    } else if (first) {
                        packed_tiles<true, false, kW>(t);
                    } else if (last) {
                        packed_tiles<false, true, kW>(t);
                    } else {
                        packed_tiles<false, false, kW>(t);
                    }
                }
            }
        }
    }
}

}  // namespace

namespace detail {

void linear_packed(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
                   int64_t n_out, int64_t n_in, ThreadPool * pool) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    const char * wb = static_cast<const char *>(w);
    // x packed once (tiles split over the threads); tasks of whole strips of outputs x every row,
    // so each task packs its own weights once; at least one range per thread.
    thread_local HugeScratch<float> xp;  // the caller's thread only: tasks read it
    const int64_t nv = n_vsteps(wtype, n_in), vbytes = nv * kLanes * 4;  // packed bytes of one row
    const int64_t n_xt = (n_rows + kMR - 1) / kMR;
    float * xpk = xp.get(static_cast<size_t>(n_xt * nv * kMR * kLanes));  // (a thread_local named inside a task would be the worker's own)
    const int64_t n_thr = pool ? pool->n_threads() : 1;
    const int64_t n_xtasks = std::min<int64_t>(n_xt, n_thr);
    for_tasks(pool, n_xtasks, [&](int64_t t) {
        pack_x_tiles(xpk, x, n_rows, n_in, wtype, n_xt * t / n_xtasks, n_xt * (t + 1) / n_xtasks);
    });
    const int64_t mc_max   = std::max<int64_t>(kMR, kXBlockBytes / vbytes / kMR * kMR);
    const int64_t n_rb     = (n_rows + mc_max - 1) / mc_max;  // blocks of rows of about equal size
    const int64_t mc       = ((n_rows + n_rb - 1) / n_rb + kMR - 1) / kMR * kMR;
    const int64_t n_strips = (n_out + kNR - 1) / kNR;
    const int64_t n_or     = std::min(n_strips, n_thr);
    // One block of rows meets each weight strip once: packing it would only cost a copy. (Not
    // past one k chunk: rows 8 KiB apart and more then share L1 sets, 2-3 % slower at K = 2048;
    // nor with a partial last step, which the rows do not pad.)
    const bool direct = n_rb == 1 && n_in % Step<WType::bf16>::K == 0 && nv <= kKcSteps;
    for_tasks(pool, n_or, [&](int64_t t) {
        const int64_t o0 = n_strips * t / n_or * kNR, o1 = std::min(n_out, n_strips * (t + 1) / n_or * kNR);
        if (o0 >= o1) { return; }
        auto run = [&](auto dtype, auto is_direct) {
            packed_task<decltype(dtype)::value, decltype(is_direct)::value>(out, xpk, wb, bias, n_in, nv, n_rows, mc, n_out, o0, o1);
        };
        using F32 = std::integral_constant<WType, WType::f32>;
        using BF16 = std::integral_constant<WType, WType::bf16>;
        if (wtype == WType::f32) {
            direct ? run(F32{}, std::true_type{}) : run(F32{}, std::false_type{});
        } else {
            direct ? run(BF16{}, std::true_type{}) : run(BF16{}, std::false_type{});
        }
    });
}

}  // namespace detail
}  // namespace fd::kernels
