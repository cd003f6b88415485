// Batch-invariant packed matmul (see ops.h).
//
// Layout: the weight is packed into panels of 32 output columns, [n_panels, n_in, 32], so the
// micro-kernel streams one panel contiguously while broadcasting x. Each output element is one
// FMA chain over k = 0..n_in-1 starting from zero; tiles only decide how many rows share a
// panel load, never the arithmetic, which keeps results identical for any batch size.
#include "fd/kernels/ops.h"

#include <algorithm>
#include <cstring>

namespace fd::kernels {
namespace {

typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float * p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store16(float * p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

constexpr int kRowsPerTile = 6;  // 6 rows x 2 vectors = 12 accumulators

/// out[r, c] for r < MR, c < n_cols of one panel.
template <int MR>
void tile(float * out, int64_t out_stride, const float * x, int64_t x_stride, const float * panel,
          int64_t n_in, int n_cols, const float * bias) {
    f32x16 acc0[MR], acc1[MR];
    for (int r = 0; r < MR; ++r) { acc0[r] = f32x16{}; acc1[r] = f32x16{}; }
    for (int64_t k = 0; k < n_in; ++k) {
        // Prefetch the panel ~8 KiB ahead so weight streaming overlaps the FMAs at small batch.
        __builtin_prefetch(panel + (k + 64) * kPanelCols, 0, 1);
        __builtin_prefetch(panel + (k + 64) * kPanelCols + 16, 0, 1);
        const f32x16 b0 = load16(panel + k * kPanelCols);
        const f32x16 b1 = load16(panel + k * kPanelCols + 16);
        for (int r = 0; r < MR; ++r) {
            const float a = x[r * x_stride + k];
            acc0[r] += a * b0;
            acc1[r] += a * b1;
        }
    }
    for (int r = 0; r < MR; ++r) {
        alignas(64) float buf[kPanelCols];
        store16(buf, acc0[r]);
        store16(buf + 16, acc1[r]);
        if (bias) {
            for (int c = 0; c < n_cols; ++c) { buf[c] += bias[c]; }
        }
        std::memcpy(out + r * out_stride, buf, sizeof(float) * n_cols);
    }
}

void panel_all_rows(float * out, const float * x, const float * panel, const float * bias,
                    int64_t n_rows, int64_t n_out, int64_t n_in, int64_t p) {
    const int64_t col0   = p * kPanelCols;
    const int     n_cols = static_cast<int>(std::min<int64_t>(kPanelCols, n_out - col0));
    const float * b      = bias ? bias + col0 : nullptr;
    int64_t r = 0;
    for (; r + kRowsPerTile <= n_rows; r += kRowsPerTile) {
        tile<kRowsPerTile>(out + r * n_out + col0, n_out, x + r * n_in, n_in, panel, n_in, n_cols, b);
    }
    float *       o  = out + r * n_out + col0;
    const float * xr = x + r * n_in;
    switch (n_rows - r) {
        case 5: tile<5>(o, n_out, xr, n_in, panel, n_in, n_cols, b); break;
        case 4: tile<4>(o, n_out, xr, n_in, panel, n_in, n_cols, b); break;
        case 3: tile<3>(o, n_out, xr, n_in, panel, n_in, n_cols, b); break;
        case 2: tile<2>(o, n_out, xr, n_in, panel, n_in, n_cols, b); break;
        case 1: tile<1>(o, n_out, xr, n_in, panel, n_in, n_cols, b); break;
        default: break;
    }
}

}  // namespace

int64_t packed_linear_floats(int64_t n_out, int64_t n_in) {
    return (n_out + kPanelCols - 1) / kPanelCols * n_in * kPanelCols;
}

void pack_linear(float * packed, const float * w, int64_t n_out, int64_t n_in) {
    const int64_t n_panels = (n_out + kPanelCols - 1) / kPanelCols;
    for (int64_t p = 0; p < n_panels; ++p) {
        float * dst = packed + p * n_in * kPanelCols;
        for (int64_t k = 0; k < n_in; ++k) {
            for (int c = 0; c < kPanelCols; ++c) {
                const int64_t o = p * kPanelCols + c;
                dst[k * kPanelCols + c] = o < n_out ? w[o * n_in + k] : 0.0f;
            }
        }
    }
}

void matmul_packed(float * out, const float * x, const float * packed, const float * bias,
                   int64_t n_rows, int64_t n_out, int64_t n_in, ThreadPool * pool) {
    if (n_rows <= 0) { return; }
    const int64_t n_panels = (n_out + kPanelCols - 1) / kPanelCols;
    // Group panels so a task is worth waking a thread for (~256 KiB of weights or more).
    const int64_t panel_bytes     = n_in * kPanelCols * static_cast<int64_t>(sizeof(float));
    const int64_t panels_per_task = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, panel_bytes * n_rows));
    const int64_t n_tasks         = (n_panels + panels_per_task - 1) / panels_per_task;
    auto run = [&](int64_t t) {
        const int64_t p_end = std::min(n_panels, (t + 1) * panels_per_task);
        for (int64_t p = t * panels_per_task; p < p_end; ++p) {
            panel_all_rows(out, x, packed + p * n_in * kPanelCols, bias, n_rows, n_out, n_in, p);
        }
    };
    if (pool && n_tasks > 1) {
        pool->parallel_for(n_tasks, run);
    } else {
        for (int64_t t = 0; t < n_tasks; ++t) { run(t); }
    }
}

}  // namespace fd::kernels
