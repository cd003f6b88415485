// Paged KV store and causal GQA attention (see ops.h).
//
// Tiles: consecutive queries over the same block table (a prefill's tokens) are attended
// together, up to 16, so each K and V row read from memory serves all of them; with few tiles
// (small decode batches) the kv heads are split into ranges as well. Per (query, head) the
// arithmetic never depends on the tile: scores are 16 lane-wise FMA chains over head_dim and
// the shared reduce16, softmax sums are 16 lane-wise chains over t and reduce16, and the V
// accumulation is one FMA per element and t, t ascending. Results are therefore bitwise the
// same whatever the batch, its order or the threads.
#include "fd/kernels/cpu_ops.h"
#include "lanes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace fd::kernels {

void kv_store(PagedKv kv, const float * k_new, const float * v_new, const int64_t * slots,
              int64_t n_tokens) {
    const int64_t row = static_cast<int64_t>(kv.n_kv_heads) * kv.head_dim;
    for (int64_t t = 0; t < n_tokens; ++t) {
        std::memcpy(kv.k + slots[t] * row, k_new + t * row, sizeof(float) * row);
        std::memcpy(kv.v + slots[t] * row, v_new + t * row, sizeof(float) * row);
    }
}

namespace {

typedef int32_t i32x16 __attribute__((vector_size(64)));

/// Queries of one task: up to kQt consecutive batch entries of one sequence (same block table),
/// so each K and V row read from memory serves all of them.
constexpr int64_t kQt = 64;
/// Tiles of more queries than this run one kv head at a time: the scores scratch of a head
/// ([queries, group, context]) stays in L2 and each K/V row slice is still read once per tile.
constexpr int64_t kPerHeadQueries = 4;
/// Context positions per inner chunk: 16 scores are reduced at once (reduce_all).
constexpr int64_t kTc = 16;

/// e^x for x <= 0 (softmax after subtracting the max), 16 lanes: x = n ln2 + r, |r| <= ln2 / 2,
/// e^r by the Cephes expf polynomial, times 2^n. Within ~2 ulp of expf; lanes below -87 give
/// ~1e-38 instead of underflowing. Each lane depends on its own input only.
inline f32x16 exp16(f32x16 x) {
    const f32x16 lo = f32x16{} - 87.0f;
    x = x < lo ? lo : x;
    const f32x16 round = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const f32x16 n = (x * 1.44269504088896341f + round) - round;
    const f32x16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    f32x16 p = f32x16{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const f32x16 y = p * r * r + r + 1.0f;
    const i32x16 e = (__builtin_convertvector(n, i32x16) + 127) << 23;
    f32x16 scale;
    std::memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/// Where context position t of a query's sequence lives.
inline const float * kv_row(const float * pool, const AttnQuery & qry, int64_t t, int64_t bs, int64_t row) {
    return pool + (static_cast<int64_t>(qry.block_table[t / bs]) * bs + t % bs) * row;
}

/// Lane sums of M queries' scores against kTc K rows: acc[m][j] = 16 lane-wise FMA chains over
/// d of q[m] · k[j] (d ascending). Every K vector is loaded once for the M queries; each
/// (query, row) chain is the same for any M.
/// kHd > 0: head_dim known at compile time (q held in registers); 0: `hd` at run time. The same
/// FMAs either way.
template <int M, int kHd = 0>
inline void score_lanes(f32x16 (&acc)[4][kTc], const float * const (&qh)[4], const float * const (&kr)[kTc], int64_t hd) {
    if constexpr (kHd > 0) {
        constexpr int ND = kHd / kLanes;
        f32x16 qv[M][ND];
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
            for (int d = 0; d < ND; ++d) { qv[m][d] = load16(qh[m] + d * kLanes); }
        }
#pragma GCC unroll 2
        for (int64_t j = 0; j < kTc; ++j) {
            f32x16 a[M] = {};
#pragma GCC unroll 8
            for (int d = 0; d < ND; ++d) {
                const f32x16 k = load16(kr[j] + d * kLanes);
#pragma GCC unroll 4
                for (int m = 0; m < M; ++m) { a[m] += qv[m][d] * k; }
            }
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) { acc[m][j] = a[m]; }
        }
    } else {
        for (int64_t j = 0; j < kTc; ++j) {
            f32x16 a[M] = {};
            for (int64_t d = 0; d < hd; d += kLanes) {
                const f32x16 k = load16(kr[j] + d);
                for (int m = 0; m < M; ++m) { a[m] += load16(qh[m] + d) * k; }
            }
            for (int m = 0; m < M; ++m) { acc[m][j] = a[m]; }
        }
    }
}

/// o[m] += p[m][j] * V[j] for j < nt[m] (ascending), M queries sharing every V load; one FMA
/// per element and j, whatever M.
template <int M>
inline void accumulate_v(float * const (&o)[4], const float * const (&p)[4], const int64_t (&nt)[4],
                         const float * const (&vr)[kTc], int64_t hd) {
    for (int64_t d = 0; d < hd; d += kLanes) {
        f32x16 a[M];
        for (int m = 0; m < M; ++m) { a[m] = load16(o[m] + d); }
        bool full = true;
        for (int m = 0; m < M; ++m) { full = full && nt[m] == kTc; }
        if (full) {  // the same FMAs as below, without the per-row test
            for (int64_t j = 0; j < kTc; ++j) {
                const f32x16 v = load16(vr[j] + d);
                for (int m = 0; m < M; ++m) { a[m] += p[m][j] * v; }
            }
        } else {
            for (int64_t j = 0; j < kTc; ++j) {
                const f32x16 v = load16(vr[j] + d);
                for (int m = 0; m < M; ++m) {
                    if (j < nt[m]) { a[m] += p[m][j] * v; }
                }
            }
        }
        for (int m = 0; m < M; ++m) { std::memcpy(o[m] + d, &a[m], sizeof a[m]); }
    }
}

/// Attention of queries [i0, i1) (one sequence) for the query heads of kv heads [g0, g1).
///   scores [i1 - i0, (g1 - g0) * group, n_ctx_max rounded up to kTc] scratch.
/// Per (query, head), whatever the tile: s[t] = reduce16(16 lane-wise FMA chains over d) * scale
/// (head_dim % 16 == 0; else one sequential chain), p = exp16(s - max) / sum with the sum
/// 16 lane-wise chains over t then reduce16, out = sum over t ascending of p[t] * V[t] (one FMA
/// per element and t).
void attend_tile(float * out, const float * q, const AttnQuery * queries, int64_t i0, int64_t i1, int64_t n_heads,
                 int64_t g0, int64_t g1, PagedKv kv, float scale, float * scores) {
    const int64_t hd = kv.head_dim, row = static_cast<int64_t>(kv.n_kv_heads) * hd, bs = kv.block_size;
    const int64_t group = n_heads / kv.n_kv_heads, nq = i1 - i0, nh = (g1 - g0) * group;
    const bool    lanes = hd % kLanes == 0;
    int64_t       n_max = 0;
    for (int64_t i = i0; i < i1; ++i) { n_max = std::max<int64_t>(n_max, queries[i].n_ctx); }
    const int64_t ld = (n_max + kTc - 1) / kTc * kTc;  // scores row stride
    const AttnQuery & qt = queries[i0];  // the tile's block table (all its queries share it)
    // Scores: each K row (this head's part) is read once for every query of the tile.
    const float * kr[kTc];
    const float * kb[kTc];
    int64_t       act[kQt];  // queries whose context reaches the chunk
    for (int64_t t0 = 0; t0 < n_max; t0 += kTc) {
        for (int64_t j = 0; j < kTc; ++j) { kb[j] = kv_row(kv.k, qt, std::min(t0 + j, n_max - 1), bs, row); }
        int64_t n_act = 0;
        for (int64_t qi = 0; qi < nq; ++qi) {
            if (t0 < queries[i0 + qi].n_ctx) { act[n_act++] = qi; }
        }
        for (int64_t h = g0 * group; h < g1 * group; ++h) {
            for (int64_t j = 0; j < kTc; ++j) { kr[j] = kb[j] + (h / group) * hd; }
            for (int64_t a0 = 0; a0 < n_act; a0 += 4) {
                const int     m_n = static_cast<int>(std::min<int64_t>(4, n_act - a0));
                const float * qh[4];
                float *       sp[4];
                for (int m = 0; m < 4; ++m) {
                    const int64_t qi = act[a0 + std::min(m, m_n - 1)];
                    qh[m] = q + ((i0 + qi) * n_heads + h) * hd;
                    sp[m] = scores + (qi * nh + h - g0 * group) * ld + t0;
                }
                if (lanes) {
                    f32x16 acc[4][kTc];
                    if (m_n == 4 && hd == 64) {
                        score_lanes<4, 64>(acc, qh, kr, hd);
                    } else if (m_n == 4 && hd == 128) {
                        score_lanes<4, 128>(acc, qh, kr, hd);
                    } else if (m_n == 4) {
                        score_lanes<4>(acc, qh, kr, hd);
                    } else {
                        for (int m = 0; m < m_n; ++m) {
                            const float * q1[4] = {qh[m], qh[m], qh[m], qh[m]};
                            f32x16        a1[4][kTc];
                            score_lanes<1>(a1, q1, kr, hd);
                            std::memcpy(acc[m], a1[0], sizeof acc[m]);
                        }
                    }
                    for (int m = 0; m < m_n; ++m) { reduce_all(acc[m], kTc, sp[m]); }
                } else {
                    for (int m = 0; m < m_n; ++m) {
                        for (int64_t j = 0; j < kTc; ++j) {
                            float sum = 0.0f;
                            for (int64_t d = 0; d < hd; ++d) { sum += qh[m][d] * kr[j][d]; }
                            sp[m][j] = sum;
                        }
                    }
                }
                for (int m = 0; m < m_n; ++m) {
                    for (int64_t j = 0; j < kTc; ++j) { sp[m][j] *= scale; }
                }
            }
        }
    }
    // Softmax of each (query, head) over its own context; lanes past it hold exactly 0.
    for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t n = queries[i0 + qi].n_ctx;
        for (int64_t hh = 0; hh < nh; ++hh) {
            float * s  = scores + (qi * nh + hh) * ld;
            f32x16 m16 = f32x16{} - INFINITY;  // max: exact in any order
            int64_t t = 0;
            for (; t + kLanes <= n; t += kLanes) {
                const f32x16 v = load16(s + t);
                m16 = v > m16 ? v : m16;
            }
            float mx = -INFINITY;
            for (int j = 0; j < kLanes; ++j) { mx = m16[j] > mx ? m16[j] : mx; }
            for (; t < n; ++t) { mx = s[t] > mx ? s[t] : mx; }
            f32x16 sum{};
            for (int64_t t = 0; t < n; t += kLanes) {
                f32x16 e = exp16(load16(s + t) - mx);
                for (int64_t j = n - t; j < kLanes; ++j) { e[j] = 0.0f; }
                std::memcpy(s + t, &e, sizeof e);
                sum += e;
            }
            const float inv = 1.0f / reduce16(sum);
            for (int64_t t = 0; t < n; ++t) { s[t] *= inv; }
        }
    }
    // Output: V rows read once per chunk for every query of the tile, accumulated in t order.
    for (int64_t qi = 0; qi < nq; ++qi) {
        float * o = out + ((i0 + qi) * n_heads + g0 * group) * hd;
        std::fill(o, o + nh * hd, 0.0f);
    }
    const float * vb[kTc];
    const float * vr[kTc];
    for (int64_t t0 = 0; t0 < n_max; t0 += kTc) {
        for (int64_t j = 0; j < kTc; ++j) { vb[j] = kv_row(kv.v, qt, std::min(t0 + j, n_max - 1), bs, row); }
        int64_t n_act = 0;
        for (int64_t qi = 0; qi < nq; ++qi) {
            if (t0 < queries[i0 + qi].n_ctx) { act[n_act++] = qi; }
        }
        for (int64_t h = g0 * group; h < g1 * group; ++h) {
            for (int64_t j = 0; j < kTc; ++j) { vr[j] = vb[j] + (h / group) * hd; }
            for (int64_t a0 = 0; a0 < n_act; a0 += 4) {
                const int     m_n = static_cast<int>(std::min<int64_t>(4, n_act - a0));
                float *       o[4];
                const float * p[4];
                int64_t       nt[4];
                for (int m = 0; m < 4; ++m) {
                    const int64_t qi = act[a0 + std::min(m, m_n - 1)];
                    o[m]  = out + ((i0 + qi) * n_heads + h) * hd;
                    p[m]  = scores + (qi * nh + h - g0 * group) * ld + t0;
                    nt[m] = std::min(kTc, queries[i0 + qi].n_ctx - t0);
                }
                if (lanes && m_n == 4) {
                    accumulate_v<4>(o, p, nt, vr, hd);
                } else if (lanes) {
                    for (int m = 0; m < m_n; ++m) {
                        float * const       o1[4] = {o[m], o[m], o[m], o[m]};
                        const float * const p1[4] = {p[m], p[m], p[m], p[m]};
                        const int64_t       n1[4] = {nt[m], nt[m], nt[m], nt[m]};
                        accumulate_v<1>(o1, p1, n1, vr, hd);
                    }
                } else {
                    for (int m = 0; m < m_n; ++m) {
                        for (int64_t j = 0; j < nt[m]; ++j) {
                            for (int64_t d = 0; d < hd; ++d) { o[m][d] += p[m][j] * vr[j][d]; }
                        }
                    }
                }
            }
        }
    }
}

}  // namespace

void attention_paged(float * out, const float * q, const AttnQuery * queries, int64_t n_tokens,
                     int64_t n_heads, PagedKv kv, float scale, ThreadPool * pool) {
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
    auto run = [&](int64_t task) {
        thread_local std::vector<float> scores;
        const int64_t tile = task / n_ranges, g0 = task % n_ranges * per_range, g1 = std::min(n_kv, g0 + per_range);
        const int64_t nq = starts[tile + 1] - starts[tile];
        const int64_t heads_at_once = nq > kPerHeadQueries ? 1 : per_range;  // kv heads per attend_tile
        const size_t  need = static_cast<size_t>(nq * heads_at_once * group * ((n_ctx_max + kTc - 1) / kTc * kTc));
        if (scores.size() < need) { scores.resize(need); }
        for (int64_t g = g0; g < g1; g += heads_at_once) {
            attend_tile(out, q, queries, starts[tile], starts[tile + 1], n_heads, g, std::min(g1, g + heads_at_once), kv, scale,
                        scores.data());
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
