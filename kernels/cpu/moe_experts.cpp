// The CPU backend's routed-expert GEMMs (moe_experts.h; issue 23).
//
// A sparse MoE block meets each expert with a handful of rows: 1 at single-sequence decode, ~4
// at a batch of 64 (top-8 of 128). Through kernels::linear each group took a generic path: 4-row
// tiles whatever the group size (a 5-row group computed 8 rows), the x permutation, a pool call
// and a fresh prefetch stream per expert matrix, whose first tile began with demand misses.
// Here a segment of the plan runs as two phases over one task list each (gate_up of every
// expert, then down of every expert):
//  - x rows are gathered once per pair, in the weights' lane order (bf16: permute_bf16_step, as
//    linear's few-row paths; zero-padded to whole steps);
//  - a group of m <= kMoeSmallRows rows is cut into ceil(m / 6) row tiles of near-equal size, and
//    each tile runs a register tile of exactly its rows (MR = 1..6; NR = 8..3 weight rows so the
//    MR x NR accumulators, a step's 2 NR weight vectors and one x vector fit 32 registers), so no
//    padding rows are computed; the expert's weights stream from memory once (a 60-output chunk
//    at a time, so the later tiles find them in L2);
//  - the first row tile prefetches the weights 3-4 strips ahead into L2 as one sequential
//    stream (NR lines per step, as matmul.cpp's TileArgs::pf streams the next tile), running
//    on into the next task's weights at a task's end: the segment's experts are one continuous
//    prefetched stream, and the FMAs of one expert overlap the fetch of the next.
// Arithmetic: every output is kernels::linear's chain (matmul.cpp's header): 16 lanes, k steps
// ascending, one FMA each (bf16: lo before hi), the tail through linear_step.h's zero-padded
// loads, then reduce_all. Tiles only choose which loads feed an FMA, so each row's result is
// bitwise kernels::linear's (test_moe_experts checks it against the per-expert linear loop).
#include "moe_experts.h"

#include "fd/kernels/cpu_ops.h"
#include "lanes.h"
#include "linear_step.h"
#include "scratch.h"

#include <algorithm>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace fd::kernels {
namespace {

/// Rows per register tile at most: 7- and 8-row tiles (NR = 3) ran at 68 GFLOP/s where two tiles
/// of 3-4 rows ran at 79 (1 thread, weights in cache, bf16 512 x 192 experts).
constexpr int     kMaxMR    = 6;
constexpr int64_t kChunkOut = 60;          ///< outputs per chunk of a group of several row tiles
                                           ///< (every NR of 3..6 rows divides it)
constexpr int64_t kTaskOut  = 120;         ///< tasks are whole multiples of this: every NR divides it
constexpr int64_t kTaskBytes = 128 << 10;  ///< weights per task (as linear's decode tasks)
/// The leading row tile prefetches the weights this many strips ahead, into L2 (issue 23, 1
/// thread, B = 64 on 120 experts of 590 KB: L1 prefetches 1-2 strips ahead left the expert
/// stream at ~0.45 of the dense FLOP rate, compute and memory barely overlapping, the L1 miss
/// buffers bounding the bytes in flight; 4 strips into L2 ran at 0.7-0.8, 8-16 strips or an
/// extra L1 stream one strip ahead no better).
constexpr int64_t kPfStrips = 4;
/// One-row tiles (B = 1 decode): 3 strips ahead (24 KiB of 1 KiB rows) read the block at ~870
/// µs per token against ~970 at 4 strips and ~930 at 2 (fd_moe_bench --batch 1, 6 runs each
/// interleaved, load 11); L1 prefetches 2 or 8 strips ahead were slower still.
constexpr int64_t kPfStripsOneRow = 3;

/// Weights per register tile for MR rows: MR x NR accumulators + 2 NR weight vectors (a bf16
/// step's lo and hi) + 1 x vector <= 32 registers.
constexpr int nr_for(int mr) { return mr == 1 ? 8 : mr <= 3 ? 6 : mr == 4 ? 5 : mr == 5 ? 4 : 3; }
static_assert(kMaxMR == 6 && kChunkOut % 6 == 0 && kChunkOut % 5 == 0 && kChunkOut % 4 == 0, "row_tile's cases, the chunk's strips");

/// Floats of a packed row of n_in k's: whole bf16 steps (32), zero-padded (both dtypes).
int64_t padded(int64_t n_in) { return (n_in + 31) / 32 * 32; }

#if defined(__AVX512BW__)
/// n_steps whole steps of an MR x NR tile with AVX-512 intrinsics (matmul.cpp's whole_steps,
/// with x rows ldx apart): acc = x * w + acc, one rounding each, per accumulator lo before hi.
template <WType T, int MR, int NR>
__attribute__((noinline)) void tile_steps(f32x16 (&acc)[MR][NR], const float * x, int64_t ldx, const char * const (&wr)[NR],
                                          int64_t n_steps, const char * pf) {
    using S = Step<T>;
    __m512 a[MR][NR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) { a[r][c] = _mm512_setzero_ps(); }
    }
    for (int64_t s = 0; s < n_steps; ++s) {
        const int64_t k = s * S::K;
        // The step's NR x V weight vectors first (bf16: the lo and hi unpack of each row's 64
        // bytes), then every row's x against them.
        __m512 w[NR][S::V];
#pragma GCC unroll 8
        for (int c = 0; c < NR; ++c) {
            if (pf) { __builtin_prefetch(pf + (s * NR + c) * 64, 0, 2); }  // into L2 (see kPfStrips)
            if constexpr (T == WType::f32) {
                w[c][0] = _mm512_loadu_ps(reinterpret_cast<const float *>(wr[c]) + k);
            } else {
                const __m512i v = _mm512_loadu_si512(wr[c] + k * 2), z = _mm512_setzero_si512();
                w[c][0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
                w[c][1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
            }
#pragma GCC unroll 2
            for (int v = 0; v < S::V; ++v) { __asm__("" : "+v"(w[c][v])); }  // loaded once, not per FMA
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
            for (int v = 0; v < S::V; ++v) {
                __m512 xv = _mm512_loadu_ps(x + r * ldx + k + v * kLanes);
                __asm__("" : "+v"(xv));  // one load per row, not one per FMA
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

/// One MR x NR tile over all n_in k's: x rows [MR] at x (ldx floats apart, lane order, padded),
/// weight rows w + c row_bytes (c < n_cols; past it the last valid row again, not stored),
/// out[r * ldo + c] written. pf: NR cache lines per whole step are prefetched from there (the
/// next strip's weights), or nothing.
template <WType T, int MR, int NR>
void expert_tile(const float * x, int64_t ldx, const char * w, int64_t row_bytes, int n_cols, int64_t n_in, float * out,
                 int64_t ldo, const char * pf) {
    using S = Step<T>;
    const char * wr[NR];
    for (int c = 0; c < NR; ++c) { wr[c] = w + std::min(c, n_cols - 1) * row_bytes; }
    f32x16  acc[MR][NR];
    int64_t k = 0;
#if defined(__AVX512BW__)
    tile_steps<T, MR, NR>(acc, x, ldx, wr, n_in / S::K, pf);
    k = n_in / S::K * S::K;
#else
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NR; ++c) { acc[r][c] = f32x16{}; }
    }
#endif
    // Generic steps (the tail under AVX-512): matmul.cpp tile()'s step, the same expression.
    auto step = [&](int64_t kk, int n) {
        f32x16 wv[NR][S::V];
        for (int c = 0; c < NR; ++c) { load_w<T>(wr[c], kk, n, wv[c]); }
        for (int r = 0; r < MR; ++r) {
            f32x16 xv[S::V];
            load_x<T>(x + r * ldx, kk, n, xv);
            for (int v = 0; v < S::V; ++v) {
                for (int c = 0; c < NR; ++c) { acc[r][c] += xv[v] * wv[c][v]; }
            }
        }
    };
    for (; k + S::K <= n_in; k += S::K) { step(k, S::K); }
    if (k < n_in) { step(k, static_cast<int>(n_in - k)); }
    float sums[MR * NR];
    reduce_all(&acc[0][0], MR * NR, sums);
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < n_cols; ++c) { out[r * ldo + c] = sums[r * NR + c]; }
    }
}

/// One row tile of MR rows x outputs [oc, oe) of w, strip by strip; `stream`: this tile leads
/// the prefetch (kPfStrips strips ahead, one-row tiles kPfStripsOneRow; past the task's last
/// output o_end, on from `next`).
template <WType T, int MR>
void tile_strips(float * out, int64_t ldo, const float * x, int64_t ldx, const char * w, int64_t row_bytes, int64_t n_in,
                 int64_t oc, int64_t oe, int64_t o_end, const char * next, bool stream) {
    constexpr int NR = nr_for(MR);
    for (int64_t o = oc; o < oe; o += NR) {
        const int64_t ahead = o + (MR == 1 ? kPfStripsOneRow : kPfStrips) * NR;  // the strip this one prefetches
        const char *  pf    = !stream ? nullptr : ahead < o_end ? w + ahead * row_bytes : next ? next + (ahead - o_end) * row_bytes : nullptr;
        expert_tile<T, MR, NR>(x, ldx, w + o * row_bytes, row_bytes, static_cast<int>(std::min<int64_t>(NR, oe - o)), n_in,
                               out + o, ldo, pf);
    }
}

template <WType T>
void row_tile(int mr, float * out, int64_t ldo, const float * x, int64_t ldx, const char * w, int64_t row_bytes, int64_t n_in,
              int64_t oc, int64_t oe, int64_t o_end, const char * next, bool stream) {
    switch (mr) {
        case 1: tile_strips<T, 1>(out, ldo, x, ldx, w, row_bytes, n_in, oc, oe, o_end, next, stream); break;
        case 2: tile_strips<T, 2>(out, ldo, x, ldx, w, row_bytes, n_in, oc, oe, o_end, next, stream); break;
        case 3: tile_strips<T, 3>(out, ldo, x, ldx, w, row_bytes, n_in, oc, oe, o_end, next, stream); break;
        case 4: tile_strips<T, 4>(out, ldo, x, ldx, w, row_bytes, n_in, oc, oe, o_end, next, stream); break;
        case 5: tile_strips<T, 5>(out, ldo, x, ldx, w, row_bytes, n_in, oc, oe, o_end, next, stream); break;
        default: tile_strips<T, 6>(out, ldo, x, ldx, w, row_bytes, n_in, oc, oe, o_end, next, stream); break;
    }
}

/// One task: a group's m (<= kMoeSmallRows) rows x outputs [o0, o1) of one expert matrix.
struct GroupTask {
    const float * x;      ///< the group's packed rows [m, ldx]
    int64_t       ldx;
    const char *  w;      ///< weights [n_out, n_in]
    WType         t;
    int64_t       n_in, m, o0, o1;
    float *       out;    ///< the group's output rows [m, ldo] (column 0)
    int64_t       ldo;
    int64_t       group = 0;  ///< its plan expert index
    /// The first weight byte this task reads.
    const char * start() const { return w + o0 * n_in * (t == WType::f32 ? 4 : 2); }
};

void run_task(const GroupTask & g, const char * next) {
    const int64_t row_bytes = g.n_in * (g.t == WType::f32 ? 4 : 2);
    const int64_t n_tiles = (g.m + kMaxMR - 1) / kMaxMR;
    const int64_t chunk = n_tiles == 1 ? g.o1 - g.o0 : kChunkOut;  // one tile: nothing to keep in L1
    for (int64_t oc = g.o0; oc < g.o1; oc += chunk) {
        const int64_t oe = std::min(g.o1, oc + chunk);
        for (int64_t i = 0, r = 0; i < n_tiles; ++i) {
            const int mr = static_cast<int>(g.m / n_tiles + (i < g.m % n_tiles ? 1 : 0));  // near-equal tiles
            const float * x = g.x + r * g.ldx;
            float *       o = g.out + r * g.ldo;
            if (g.t == WType::f32) {
                row_tile<WType::f32>(mr, o, g.ldo, x, g.ldx, g.w, row_bytes, g.n_in, oc, oe, g.o1, next, i == 0);
            } else {
                row_tile<WType::bf16>(mr, o, g.ldo, x, g.ldx, g.w, row_bytes, g.n_in, oc, oe, g.o1, next, i == 0);
            }
            r += mr;
        }
    }
}

/// Tasks of ~kTaskBytes of weights (whole chunks) for a group: [o0, o1) ranges of n_out.
void add_tasks(std::vector<GroupTask> & tasks, const GroupTask & g, int64_t n_out) {
    const int64_t row_bytes = g.n_in * (g.t == WType::f32 ? 4 : 2);
    const int64_t per = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, row_bytes) / kTaskOut) * kTaskOut;
    for (int64_t o = 0; o < n_out; o += per) {
        GroupTask t = g;
        t.o0 = o, t.o1 = std::min(n_out, o + per);
        tasks.push_back(t);
    }
}

/// x row → dst [padded(n)] in `t`'s lane order (bf16: permute_bf16_step; f32: as is), zero tail.
void pack_row(float * dst, const float * src, int64_t n, WType t) {
    if (t == WType::bf16) {
        for (int64_t k = 0; k < n; k += 32) { permute_bf16_step(src + k, n - k, dst + k, dst + k + kLanes); }
    } else {
        std::memcpy(dst, src, sizeof(float) * n);
        std::fill(dst + n, dst + padded(n), 0.0f);
    }
}

void run_tasks(const std::vector<GroupTask> & tasks, const char * after, ThreadPool * pool) {
    const int64_t n = static_cast<int64_t>(tasks.size());
    for_tasks(pool, n, [&](int64_t i) { run_task(tasks[i], i + 1 < n ? tasks[i + 1].start() : after); });
}

}  // namespace

namespace detail {

int64_t moe_scratch_floats_per_pair(int64_t n_embd, int64_t n_ff) {
    return padded(n_embd) + 2 * n_ff + n_ff + padded(n_ff);
}

void moe_expert_outputs(float * ye, const float * x, const MoePlan & plan, int64_t i0, int64_t i1,
                        const ExpertWeights * experts, int64_t n_embd, int64_t n_ff, ThreadPool * pool) {
    const int64_t b0 = plan.begin[i0], n_pairs = plan.begin[i1] - b0;
    if (n_pairs <= 0) { return; }
    const int64_t ldh = padded(n_embd), ldf = padded(n_ff);
    thread_local detail::ScratchVec<float> scratch;
    scratch.resize(static_cast<size_t>(n_pairs * moe_scratch_floats_per_pair(n_embd, n_ff)));
    float * xp  = scratch.data();           // [P, ldh]     x rows (small groups: lane order)
    float * gu  = xp + n_pairs * ldh;       // [P, 2 n_ff]  gate | up
    float * act = gu + n_pairs * 2 * n_ff;  // [P, n_ff]    silu(gate) * up
    float * ap  = act + n_pairs * n_ff;     // [P, ldf]     act rows of small groups in lane order
    auto small = [&](int64_t i) { return plan.begin[i + 1] - plan.begin[i] <= kMoeSmallRows; };
    // x: small groups' rows packed (ldh apart), large groups' rows gathered contiguous (n_embd).
    for_tasks(pool, i1 - i0, [&](int64_t j) {
        const int64_t i = i0 + j, b = plan.begin[i], m = plan.begin[i + 1] - b;
        const ExpertWeights & w = experts[plan.experts[static_cast<size_t>(i)]];
        for (int64_t r = 0; r < m; ++r) {
            const float * src = x + static_cast<int64_t>(plan.rows[static_cast<size_t>(b + r)]) * n_embd;
            if (small(i)) {
                pack_row(xp + (b - b0 + r) * ldh, src, n_embd, w.gate_up_type);
            } else {
                std::memcpy(xp + (b - b0) * ldh + r * n_embd, src, sizeof(float) * n_embd);
            }
        }
    });
    std::vector<GroupTask> up_tasks, down_tasks;
    for (int64_t i = i0; i < i1; ++i) {
        if (!small(i)) { continue; }
        const int64_t b = plan.begin[i] - b0, m = plan.begin[i + 1] - plan.begin[i];
        const ExpertWeights & w = experts[plan.experts[static_cast<size_t>(i)]];
        add_tasks(up_tasks, {.x = xp + b * ldh, .ldx = ldh, .w = static_cast<const char *>(w.gate_up), .t = w.gate_up_type,
                             .n_in = n_embd, .m = m, .o0 = 0, .o1 = 0, .out = gu + b * 2 * n_ff, .ldo = 2 * n_ff, .group = i}, 2 * n_ff);
        add_tasks(down_tasks, {.x = ap + b * ldf, .ldx = ldf, .w = static_cast<const char *>(w.down), .t = w.down_type,
                               .n_in = n_ff, .m = m, .o0 = 0, .o1 = 0, .out = ye + b * n_embd, .ldo = n_embd, .group = i}, n_embd);
    }
    // silu(gate) * up per pair (the backend's silu_mul); a small group's act rows then packed
    // for down in its dtype's lane order.
    std::vector<char> act_done(static_cast<size_t>(i1 - i0), 0);
    auto group_act = [&](int64_t i) {
        const WType t = experts[plan.experts[static_cast<size_t>(i)]].down_type;
        for (int64_t p = plan.begin[i] - b0; p < plan.begin[i + 1] - b0; ++p) {
            silu_mul(act + p * n_ff, gu + p * 2 * n_ff, gu + p * 2 * n_ff + n_ff, n_ff);
            if (small(i)) { pack_row(ap + p * ldf, act + p * n_ff, n_ff, t); }
        }
        act_done[static_cast<size_t>(i - i0)] = 1;
    };
    const char * const down_first = down_tasks.empty() ? nullptr : down_tasks.front().start();
    if (!pool || pool->n_threads() == 1) {
        // One thread: a group's act right after its last gate_up task, while the prefetch stream
        // already fetches the next expert's weights (the exps overlap the memory stream instead
        // of leaving it idle between the phases).
        const int64_t n = static_cast<int64_t>(up_tasks.size());
        for (int64_t t = 0; t < n; ++t) {
            const GroupTask & g = up_tasks[static_cast<size_t>(t)];
            run_task(g, t + 1 < n ? up_tasks[static_cast<size_t>(t + 1)].start() : down_first);
            if (g.o1 == 2 * n_ff) { group_act(g.group); }
        }
    } else {
        run_tasks(up_tasks, down_first, pool);
    }
    for (int64_t i = i0; i < i1; ++i) {
        if (small(i)) { continue; }
        const int64_t b = plan.begin[i] - b0, m = plan.begin[i + 1] - plan.begin[i];
        const ExpertWeights & w = experts[plan.experts[static_cast<size_t>(i)]];
        linear(gu + b * 2 * n_ff, xp + b * ldh, w.gate_up, w.gate_up_type, nullptr, m, 2 * n_ff, n_embd, pool);
    }
    for_tasks(pool, i1 - i0, [&](int64_t j) {
        if (!act_done[static_cast<size_t>(j)]) { group_act(i0 + j); }
    });
    run_tasks(down_tasks, nullptr, pool);
    for (int64_t i = i0; i < i1; ++i) {
        if (small(i)) { continue; }
        const int64_t b = plan.begin[i] - b0, m = plan.begin[i + 1] - plan.begin[i];
        const ExpertWeights & w = experts[plan.experts[static_cast<size_t>(i)]];
        linear(ye + b * n_embd, act + b * n_ff, w.down, w.down_type, nullptr, m, n_embd, n_ff, pool);
    }
}

}  // namespace detail
}  // namespace fd::kernels
