// Paged KV store and causal GQA attention (see cpu_ops.h).
//
// Tiles: consecutive queries over the same block table (a prefill's tokens) are attended
// together, up to 64, so each K and V row read from memory serves all of them; with few tiles
// (small decode batches) the kv heads are split into ranges as well. Per (query, head) the
// arithmetic never depends on the tile: each score is one FMA chain over head_dim (keys along
// the 16 lanes, so 16 scores are computed at once without a lane reduction), softmax sums are
// 16 lane-wise chains over t and reduce16, and the V accumulation is one FMA per element and t,
// t ascending. Results are therefore bitwise the same whatever the batch, its order or the
// threads.
//
// K is stored transposed within each block (kv_store): per (block, kv head) [head_dim, block_size],
// so dimension d of 16 consecutive keys is one contiguous load and no path transposes K; V rows
// stay [block_size, n_kv_heads, head_dim].
//
// bf16 pools (--kv-cache-dtype bfloat16): every K and V load widens 16 bf16 values to f32
// exactly (a shift into the upper half) and feeds the same FMA chains in the same order, so the
// result is bitwise that of the f32 kernel over a pool holding the bf16-rounded values. The
// element type is a template parameter (float or Bf16) of every function that reads the pool.
//
// Decode queries (a tile of one query, block_size and head_dim multiples of 16) take
// attention_decode.cpp's path instead: the same chains in the same order (bitwise this kernel's
// output; the tests compare a prefill's queries with their decode outputs), laid out for one
// query (more chains in flight, V walked block by block over every head); with AttnIsa::avx2
// (the default where the build has AVX2 and no AVX-512BW) attention_decode_avx2.cpp's instead,
// the same chains again on 8-lane registers. With AttnIsa::avx2 the tiles' scores, softmax and
// P·V run attention_prefill_avx2.cpp's register tiles (attention_avx2.h's softmax): the same
// chains, grouped so the accumulators fit AVX2's 16 registers.
#include "attention_avx2.h"
#include "fd/status.h"
#include "scratch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace fd::kernels {

void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots,
              int64_t n_tokens) {
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim, bs = kv.block_size;
    const bool    bf16 = kv.dtype == WType::bf16;
    for (int64_t t = 0; t < n_tokens; ++t) {
        // K: element e = kv_head * head_dim + d of the token at offset o of block b goes to
        // block b's [n_kv_heads * head_dim, block_size] at [e, o].
        const int64_t k0 = slots[t] / bs * bs * row + slots[t] % bs;
        const float * ks = k_new + t * row;
        const float * vs = v_new + t * row;
        if (bf16) {
            uint16_t * kd = static_cast<uint16_t *>(kv.k) + k0;
            uint16_t * vd = static_cast<uint16_t *>(kv.v) + slots[t] * row;
            for (int64_t e = 0; e < row; ++e) { kd[e * bs] = f32_to_bf16_rne(ks[e]); }
            for (int64_t e = 0; e < row; ++e) { vd[e] = f32_to_bf16_rne(vs[e]); }
        } else {
            float * kd = static_cast<float *>(kv.k) + k0;
            for (int64_t e = 0; e < row; ++e) { kd[e * bs] = ks[e]; }
            std::memcpy(static_cast<float *>(kv.v) + slots[t] * row, vs, sizeof(float) * row);
        }
    }
}

namespace {

/// Queries of one task: up to kQt consecutive batch entries of one sequence (same block table),
/// so each K and V row read from memory serves all of them.
constexpr int64_t kQt = 64;
/// Tiles of more queries than this run one kv head at a time: the scores scratch of a head
/// ([queries, group, context]) stays in L2 and each K/V row slice is still read once per tile.
constexpr int64_t kPerHeadQueries = 4;
/// Context positions per chunk: the keys of two 16-lane score vectors.
constexpr int64_t kTc = 32;

/// The kTc V row pointers of chunk [t0, t0 + kTc) (rows past n_max repeat row n_max - 1, which
/// exists): one block-table look-up per block, not per row.
template <typename T>
inline void chunk_rows(const T * (&rows)[kTc], const T * pool, const AttnQuery & qry, int64_t t0, int64_t n_max,
                       int64_t bs, int64_t row) {
    int64_t j = 0;
    while (j < kTc && t0 + j < n_max) {
        const int64_t t = t0 + j, off = t % bs, n = std::min<int64_t>({bs - off, kTc - j, n_max - t});
        const T * base = pool + (static_cast<int64_t>(qry.block_table[t / bs]) * bs + off) * row;
        for (int64_t i = 0; i < n; ++i) { rows[j + i] = base + i * row; }
        j += n;
    }
    for (; j < kTc; ++j) { rows[j] = rows[j - 1]; }
}

/// Prefetch elements [off, off + len) of each of the kTc rows (the next chunk, while this one
/// computes): one prefetch per 64-byte line.
template <typename T>
inline void prefetch_rows(const T * const (&rows)[kTc], int64_t off, int64_t len) {
    constexpr int64_t kPerLine = 64 / sizeof(T);
    for (int64_t j = 0; j < kTc; ++j) {
        if (j > 0 && rows[j] == rows[j - 1]) { break; }
        for (int64_t e = 0; e < len; e += kPerLine) { __builtin_prefetch(rows[j] + off + e, 0, 3); }
    }
}

/// kt[d, j] = dimension d of key t0 + j, kv head g, for t0 + j < n_max; 0 past it. Gathers the
/// chunk's keys from the blocks' Kᵀ for block sizes that are not a multiple of 16 (moves data
/// only; bf16 widened exactly).
///   kt [hd, kTc]
template <typename T>
inline void gather_keys(float * kt, const T * k, const AttnQuery & qry, int64_t t0, int64_t n_max, int64_t bs,
                        int64_t row, int64_t g, int64_t hd) {
    int64_t j = 0;
    while (j < kTc && t0 + j < n_max) {
        const int64_t t = t0 + j, off = t % bs, n = std::min<int64_t>({bs - off, kTc - j, n_max - t});
        const T * base = k + static_cast<int64_t>(qry.block_table[t / bs]) * bs * row + g * hd * bs + off;
        for (int64_t d = 0; d < hd; ++d) {
            for (int64_t i = 0; i < n; ++i) { kt[d * kTc + j + i] = to_f32(base[d * bs + i]); }
        }
        j += n;
    }
    if (j < kTc) {
        for (int64_t d = 0; d < hd; ++d) { std::fill(kt + d * kTc + j, kt + (d + 1) * kTc, 0.0f); }
    }
}

/// Scores of M (query, head) pairs against the chunk's kTc keys, lanes along the keys:
///   s[m][j] = (FMA chain over d ascending of q[m][d] * K[j][d], from 0) * scale.
/// Each score is its own chain, so it is the same for any M, tile or chunk. Keys 0..15 of the
/// chunk: dimension d at k0[d * ld]; keys 16..31 at k1[d * ld] (a block's Kᵀ, ld = block_size,
/// or gather_keys' scratch, ld = kTc); shared by the M pairs (one kv head).
template <int M, typename T>
inline void score_chunk(float * const * s, const float * const * qh, const T * k0p, const T * k1p, int64_t ld,
                        int64_t hd, float scale) {
    f32x16 a[M][2] = {};
    for (int64_t d = 0; d < hd; ++d) {
        const f32x16 k0 = load16(k0p + d * ld), k1 = load16(k1p + d * ld);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
            const float qd = qh[m][d];
            a[m][0] += qd * k0;
            a[m][1] += qd * k1;
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
        const f32x16 s0 = a[m][0] * scale, s1 = a[m][1] * scale;
        std::memcpy(s[m], &s0, sizeof s0);
        std::memcpy(s[m] + 16, &s1, sizeof s1);
    }
}

/// score_chunk for n pairs, 8 at a time (then 4, 2, 1): the same chains whatever the grouping.
template <typename T>
inline void score_pairs(float * const * s, const float * const * qh, int n, const T * k0, const T * k1, int64_t ld,
                        int64_t hd, float scale) {
    int i = 0;
    for (; i + 8 <= n; i += 8) { score_chunk<8>(s + i, qh + i, k0, k1, ld, hd, scale); }
    if (i + 4 <= n) { score_chunk<4>(s + i, qh + i, k0, k1, ld, hd, scale); i += 4; }
    if (i + 2 <= n) { score_chunk<2>(s + i, qh + i, k0, k1, ld, hd, scale); i += 2; }
    if (i < n) { score_chunk<1>(s + i, qh + i, k0, k1, ld, hd, scale); }
}

/// o[m] += p[m][j] * V[j] for j < nt[m] (ascending), M (query, head) pairs of one kv head sharing
/// every V load; one FMA per element and j, whatever M. ND 16-lane vectors of d at a time
/// (hd % (16 * ND) == 0): M * ND independent chains.
template <int M, int ND, typename T>
inline void pv_chunk(float * const * o, const float * const * p, const int64_t * nt, const T * const (&vr)[kTc],
                     int64_t hd) {
    int64_t j_all = kTc, j_any = 0;  // every pair / some pair reaches j
    for (int m = 0; m < M; ++m) {
        j_all = std::min(j_all, nt[m]);
        j_any = std::max(j_any, nt[m]);
    }
    for (int64_t d = 0; d < hd; d += ND * kLanes) {
        f32x16 a[M][ND];
        for (int m = 0; m < M; ++m) {
            for (int e = 0; e < ND; ++e) { a[m][e] = load16(o[m] + d + e * kLanes); }
        }
        for (int64_t j = 0; j < j_all; ++j) {
            f32x16 v[ND];
#pragma GCC unroll 4
            for (int e = 0; e < ND; ++e) {
                v[e] = load16(vr[j] + d + e * kLanes);
                in_register(v[e]);
            }
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
                const float pj = p[m][j];
#pragma GCC unroll 4
                for (int e = 0; e < ND; ++e) { a[m][e] += pj * v[e]; }
            }
        }
        for (int64_t j = j_all; j < j_any; ++j) {  // the same FMAs, for the pairs that reach j
            for (int e = 0; e < ND; ++e) {
                const f32x16 v = load16(vr[j] + d + e * kLanes);
                for (int m = 0; m < M; ++m) {
                    if (j < nt[m]) { a[m][e] += p[m][j] * v; }
                }
            }
        }
        for (int m = 0; m < M; ++m) {
            for (int e = 0; e < ND; ++e) { std::memcpy(o[m] + d + e * kLanes, &a[m][e], sizeof a[m][e]); }
        }
    }
}

/// pv_chunk for n pairs, 8 at a time (then 4, 2, 1); head_dim not a multiple of 16: scalar FMAs
/// in the same order.
template <typename T>
inline void pv_pairs(float * const * o, const float * const * p, const int64_t * nt, int n, const T * const (&vr)[kTc],
                     int64_t hd) {
    if (hd % kLanes != 0) {
        for (int m = 0; m < n; ++m) {
            for (int64_t j = 0; j < nt[m]; ++j) {
                for (int64_t d = 0; d < hd; ++d) { o[m][d] += p[m][j] * to_f32(vr[j][d]); }
            }
        }
        return;
    }
    int i = 0;
    if (hd % (2 * kLanes) == 0) {
        for (; i + 8 <= n; i += 8) { pv_chunk<8, 2>(o + i, p + i, nt + i, vr, hd); }
        if (i + 4 <= n) { pv_chunk<4, 2>(o + i, p + i, nt + i, vr, hd); i += 4; }
    }
    if (hd % (4 * kLanes) == 0) {
        for (; i + 2 <= n; i += 2) { pv_chunk<2, 4>(o + i, p + i, nt + i, vr, hd); }
        for (; i < n; ++i) { pv_chunk<1, 4>(o + i, p + i, nt + i, vr, hd); }
    }
    for (; i + 4 <= n; i += 4) { pv_chunk<4, 1>(o + i, p + i, nt + i, vr, hd); }
    for (; i < n; ++i) { pv_chunk<1, 1>(o + i, p + i, nt + i, vr, hd); }
}

/// score_pairs, pv_pairs and softmax_row on `avx2`'s instructions (attention_prefill_avx2.cpp,
/// attention_avx2.h) or the generic ones: the same bits either way.
template <typename T>
inline void score_isa(bool avx2, float * const * s, const float * const * qh, int n, const T * k0, const T * k1,
                      int64_t ld, int64_t hd, float scale) {
#if FD_ATTN_AVX2
    if (avx2) { return score_pairs_avx2(s, qh, n, k0, k1, ld, hd, scale); }
#endif
    score_pairs(s, qh, n, k0, k1, ld, hd, scale);
}
template <typename T>
inline void pv_isa(bool avx2, float * const * o, const float * const * p, const int64_t * nt, int n,
                   const T * const (&vr)[kTc], int64_t hd) {
#if FD_ATTN_AVX2
    if (avx2) { return pv_pairs_avx2(o, p, nt, n, vr, hd); }
#endif
    pv_pairs(o, p, nt, n, vr, hd);
}
inline void softmax_isa(bool avx2, float * s, int64_t n) {
#if FD_ATTN_AVX2
    if (avx2) { return softmax_row_avx2(s, n); }
#endif
    softmax_row(s, n);
}

/// Attention of queries [i0, i1) (one sequence) for the query heads of kv heads [g0, g1).
///   scores [i1 - i0, (g1 - g0) * group, n_ctx_max rounded up to kTc] scratch;  kt [hd, kTc] scratch
///   (gather_keys; block sizes not a multiple of 16 only).
/// Per (query, head), whatever the tile: s[t] = (one FMA chain over d ascending) * scale,
/// p = exp16(s - max) / sum with the sum 16 lane-wise chains over t then reduce16,
/// out = sum over t ascending of p[t] * V[t] (one FMA per element and t).
/// avx2: the scores, softmax and P·V on AVX2 + FMA registers (the same bits).
template <typename T>
void attend_tile(float * out, const float * q, const AttnQuery * queries, int64_t i0, int64_t i1, int64_t n_heads,
                 int64_t g0, int64_t g1, PagedKv kv, float scale, float * scores, float * kt, bool avx2) {
    const T *     kpool = static_cast<const T *>(kv.k);
    const T *     vpool = static_cast<const T *>(kv.v);
    const int64_t hd = kv.head_dim, row = static_cast<int64_t>(kv.n_kv_heads) * hd, bs = kv.block_size;
    const int64_t group = n_heads / kv.n_kv_heads, nq = i1 - i0, nh = (g1 - g0) * group;
    int64_t       n_max = 0;
    for (int64_t i = i0; i < i1; ++i) { n_max = std::max<int64_t>(n_max, queries[i].n_ctx); }
    const int64_t ld = (n_max + kTc - 1) / kTc * kTc;  // scores row stride
    const AttnQuery & qt = queries[i0];  // the tile's block table (all its queries share it)
    // Scores: each key is read once for every (query, head) of the tile, straight from the
    // blocks' Kᵀ (dimension d of 16 consecutive keys is one 64-byte run) when block_size % 16 == 0.
    const bool    direct = bs % kLanes == 0;
    const T *     kb[2] = {};  // keys [t0, t0 + 16) and [t0 + 16, t0 + 32), kv head 0 (direct)
    const T *     kn[2] = {};  // the next chunk's
    int64_t       act[kQt];  // queries whose context reaches the chunk
    thread_local detail::ScratchVec<const float *> qp, pp;  // per (query, head) pair of one kv head
    thread_local detail::ScratchVec<float *>       sp, op;
    thread_local detail::ScratchVec<int64_t>       nt;
    const size_t n_pairs = static_cast<size_t>(nq * group);
    if (qp.size() < n_pairs) {
        qp.resize(n_pairs);
        pp.resize(n_pairs);
        sp.resize(n_pairs);
        op.resize(n_pairs);
        nt.resize(n_pairs);
    }
    // Halves past n_max point at the first half (their scores are never read).
    auto chunk_keys = [&](const T * (&p)[2], int64_t t0) {
        p[0] = key_lanes(kpool, qt, t0, bs, row);
        p[1] = t0 + kLanes < n_max ? key_lanes(kpool, qt, t0 + kLanes, bs, row) : p[0];
    };
    if (direct) { chunk_keys(kb, 0); }
    for (int64_t t0 = 0; t0 < n_max; t0 += kTc) {
        const bool next = direct && t0 + kTc < n_max;
        if (next) { chunk_keys(kn, t0 + kTc); }
        int64_t n_act = 0;
        for (int64_t qi = 0; qi < nq; ++qi) {
            if (t0 < queries[i0 + qi].n_ctx) { act[n_act++] = qi; }
        }
        for (int64_t g = g0; g < g1; ++g) {
            if (next) {  // this head's slice of the next chunk
                for (int64_t d = 0; d < hd; ++d) {
                    __builtin_prefetch(kn[0] + (g * hd + d) * bs, 0, 3);
                    __builtin_prefetch(kn[1] + (g * hd + d) * bs, 0, 3);
                }
            }
            int n = 0;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                for (int64_t a = 0; a < n_act; ++a) {
                    const int64_t qi = act[a];
                    qp[n] = q + ((i0 + qi) * n_heads + h) * hd;
                    sp[n] = scores + (qi * nh + h - g0 * group) * ld + t0;
                    ++n;
                }
            }
            if (direct) {
                score_isa(avx2, sp.data(), qp.data(), n, kb[0] + g * hd * bs, kb[1] + g * hd * bs, bs, hd, scale);
            } else {
                gather_keys(kt, kpool, qt, t0, n_max, bs, row, g, hd);
                score_isa(avx2, sp.data(), qp.data(), n, static_cast<const float *>(kt), kt + kLanes, kTc, hd, scale);
            }
        }
        if (next) { std::copy(std::begin(kn), std::end(kn), std::begin(kb)); }
    }
    // Softmax of each (query, head) over its own context; lanes past it hold exactly 0 (the row
    // stride is >= n + 16).
    for (int64_t qi = 0; qi < nq; ++qi) {
        for (int64_t hh = 0; hh < nh; ++hh) { softmax_isa(avx2, scores + (qi * nh + hh) * ld, queries[i0 + qi].n_ctx); }
    }
    // Output: V rows read once per chunk for every query of the tile, accumulated in t order.
    for (int64_t qi = 0; qi < nq; ++qi) {
        float * o = out + ((i0 + qi) * n_heads + g0 * group) * hd;
        std::fill(o, o + nh * hd, 0.0f);
    }
    // Tiles of many queries read each V chunk many times: from a packed copy (bf16 widened
    // exactly to f32, so the FMAs see the same values).
    thread_local detail::ScratchVec<float> vpack;
    const bool pack_v = nq > kPerHeadQueries;
    if (pack_v && vpack.size() < static_cast<size_t>(kTc * hd)) { vpack.resize(static_cast<size_t>(kTc * hd)); }
    const T *     vb[kTc];
    const T *     vn[kTc];
    const T *     vr[kTc];
    const float * vf[kTc];
    chunk_rows(vb, vpool, qt, 0, n_max, bs, row);
    for (int64_t t0 = 0; t0 < n_max; t0 += kTc) {
        if (t0 + kTc < n_max) {
            chunk_rows(vn, vpool, qt, t0 + kTc, n_max, bs, row);
        }
        int64_t n_act = 0;
        for (int64_t qi = 0; qi < nq; ++qi) {
            if (t0 < queries[i0 + qi].n_ctx) { act[n_act++] = qi; }
        }
        for (int64_t g = g0; g < g1; ++g) {
            if (t0 + kTc < n_max) { prefetch_rows(vn, g * hd, hd); }
            if (pack_v) {  // contiguous copy: rows 3+ KiB apart crowd a few L1 sets
                for (int64_t j = 0; j < kTc; ++j) {
                    float * dst = vpack.data() + j * hd;
                    if constexpr (std::is_same_v<T, float>) {
                        std::memcpy(dst, vb[j] + g * hd, sizeof(float) * hd);
                    } else {
                        for (int64_t d = 0; d < hd; ++d) { dst[d] = to_f32(vb[j][g * hd + d]); }
                    }
                    vf[j] = dst;
                }
            } else {
                for (int64_t j = 0; j < kTc; ++j) { vr[j] = vb[j] + g * hd; }
            }
            int n = 0;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                for (int64_t a = 0; a < n_act; ++a) {
                    const int64_t qi = act[a];
                    op[n] = out + ((i0 + qi) * n_heads + h) * hd;
                    pp[n] = scores + (qi * nh + h - g0 * group) * ld + t0;
                    nt[n] = std::min(kTc, queries[i0 + qi].n_ctx - t0);
                    ++n;
                }
            }
            if (pack_v) {
                pv_isa(avx2, op.data(), pp.data(), nt.data(), n, vf, hd);
            } else {
                pv_isa(avx2, op.data(), pp.data(), nt.data(), n, vr, hd);
            }
        }
        if (t0 + kTc < n_max) { std::copy(std::begin(vn), std::end(vn), std::begin(vb)); }
    }
}

}  // namespace

const char * attn_isa_name(AttnIsa isa) { return isa == AttnIsa::avx2 ? "avx2" : "generic"; }

bool attn_has_avx2() { return FD_ATTN_AVX2 != 0; }

AttnIsa attn_best_isa() {
#if FD_ATTN_AVX2 && !defined(__AVX512BW__)
    return AttnIsa::avx2;
#else
    return AttnIsa::generic;
#endif
}

void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool, AttnIsa isa) {
    if (isa == AttnIsa::avx2 && !attn_has_avx2()) {
        fail(Errc::invalid_argument, "attention_paged: this build has no AVX2 path (isa avx2; use generic)");
    }
    if (n_tokens <= 0) { return; }
    // Tiles: runs of consecutive queries over the same block table (a prefill), at most kQt.
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < n_tokens; ++i) {
        if (starts.empty() || i - starts.back() >= kQt || queries[i].block_table != queries[starts.back()].block_table) {
            starts.push_back(i);
        }
    }
    starts.push_back(n_tokens);
    const int64_t n_tiles = static_cast<int64_t>(starts.size()) - 1, n_kv = kv.n_kv_heads;
    int64_t       n_ctx_max = 1;
    for (int64_t i = 0; i < n_tokens; ++i) { n_ctx_max = std::max<int64_t>(n_ctx_max, queries[i].n_ctx); }
    // Few tiles (decode at small batch): split the kv heads into ranges too, so every thread
    // gets work; each range still reads whole contiguous runs of the K and V rows.
    const int64_t n_threads = pool ? pool->n_threads() : 1;
    const int64_t n_ranges  = n_threads == 1 ? 1 : std::clamp<int64_t>((2 * n_threads + n_tiles - 1) / n_tiles, 1, n_kv);
    const int64_t per_range = (n_kv + n_ranges - 1) / n_ranges;
    const int64_t group     = n_heads / n_kv;
    // Tiles largest first (work ~ the sum of their queries' contexts; a prefill's last tiles
    // attend to the most keys): tasks are claimed in order, so the threads finish together
    // instead of one running the largest tile alone at the end.
    std::vector<int64_t> order(static_cast<size_t>(n_tiles)), cost(static_cast<size_t>(n_tiles), 0);
    for (int64_t t = 0; t < n_tiles; ++t) {
        order[t] = t;
        for (int64_t i = starts[t]; i < starts[t + 1]; ++i) { cost[t] += queries[i].n_ctx; }
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
    const bool avx2 = isa == AttnIsa::avx2;
    auto run = [&](int64_t task) {
        thread_local detail::ScratchVec<float> scores, kt;
        const int64_t tile = order[task / n_ranges], g0 = task % n_ranges * per_range, g1 = std::min(n_kv, g0 + per_range);
        const int64_t nq = starts[tile + 1] - starts[tile];
        const int64_t heads_at_once = nq > kPerHeadQueries ? 1 : per_range;  // kv heads per attend_tile
        const size_t  need = static_cast<size_t>(nq * heads_at_once * group * ((n_ctx_max + kTc - 1) / kTc * kTc));
        if (scores.size() < need) { scores.resize(need); }
        if (kt.size() < static_cast<size_t>(kv.head_dim * kTc)) { kt.resize(static_cast<size_t>(kv.head_dim * kTc)); }
        if (nq == 1 && kv.block_size % kLanes == 0 && kv.head_dim % kLanes == 0) {
            const int64_t i = starts[tile];
#if FD_ATTN_AVX2
            if (isa == AttnIsa::avx2) {
                if (kv.dtype == WType::bf16) {
                    attend_one_avx2<Bf16>(out + i * n_heads * kv.head_dim, q + i * n_heads * kv.head_dim, queries[i], n_heads, g0, g1, kv, scale);
                } else {
                    attend_one_avx2<float>(out + i * n_heads * kv.head_dim, q + i * n_heads * kv.head_dim, queries[i], n_heads, g0, g1, kv, scale);
                }
                return;
            }
#endif
            if (kv.dtype == WType::bf16) {
                attend_one<Bf16>(out + i * n_heads * kv.head_dim, q + i * n_heads * kv.head_dim, queries[i], n_heads, g0, g1, kv, scale);
            } else {
                attend_one<float>(out + i * n_heads * kv.head_dim, q + i * n_heads * kv.head_dim, queries[i], n_heads, g0, g1, kv, scale);
            }
            return;
        }
        for (int64_t g = g0; g < g1; g += heads_at_once) {
            const int64_t gh = std::min(g1, g + heads_at_once);
            if (kv.dtype == WType::bf16) {
                attend_tile<Bf16>(out, q, queries, starts[tile], starts[tile + 1], n_heads, g, gh, kv, scale, scores.data(), kt.data(), avx2);
            } else {
                attend_tile<float>(out, q, queries, starts[tile], starts[tile + 1], n_heads, g, gh, kv, scale, scores.data(), kt.data(), avx2);
            }
        }
    };
    const int64_t n_tasks = n_tiles * n_ranges;
    const int64_t work    = n_ctx_max * n_tokens * n_heads * kv.head_dim;
    if (pool && n_tasks > 1 && work > (1 << 16)) {
        pool->parallel_for(n_tasks, run);
    } else {
        for (int64_t t = 0; t < n_tasks; ++t) { run(t); }
    }
}

}  // namespace fd::kernels
