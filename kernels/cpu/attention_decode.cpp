// Paged attention for one decode query (attention_paged's decode path; see cpu_ops.h and
// attention_lanes.h). The arithmetic is the tile kernel's (attention.cpp), bitwise: each score
// one FMA chain over d ascending from 0, times scale; softmax_row; each output element one FMA
// chain over t ascending from 0. What differs is the order of independent work, so one query
// keeps the core busy and the K/V stream at memory speed:
// - scores: per kv head, its group's pairs against kNv 16-key vectors at once (group * kNv >= 8
//   independent FMA chains, not 2 per pair), the next vectors' K prefetched along d; with one
//   kv head per query (group 1), vector by vector instead, up to 8 heads at once, so a block's K
//   is read as one run in address order (score_block_major: B=64 at 4,096 tokens, llama-110m,
//   attention in 0.86-0.99 of the time (6 runs, interleaved, f32 and bf16 KV); groups 2, 4 not
//   faster that way: docs/benchmarks.md "Stop 47");
// - P·V: block by block, every head of the range per block (a block's V rows for all kv heads
//   are one contiguous run), accumulators in registers over the block's rows and in `out`
//   between blocks (stored and reloaded exactly: the same chain), the V of kVAhead blocks ahead
//   prefetched row by row.
#include "attention_lanes.h"
#include "scratch.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace fd::kernels {
namespace {

constexpr int64_t kNv = 8;      // 16-key vectors scored at once (group 1); fewer for larger groups
// V blocks prefetched ahead. One: a block's V rows (all kv heads) are 24 KiB in bf16 at n_kv_heads
// x head_dim = 768 and 16 tokens, so two blocks ahead filled the whole 48 KiB L1 and lines went
// before their use (B=64 at 4,096 tokens, bf16 KV: attention 6 % faster at one than at two, 5 of
// 5 interleaved pairs; f32 KV unchanged within the noise; docs/benchmarks.md "Stop 41").
constexpr int64_t kVAhead = 1;

/// s[m][16b + j] = (FMA chain over d of q[m][d] * key(16b + j)[d]) * scale for NV key vectors, M
/// pairs of one kv head; key vector b: dimension d at kp[b][d * ld]. pf: the next chunk's vectors
/// (prefetched line by line along d), or nullptr.
template <int M, int NV, typename T>
inline void score_vecs(float * const * s, const float * const * qh, const T * const * kp, const T * const * pf,
                       int64_t ld, int64_t hd, float scale) {
    f32x16 a[M][NV] = {};
    const int64_t row_bytes = ld * static_cast<int64_t>(sizeof(T));
    for (int64_t d = 0; d < hd; ++d) {
        if (pf != nullptr && ((d * row_bytes) & 63) < row_bytes) {
#pragma GCC unroll 8
            for (int b = 0; b < NV; ++b) { __builtin_prefetch(pf[b] + d * ld, 0, 3); }
        }
        f32x16 k[NV];
#pragma GCC unroll 8
        for (int b = 0; b < NV; ++b) {
            k[b] = load16(kp[b] + d * ld);
            if constexpr (M > 1) { in_register(k[b]); }  // M == 1: the load folds into the FMA
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const float qd = qh[m][d];
#pragma GCC unroll 8
            for (int b = 0; b < NV; ++b) { a[m][b] += qd * k[b]; }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
        for (int b = 0; b < NV; ++b) {
            const f32x16 v = a[m][b] * scale;
            std::memcpy(s[m] + b * kLanes, &v, sizeof v);
        }
    }
}

/// o[m][16e + i] += p[m][j] * v(j)[16e + i] for rows j < cnt ascending (one FMA per element and
/// row), e < ND, M pairs sharing every V load; row j at v + j * row. The accumulators are loaded
/// from o and stored back exactly, so a chain split over calls is the same chain. pf: the same
/// rows of a block ahead (prefetched row by row), or nullptr.
template <int M, int ND, typename T>
inline void pv_rows(float * const * o, const float * const * p, int64_t cnt, const T * v, const T * pf, int64_t row) {
    f32x16 a[M][ND];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
        for (int e = 0; e < ND; ++e) { a[m][e] = load16(o[m] + e * kLanes); }
    }
    constexpr int64_t kLines = (ND * kLanes * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    for (int64_t j = 0; j < cnt; ++j) {
        if (pf != nullptr) {
#pragma GCC unroll 8
            for (int64_t l = 0; l < kLines; ++l) { __builtin_prefetch(pf + j * row + l * (64 / sizeof(T)), 0, 3); }
        }
        f32x16 vv[ND];
#pragma GCC unroll 8
        for (int e = 0; e < ND; ++e) {
            vv[e] = load16(v + j * row + e * kLanes);
            if constexpr (M > 1) { in_register(vv[e]); }  // M == 1: the load folds into the FMA
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const float pj = p[m][j];
#pragma GCC unroll 8
            for (int e = 0; e < ND; ++e) { a[m][e] += pj * vv[e]; }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
        for (int e = 0; e < ND; ++e) { std::memcpy(o[m] + e * kLanes, &a[m][e], sizeof a[m][e]); }
    }
}

#if defined(__AVX512BW__)
/// pv_rows<M, 4> for bf16 V (64 dimensions): each 64-byte load holds 32 dimensions as 16 pairs,
/// widened by one shift (even dimensions) and one mask (odd ones) instead of a zero-extension and
/// a shift per 16. The accumulators hold even and odd dimensions apart (de-interleaved from o on
/// entry, re-interleaved on exit: moves only), so each dimension is still one FMA chain over the
/// rows in order: bitwise pv_rows<M, 4, Bf16>.
template <int M>
inline void pv_rows_bf16x64(float * const * o, const float * const * p, int64_t cnt, const Bf16 * v, const Bf16 * pf,
                            int64_t row) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd  = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i lo   = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi   = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i top  = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 a[M][4];  // [m][2h]: even dimensions of 32h..32h+31, [m][2h+1]: odd ones
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m512 n0 = _mm512_loadu_ps(o[m] + 32 * h), n1 = _mm512_loadu_ps(o[m] + 32 * h + 16);
            a[m][2 * h]     = _mm512_permutex2var_ps(n0, even, n1);
            a[m][2 * h + 1] = _mm512_permutex2var_ps(n0, odd, n1);
        }
    }
    for (int64_t j = 0; j < cnt; ++j) {
        if (pf != nullptr) {
            __builtin_prefetch(pf + j * row, 0, 3);
            __builtin_prefetch(pf + j * row + 32, 0, 3);
        }
        __m512 w[4];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m512i x = _mm512_loadu_si512(v + j * row + 32 * h);
            w[2 * h]     = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(__mmask16(0xFFFF), x, 16));
            w[2 * h + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, top));
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const __m512 pj = _mm512_set1_ps(p[m][j]);
#pragma GCC unroll 4
            for (int e = 0; e < 4; ++e) { a[m][e] = _mm512_fmadd_ps(pj, w[e], a[m][e]); }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            _mm512_storeu_ps(o[m] + 32 * h, _mm512_permutex2var_ps(a[m][2 * h], lo, a[m][2 * h + 1]));
            _mm512_storeu_ps(o[m] + 32 * h + 16, _mm512_permutex2var_ps(a[m][2 * h], hi, a[m][2 * h + 1]));
        }
    }
}
#endif

/// One kv head per query (group 1): s[h][j] = (FMA chain over d of qh[h][d] * k_h(j)[d]) * scale
/// for the 16 keys of one vector and NH heads, head h's keys at kp[h] (dimension d at kp[h][d *
/// ld]) — score_vecs<1, 1>'s chain for each head, NH chains at once. pf: the next region to be
/// scored (pf_bytes from pf, prefetched in even slices along d), or nullptr.
template <int NH, typename T>
inline void score_heads(float * const * s, const float * const * qh, const T * const * kp, const std::byte * pf, int64_t pf_bytes,
                        int64_t ld, int64_t hd, float scale) {
    f32x16 a[NH] = {};
    const int64_t lines = pf_bytes / 64, per_d = (lines + hd - 1) / hd;
    for (int64_t d = 0; d < hd; ++d) {
        if (pf != nullptr) {
            for (int64_t l = d * per_d; l < std::min(lines, (d + 1) * per_d); ++l) { __builtin_prefetch(pf + l * 64, 0, 3); }
        }
#pragma GCC unroll 8
        for (int h = 0; h < NH; ++h) { a[h] += qh[h][d] * load16(kp[h] + d * ld); }
    }
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
        const f32x16 v = a[h] * scale;
        std::memcpy(s[h], &v, sizeof v);
    }
}

/// Group 1: the scores of kv heads [g0, g1) vector by vector, up to 8 heads at once. A block holds
/// its kv heads one after another (head g's keys: g * hd * bs on), so the heads of one vector are
/// one contiguous run (16 KiB of bf16 for 8 heads of 64 dims), read in address order; walking the
/// whole context head by head instead reads a 2 KiB piece of every block per head. Each score is
/// the same chain either way: bitwise score_head<1, NV>. s: [g1 - g0][ld] rows.
template <typename T>
inline void score_block_major(float * s, const float * q, const T * kpool, const AttnQuery & qry, int64_t n, int64_t g0, int64_t g1,
                              int64_t bs, int64_t row, int64_t hd, int64_t ld, float scale) {
    constexpr int64_t kHeads = 8;
    const int64_t nv = (n + kLanes - 1) / kLanes, nh = g1 - g0;
    const int64_t head_elems = hd * bs;
    auto region = [&](int64_t v, int64_t g) { return key_lanes(kpool, qry, v * kLanes, bs, row) + g * head_elems; };
    for (int64_t v = 0; v < nv; ++v) {
        for (int64_t c = 0; c < nh; c += kHeads) {
            const int64_t m = std::min(kHeads, nh - c);
            const T *     kp[kHeads];
            const float * qh[kHeads];
            float *       sp[kHeads];
            for (int64_t h = 0; h < m; ++h) {
                kp[h] = region(v, g0 + c + h);
                qh[h] = q + (g0 + c + h) * hd;
                sp[h] = s + (c + h) * ld + v * kLanes;
            }
            // What comes next: this vector's next heads, or the next vector's first ones (another block).
            const bool    more = c + kHeads < nh;
            const int64_t nm   = more ? std::min(kHeads, nh - c - kHeads) : std::min(kHeads, nh);
            const T *     next = more ? region(v, g0 + c + kHeads) : v + 1 < nv ? region(v + 1, g0) : nullptr;
            const auto *  pf   = reinterpret_cast<const std::byte *>(next);
            // A vector's keys are kLanes consecutive tokens of a head's [d][bs] tile: prefetch the
            // whole tiles (their other vectors are next when bs > 16).
            const int64_t pf_bytes = next ? nm * head_elems * static_cast<int64_t>(sizeof(T)) : 0;
            switch (m) {
                case 8: score_heads<8>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                case 7: score_heads<7>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                case 6: score_heads<6>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                case 5: score_heads<5>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                case 4: score_heads<4>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                case 3: score_heads<3>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                case 2: score_heads<2>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
                default: score_heads<1>(sp, qh, kp, pf, pf_bytes, bs, hd, scale); break;
            }
        }
    }
}

/// Scores of M pairs over the whole context, NV key vectors at a time (vectors past the context
/// repeat its last one: their scores land in the padding and are never read).
template <int M, int NV, typename T>
inline void score_head(float * const * s, const float * const * qh, const T * kpool, const AttnQuery & qry,
                       int64_t n, int64_t bs, int64_t row, int64_t koff, int64_t hd, float scale) {
    const int64_t nv = (n + kLanes - 1) / kLanes;
    auto vec = [&](int64_t v) {
        v = std::min(v, nv - 1);
        return key_lanes(kpool, qry, v * kLanes, bs, row) + koff;
    };
    const T * kp[NV];
    const T * pf[NV];
    for (int b = 0; b < NV; ++b) { kp[b] = vec(b); }
    float * sv[M];
    for (int64_t v0 = 0; v0 < nv; v0 += NV) {
        const bool next = v0 + NV < nv;
        for (int b = 0; b < NV; ++b) { pf[b] = next ? vec(v0 + NV + b) : nullptr; }
        for (int m = 0; m < M; ++m) { sv[m] = s[m] + v0 * kLanes; }
        score_vecs<M, NV>(sv, qh, kp, next ? pf : nullptr, bs, hd, scale);
        if (next) { std::copy(std::begin(pf), std::end(pf), std::begin(kp)); }
    }
}

}  // namespace

/// attend_tile for one query (queries[i]) and kv heads [g0, g1), when block_size % 16 == 0 and
/// head_dim % 16 == 0: bitwise its result.
template <typename T>
void attend_one(float * out, const float * q, const AttnQuery & qry, int64_t n_heads, int64_t g0, int64_t g1,
                PagedKv kv, float scale) {
    const T *     kpool = static_cast<const T *>(kv.k);
    const T *     vpool = static_cast<const T *>(kv.v);
    const int64_t hd = kv.head_dim, row = static_cast<int64_t>(kv.n_kv_heads) * hd, bs = kv.block_size;
    const int64_t group = n_heads / kv.n_kv_heads, n = qry.n_ctx;
    if (n <= 0) {  // no keys: zeros, as attend_tile leaves them
        std::fill(out + g0 * group * hd, out + g1 * group * hd, 0.0f);
        return;
    }
    const int64_t ld = ((n + kNv * kLanes - 1) / (kNv * kLanes) + 1) * kNv * kLanes;  // + a padding chunk
    thread_local detail::ScratchVec<float> scores;
    const size_t need = static_cast<size_t>((g1 - g0) * group * ld);  // [heads of the range, ld]
    if (scores.size() < need) { scores.resize(need); }
    const bool block_major = group == 1 && g1 - g0 >= 2;  // one kv head per query: the heads of a vector together
    if (block_major) {
        score_block_major(scores.data(), q, kpool, qry, n, g0, g1, bs, row, hd, ld, scale);
        for (int64_t g = g0; g < g1; ++g) { softmax_row(scores.data() + (g - g0) * ld, n); }
    }
    for (int64_t g = g0; g < g1 && !block_major; ++g) {
        // Scores, 8 pairs at a time (then 4, 2, 1) with 1, 2, 4 or 8 key vectors: >= 8 chains.
        for (int64_t h0 = 0; h0 < group;) {
            const int64_t left = group - h0;
            const int     mm   = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            const float * qh[8];
            float *       s[8];
            for (int m = 0; m < mm; ++m) {
                qh[m] = q + (g * group + h0 + m) * hd;
                s[m]  = scores.data() + ((g - g0) * group + h0 + m) * ld;
            }
            const int64_t koff = g * hd * bs;
            // Short contexts: no more key vectors at once than the context has (the chains are
            // independent, so any count gives the same scores).
            const int64_t nv = (n + kLanes - 1) / kLanes;
            const int     vecs = std::min<int64_t>(nv >= 8 ? 8 : nv >= 4 ? 4 : nv >= 2 ? 2 : 1, kNv / mm);
            switch (mm * 16 + vecs) {
                case 8 * 16 + 1: score_head<8, 1>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 4 * 16 + 2: score_head<4, 2>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 4 * 16 + 1: score_head<4, 1>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 2 * 16 + 4: score_head<2, 4>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 2 * 16 + 2: score_head<2, 2>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 2 * 16 + 1: score_head<2, 1>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 1 * 16 + 8: score_head<1, 8>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 1 * 16 + 4: score_head<1, 4>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                case 1 * 16 + 2: score_head<1, 2>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
                default: score_head<1, 1>(s, qh, kpool, qry, n, bs, row, koff, hd, scale); break;
            }
            h0 += mm;
        }
        for (int64_t h = 0; h < group; ++h) { softmax_row(scores.data() + (g - g0) * group * ld + h * ld, n); }
    }
    // P·V block by block, every head of the range per block: a block's V rows are one contiguous
    // run (all kv heads), read once, with the accumulators kept in `out` between blocks.
    const int64_t nh = (g1 - g0) * group;
    float *       o0 = out + g0 * group * hd;
    std::fill(o0, o0 + nh * hd, 0.0f);
    const int64_t n_blocks = (n + bs - 1) / bs;
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t t0 = b * bs, cnt = std::min(bs, n - t0);
        const T *     vb = vpool + static_cast<int64_t>(qry.block_table[b]) * bs * row;
        const T *     vf = b + kVAhead < n_blocks ? vpool + static_cast<int64_t>(qry.block_table[b + kVAhead]) * bs * row : nullptr;
        for (int64_t g = g0; g < g1; ++g) {
            for (int64_t h0 = 0; h0 < group;) {
                const int     mm = group - h0 >= 2 && hd % 64 == 0 ? 2 : 1;
                const float * p[2];
                float *       o[2];
                for (int m = 0; m < mm; ++m) {
                    p[m] = scores.data() + ((g - g0) * group + h0 + m) * ld + t0;
                    o[m] = out + (g * group + h0 + m) * hd;
                }
                for (int64_t d0 = 0; d0 < hd;) {
                    float *       od[2] = {o[0] + d0, mm > 1 ? o[1] + d0 : nullptr};
                    const int64_t off = g * hd + d0;
                    const T *     pf = vf != nullptr ? vf + off : nullptr;
                    if (hd - d0 >= 64) {
#if defined(__AVX512BW__)
                        if constexpr (std::is_same_v<T, Bf16>) {
                            if (mm == 2) { pv_rows_bf16x64<2>(od, p, cnt, vb + off, pf, row); }
                            else { pv_rows_bf16x64<1>(od, p, cnt, vb + off, pf, row); }
                        } else
#endif
                        {
                            if (mm == 2) { pv_rows<2, 4>(od, p, cnt, vb + off, pf, row); }
                            else { pv_rows<1, 4>(od, p, cnt, vb + off, pf, row); }
                        }
                        d0 += 64;
                    } else {
                        if (mm == 2) { pv_rows<2, 1>(od, p, cnt, vb + off, pf, row); }
                        else { pv_rows<1, 1>(od, p, cnt, vb + off, pf, row); }
                        d0 += 16;
                    }
                }
                h0 += mm;
            }
        }
    }
}

template void attend_one<float>(float *, const float *, const AttnQuery &, int64_t, int64_t, int64_t, PagedKv, float);
template void attend_one<Bf16>(float *, const float *, const AttnQuery &, int64_t, int64_t, int64_t, PagedKv, float);

}  // namespace fd::kernels
