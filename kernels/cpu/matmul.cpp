// Batch-invariant linear layer over weights in the checkpoint's own layout (see ops.h).
//
// The weight stays [n_out, n_in] in its stored dtype (f32 or bf16), exactly as the checkpoint
// holds it, so loading or updating weights is a plain copy. Each output element is a dot
// product computed the same way everywhere: 16 lane-wise partial sums, lane l accumulating
// x[k] * w[k] for k = l, l + 16, ... in ascending k with one fused multiply-add each (the last,
// partial block zero-padded), then one fixed pairwise reduction of the 16 lanes, then the bias.
// Tiles only decide how many rows and outputs share a load, never the arithmetic, so a row's
// result is bitwise the same for any batch size, batch position, tiling or thread count.
#include "fd/kernels/ops.h"

#include <algorithm>
#include <cstring>

namespace fd::kernels {
namespace {

typedef float    f32x16 __attribute__((vector_size(64)));
typedef float    f32x8  __attribute__((vector_size(32)));
typedef float    f32x4  __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int kLanes = 16;

inline f32x16 load_x(const float * p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

/// 16 weights from element k of a row, widened to f32 (bf16 = the upper half of an f32).
template <WType T>
inline f32x16 load_w(const void * row, int64_t k) {
    if constexpr (T == WType::f32) {
        return load_x(static_cast<const float *>(row) + k);
    } else {
        u16x16 h;
        std::memcpy(&h, static_cast<const uint16_t *>(row) + k, sizeof h);
        const u32x16 u = __builtin_convertvector(h, u32x16) << 16;
        f32x16 f;
        std::memcpy(&f, &u, sizeof f);
        return f;
    }
}

/// The zero-padded last block of a row (n < 16 valid elements from k).
inline f32x16 load_x_tail(const float * p, int n) {
    alignas(64) float buf[kLanes] = {};
    std::memcpy(buf, p, sizeof(float) * n);
    return load_x(buf);
}

template <WType T>
inline f32x16 load_w_tail(const void * row, int64_t k, int n) {
    if constexpr (T == WType::f32) {
        return load_x_tail(static_cast<const float *>(row) + k, n);
    } else {
        alignas(64) uint16_t buf[kLanes] = {};
        std::memcpy(buf, static_cast<const uint16_t *>(row) + k, sizeof(uint16_t) * n);
        return load_w<WType::bf16>(buf, 0);
    }
}

/// Fixed pairwise reduction: halves, then quarters, ... (the same for every output).
inline float reduce16(f32x16 v) {
    f32x8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char *>(&v) + sizeof lo, sizeof hi);
    const f32x8 s8 = lo + hi;
    f32x4 l4, h4;
    std::memcpy(&l4, &s8, sizeof l4);
    std::memcpy(&h4, reinterpret_cast<const char *>(&s8) + sizeof l4, sizeof h4);
    const f32x4 s4 = l4 + h4;
    const float s2a = s4[0] + s4[2], s2b = s4[1] + s4[3];
    return s2a + s2b;
}

size_t elem_bytes(WType t) { return t == WType::f32 ? 4 : 2; }

/// out[r, c] for MR rows of x and NR weight rows. Rows past n_rows / outputs past n_cols repeat
/// the last valid one (their results are not stored), so one instantiation covers every edge.
template <WType T, int MR, int NR, bool kPrefetch>
void tile(float * out, int64_t ldo, const float * x, int64_t n_in, int n_rows, const char * w, int n_cols,
          const float * bias) {
    const size_t row_bytes = static_cast<size_t>(n_in) * elem_bytes(T);
    const float * xr[MR];
    const void *  wr[NR];
    for (int r = 0; r < MR; ++r) { xr[r] = x + std::min(r, n_rows - 1) * n_in; }
    for (int c = 0; c < NR; ++c) { wr[c] = w + std::min(c, n_cols - 1) * row_bytes; }
    f32x16 acc[MR][NR];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NR; ++c) { acc[r][c] = f32x16{}; }
    }
    int64_t k = 0;
    for (; k + kLanes <= n_in; k += kLanes) {
        f32x16 wv[NR];
        for (int c = 0; c < NR; ++c) {
            // Streaming (one row of x): keep ~512 bytes of each row in flight ahead of the loads.
            if (kPrefetch) { __builtin_prefetch(static_cast<const char *>(wr[c]) + k * elem_bytes(T) + 512, 0, 3); }
            wv[c] = load_w<T>(wr[c], k);
        }
        for (int r = 0; r < MR; ++r) {
            const f32x16 xv = load_x(xr[r] + k);
            for (int c = 0; c < NR; ++c) { acc[r][c] += xv * wv[c]; }
        }
    }
    if (k < n_in) {
        const int n = static_cast<int>(n_in - k);
        f32x16 wv[NR];
        for (int c = 0; c < NR; ++c) { wv[c] = load_w_tail<T>(wr[c], k, n); }
        for (int r = 0; r < MR; ++r) {
            const f32x16 xv = load_x_tail(xr[r] + k, n);
            for (int c = 0; c < NR; ++c) { acc[r][c] += xv * wv[c]; }
        }
    }
    for (int r = 0; r < std::min(MR, n_rows); ++r) {
        for (int c = 0; c < std::min(NR, n_cols); ++c) {
            float v = reduce16(acc[r][c]);
            if (bias) { v += bias[c]; }
            out[r * ldo + c] = v;
        }
    }
}

/// All rows x outputs [o0, o1): x in chunks that stay in L2, weights in NR-row strips.
template <WType T>
void block(float * out, const float * x, const char * w, const float * bias, int64_t n_rows, int64_t n_out,
           int64_t n_in, int64_t o0, int64_t o1) {
    const size_t  row_bytes  = static_cast<size_t>(n_in) * elem_bytes(T);
    const int64_t rows_chunk = std::max<int64_t>(4, (512 << 10) / (n_in * 4) / 4 * 4);
    for (int64_t r0 = 0; r0 < n_rows; r0 += rows_chunk) {
        const int64_t r1 = std::min(n_rows, r0 + rows_chunk);
        if (r1 - r0 == 1) {  // decode of one sequence: wider strips keep more weight streams in flight
            constexpr int NR = 8;
            for (int64_t o = o0; o < o1; o += NR) {
                tile<T, 1, NR, true>(out + r0 * n_out + o, n_out, x + r0 * n_in, n_in, 1, w + o * row_bytes,
                                     static_cast<int>(std::min<int64_t>(NR, o1 - o)), bias ? bias + o : nullptr);
            }
            continue;
        }
        // Batches: 4 rows x 6 outputs per tile (24 accumulators); the x rows stay in L1 while
        // the task's weight strips stream past them.
        constexpr int MR = 4, NR = 6;
        for (int64_t r = r0; r < r1; r += MR) {
            const int nr = static_cast<int>(std::min<int64_t>(MR, r1 - r));
            for (int64_t o = o0; o < o1; o += NR) {
                tile<T, MR, NR, false>(out + r * n_out + o, n_out, x + r * n_in, n_in, nr, w + o * row_bytes,
                                       static_cast<int>(std::min<int64_t>(NR, o1 - o)), bias ? bias + o : nullptr);
            }
        }
    }
}

}  // namespace

void linear(float * out, const float * x, const void * w, WType wtype, const float * bias, int64_t n_rows,
            int64_t n_out, int64_t n_in, ThreadPool * pool) {
    if (n_rows <= 0 || n_out <= 0) { return; }
    // Split outputs into tasks of whole strips (24 = both strip widths) holding ~32 KiB of
    // weights per batch row, at least 24 rows: enough work to wake a thread for.
    const int64_t row_bytes = n_in * static_cast<int64_t>(elem_bytes(wtype));
    const int64_t per_task  = std::max<int64_t>(24, ((32 << 10) * 4 / std::max<int64_t>(1, row_bytes * std::min<int64_t>(n_rows, 4))) / 24 * 24);
    const int64_t n_tasks   = (n_out + per_task - 1) / per_task;
    const char *  wb        = static_cast<const char *>(w);
    auto run = [&](int64_t t) {
        const int64_t o0 = t * per_task, o1 = std::min(n_out, o0 + per_task);
        if (wtype == WType::f32) {
            block<WType::f32>(out, x, wb, bias, n_rows, n_out, n_in, o0, o1);
        } else {
            block<WType::bf16>(out, x, wb, bias, n_rows, n_out, n_in, o0, o1);
        }
    };
    if (pool && n_tasks > 1) {
        pool->parallel_for(n_tasks, run);
    } else {
        for (int64_t t = 0; t < n_tasks; ++t) { run(t); }
    }
}

}  // namespace fd::kernels
