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
// Paths: up to 8 rows (decode; bf16 too since issue 23) stream the weights from their rows
// in register tiles (this file); more rows run on packed x (linear_packed.cpp), the
// weights packed once per call or, when every strip meets the rows only once, read from their
// rows. Tiles and packing only decide which loads feed an FMA, never
// the arithmetic, so a row's result is bitwise the same for any batch size, batch position, path,
// tiling or thread count.
#include "fd/kernels/cpu_ops.h"
#include "lanes.h"
#include "linear_packed.h"
#include "linear_step.h"
#include "scratch.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif
namespace fd::kernels {
namespace {

constexpr int64_t kDirectRows = 8;  ///< f32 weights, up to this many rows: streamed, not packed
constexpr int64_t kShortRowBytes = 4096;  ///< one-row path: rows shorter than this prefetch the next tile (TileArgs::pf)
#if defined(__AVX512BW__)
constexpr int kStripNR = 8;  ///< one-row path: outputs per tile (8 accumulators of 16 lanes)
#else
constexpr int kStripNR = 4;  ///< one-row path: outputs per tile (two ymm per 16-lane accumulator)
#endif

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
    /// kPrefetch with short weight rows: the next tile's weights (NR rows, contiguous after this
    /// tile's), prefetched as one sequential stream, NR cache lines per step (a step reads one
    /// line of each of the NR rows, so the stream covers the next tile as this one ends). nullptr:
    /// each row's own line 512 bytes ahead (rows long enough for that to stay inside them).
    const char *  pf = nullptr;
};

#if defined(__AVX512BW__)
/// `n_steps` whole steps of a tile with AVX-512 intrinsics. The weights of a step are loaded
/// once into registers (left to itself the compiler folds each load into every row's FMA:
/// MR x NR loads per step instead of MR + NR). The same FMAs in the same order as the generic
/// step in tile(): acc = x * w + acc, one rounding each, rows' x vectors lo before hi.
/// kPrefetch: one streaming row, keep ~512 bytes of each weight row in flight (or, with `pf`,
/// stream the next tile's weights: TileArgs::pf).
template <WType T, int MR, int NR, bool kPrefetch>
__attribute__((noinline)) void whole_steps(f32x16 (&acc)[MR][NR], const float * const (&xr)[MR],
                                           const char * const (&wr)[NR], int64_t n_steps, const char * pf) {
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
            if (kPrefetch) { __builtin_prefetch(pf ? pf + (s * NR + c) * 64 : wr[c] + k * S::kElemBytes + 512, 0, 3); }
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
#if defined(__AVX512BW__)
#define FD_HAVE_WHOLE_STEPS 1
#endif

#if defined(FD_LINEAR_AVX2)
/// AVX2 (16 ymm registers) counterpart of whole_steps: columns [C0, C0 + G) of the tile over
/// `n_steps` whole steps, each lane vector as two __m256 halves (lanes 0-7, 8-15) so that MR x G x
/// 2 accumulators stay in registers. The same FMAs as the generic step in tile(), in the same order
/// per lane (each lane's chain is independent of the others'; bf16: x lo before hi).
template <WType T, int MR, int NR, int C0, int G, bool kPrefetch>
__attribute__((noinline)) void group_steps_avx2(f32x16 (&acc)[MR][NR], const float * const (&xr)[MR],
                                                const char * const (&wr)[NR], int64_t n_steps, const char * pf) {
    using S = Step<T>;
    __m256 a[MR][G][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {  // two 32-byte loads (a memcpy of the pair became 16-byte
                                        // copies through the stack, reloaded 32 bytes at a time:
                                        // a store-forwarding stall per call)
            const float * p = reinterpret_cast<const float *>(&acc[r][C0 + g]);
            a[r][g][0] = _mm256_loadu_ps(p), a[r][g][1] = _mm256_loadu_ps(p + 8);
        }
    }
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t k = s * S::K;
        if (kPrefetch) {
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) { __builtin_prefetch(pf ? pf + (s * NR + C0 + g) * 64 : wr[C0 + g] + k * S::kElemBytes + 512, 0, 3); }
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            if constexpr (T == WType::f32) {
                __m256 xv[MR];
#pragma GCC unroll 8
                for (int r = 0; r < MR; ++r) { xv[r] = _mm256_loadu_ps(xr[r] + k + 8 * h); }
#pragma GCC unroll 8
                for (int g = 0; g < G; ++g) {
                    __m256 w = _mm256_loadu_ps(reinterpret_cast<const float *>(wr[C0 + g]) + k + 8 * h);
                    if constexpr (MR > 1) { __asm__("" : "+x"(w)); }  // loaded once, not folded into each row's FMA
#pragma GCC unroll 8
                    for (int r = 0; r < MR; ++r) { a[r][g][h] = _mm256_fmadd_ps(xv[r], w, a[r][g][h]); }
                }
            } else {
                // Half h of both vectors of the step: lanes 8h..8h+7 of lo and hi are the unpacks
                // of the step's k 16h..16h+15 (as load_bf16_step).
                // One row: x's two vectors of the half loaded once into registers and each 32-byte
                // weight load unpacked twice from its register (left to itself GCC folds both into
                // every instruction: 4 loads per column and half instead of 1, and the one-row
                // decode was load-port bound at ~30 GB/s with the weights in L2; issue 28 gemv28).
                const __m256i z = _mm256_setzero_si256();
                __m256        xlo = _mm256_setzero_ps(), xhi = _mm256_setzero_ps();
                if constexpr (MR == 1) {
                    xlo = _mm256_loadu_ps(xr[0] + k + 8 * h), xhi = _mm256_loadu_ps(xr[0] + k + kLanes + 8 * h);
                    __asm__("" : "+x"(xlo), "+x"(xhi));
                }
#pragma GCC unroll 8
                for (int g = 0; g < G; ++g) {
                    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(
                        reinterpret_cast<const uint16_t *>(wr[C0 + g]) + k + 16 * h));
                    if constexpr (MR == 1) { __asm__("" : "+x"(v)); }
                    const __m256 wlo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
                    const __m256 whi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
#pragma GCC unroll 8
                    for (int r = 0; r < MR; ++r) {
                        if constexpr (MR == 1) {
                            a[r][g][h] = _mm256_fmadd_ps(xlo, wlo, a[r][g][h]);
                            a[r][g][h] = _mm256_fmadd_ps(xhi, whi, a[r][g][h]);
                        } else {
                            a[r][g][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + k + 8 * h), wlo, a[r][g][h]);
                            a[r][g][h] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[r] + k + kLanes + 8 * h), whi, a[r][g][h]);
                        }
                    }
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
            float * p = reinterpret_cast<float *>(&acc[r][C0 + g]);
            _mm256_storeu_ps(p, a[r][g][0]), _mm256_storeu_ps(p + 8, a[r][g][1]);
        }
    }
}

/// whole_steps on AVX2: the tile's columns in groups of G (MR x G x 2 accumulators, at most 8).
template <WType T, int MR, int NR, bool kPrefetch, int C0 = 0>
void whole_steps_avx2(f32x16 (&acc)[MR][NR], const float * const (&xr)[MR], const char * const (&wr)[NR],
                      int64_t n_steps, const char * pf) {
    constexpr int G = MR == 1 ? 4 : MR == 2 ? 2 : 1;
    static_assert(NR % G == 0, "the column groups cover the tile");
    if constexpr (C0 < NR) {
        group_steps_avx2<T, MR, NR, C0, G, kPrefetch>(acc, xr, wr, n_steps, pf);
        whole_steps_avx2<T, MR, NR, kPrefetch, C0 + G>(acc, xr, wr, n_steps, pf);
    }
}
#endif

/// Every step of an MR x NR tile over n_k k's (whole steps, then the zero-padded tail): acc
/// [MR][NR] lanes read and written; xr: x rows, wr: weight rows, both at the first k.
template <WType T, int MR, int NR, bool kPrefetch>
void tile_steps(f32x16 (&acc)[MR][NR], const float * const (&xr)[MR], const char * const (&wr)[NR], int64_t n_k,
                const char * pf) {
    using S = Step<T>;
    int64_t k = 0;
#if defined(FD_HAVE_WHOLE_STEPS)
    whole_steps<T, MR, NR, kPrefetch>(acc, xr, wr, n_k / S::K, pf);
    k = n_k / S::K * S::K;
#elif defined(FD_LINEAR_AVX2)
    whole_steps_avx2<T, MR, NR, kPrefetch>(acc, xr, wr, n_k / S::K, pf);
    k = n_k / S::K * S::K;
#endif
    auto step = [&](int64_t kk, int n) {
        f32x16 wv[NR][S::V];
        for (int c = 0; c < NR; ++c) {
            if (kPrefetch) { __builtin_prefetch(pf ? pf + (kk / S::K * NR + c) * 64 : wr[c] + kk * S::kElemBytes + 512, 0, 3); }
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
    for (; k + S::K <= n_k; k += S::K) { step(k, S::K); }
    if (k < n_k) { step(k, static_cast<int>(n_k - k)); }
}

template <WType T, int MR, int NR, bool kPrefetch>
void tile(const TileArgs & t) {
    const float * xr[MR];
    const char *  wr[NR];
    for (int r = 0; r < MR; ++r) { xr[r] = t.x + std::min(r, t.n_rows - 1) * t.ldx; }
    for (int c = 0; c < NR; ++c) { wr[c] = t.w + std::min(c, t.n_cols - 1) * t.ldw; }
    f32x16 acc[MR][NR];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NR; ++c) { acc[r][c] = t.first ? f32x16{} : t.carry[r * NR + c]; }
    }
    tile_steps<T, MR, NR, kPrefetch>(acc, xr, wr, t.n_k, t.pf);
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
/// One row x outputs [o0, o1): streams the weights in their stored dtype, 8 rows at a time.
template <WType T>
void strip(float * out, const float * x, const char * w, const float * bias, int64_t n_in, int64_t o0,
           int64_t o1) {
    const int64_t row_bytes = n_in * Step<T>::kElemBytes;
#if defined(FD_LINEAR_AVX2)
    // AVX2 (AMD Zen 3 class; issue 28, docs/benchmarks.md "B=1 GEMV on AVX2"): the outputs in 4
    // equal parts, read as 4 sequential streams, one per part, which the hardware prefetchers
    // follow (no software prefetch). A tile takes 2 consecutive rows of each part (8 outputs:
    // one transposed reduction): group_steps_avx2 runs the parts' row i over all k, then row
    // i + 1. Tiles of adjacent rows with the next tile prefetched (the loop below) read at 0.8 of
    // a one-stream read probe here; these streams at 1.1-1.3.
    const int64_t n = o1 - o0, part = (n + 3) / 4;  // parts of part rows, the last one maybe shorter or empty
    const float * const xr[1] = {x};
    for (int64_t i = 0; i < part; i += 2) {
        const char * wr[8];
        int64_t      oc[8];  // column c's output: part c % 4, row i + c / 4 of it; -1 past the end
        for (int c = 0; c < 8; ++c) {
            const int64_t j = i + c / 4, o = (c % 4) * part + j;
            oc[c] = j < part && o < n ? o0 + o : -1;
            wr[c] = w + (oc[c] >= 0 ? oc[c] : o0 + i) * row_bytes;  // past the end: a valid row again (not stored)
        }
        f32x16 acc[1][8] = {};
        tile_steps<T, 1, 8, false>(acc, xr, wr, n_in, nullptr);
        float sums[8];
        reduce_all(&acc[0][0], 8, sums);
        for (int c = 0; c < 8; ++c) {
            if (oc[c] >= 0) { out[oc[c]] = bias ? sums[c] + bias[oc[c]] : sums[c]; }
        }
    }
#else
    constexpr int NR = kStripNR;
    // Short rows (MoE experts, small models): 512 bytes ahead would land in the tile's own next
    // row; stream the next tile instead (issue 23: 1 KiB bf16 expert rows read at 0.3 of the
    // read bandwidth with the per-row prefetch).
    const bool short_rows = row_bytes < kShortRowBytes;
    for (int64_t o = o0; o < o1; o += NR) {
        tile<T, 1, NR, true>({.x = x, .ldx = 0, .w = w + o * row_bytes, .ldw = row_bytes, .n_rows = 1,
                              .n_cols = static_cast<int>(std::min<int64_t>(NR, o1 - o)), .n_k = n_in,
                              .first = true, .last = true, .carry = nullptr, .out = out + o, .ldo = 1,
                              .bias = bias ? bias + o : nullptr, .pf = short_rows ? w + (o + NR) * row_bytes : nullptr});
    }
#endif
}

/// A few rows (2..kDirectRows) x outputs [o0, o1) on unpacked weights: they stream from their
/// rows as in the one-row path (packing them would cost more than these rows use). x [n_rows,
/// ldx]: f32 x itself (ldx = n_in); bf16 each row in the bf16 lane order, zero-padded to whole
/// steps (ldx = its padded length), as the one-row path permutes it.
template <WType T, int MR, int NR>
void rows_direct(float * out, const float * x, int64_t ldx, const char * w, const float * bias, int64_t n_rows, int64_t n_in,
                 int64_t n_out, int64_t o0, int64_t o1) {
    const int64_t row_bytes  = n_in * Step<T>::kElemBytes;
    const bool    short_rows = row_bytes < kShortRowBytes;  // the next tile streamed by the first row block (strip())
    for (int64_t o = o0; o < o1; o += NR) {
        for (int64_t r = 0; r < n_rows; r += MR) {
            tile<T, MR, NR, true>({.x = x + r * ldx, .ldx = ldx, .w = w + o * row_bytes, .ldw = row_bytes,
                                            .n_rows = static_cast<int>(std::min<int64_t>(MR, n_rows - r)),
                                            .n_cols = static_cast<int>(std::min<int64_t>(NR, o1 - o)), .n_k = n_in,
                                            .first = true, .last = true, .carry = nullptr, .out = out + r * n_out + o,
                                            .ldo = n_out, .bias = bias ? bias + o : nullptr,
                                            .pf = short_rows && r == 0 ? w + (o + NR) * row_bytes : nullptr});
        }
    }
}

}  // namespace

void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, ThreadPool * pool) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    const char * wb = static_cast<const char *>(w);
    if (n_rows == 1) {
        // Decode: tasks as decode_task_outputs says (AVX2: long streams). bf16: x in the bf16
        // lane order first.
        thread_local detail::ScratchVec<float> xperm;
        const float * xs = x;
        if (wtype == WType::bf16) {
            xperm.resize(static_cast<size_t>((n_in + 31) / 32 * 32));  // whole steps, zero-padded
            for (int64_t k = 0; k < n_in; k += 32) { permute_bf16_step(x + k, n_in - k, xperm.data() + k, xperm.data() + k + kLanes); }
            xs = xperm.data();
        }
        const int64_t row_bytes = n_in * static_cast<int64_t>(wtype == WType::f32 ? 4 : 2);
#if defined(FD_LINEAR_AVX2)
        constexpr bool kStreams = true;  // strip()'s column streams
#else
        constexpr bool kStreams = false;
#endif
        const int64_t per_task = decode_task_outputs(n_out, row_bytes, pool ? pool->n_threads() : 1, kStreams);
        for_tasks(pool, (n_out + per_task - 1) / per_task, [&](int64_t t) {
            const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
            if (wtype == WType::f32) {
                strip<WType::f32>(out, xs, wb, bias, n_in, o0, o1);
            } else {
                strip<WType::bf16>(out, xs, wb, bias, n_in, o0, o1);
            }
        });
        return;
    }
    if (n_rows <= kDirectRows) {
        // A few rows: as the one-row path, tasks of ~128 KiB of weights. bf16 (issue 23: MoE
        // experts meet a few rows each at batched decode): x rows permuted as the one-row path's.
        const float * xs  = x;
        int64_t       ldx = n_in;
        if (wtype == WType::bf16) {
            thread_local detail::ScratchVec<float> xperm;
            ldx = (n_in + 31) / 32 * 32;
            xperm.resize(static_cast<size_t>(n_rows * ldx));
            for (int64_t r = 0; r < n_rows; ++r) {
                float * d = xperm.data() + r * ldx;
                for (int64_t k = 0; k < n_in; k += 32) { permute_bf16_step(x + r * n_in + k, n_in - k, d + k, d + k + kLanes); }
            }
            xs = xperm.data();
        }
        const int64_t row_bytes = n_in * static_cast<int64_t>(wtype == WType::f32 ? 4 : 2);
        const int64_t per_task  = std::max<int64_t>(24, ((128 << 10) / std::max<int64_t>(1, row_bytes)) / 24 * 24);
        auto run = [&]<WType T>(int64_t o0, int64_t o1) {
            if (n_rows == 2) {
                rows_direct<T, 2, 8>(out, xs, ldx, wb, bias, n_rows, n_in, n_out, o0, o1);
            } else if (n_rows == 3) {
                rows_direct<T, 3, 6>(out, xs, ldx, wb, bias, n_rows, n_in, n_out, o0, o1);
            } else {
                rows_direct<T, 4, 6>(out, xs, ldx, wb, bias, n_rows, n_in, n_out, o0, o1);
            }
        };
        for_tasks(pool, (n_out + per_task - 1) / per_task, [&](int64_t t) {
            const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
            if (wtype == WType::f32) {
                run.template operator()<WType::f32>(o0, o1);
            } else {
                run.template operator()<WType::bf16>(o0, o1);
            }
        });
        return;
    }
    detail::linear_packed(out, x, w, wtype, bias, n_rows, n_out, n_in, pool);
}

}  // namespace fd::kernels
