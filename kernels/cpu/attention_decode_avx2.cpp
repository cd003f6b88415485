// Paged attention for one decode query on AVX2 + FMA (AttnIsa::avx2; attention_paged's decode
// path where the build targets AVX2 without AVX-512BW). Bitwise attend_one's output (and so the
// tile kernel's): each score one FMA chain over d ascending from 0, then times scale; softmax_row
// (the shared code); each output element one FMA chain over t ascending from 0, accumulators
// stored and reloaded exactly between blocks. Only the order of independent chains and the
// memory walk differ from attention_decode.cpp, whose 16-lane vectors are two ymm registers here
// (8 of its accumulators fill all 16) and whose bf16 widening compiles to 128-bit pieces:
// - 8 ymm accumulators per call: scores of 4 key vectors × 1 query (group 1), 2 × 2 (even
//   groups) or 1 × 4 (groups of 4k); P·V of 64 dimensions of one head over a block's rows;
// - bf16 widened with one shift (even elements) and one mask (odd elements) per 16 values: the
//   scores of a key vector and the accumulators of 16 dimensions are held as (8 even, 8 odd)
//   and put back in order once (scores when stored, outputs at the end);
// - the K walk takes a kv head's key vectors from several blocks at once (4 vectors per call: 4
//   blocks of 16, 2 of 32, ...), so one call reads 4 sequential runs far apart in the pool and
//   shares each q broadcast across them; no software prefetch (the hardware prefetcher keeps up
//   with 4 sequential runs; prefetch instructions only cost issue slots there);
// - the V walk goes block by block (a block's V rows for the range's kv heads are one contiguous
//   run, read head by head, i.e. in 12 strided passes for 12 heads, which the hardware prefetcher
//   does not follow) and software-prefetches the run kVAheadBlocks blocks ahead *in address
//   order*, its lines spread over the rows of the P·V calls (a burst of prefetches fills the miss
//   buffers and stalls). On a Zen 3 EPYC at B=64, ctx 4,096 this took bf16 KV attention from
//   ~11 to ~15-17 GB/s (docs/benchmarks.md "issue 28 KV at the read rate").
#include "attention_avx2.h"
#include "scratch.h"

#if FD_ATTN_AVX2
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace fd::kernels {
namespace {

constexpr int64_t kVAheadBlocks = 2;  // the V walk prefetches the run of the block this far ahead
constexpr int64_t kMaxPf        = 128;  // prefetched lines per (block, kv head) piece of the V walk, at most

/// 16 consecutive pool values, widened exactly to f32, in two registers: f32: values 0-7, 8-15;
/// bf16: the even values, the odd ones (a bf16 pair is one 32-bit lane: shift / mask).
inline void widen16(const float * p, __m256 & a, __m256 & b) {
    a = _mm256_loadu_ps(p);
    b = _mm256_loadu_ps(p + 8);
}
inline void widen16(const Bf16 * p, __m256 & a, __m256 & b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

/// 16 values held as widen16<T> holds them, stored at s in natural order.
template <typename T>
inline void store_ordered(float * s, __m256 a, __m256 b) {
    if constexpr (std::is_same_v<T, float>) {
        _mm256_storeu_ps(s, a);
        _mm256_storeu_ps(s + 8, b);
    } else {
        const __m256 lo = _mm256_unpacklo_ps(a, b);  // 0-3 | 8-11
        const __m256 hi = _mm256_unpackhi_ps(a, b);  // 4-7 | 12-15
        _mm256_storeu_ps(s, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(s + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

inline void prefetch(const void * p) { _mm_prefetch(static_cast<const char *>(p), _MM_HINT_T0); }

/// Scores of NK key vectors (16 keys each) against NQ queries each: for query slot c = NQ j + i,
///   s[c][l] = (FMA chain over d ascending of q[c][d] * key(j, l)[d]) * scale,   l < 16,
/// key vector j's 16 values of dimension d at k[j] + d * ld. SQ: every key vector has the same
/// queries (q[i] for all j: one kv head's vectors), so each q value is broadcast once for all NK.
/// Not inlined: its loop keeps every pointer and accumulator in a register (inlined into
/// attend_one_avx2, GCC spilled them).
template <int NQ, int NK, typename T, bool SQ = false>
__attribute__((noinline)) void score_tile(float * const * s, const float * const * q, const T * const * k, int64_t ld,
                                          int64_t hd, float scale) {
    __m256 a[NK][NQ][2];
    const T *     kp[NK];
    const float * qp[NK * NQ];
#pragma GCC unroll 4
    for (int j = 0; j < NK; ++j) {
        kp[j] = k[j];
#pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
            a[j][i][0] = a[j][i][1] = _mm256_setzero_ps();
            qp[NQ * j + i] = q[NQ * j + i];
        }
    }
    // Two rows (d, d + 1) per step (hd % 16 == 0). One shared offset indexes every pointer.
    for (int64_t d = 0, off = 0; d < hd; d += 2, off += 2 * ld) {
#pragma GCC unroll 2
        for (int dd = 0; dd < 2; ++dd) {
            __m256 qs[NQ];
            if constexpr (SQ) {
#pragma GCC unroll 4
                for (int i = 0; i < NQ; ++i) { qs[i] = _mm256_broadcast_ss(qp[i] + d + dd); }
            }
#pragma GCC unroll 4
            for (int j = 0; j < NK; ++j) {
                __m256 k0, k1;
                widen16(kp[j] + off + dd * ld, k0, k1);
#pragma GCC unroll 4
                for (int i = 0; i < NQ; ++i) {
                    const __m256 qd = SQ ? qs[i] : _mm256_broadcast_ss(qp[NQ * j + i] + d + dd);
                    a[j][i][0] = _mm256_fmadd_ps(qd, k0, a[j][i][0]);
                    a[j][i][1] = _mm256_fmadd_ps(qd, k1, a[j][i][1]);
                }
            }
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
#pragma GCC unroll 4
    for (int j = 0; j < NK; ++j) {
#pragma GCC unroll 4
        for (int i = 0; i < NQ; ++i) {
            store_ordered<T>(s[NQ * j + i], _mm256_mul_ps(a[j][i][0], sc), _mm256_mul_ps(a[j][i][1], sc));
        }
    }
}

/// acc[16e .. 16e + 16) (widen16<T>'s order) += p[j] * v(j)[16e .. 16e + 16) for rows j < cnt
/// ascending (one FMA per element and row), e < NE; row j at v + j * row. acc loaded and stored
/// back exactly, so a chain split over calls is the same chain. pf[0, npf): lines to prefetch,
/// spread over the rows (ceil(npf / cnt) per row). Not inlined (as score_tile).
template <int NE, typename T>
__attribute__((noinline)) void pv_tile(float * acc, const float * p, int64_t cnt, const T * v, int64_t row,
                                       const char * const * pf, int64_t npf) {
    __m256 a[NE][2];
#pragma GCC unroll 4
    for (int e = 0; e < NE; ++e) {
        a[e][0] = _mm256_loadu_ps(acc + 16 * e);
        a[e][1] = _mm256_loadu_ps(acc + 16 * e + 8);
    }
    const int64_t per = (npf + cnt - 1) / cnt;
    for (int64_t j = 0, x = 0; j < cnt; ++j, v += row) {
        for (const int64_t x1 = std::min(npf, x + per); x < x1; ++x) { prefetch(pf[x]); }
        const __m256 pj = _mm256_broadcast_ss(p + j);
#pragma GCC unroll 4
        for (int e = 0; e < NE; ++e) {
            __m256 x0, x1;
            widen16(v + 16 * e, x0, x1);
            a[e][0] = _mm256_fmadd_ps(pj, x0, a[e][0]);
            a[e][1] = _mm256_fmadd_ps(pj, x1, a[e][1]);
        }
    }
#pragma GCC unroll 4
    for (int e = 0; e < NE; ++e) {
        _mm256_storeu_ps(acc + 16 * e, a[e][0]);
        _mm256_storeu_ps(acc + 16 * e + 8, a[e][1]);
    }
}

/// One 16-key vector of the K walk: its values (kv head 0's dimension 0 at k), its first key.
template <typename T>
struct KeyVec {
    const T * k;
    int64_t   t, g;
};

}  // namespace

template <typename T>
void attend_one_avx2(float * out, const float * q, const AttnQuery & qry, int64_t n_heads, int64_t g0, int64_t g1,
                     PagedKv kv, float scale) {
    const T *     kpool = static_cast<const T *>(kv.k);
    const T *     vpool = static_cast<const T *>(kv.v);
    const int64_t hd = kv.head_dim, row = static_cast<int64_t>(kv.n_kv_heads) * hd, bs = kv.block_size;
    const int64_t group = n_heads / kv.n_kv_heads, n = qry.n_ctx, h0 = g0 * group, nh = (g1 - g0) * group;
    if (n <= 0) {  // no keys: zeros, as attend_tile leaves them
        std::fill(out + h0 * hd, out + (h0 + nh) * hd, 0.0f);
        return;
    }
    const int64_t ld = (n + kLanes - 1) / kLanes * kLanes + kLanes;  // scores row stride (>= the last vector's end)
    const int64_t n_blocks = (n + bs - 1) / bs;
    thread_local detail::ScratchVec<float>      scores, acc;
    thread_local detail::ScratchVec<KeyVec<T>>  vecs;
    if (scores.size() < static_cast<size_t>(nh * ld)) { scores.resize(static_cast<size_t>(nh * ld)); }

    // K walk: chunks of `chunk` blocks (nk key vectors of one kv head), each kv head of the range,
    // the chunk's blocks, their 16-key vectors: nk consecutive vectors are one head's, from
    // `chunk` blocks (each block's K for head g is a contiguous [hd, bs] run).
    const int     nq = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;  // queries per key vector per call
    const int     nk = 4 / nq;                                       // key vectors per call
    const int64_t chunk = std::max<int64_t>(1, nk / (bs / kLanes));
    vecs.clear();
    for (int64_t c0 = 0; c0 < n_blocks; c0 += chunk) {
        for (int64_t g = g0; g < g1; ++g) {
            for (int64_t b = c0; b < std::min(n_blocks, c0 + chunk); ++b) {
                const T * kb = kpool + static_cast<int64_t>(qry.block_table[b]) * bs * row;
                for (int64_t t = b * bs; t < std::min(n, (b + 1) * bs); t += kLanes) {
                    vecs.push_back({kb + g * hd * bs + (t - b * bs), t, g});
                }
            }
        }
    }
    const int64_t nv = static_cast<int64_t>(vecs.size());
    for (int64_t r = 0; r < nv;) {
        const int kk = nv - r >= nk ? nk : nv - r >= 2 && nk >= 2 ? 2 : 1;
        const T * kp[4];
        bool      same = true;  // one kv head's vectors: each q value broadcast once
        for (int j = 0; j < kk; ++j) {
            kp[j] = vecs[r + j].k;
            same  = same && vecs[r + j].g == vecs[r].g;
        }
        for (int64_t hq = 0; hq < group; hq += nq) {
            const float * qq[4];
            float *       ss[4];
            for (int j = 0; j < kk; ++j) {
                for (int i = 0; i < nq; ++i) {
                    const int64_t h = vecs[r + j].g * group + hq + i;
                    qq[nq * j + i] = q + h * hd;
                    ss[nq * j + i] = scores.data() + (h - h0) * ld + vecs[r + j].t;
                }
            }
            switch ((same && kk > 1 ? 64 : 0) + nq * 8 + kk) {
                case 64 + 2 * 8 + 2: score_tile<2, 2, T, true>(ss, qq, kp, bs, hd, scale); break;
                case 64 + 1 * 8 + 4: score_tile<1, 4, T, true>(ss, qq, kp, bs, hd, scale); break;
                case 64 + 1 * 8 + 2: score_tile<1, 2, T, true>(ss, qq, kp, bs, hd, scale); break;
                case 4 * 8 + 1: score_tile<4, 1>(ss, qq, kp, bs, hd, scale); break;
                case 2 * 8 + 2: score_tile<2, 2>(ss, qq, kp, bs, hd, scale); break;
                case 2 * 8 + 1: score_tile<2, 1>(ss, qq, kp, bs, hd, scale); break;
                case 1 * 8 + 4: score_tile<1, 4>(ss, qq, kp, bs, hd, scale); break;
                case 1 * 8 + 2: score_tile<1, 2>(ss, qq, kp, bs, hd, scale); break;
                default: score_tile<1, 1>(ss, qq, kp, bs, hd, scale); break;
            }
        }
        r += kk;
    }
    for (int64_t h = 0; h < nh; ++h) { softmax_row_avx2(scores.data() + h * ld, n); }

    // V walk: block by block, each kv head of the range (a block's V rows for heads [g0, g1) are
    // one contiguous run), each head of its group 64 dimensions at a time. The accumulators live in
    // `out` (f32) or in `acc` in widen16<Bf16>'s order, put in order at the end (bf16). Piece
    // (b, g) prefetches its share (the (g - g0)-th of ng) of block b + kVAheadBlocks's run, in
    // address order, spread over the rows of its first P·V call.
    constexpr bool is_f32 = std::is_same_v<T, float>;
    float *        o0 = out + h0 * hd;
    if constexpr (!is_f32) {
        if (acc.size() < static_cast<size_t>(nh * hd)) { acc.resize(static_cast<size_t>(nh * hd)); }
    }
    float * a0 = is_f32 ? o0 : acc.data();
    std::fill(a0, a0 + nh * hd, 0.0f);
    const int64_t ng = g1 - g0;
    const int64_t seg = ng * hd * static_cast<int64_t>(sizeof(T)), rowb = row * static_cast<int64_t>(sizeof(T));
    const int64_t run_lines = (bs * seg + 63) / 64;  // lines of one block's run
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t t0 = b * bs, cnt = std::min(bs, n - t0);
        const T *     vb = vpool + static_cast<int64_t>(qry.block_table[b]) * bs * row;
        for (int64_t g = g0; g < g1; ++g) {
            const char * pf[kMaxPf];
            int64_t      npf = 0;
            if (b + kVAheadBlocks < n_blocks) {
                const char *  nb = reinterpret_cast<const char *>(vpool + static_cast<int64_t>(qry.block_table[b + kVAheadBlocks]) * bs * row + g0 * hd);
                int64_t       l  = (g - g0) * run_lines / ng;
                const int64_t l1 = std::min(l + kMaxPf, (g - g0 + 1) * run_lines / ng);
                int64_t       r = l * 64 / seg, off = l * 64 - r * seg;  // row and byte within its segment
                for (; l < l1; ++l) {
                    pf[npf++] = nb + r * rowb + off;
                    off += 64;
                    if (off >= seg) { off -= seg, ++r; }
                }
            }
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                const float * p = scores.data() + (h - h0) * ld + t0;
                float *       a = a0 + (h - h0) * hd;
                for (int64_t d0 = 0; d0 < hd;) {
                    const T *     v   = vb + g * hd + d0;
                    const int64_t npc = h == g * group && d0 == 0 ? npf : 0;
                    if (hd - d0 >= 64) {
                        pv_tile<4>(a + d0, p, cnt, v, row, pf, npc);
                        d0 += 64;
                    } else if (hd - d0 >= 32) {
                        pv_tile<2>(a + d0, p, cnt, v, row, pf, npc);
                        d0 += 32;
                    } else {
                        pv_tile<1>(a + d0, p, cnt, v, row, pf, npc);
                        d0 += 16;
                    }
                }
            }
        }
    }
    if constexpr (!is_f32) {
        for (int64_t i = 0; i < nh * hd; i += kLanes) {
            store_ordered<T>(o0 + i, _mm256_loadu_ps(a0 + i), _mm256_loadu_ps(a0 + i + 8));
        }
    }
}

template void attend_one_avx2<float>(float *, const float *, const AttnQuery &, int64_t, int64_t, int64_t, PagedKv, float);
template void attend_one_avx2<Bf16>(float *, const float *, const AttnQuery &, int64_t, int64_t, int64_t, PagedKv, float);

}  // namespace fd::kernels
#endif
